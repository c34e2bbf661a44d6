"""What OmniVoice fine-tuning needs in memory: peak RSS of two optimizer steps at the real dims (Qwen3-0.6B
shape, random weights) on CPU in fp32, full or LoRA (train_omnivoice.py's defaults), with or without
gradient checkpointing, one sequence of --length tokens. A one-off measurement behind the figures in the
docs; each run is its own process, so each peak is its own.

    python tools/omnivoice_train_memory.py --method lora --checkpointing --length 500
"""
import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import omnivoice  # noqa: E402  (the repository root)
import train_omnivoice as T  # noqa: E402


def random_lm(cfg: dict) -> omnivoice.OmniVoice:
    """The LM alone (no audio tokenizer), small uniform weights, unit norms, ready to train."""
    with torch.device("meta"):
        model = omnivoice.OmniVoice(cfg)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.uniform_(-0.02, 0.02, generator=generator)
    model.codebook_offsets = torch.arange(cfg["num_codebooks"]) * cfg["audio_vocab_size"]
    model.codebook_weights = torch.full((cfg["num_codebooks"],), 1 / cfg["num_codebooks"])
    return model.train()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["full", "lora"], default="lora")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--length", type=int, default=500, help="tokens in the one sequence of the batch")
    ap.add_argument("--config", help="a checkpoint's config.json for other dims (default: the real model's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = omnivoice.read_config(Path(args.config)) if args.config else omnivoice.CONFIG
    model = random_lm(cfg)
    if args.method == "lora":
        T.add_lora(model, T.lora_config(None))
    trainable = T.trainable_parameters(model)
    settings = dict(T.TRAIN_DEFAULTS, steps=10)
    run = dict(settings=settings, trainable=trainable, world=1,
               optimizer=T.make_optimizer([p for _, p in trainable], settings))
    L, C = args.length, cfg["num_codebooks"]
    ids = torch.randint(0, cfg["audio_vocab_size"] - 1, (1, C, L))
    batch = dict(input_ids=ids, labels=ids.clone(), audio_mask=torch.ones(1, L, dtype=torch.bool),
                 position_ids=torch.arange(L)[None], attention_mask=torch.ones(1, 1, L, L, dtype=torch.bool))
    weights = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    start = time.perf_counter()
    for step in (1, 2):
        T.training_loss(model, batch, args.checkpointing).backward()
        T.optimizer_step(run, step)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    trained = sum(p.numel() for _, p in trainable)
    print(f"{args.method}, checkpointing {args.checkpointing}, {L} tokens: {trained / 1e6:.1f} M trained"
          f" parameters, peak RSS {peak:.2f} GiB (after building: {weights:.2f} GiB),"
          f" {time.perf_counter() - start:.0f} s for 2 steps")
    return dict(trained=trained, peak_gib=peak, built_gib=weights)


if __name__ == "__main__":
    main()
