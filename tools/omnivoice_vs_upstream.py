"""fishfast's OmniVoice side by side with upstream (omnivoice 0.2.1): the same clone request (a reference
clip, its transcript, a text, a seed) through upstream, run by its own venv in a subprocess that loads the
checkpoint once, and through omnivoice.py in this process, in interleaved rounds after one warm-up call each.
Prints whether the tokens are identical, the largest audio difference, each side's wall time and RTF
(min / median / max) and the ratio of medians.

Upstream needs its own venv (omnivoice 0.2.1, transformers, torchaudio); this script is not in the tests.
Upstream builds from a folder, so a bigger model than the tiny fixture is written first with
--make-checkpoint: upstream's folder layout, the real dims but --layers layers, random weights, the tiny
fixture's tokenizer and audio tokenizer.

    python tools/omnivoice_vs_upstream.py                                  # the tiny fixture
    python tools/omnivoice_vs_upstream.py --make-checkpoint /tmp/ov-6 --layers 6 --threads 2
"""
import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # omnivoice.py, from anywhere
import common  # noqa: E402
import cpu_fast  # noqa: E402
import omnivoice  # noqa: E402

TINY = ROOT / "tests/fixtures/omnivoice-tiny/checkpoint"
CLIP = ROOT / "tests/fixtures/omnivoice-tiny/golden/clip_ref24.npy"  # 3 s at 24 kHz
CLIP_TEXT = "Hello world, nice to meet you"
TEXT = "Good morning everyone, the weather is fine today."
MARK = "@@"  # the driver's answer lines start with it (upstream prints its own lines too)

# Runs in upstream's venv: load once, then per request line on stdin: seed, generate, save, report.
DRIVER = r"""
import json, sys, time
import numpy as np, torch
from omnivoice import OmniVoice
setup = json.loads(sys.argv[1])
torch.set_num_threads(setup["threads"])
model = OmniVoice.from_pretrained(setup["checkpoint"])
calls, iterative = [], model._generate_iterative
def recorded(task, config):  # the tokens of each unmasking run (one per chunk on the long-text path)
    out = iterative(task, config)
    calls.append(out[0].cpu())
    return out
model._generate_iterative = recorded
info = dict(dtype=str(model.dtype), attention=model.llm.config._attn_implementation)
print("@@" + json.dumps(info), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    wave = torch.from_numpy(np.load(job["clip"]))
    calls.clear()
    torch.manual_seed(job["seed"])
    start = time.perf_counter()
    audio = model.generate(text=job["text"], language=job["language"], ref_audio=(wave, job["sample_rate"]),
                           ref_text=job["ref_text"], duration=job["duration"], num_step=job["num_step"])[0]
    wall = time.perf_counter() - start
    np.save(job["out"] + ".audio.npy", audio)
    np.save(job["out"] + ".tokens.npy", torch.cat(calls, 1).numpy())
    print("@@" + json.dumps(dict(wall=wall)), flush=True)
"""


def make_checkpoint(folder: Path, layers: int, seed: int = 0):
    """A random checkpoint upstream and omnivoice.load both read: config.json with the real LM dims but
    `layers` layers, model.safetensors in upstream's key names (the fixture README's list), torch.rand
    weights scaled to unit variance / sqrt(fan in); tokenizer files and audio_tokenizer/ from the fixture."""
    from safetensors.torch import save_file
    cfg = dict(omnivoice.CONFIG, n_layer=layers)
    tiny = json.loads((TINY / "config.json").read_text())
    llm = dict(tiny["llm_config"], vocab_size=cfg["vocab_size"], hidden_size=cfg["dim"],
               num_hidden_layers=layers, num_attention_heads=cfg["n_head"],
               num_key_value_heads=cfg["n_local_heads"],
               head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate_size"],
               layer_types=["full_attention"] * layers, max_window_layers=layers)
    d, q, kv, ff = cfg["dim"], cfg["n_head"] * cfg["head_dim"], cfg["n_local_heads"] * cfg["head_dim"], \
        cfg["intermediate_size"]
    CV = cfg["num_codebooks"] * cfg["audio_vocab_size"]
    shapes = {"llm.embed_tokens.weight": (cfg["vocab_size"], d), "llm.norm.weight": (d,),
              "audio_embeddings.weight": (CV, d), "audio_heads.weight": (CV, d)}
    for i in range(layers):
        shapes.update({f"llm.layers.{i}.{name}": shape for name, shape in [
            ("input_layernorm.weight", (d,)), ("post_attention_layernorm.weight", (d,)),
            ("self_attn.q_proj.weight", (q, d)), ("self_attn.k_proj.weight", (kv, d)),
            ("self_attn.v_proj.weight", (kv, d)), ("self_attn.o_proj.weight", (d, q)),
            ("self_attn.q_norm.weight", (cfg["head_dim"],)), ("self_attn.k_norm.weight", (cfg["head_dim"],)),
            ("mlp.gate_proj.weight", (ff, d)), ("mlp.up_proj.weight", (ff, d)),
            ("mlp.down_proj.weight", (d, ff))]})
    generator, tensors = torch.Generator().manual_seed(seed), {}
    for name, shape in shapes.items():
        u = (torch.rand(shape, generator=generator) * 2 - 1) * math.sqrt(3)  # unit variance
        scale = 0.1 if len(shape) == 1 else 0.5 if "embed" in name else 1 / math.sqrt(shape[1])
        tensors[name] = 1 + scale * u if len(shape) == 1 else scale * u  # norms near 1
    tensors["codebook_layer_offsets"] = torch.arange(cfg["num_codebooks"]) * cfg["audio_vocab_size"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(tiny, llm_config=llm), indent=2) + "\n")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / name, folder / name)
    shutil.copytree(TINY / "audio_tokenizer", folder / "audio_tokenizer", dirs_exist_ok=True)
    params = sum(t.numel() for t in tensors.values())
    print(f"wrote {folder}: real LM dims, {layers} layers, {params / 1e6:.0f} M parameters (random), the tiny"
          f" fixture's tokenizer and audio tokenizer")


def start_upstream(args) -> subprocess.Popen:
    python = Path(args.venv) / "bin/python"
    if not python.is_file():
        raise common.UserError(f"no {python}: make a venv with omnivoice 0.2.1 there (pip install omnivoice)")
    setup = json.dumps(dict(checkpoint=str(Path(args.checkpoint).resolve()), threads=args.threads))
    log = tempfile.TemporaryFile("w+")
    upstream = subprocess.Popen([str(python), "-c", DRIVER, setup], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, cwd=tempfile.gettempdir())
    upstream.log = log
    return upstream


def upstream_answer(upstream) -> dict:
    for line in upstream.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    upstream.log.seek(0)
    sys.exit("upstream driver died:\n" + upstream.log.read()[-3000:])


def spread(values) -> str:
    values = sorted(values)
    return " / ".join(f"{v:.3f}" for v in (values[0], statistics.median(values), values[-1]))


def compare(name: str, ours: tuple, theirs: tuple):
    """(tokens, audio) of both sides -> the report lines."""
    (t1, a1), (t2, a2) = ours, theirs
    same = t1.shape == t2.shape and bool((t1 == t2).all())
    detail = f"{t1.shape[0]} x {t1.shape[1]}" if same else (
        f"fishfast {list(t1.shape)}, upstream {list(t2.shape)}" if t1.shape != t2.shape else
        f"{int((t1 != t2).sum())} of {t1.size} differ, first at (codebook, frame)"
        f" {tuple(int(i) for i in np.argwhere(t1 != t2)[0])}")
    diff = float(np.abs(a1 - a2).max()) if a1.shape == a2.shape else float("nan")
    print(f"{name}: tokens identical: {'yes' if same else 'NO'} ({detail}); max |audio difference| {diff:.3g}"
          f" ({len(a1)} vs {len(a2)} samples)")
    return same


def read_reference(args) -> tuple:
    """--ref-audio -> ((channels, N) float32, rate): both sides get exactly these samples."""
    if Path(args.ref_audio).suffix == ".npy":
        wave, rate = np.load(args.ref_audio).astype(np.float32), args.ref_rate
    else:
        data, rate = common.read_audio(args.ref_audio)
        wave = data.T
    return wave.reshape(-1, wave.shape[-1]), rate


def run_rounds(args, model, upstream, wave, rate) -> tuple:
    """One warm-up call each (2 steps), then `--rounds` interleaved rounds, so that both sides see the same
    machine load -> (walls, results): per side a list of seconds and of (tokens, audio)."""
    work = Path(tempfile.mkdtemp(prefix="omnivoice-vs-upstream-"))
    np.save(work / "clip.npy", wave)
    job = dict(clip=str(work / "clip.npy"), sample_rate=rate, text=args.text, language=args.language,
               ref_text=args.ref_text, duration=args.duration, num_step=args.num_step, seed=args.seed)
    walls, results = dict(upstream=[], fishfast=[]), dict(upstream=[], fishfast=[])
    for r in range(-1, args.rounds):
        steps, out = args.num_step if r >= 0 else 2, str(work / f"round{r}")
        upstream.stdin.write(json.dumps(dict(job, num_step=steps, out=out)) + "\n")
        upstream.stdin.flush()
        wall = upstream_answer(upstream)["wall"]
        start = time.perf_counter()
        [audio], [tokens] = omnivoice.generate(
            model, args.text, language=args.language, ref_audio=(wave, rate), ref_text=args.ref_text,
            duration=args.duration, seed=args.seed, num_step=steps, return_tokens=True, packed=args.packed)
        ours = time.perf_counter() - start
        if r < 0:
            continue
        walls["upstream"].append(wall)
        walls["fishfast"].append(ours)
        results["upstream"].append((np.load(out + ".tokens.npy"), np.load(out + ".audio.npy")))
        tokens = torch.cat(tokens, 1) if isinstance(tokens, list) else tokens  # a long text's chunks in a row
        results["fishfast"].append((tokens.numpy(), audio))
        print(f"round {r + 1}: upstream {wall:.3f} s, fishfast {ours:.3f} s", flush=True)
    shutil.rmtree(work)
    return walls, results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(TINY), help="the OmniVoice folder both load (tiny fixture)")
    ap.add_argument("--make-checkpoint", metavar="DIR", help="first write a random checkpoint with the real"
                    " dims and --layers layers to DIR, then compare on it")
    ap.add_argument("--layers", type=int, default=4, help="LM layers of --make-checkpoint (4; the real: 28)")
    ap.add_argument("--venv", default="/work/upstream-venv", help="upstream's venv (/work/upstream-venv)")
    ap.add_argument("--text", default=TEXT, help="what to say")
    ap.add_argument("--ref-audio", default=str(CLIP), help="the reference clip: a .npy at --ref-rate or an"
                    " audio file (default the fixture's 3 s clip)")
    ap.add_argument("--ref-rate", type=int, default=24000, help="sample rate of a .npy --ref-audio (24000)")
    ap.add_argument("--ref-text", default=CLIP_TEXT, help="what the reference says")
    ap.add_argument("--language", default="en", help="language of the text (en)")
    ap.add_argument("--duration", type=float, help="audio length in seconds (default: the length estimate)")
    ap.add_argument("--num-step", type=int, default=32, help="unmasking steps (32)")
    ap.add_argument("--seed", type=int, default=1234, help="torch.manual_seed upstream, seed= here (1234)")
    ap.add_argument("--packed", action="store_true", help="fishfast with packed guidance (packed=True)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (3)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help=f"torch threads, the same on both sides (default {torch.get_num_threads()})")
    args = ap.parse_args(argv)
    if min(args.layers, args.num_step, args.rounds, args.threads) < 1:
        raise common.UserError("--layers, --num-step, --rounds and --threads must be >= 1")
    if args.make_checkpoint:
        make_checkpoint(Path(args.make_checkpoint), args.layers)
        args.checkpoint = args.make_checkpoint
    torch.set_num_threads(args.threads)
    wave, rate = read_reference(args)
    upstream = start_upstream(args)
    model = cpu_fast.tune(omnivoice.load(args.checkpoint))  # as omnivoice.py's CLI runs it
    info = upstream_answer(upstream)  # upstream has loaded
    print(f"checkpoint {args.checkpoint}: {len(model.layers)} layers; upstream {info['dtype']},"
          f" {info['attention']} attention; {args.threads} threads each; seed {args.seed}, {args.num_step}"
          f" steps{'; fishfast packed' if args.packed else ''}; text {args.text!r};"
          f" reference {Path(args.ref_audio).name}"
          f" ({wave.shape[-1] / rate:.2f} s at {rate} Hz)")
    walls, results = run_rounds(args, model, upstream, wave, rate)
    upstream.stdin.close()
    upstream.wait()

    compare("round 1", results["fishfast"][0], results["upstream"][0])
    for side in ("upstream", "fishfast"):  # and every round gives what round 1 gave
        repeat = all(np.array_equal(t, results[side][0][0]) and np.array_equal(a, results[side][0][1])
                     for t, a in results[side][1:])
        seconds = len(results[side][0][1]) / model.sample_rate
        print(f"{side:8s}: wall {spread(walls[side])} s, RTF {spread([w / seconds for w in walls[side]])}"
              f" (min / median / max of {args.rounds}; {seconds:.2f} s of audio); rounds identical:"
              f" {'yes' if repeat else 'NO'}")
    ratio = statistics.median(walls["upstream"]) / statistics.median(walls["fishfast"])
    print(f"ratio of medians: upstream / fishfast = {ratio:.2f}")


if __name__ == "__main__":
    common.cli(main)
