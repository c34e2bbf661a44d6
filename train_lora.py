"""LoRA fine-tuning of S2-Pro's Dual-AR model: data, LoRA, training loop, merge and export, one file.

Samples, loss and merged weights are upstream fish-speech's (commit 3dd1f85), so a LoRA trained here
merges into a checkpoint upstream serves, and upstream's LoRA weights merge here.

    python train_lora.py prepare data/                  # audio + .lab/.txt -> cached .npy codes
    python train_lora.py train data/ --out runs/me      # -> runs/me/lora.safetensors, metrics.jsonl
    python train_lora.py merge --lora runs/me --out s2-pro-me    # a checkpoint dualAR.py loads
    torchrun --nproc-per-node N train_lora.py train data/ --out runs/me     # N GPUs; prepare too
"""
import argparse
import json
import math
import os
import shutil
import sys
import time
from contextlib import suppress
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import codec
import common
import dualAR
import training
from common import UserError, write_atomic
from training import short_list

SYSTEM_PROMPT = "Speak out the provided text."  # upstream's training system turn
IGNORE = -100  # label of positions without loss (cross_entropy's ignore_index)
RANK, ALPHA, DROPOUT = 8, 16, 0.01  # upstream's lora config r_8_alpha_16
LR, WARMUP, BETAS, EPS, CLIP = 1e-4, 10, (0.9, 0.95), 1e-5, 1.0  # upstream's text2semantic_finetune
# positions per slice, checkpointing: of the slow logits (positions x vocabulary: the largest activation) and
# of the fast model's semantic positions (each a sequence of num_codebooks)
CHECKPOINT_CHUNK = 1024
SHARD_BYTES = 4 * 2**30  # per exported safetensors file: saving one holds a copy of its bytes in memory
LORA_FILE, STATE_FILE, RUN_FILE, METRICS_FILE = "lora.safetensors", "state.pt", "run.json", "metrics.jsonl"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "codec.pth",
                "codec_config.json")
# what upstream's flat `dual_ar` config.json holds (its DualARModelArgs fields that we know)
FLAT_KEYS = list(dualAR.FLAT_DEFAULTS) + ["fast_" + k for k in dualAR.FAST_KEYS] + [
    "semantic_begin_id", "semantic_end_id"]
# what run.json keeps of the command line: --resume continues with these
RUN_SETTINGS = ("checkpoint", "rank", "alpha", "dropout", "lr", "warmup", "batch_size", "grad_accum",
                "max_length", "val_size", "seed", "checkpointing")


# ----------------------------------------------------------------------------- LoRA
class LoRALinear(nn.Module):
    """base(x) + dropout(x) A^T B^T * alpha / rank, base frozen (loralib's Linear, as upstream wraps it)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base, device = base, base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # loralib's init: B = 0, so W' = W at first
        self.scaling, self.dropout = alpha / rank, nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.dropout(x) @ self.lora_A.T @ self.lora_B.T * self.scaling


class LoRAEmbedding(nn.Module):
    """base(ids) + A^T[ids] B^T * alpha / rank, base frozen (loralib's Embedding: no dropout). `.weight` is
    the raw table: a tied head reading it does not see the LoRA, as in upstream's training forward."""

    def __init__(self, base: nn.Embedding, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base, device = base, base.weight.device
        self.lora_A = nn.Parameter(torch.zeros(rank, base.num_embeddings, device=device))
        self.lora_B = nn.Parameter(torch.randn(base.embedding_dim, rank, device=device))  # loralib's init
        self.scaling = alpha / rank

    weight = property(lambda self: self.base.weight)

    def forward(self, ids: Tensor) -> Tensor:
        return self.base(ids) + F.embedding(ids, self.lora_A.T) @ self.lora_B.T * self.scaling


def lora_targets(model: dualAR.DualAR) -> list:
    """What upstream's target_modules [attention, mlp, embeddings, output] wrap (the LM head is tied)."""
    names = ["embeddings", "codebook_embeddings", "fast_embeddings", "fast_output"]
    names += ["output"] if hasattr(model, "output") else []
    weights = ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    for prefix, layers in (("layers", model.layers), ("fast_layers", model.fast_layers)):
        names += [f"{prefix}.{i}.{w}" for i in range(len(layers)) for w in weights]
    return names


def lora_modules(model: nn.Module) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAEmbedding))}


def lora_params(model: nn.Module) -> dict:
    return {n: p for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))}


def add_lora(model: dualAR.DualAR, rank=RANK, alpha=ALPHA, dropout=DROPOUT, names=None) -> list:
    """Wrap the target modules in LoRA (fp32 A and B, the only trainable parameters) -> those parameters."""
    model.requires_grad_(False)
    for name in names or lora_targets(model):
        base = model.get_submodule(name)
        wrap = LoRAEmbedding if isinstance(base, nn.Embedding) else LoRALinear
        model.set_submodule(name, wrap(base, rank, alpha, dropout))
    return list(lora_params(model).values())


def load_lora(model: dualAR.DualAR, path, alpha=None, dropout=0.0) -> list:
    """Our or upstream's LoRA file (or a run folder) into the model, wrapped if need be -> its parameters."""
    path = Path(path) / LORA_FILE if Path(path).is_dir() else Path(path)
    if not path.is_file():
        raise UserError(f"LoRA weights {path} not found")
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        else:
            tensors, meta = torch.load(path, map_location="cpu", weights_only=True), {}
            tensors = tensors.get("state_dict", tensors)
    except Exception as e:
        raise common.unreadable(path, e) from None
    lora = {k.removeprefix("model."): v for k, v in tensors.items()
            if k.endswith((".lora_A", ".lora_B")) and isinstance(v, Tensor)}
    if not lora:
        raise UserError(f"{path} holds no LoRA weights (no keys ending in .lora_A / .lora_B)")
    names, targets = {k.rpartition(".")[0] for k in lora}, lora_targets(model)
    if unknown := sorted(names - set(targets)):
        raise UserError(f"{path}: LoRA for {unknown[0]!r}, a module the base checkpoint does not have (or"
                        " that is not a LoRA target) — weights for another model?")
    if not lora_modules(model):
        key, value = next(iter(lora.items()))
        rank = value.shape[0] if key.endswith("lora_A") else value.shape[1]  # A (rank, in), B (out, rank)
        alpha = float(meta.get("alpha", alpha or ALPHA))
        add_lora(model, rank, alpha, dropout, names=[n for n in targets if n in names])
    params = lora_params(model)
    if key := min(params.keys() ^ lora.keys(), default=None):
        raise UserError(f"{path}: {key} is {'missing' if key in params else 'not in the model'}: LoRA weights"
                        " for other modules")
    for key, param in params.items():
        if lora[key].shape != param.shape:
            raise UserError(f"{path}: {key} has shape {list(lora[key].shape)}, the base checkpoint needs"
                            f" {list(param.shape)} — weights for another model or rank?")
    model.load_state_dict(lora, strict=False)  # exactly the LoRA parameters, checked above
    return list(params.values())


@torch.no_grad()
def merge_lora(model: dualAR.DualAR) -> dualAR.DualAR:
    """W' = W + B A alpha/r (embeddings: transposed), in fp32 and kept in fp32 as upstream's LoRA modules."""
    for name, lora in lora_modules(model).items():
        delta = (lora.lora_B @ lora.lora_A) * lora.scaling
        delta = delta.T if isinstance(lora, LoRAEmbedding) else delta  # an embedding table is (num, dim)
        lora.base.weight = nn.Parameter(lora.base.weight.float() + delta, requires_grad=False)
        model.set_submodule(name, lora.base)
    return model


# ----------------------------------------------------------------------------- samples and loss
def sample_tokens(model: dualAR.DualAR, text: str, codes) -> tuple:
    """Upstream's sample -> (inputs, labels) (1 + num_codebooks, T): a loss on <|voice|> codes <|im_end|>."""
    turns = ["<|im_start|>system\n", SYSTEM_PROMPT, "<|im_end|>\n",
             "<|im_start|>user\n", text, "<|im_end|>\n"]
    prompt = dualAR.encode_pieces(model, turns + ["<|im_start|>assistant\n"])
    target = dualAR.encode_pieces(model, ["<|voice|>", torch.as_tensor(codes), "<|im_end|>\n"])
    tokens = torch.cat([prompt, target], dim=1)
    labels = torch.where(dualAR.is_semantic(tokens[0], model.config), tokens, IGNORE)
    labels[0] = torch.cat([torch.full_like(prompt[0], IGNORE), target[0]])
    labels = labels[:, 1:].clone()
    labels[1:, -1] = 0  # upstream sets the codebook labels of the last column to its pad code 0
    return tokens[:, :-1], labels


def collate(encoded: list) -> tuple:
    """[(inputs, labels)] of sample_tokens -> right-padded (inputs, labels, padding_mask), as upstream's
    collator; tokens pad with 0 as upstream's (no pad token)."""
    length = max(x.size(1) for x, _ in encoded)
    inputs = torch.stack([F.pad(x, (0, length - x.size(1)), value=0) for x, _ in encoded])
    labels = torch.stack([F.pad(y, (0, length - y.size(1)), value=IGNORE) for _, y in encoded])
    padding = torch.stack([torch.arange(length) >= x.size(1) for x, _ in encoded])
    return inputs, labels, padding


def loss_sum(logits, states: Tensor, labels: Tensor) -> Tensor:  # its own function: checkpointing reruns it
    return F.cross_entropy(logits(states).flatten(0, -2).float(), labels.flatten(), reduction="sum")


def training_loss(model, inputs: Tensor, labels: Tensor, padding_mask=None, checkpointing=False,
                  chunk=CHECKPOINT_CHUNK) -> dict:
    """Upstream's loss: slow logits on label row 0, plus fast logits on the codes of semantic labels. Causal
    attention keeps right padding from real positions: padding_mask is only checked to be right padding.
    Checkpointing runs the heads and the fast model `chunk` positions at a time."""
    if padding_mask is not None and (padding_mask[:, :-1] & ~padding_mask[:, 1:]).any():
        raise ValueError("padding_mask: padding must be at the end of each row (right padding)")

    def run(fn, *args):  # checkpointing keeps only the arguments: the backward pass runs fn again
        return checkpoint(fn, *args, use_reentrant=False) if checkpointing else fn(*args)

    x = model.slow_states(inputs, call=run)  # (B, S, dim), the training embedding (no codebook scale)
    token_labels = labels[:, 0]
    scored = token_labels != IGNORE
    x_scored, y_scored, n = x[scored], token_labels[scored], int(scored.sum())
    step = chunk if checkpointing else n
    base_loss = sum(run(loss_sum, model.vocab_logits, x_scored[i:i + step], y_scored[i:i + step])
                    for i in range(0, n, step)) / n
    semantic = dualAR.is_semantic(token_labels, model.config)
    hidden = model.fast_input(x[semantic])  # (N, fast_dim)
    codes = labels[:, 1:].transpose(1, 2)[semantic]  # (N, num_codebooks)
    step, total = chunk if checkpointing else len(codes), 0.0
    for i in range(0, len(codes), step):
        y = torch.cat([hidden[i:i + step, None], model.fast_embeddings(codes[i:i + step, :-1])], dim=1)
        total = total + run(loss_sum, model.fast_logits, model.fast_states(y, call=run), codes[i:i + step])
    semantic_loss = total / codes.numel()
    return dict(loss=base_loss + semantic_loss, base_loss=base_loss, semantic_loss=semantic_loss,
                positions=n, codes=codes.numel())  # what base_loss and semantic_loss average over


# ----------------------------------------------------------------------------- data
def find_clips(data_dir: Path, strict: bool, audio_only: bool) -> tuple:
    """-> (clips found, {stem: dict(audio, codes, text, stale)} of the transcribed); others: a warning."""
    if not data_dir.is_dir():
        raise UserError(f"data folder {data_dir} does not exist")
    clips = {}
    for path in sorted(data_dir.rglob("*")):
        suffix = path.suffix.lower()
        kind = "audio" if suffix in common.AUDIO_EXTENSIONS else "codes" if suffix == ".npy" else None
        if kind is None or not path.is_file():
            continue
        clip = clips.setdefault(path.with_suffix(""), {})
        if kind in clip:
            raise UserError(f"{clip[kind]} and {path} share the codes file {path.with_suffix('.npy')}:"
                            " keep one of them")
        clip[kind] = path
    clips = {stem: clip for stem, clip in clips.items() if "audio" in clip or not audio_only}
    if not clips:
        kinds = " ".join(sorted(common.AUDIO_EXTENSIONS)) + ("" if audio_only else " .npy")
        raise UserError(f"no audio files{'' if audio_only else ' or .npy codes'} under {data_dir} (looked"
                        f" for {kinds})")
    for stem, clip in clips.items():
        clip["text"] = next((t for s in (".lab", ".txt") if (t := Path(f"{stem}{s}")).is_file()), None)
        audio, codes = clip.get("audio"), clip.get("codes")
        clip["stale"] = audio is not None and (codes is None or codes.stat().st_mtime < audio.stat().st_mtime)
    if missing := [clip.get("audio") or clip["codes"] for clip in clips.values() if clip["text"] is None]:
        files, listed = f"{len(missing)} file(s)", short_list(missing)
        if strict:
            raise UserError(f"{files} have no .lab/.txt transcript (--strict): {listed}")
        print(f"warning: skipped {files} without a .lab/.txt transcript: {listed}", file=sys.stderr)
    return len(clips), {stem: clip for stem, clip in clips.items() if clip["text"] is not None}


def sum_over_processes(values: list, device) -> list:
    if not dist.is_initialized():
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def prepare_dataset(args):
    """`prepare`: each transcribed audio file -> <stem>.npy codes next to it, once (each process: a share)."""
    rank, world, device = training.join_processes(common.pick_device(args.device))
    n_found, clips = find_clips(Path(args.data_dir), args.strict, audio_only=True)
    for clip in clips.values():  # check everything before writing anything
        codec.read_transcript(clip["text"])
        try:
            info = sf.info(str(clip["audio"]))  # the header: decoding every file twice would be slow
        except Exception as e:
            detail = str(e).strip().splitlines()[-1]
            raise UserError(f"{clip['audio']} is not a readable audio file ({detail})") from None
        if info.frames == 0:
            raise UserError(f"{clip['audio']} contains no audio samples")
        clip["seconds"] = info.frames / info.samplerate
        if not os.access(clip["audio"].parent, os.W_OK):
            raise UserError(f"cannot write codes next to {clip['audio']}: the folder is not writable")
    todo = [clip for clip in clips.values() if clip["stale"]]
    if world > 1:
        dist.barrier()  # every process has its list before any writes codes
    start, mine = time.perf_counter(), todo[rank::world]
    for clip in tqdm(mine, desc="encode", unit="file", disable=rank > 0 or not mine):
        codes = codec.encode(dualAR.codec_model(args, device), codec.load_audio(clip["audio"]))[0]
        codec.save_codes(clip["audio"].with_suffix(".npy"), codes)
    if world > 1:
        dist.barrier()
    if rank == 0:
        hours = sum(clip["seconds"] for clip in clips.values()) / 3600
        print(f"prepared {len(clips)} of {n_found} audio files ({hours:.3f} h): {len(todo)} encoded in"
              f" {time.perf_counter() - start:.1f} s, {len(clips) - len(todo)} already had codes,"
              f" {n_found - len(clips)} skipped (no transcript)")


def load_samples(data_dir: Path, model: dualAR.DualAR, strict=False, max_length=None) -> list:
    """Every prepared (codes + transcript) pair under data_dir, tokenized once -> [(name, inputs, labels)]."""
    _, clips = find_clips(data_dir, strict, audio_only=False)
    if stale := [clip["audio"] for clip in clips.values() if clip["stale"]]:
        raise UserError(f"{len(stale)} audio file(s) have no up-to-date codes ({short_list(stale, 2)}):"
                        f" run `python train_lora.py prepare {data_dir}` first")
    samples, too_long = [], []
    for stem, clip in clips.items():
        codes = codec.reference_codes("codes", clip["codes"], model.config, dac=None)
        name = str(stem.relative_to(data_dir))
        inputs, labels = sample_tokens(model, codec.read_transcript(clip["text"]), codes)
        if max_length and inputs.size(1) > max_length:
            too_long.append(name)
        else:
            samples.append((name, inputs, labels))
    if too_long:
        print(f"warning: skipped {len(too_long)} sample(s) longer than --max-length {max_length} tokens:"
              f" {short_list(too_long)}", file=sys.stderr)
    if not samples:
        raise UserError(f"no usable samples under {data_dir}")
    return samples


# ----------------------------------------------------------------------------- training loop
def batch_indices(n: int, batch_size: int, seed: int, k: int) -> list:
    """Micro-batch k: each epoch's order comes from (seed, epoch) alone, so a resumed run keeps it."""
    epoch, j = divmod(k, -(-n // batch_size))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return order[j * batch_size:(j + 1) * batch_size]


def batch_loss(model, samples: list, device, checkpointing=False) -> tuple:
    """[(name, inputs, labels)] -> (their training_loss as one batch, real tokens); the LoRA stays fp32."""
    inputs, labels, padding = collate([(x, y) for _, x, y in samples])
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        result = training_loss(model, inputs.to(device), labels.to(device), None, checkpointing)
    return result, int((~padding).sum())


@torch.no_grad()
def validation_loss(model, samples: list, batch_size: int, device, rank=0, world=1) -> float:
    """The loss of all the samples as one batch: batches and processes add sums over positions and counts."""
    model.eval()
    sums = [0.0] * 4  # base loss, scored positions, semantic loss, scored codes
    mine = samples[rank::world]
    for i in tqdm(range(0, len(mine), batch_size), desc="validate", unit="batch", leave=False,
                  disable=rank > 0):
        result, _ = batch_loss(model, mine[i:i + batch_size], device)
        n, codes = result["positions"], result["codes"]
        parts = (result["base_loss"].item() * n, n, result["semantic_loss"].item() * codes, codes)
        sums = [a + b for a, b in zip(sums, parts)]
    model.train()
    base, n, semantic, codes = sum_over_processes(sums, device)
    return base / n + semantic / codes


def save_checkpoint(out: Path, model, optimizer, step: int, rank=0):
    """state.pt: all a resumed run needs (each process's dropout state too); lora.safetensors: upstream's."""
    device = next(model.parameters()).device
    rng = dict(torch=torch.get_rng_state())
    if device.type != "cpu":  # dropout on cuda or mps draws from the generator of this process's device
        rng[device.type] = getattr(torch, device.type).get_rng_state(device)
    rngs = [rng] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(rngs, rng)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        lora = {f"model.{k}": p.detach().float().cpu().contiguous() for k, p in lora_params(model).items()}
        state = dict(step=step, lora=lora, optimizer=optimizer.state_dict(), rng=rngs)
        write_atomic(out / STATE_FILE, lambda tmp: torch.save(state, tmp))
        m = next(iter(lora_modules(model).values()))
        meta = dict(rank=str(m.lora_A.shape[0]), alpha=str(m.scaling * m.lora_A.shape[0]))
        write_atomic(out / LORA_FILE, lambda tmp: save_file(lora, str(tmp), metadata=meta))


def load_checkpoint(out: Path, model, optimizer, seed: int, rank=0, world=1) -> int:
    """state.pt back into the LoRA, AdamW and the random state -> its step."""
    try:
        state = torch.load(out / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:
        raise common.unreadable(out / STATE_FILE, e) from None
    try:
        with torch.no_grad():
            for key, param in lora_params(model).items():
                param.copy_(state["lora"][f"model.{key}"])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise UserError(f"{out / STATE_FILE} does not fit this run's LoRA: {e}") from None
    rngs, device = state["rng"], next(model.parameters()).device
    if len(rngs) == world:
        torch.set_rng_state(rngs[rank]["torch"])
        if device.type in rngs[rank]:
            getattr(torch, device.type).set_rng_state(rngs[rank][device.type], device)
    else:
        if rank == 0:
            print(f"warning: {out} was saved by {len(rngs)} process(es), resumed by {world}: the same"
                  " batches, but other dropout draws than an uninterrupted run", file=sys.stderr)
        torch.manual_seed(seed + 1000 * state["step"] + rank)
    return state["step"]


def check_writable(out: Path):
    parent = next(folder for folder in (out, *out.parents) if folder.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"--out {out} is not writable ({parent} is not a writable folder)")


def run_settings(args) -> dict:
    """The command line's settings for a new run in --out, or (--resume) the stored ones of the run there."""
    out = Path(args.out)
    if args.resume:
        if not (out / RUN_FILE).is_file() or not (out / STATE_FILE).is_file():
            raise UserError(f"--resume: {out} holds no run with a checkpoint ({RUN_FILE} + {STATE_FILE})")
        try:
            run = json.loads((out / RUN_FILE).read_text())
        except ValueError as e:
            raise common.unreadable(out / RUN_FILE, e) from None
        if not isinstance(run, dict) or not {*RUN_SETTINGS, "samples"} <= run.keys():
            raise UserError(f"{out / RUN_FILE} is not the settings of a train_lora.py run")
        return run
    started = {STATE_FILE, LORA_FILE, f".{STATE_FILE}.part", f".{LORA_FILE}.part"}  # before run.json
    if out.exists() and (not out.is_dir() or any(p.name not in started for p in out.iterdir())):
        what = "another run" if (out / RUN_FILE).exists() else "other files"
        raise UserError(f"--out {out} already holds {what}: pass --resume to continue it, or another --out")
    check_writable(out)
    return {k: getattr(args, k) for k in RUN_SETTINGS}


def split_held_out(samples: list, val_size, seed: int) -> tuple:
    """-> (training samples, validation samples): val_size, by default 5% (at least 1), drawn by seed."""
    n_val = max(1, round(0.05 * len(samples))) if val_size is None else val_size
    if n_val >= len(samples):
        raise UserError(f"{len(samples)} sample(s), {n_val} held out for validation: none left to train on"
                        " (add samples, or give a smaller --val-size, 0: no validation)")
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = sorted((samples[i] for i in order[:n_val]), key=lambda s: s[0])
    return [samples[i] for i in order[n_val:]], held_out


def keep_metrics_up_to(path: Path, step: int):
    """On resume: drop the metrics logged after the checkpoint (they will be logged again)."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with suppress(ValueError):  # a line cut short by a crash
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
    write_atomic(path, lambda tmp: tmp.write_text("".join(kept)))


def start_run(args, rank: int, world: int, device) -> tuple:
    """The run in --out set up, or read back (--resume) -> its settings, model, LoRA, AdamW, samples, step."""
    run, out = run_settings(args), Path(args.out)
    if world > 1:
        dist.barrier()  # every process has checked --out before rank 0 writes in it
    if args.resume and run["grad_accum"] % world:
        raise UserError(f"--resume: {out} has {run['grad_accum']} micro-batch(es) per step, which {world}"
                        " processes cannot share: resume on a number of processes that divides it")
    run["grad_accum"] *= 1 if args.resume else world  # run.json: micro-batches per step, all processes
    model = dualAR.load(run["checkpoint"], device, common.pick_dtype(None, device)).train()
    samples = load_samples(Path(args.data_dir), model, args.strict, run["max_length"])
    names = [name for name, _, _ in samples]
    if args.resume and names != run["samples"]:
        raise UserError(f"the samples under {args.data_dir} changed since {out} started:"
                        " resume with the same data, or start a new run")
    train_set, val_set = split_held_out(samples, run["val_size"], run["seed"])
    torch.manual_seed(run["seed"])
    params = add_lora(model, run["rank"], run["alpha"], run["dropout"])
    if rank > 0:
        torch.manual_seed(run["seed"] + rank)  # its own dropout draws
    optimizer = torch.optim.AdamW(params, lr=run["lr"], betas=BETAS, eps=EPS, weight_decay=0.0)
    if args.resume:
        step = load_checkpoint(out, model, optimizer, run["seed"], rank, world)
        if rank == 0:
            keep_metrics_up_to(out / METRICS_FILE, step)
    else:
        step = 0
        run.update(samples=names, checkpoint=str(run["checkpoint"]))
        save_checkpoint(out, model, optimizer, step, rank)  # resumable from the start
        if rank == 0:  # last: a folder with run.json has a checkpoint
            write_atomic(out / RUN_FILE, lambda tmp: tmp.write_text(json.dumps(run, indent=1)))
    if rank == 0:
        n_params = sum(p.numel() for p in params) / 1e6
        print(f"{len(train_set)} training + {len(val_set)} validation samples, {n_params:.2f} M LoRA"
              f" parameters (rank {run['rank']}), {world} x {device}", file=sys.stderr)
    return run, model, params, optimizer, train_set, val_set, step


def optimizer_step(model, params, optimizer, run: dict, train_set: list, step: int, rank=0, world=1) -> tuple:
    """Step `step`: grad_accum micro-batches (every world-th here) -> (mean loss, lr, tokens) of all ranks."""
    device = params[0].device
    # upstream's schedule: linear warm-up, then constant, counted from 1 so step 0 does not run at lr 0
    lr = run["lr"] * min(1.0, (step + 1) / max(1, run["warmup"]))
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss, tokens, accum = 0.0, 0, run["grad_accum"] // world
    for micro in range(accum):
        k = (step * accum + micro) * world + rank
        batch = [train_set[i] for i in batch_indices(len(train_set), run["batch_size"], run["seed"], k)]
        result, n = batch_loss(model, batch, device, run["checkpointing"])
        # every micro-batch of every process weighs 1/grad_accum: N processes = one with N x the micro-batches
        (result["loss"] / run["grad_accum"]).backward()
        loss, tokens = loss + result["loss"].item() / run["grad_accum"], tokens + n
    if world > 1:  # data parallel: the gradients summed over the processes, all in one all-reduce
        grads = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(grads)
        for p, grad in zip(params, grads.split([p.numel() for p in params])):
            p.grad.copy_(grad.view_as(p))
    loss, tokens = sum_over_processes([loss, tokens], device)
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, lr, int(tokens)


def train(args):
    """`train`: the training loop, with validation, metrics and checkpoints."""
    rank, world, device = training.join_processes(common.pick_device(args.device))
    run, model, params, optimizer, train_set, val_set, step = start_run(args, rank, world, device)
    out, first_step, vals, losses, tokens = Path(args.out), step, [], [], 0

    def log_metrics(record: dict):
        if rank == 0:
            with open(out / METRICS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")

    def validate():
        vals.append(validation_loss(model, val_set, run["batch_size"], device, rank, world))
        log_metrics(dict(step=step, val_loss=vals[-1]))

    bar = tqdm(total=args.max_steps, initial=step, unit="step", desc="train", disable=rank > 0)
    try:
        if not args.resume and val_set:
            validate()
        start = time.perf_counter()
        while step < args.max_steps:
            t0 = time.perf_counter()
            loss, lr, n = optimizer_step(model, params, optimizer, run, train_set, step, rank, world)
            step, tokens = step + 1, tokens + n
            losses.append(loss)
            log_metrics(dict(step=step, loss=loss, lr=lr))
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", s_step=f"{time.perf_counter() - t0:.2f}")
            bar.update()
            if val_set and (step % args.val_every == 0 or step == args.max_steps):
                validate()
                if rank == 0:
                    bar.write(f"step {step}: val_loss {vals[-1]:.4f}")
            if step % args.save_every == 0 or step == args.max_steps:
                save_checkpoint(out, model, optimizer, step, rank)
    except KeyboardInterrupt:
        raise UserError(f"interrupted at step {step}: continue from the last checkpoint with --resume") \
            from None
    finally:
        bar.close()
    if rank == 0 and not losses:
        print(f"{out} is already at step {step} (--max-steps {args.max_steps}): nothing to do")
    elif rank == 0:
        wall, steps = time.perf_counter() - start, step - first_step
        val = f", val_loss {vals[0]:.4f} -> {vals[-1]:.4f}" if len(vals) > 1 else ""
        print(f"{steps} steps in {wall:.1f} s: {steps / wall:.2f} steps/s, {tokens / wall:.0f} tokens/s,"
              f" loss {losses[0]:.4f} -> {losses[-1]:.4f}{val}, wrote {out / LORA_FILE}")


# ----------------------------------------------------------------------------- merge and export
def save_hf_weights(state: dict, folder: Path):
    """model.safetensors with the HF key names, or shards of <= SHARD_BYTES + model.safetensors.index.json."""
    shards, size = [{}], 0
    for name, tensor in state.items():
        if shards[-1] and size + tensor.nbytes > SHARD_BYTES:
            shards, size = shards + [{}], 0
        shards[-1][dualAR.hf_name(name)], size = tensor, size + tensor.nbytes
    n, weight_map = len(shards), {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        save_file(shard, str(folder / file))
        common.usual_permissions(folder / file)
        weight_map.update(dict.fromkeys(shard, file))
    if n > 1:
        index = dict(metadata=dict(total_size=sum(t.nbytes for t in state.values())), weight_map=weight_map)
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def merge_checkpoint(args):
    """`merge`: base checkpoint + LoRA -> a new folder, written in full, then renamed. hf: the base's
    config.json + HF-named safetensors; dual_ar: upstream's save_pretrained form (flat config, model.pth)."""
    out, base, lora = Path(args.out), Path(args.checkpoint), Path(args.lora)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty: choose a new folder")
    check_writable(out)
    model = dualAR.load(base, "cpu", None)  # dtype None: every tensor as stored (upstream's merge dtypes)
    n = len(load_lora(model, lora, args.alpha)) // 2
    state = {name: p.detach().cpu().contiguous() for name, p in merge_lora(model).named_parameters()}

    def write(tmp: Path):
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed merge left
        tmp.mkdir()
        if args.format == "hf":
            shutil.copy(base / "config.json", tmp / "config.json")
            save_hf_weights(state, tmp)
        else:  # upstream's own flat `dual_ar` config.json, which dualAR.py reads too
            flat = dict(model_type="dual_ar", **{k: model.config[k] for k in FLAT_KEYS if k in model.config})
            (tmp / "config.json").write_text(json.dumps(flat, indent=4, sort_keys=True))
            torch.save(state, tmp / "model.pth")
        for name in COPIED_FILES:
            if (base / name).is_file():
                shutil.copy(base / name, tmp / name)
    write_atomic(out, write)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**30
    print(f"merged {n} LoRA modules of {lora} into {base}: wrote {out} ({args.format}, {size:.2f} GiB)")


# ----------------------------------------------------------------------------- CLI
# the numeric flags, for --help and their checks: (flag, type, default, what a value must be, help)
FLAGS = dict(train=[
    ("--rank", int, RANK, ">= 1", "LoRA rank"),
    ("--alpha", float, ALPHA, None, "LoRA alpha, scaling alpha/rank"),
    ("--dropout", float, DROPOUT, "in [0, 1)", "LoRA dropout"),
    ("--lr", float, LR, "> 0", "AdamW learning rate"),
    ("--warmup", int, WARMUP, ">= 0", "linear warm-up steps"),
    ("--batch-size", int, 4, ">= 1", "samples per micro-batch"),
    ("--grad-accum", int, 1, ">= 1", "micro-batches per step and process: N processes x G = 1 x N*G"),
    ("--max-steps", int, 1000, ">= 1", "optimizer steps in all"),
    ("--max-length", int, 4096, ">= 1", "upstream's limit: skip samples longer than this many tokens"),
    ("--val-size", int, None, ">= 0", "samples held out for validation (default 5%%, at least 1; 0: none)"),
    ("--val-every", int, 100, ">= 1", "validate every N steps"),
    ("--save-every", int, 100, ">= 1", "checkpoint every N steps"),
    ("--seed", int, 42, None, "seeds the LoRA init, split, data order and dropout"),
])
RULES = {">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0,
         "in [0, 1)": lambda v: 0 <= v < 1}
COMMANDS = dict(prepare=prepare_dataset, train=train, merge=merge_checkpoint)


def parse_args(argv=None):
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    device = argparse.ArgumentParser(add_help=False)
    common.add_device_arg(device, "; several processes (torchrun): NCCL on CUDA, else gloo")
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--checkpoint", default=dualAR.DEFAULT_CHECKPOINT,
                      help=f"base S2-Pro checkpoint folder (default {dualAR.DEFAULT_CHECKPOINT})")
    data = argparse.ArgumentParser(add_help=False, parents=[device, base])
    data.add_argument("data_dir", help="folder of audio files (any format soundfile reads, any rate), each"
                      " with a same-stem .lab or .txt transcript, in any sub-folders")
    data.add_argument("--strict", action="store_true",
                      help="a file without transcript is an error (default: a warning, the file is skipped)")
    sub.add_parser("prepare", parents=[data], help="encode the audio once into <stem>.npy codes")
    t = sub.add_parser("train", parents=[data], help="train a LoRA on the prepared data")
    t.add_argument("--out", required=True,
                   help="run folder: run.json, metrics.jsonl, lora.safetensors, state.pt")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint"
                   " (its stored settings: only --max-steps, --val-every and --save-every may change), on"
                   " any number of processes that divides its micro-batches per step")
    t.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                   help="keep every activation (faster, much more memory) instead of gradient checkpointing")
    m = sub.add_parser("merge", parents=[base], help="fold a LoRA into the base weights: a checkpoint folder")
    m.add_argument("--lora", required=True, help="one of our run folders, or a LoRA file: ours, or upstream's"
                   " (keys model.<module>.lora_A / lora_B, safetensors or a torch file with state_dict)")
    m.add_argument("--out", required=True, help="new folder for the merged checkpoint")
    m.add_argument("--format", choices=["hf", "dual_ar"], default="hf", help="hf: config.json + safetensors,"
                   " HF names, as fishaudio/s2-pro (default); dual_ar: upstream's flat config + model.pth")
    m.add_argument("--alpha", type=float, help=f"LoRA alpha of a file that does not store it (upstream's),"
                   f" default {ALPHA}")
    for flag, kind, default, _, help in FLAGS["train"]:
        shown = "" if default is None else f" (default {default})"
        t.add_argument(flag, type=kind, default=default, help=help + shown)
    args = ap.parse_args(argv)
    for flag, _, _, rule, _ in FLAGS.get(args.command, []):
        value = getattr(args, flag[2:].replace("-", "_"))
        if rule and value is not None and not RULES[rule](value):
            raise UserError(f"{flag} must be {rule}")
    return args


def main(argv=None):
    training.run_command(COMMANDS, parse_args(argv))


if __name__ == "__main__":
    common.cli(main)
