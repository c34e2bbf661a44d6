"""fishfast's benchmark, gpt-fast style: frames/s of the frame step per batch size, the weight bytes it reads
(GB/s, % of the measured copy bandwidth), prefill tokens/s, time to first audio, peak memory; for a
quantized model also its logit error and code agreement against the unquantized one. Random weights
(torch.rand: randn differs between CPUs) at the real size or smaller, or a checkpoint. Also the codec's
encode / decode / streaming speed, eager and cpu_fast's path, OmniVoice's unmasking steps/s, RTF and
GFLOP/s (% of the matmul peak) and its audio tokenizer's RTF, and S2-Pro LoRA training steps/s. Each model
is timed as the CLIs run it: after cpu_fast.tune (`--no-tune`: the plain model). And `parity`: each model
on a device in bf16 / fp16 against CPU fp32 on the same weights and inputs (exit 1 past PARITY_LIMITS).

    python bench.py s2 --config s2-mid --batch 1,4 --frames 64 --compile --quant int8wo  # or without `s2`
    python bench.py codec --compile
    python bench.py omnivoice --config omnivoice --layers 4 --seconds 10 --threads 2
    python bench.py lora --config tests/fixtures/s2-tiny/checkpoint/config.json --seq-len 256
    python bench.py parity --device auto --dtype bf16 --model all --config real
"""
import argparse
import copy
import ctypes
import functools
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import codec
import common
import cpu_fast
import dualAR
import omnivoice
import omnivoice_codec
import quantize
import train_lora
from dualAR import (CONFIG, DEMO_DIMS, RAS_WINDOW, DualAR, Scheduler, batch_bucket,
                    cache_bucket, decode_step, demo_tokenizer, draw_noise, sample_frame, sampling_params,
                    special_ids)
from quantize import CPU_BITS, QuantLinear, swap_linears

MID = dict(dim=1024, n_head=16, n_local_heads=4, head_dim=64, intermediate_size=3072)
MID_B = dict(MID, n_head=8, n_local_heads=2, head_dim=128)  # the real head_dim
BENCH_CONFIGS = {  # random-weight models: the real size, mid sizes a CPU can run, and a tiny one
    "s2-pro": CONFIG,
    "s2-mid": dict(CONFIG, vocab_size=4864, n_layer=12, **MID, **{"fast_" + k: v for k, v in MID.items()}),
    "s2-mid-b": dict(CONFIG, vocab_size=4864, n_layer=4, n_fast_layer=2, **MID_B,
                     **{"fast_" + k: v for k, v in MID_B.items()}),
    "tiny": dict(CONFIG, vocab_size=4864, n_layer=2, n_fast_layer=1, **DEMO_DIMS,
                 **{"fast_" + k: v for k, v in DEMO_DIMS.items()}),
}
BENCH_PROMPT = 256  # prompt tokens before the timed frames
CODES_FRAMES = 64  # seeded frames a quantized model's codes are compared over


def machine_line(device) -> str:
    """The first line of a benchmark: what its figures depend on (the CPU's capability as torch's own
    kernels see it, the half-precision and int8 units oneDNN may use, cores and threads)."""
    cpu = quantize.CPU_FLAGS
    units = [name for key, name in (("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "AVX512-VNNI"),
                                    ("avx_vnni", "AVX-VNNI"), ("amx_bf16", "AMX")) if cpu.get(key)]
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")  # an emulated smaller CPU (docs/speed.md)
    limit = f", oneDNN limited to {isa}" if isa else ""
    name = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    return (f"machine: cpu capability {torch.backends.cpu.get_cpu_capability()}"
            f" ({', '.join(units) or 'no AVX512-BF16, VNNI or AMX'}{limit}), {os.cpu_count()} cores,"
            f" {torch.get_num_threads()} threads, torch {torch.__version__}, device {name}")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type in ("npu", "xpu"):
        getattr(torch, device.type).synchronize(device)


def copy_bandwidth(device, gib=1, repeats=5) -> float:
    """Measured memory bandwidth in GB/s (read + write of a big copy): the ceiling for decoding."""
    src = torch.ones(gib * 2**28, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(device)
    return 2 * src.nbytes * repeats / (time.perf_counter() - start) / 1e9


def release_freed_memory():
    """glibc keeps freed heap pages (an unquantized model's weights) resident, where they would count in the
    peak memory measured next: hand them back to the OS. Elsewhere nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def tensor_bytes(t: Tensor) -> int:
    """Bytes a tensor holds, also for torchao's quantized tensors (their int data + scales)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.nbytes


def frame_bytes(model: DualAR) -> int:
    """Weight bytes one frame step reads: the slow model and its head window once, the fast model once
    per codebook, or once less with `fast_prefill` (its output head for codebooks 1.. only)."""
    def size(*modules):
        return sum(tensor_bytes(p) for m in modules for p in m.parameters())
    start, stop = model.sampling_rows
    head = size(model.embeddings) * (stop - start) // model.config["vocab_size"]
    n = model.config["num_codebooks"]
    passes = n - 1 if model.fast_prefill else n
    return size(model.layers, model.norm) + head + passes * size(model.fast_layers, model.fast_norm) \
        + (n - 1) * size(model.fast_output)


def random_model(config, device, dtype, quant=None) -> DualAR:
    """A config (or a BENCH_CONFIGS name) with torch.rand weights (randn differs between CPUs), and the
    demo tokenizer. quant (int8wo, int4wo, CPU): each block quantized as soon as it is drawn, so the
    unquantized model never exists whole (the real size: 17.6 GB in fp32); in fp16 / bf16 each weight is
    drawn in fp32 and cast at once."""
    cfg = BENCH_CONFIGS[config] if isinstance(config, str) else config
    tokenizer = demo_tokenizer(cfg["codebook_size"])
    with torch.device("meta"):
        model = DualAR(dict(cfg, **special_ids(tokenizer)))
    torch.manual_seed(0)
    for part in model.children():  # in state-dict order
        for piece in part if isinstance(part, nn.ModuleList) else [part]:
            for m in piece.modules():
                for name, p in m.named_parameters(recurse=False):
                    weight = ((torch.rand(p.shape, device=device) - 0.5) * 0.1).to(dtype)
                    setattr(m, name, nn.Parameter(weight, requires_grad=False))
            if quant:
                swap_linears(piece, quantize.s2_linear(quant, part is model.fast_layers))
    if quant:
        quantize.quantize_fast_head(model)
    model.quant = quant
    model.make_rope()
    model.tokenizer = tokenizer
    return model.requires_grad_(False).eval()


@torch.inference_mode()
def time_steps(model: DualAR, batch: int, frames: int) -> tuple:
    """-> (frame steps per second, seconds of the first call: the compile) of the engine's own step, for
    `batch` busy rows mid-way through a generation (random numbers drawn per row and frame as in serving,
    one host sync every `sync_every` frames, end-of-speech ignored)."""
    device = model.embeddings.weight.device
    context = cache_bucket(BENCH_PROMPT + frames + 9, model.config)
    with Scheduler(model, slots=batch, context=context) as scheduler:
        scheduler.frames[:, 0] = model.config["semantic_begin_id"]
        scheduler.pos.fill_(BENCH_PROMPT)
        scheduler.live.fill_(1)
        generators = [torch.Generator(device).manual_seed(i) for i in range(batch)]
        rows = min(batch_bucket(batch), batch)
        start = time.perf_counter()
        scheduler.run_frames(rows, generators)
        first = time.perf_counter() - start
        scheduler.run_frames(rows, generators)
        calls = max(1, frames // scheduler.sync_every)
        start = time.perf_counter()
        for _ in range(calls):
            scheduler.run_frames(rows, generators)
        return calls * scheduler.sync_every / (time.perf_counter() - start), first


def bench_prompt(model: DualAR, frames: int = 0) -> Tensor:
    """A fixed prompt of BENCH_PROMPT semantic positions, in caches of one row with room for `frames` more."""
    cfg, device = model.config, model.embeddings.weight.device
    tokens = torch.zeros(1 + cfg["num_codebooks"], BENCH_PROMPT, dtype=torch.long, device=device)
    tokens[0] = cfg["semantic_begin_id"] + torch.arange(BENCH_PROMPT, device=device) % cfg["codebook_size"]
    tokens[1:] = torch.arange(BENCH_PROMPT, device=device) % cfg["codebook_size"]
    model.setup_caches(1, cache_bucket(BENCH_PROMPT + frames + 1, cfg))
    return tokens


@torch.inference_mode()
def prefill_speed(model: DualAR) -> float:
    """Prompt tokens per second of one row's prefill."""
    device, tokens = model.embeddings.weight.device, bench_prompt(model)
    model.prefill(tokens)
    synchronize(device)
    start = time.perf_counter()
    model.prefill(tokens)
    synchronize(device)
    return BENCH_PROMPT / (time.perf_counter() - start)


@torch.inference_mode()
def head_logits(model: DualAR) -> tuple:
    """Slow logits (sampling window) at the end of a fixed prompt, and the fast logits of every codebook
    teacher-forced with codes 0: what quantization must not move."""
    slow, hidden = model.prefill(bench_prompt(model))
    fast = [model.forward_fast(hidden[:, None], 0)]
    code = torch.zeros(1, 1, dtype=torch.long, device=hidden.device)
    n = model.config["num_codebooks"]
    fast += [model.forward_fast(model.fast_embeddings(code), i) for i in range(1, n)]
    return slow.float(), torch.cat(fast).float()


@torch.inference_mode()
def seeded_frames(model: DualAR, frames: int, forced: Tensor = None) -> Tensor:
    """`frames` frames (eager, seed 0) after the fixed prompt, each from the previous frame of `forced` if
    given (teacher forcing: a quantized model judged frame by frame on the reference's history) -> (frames,
    1 + num_codebooks)."""
    logits, hidden = model.prefill(bench_prompt(model, frames))
    p = sampling_params(model, [(0.7, 0.7, 30)])
    generator = torch.Generator(hidden.device).manual_seed(0)
    frame = sample_frame(model, logits, hidden, torch.full((1, RAS_WINDOW), -1, device=hidden.device), p,
                         *draw_noise(model, [generator]))
    out, recent = [frame], torch.zeros(1, RAS_WINDOW, dtype=torch.long, device=hidden.device)
    for i in range(1, frames):
        last = out[-1] if forced is None else forced[i - 1: i]
        recent = torch.cat([recent[:, 1:], last[:, :1]], dim=1)
        pos = torch.tensor([BENCH_PROMPT + i - 1], device=hidden.device)
        out.append(decode_step(model, last, pos, recent, p, *draw_noise(model, [generator])))
    return torch.cat(out)


def bench_codec(args, device):
    """The checkpoint's codec, or the real codec size with random weights (fp32, as the CLI runs it)."""
    if args.checkpoint and (Path(args.checkpoint) / "codec.pth").is_file():
        return codec.load(args.checkpoint, device)
    return random_codec(codec.CONFIG, device, torch.float32)


def random_codec(cfg: dict, device, dtype):
    """A codec of config `cfg` with its default (seeded) random weights, ready for inference."""
    torch.manual_seed(0)
    with torch.device(device):
        return codec.fold_weight_norm(codec.DAC(cfg)).requires_grad_(False).eval().to(dtype)


BENCH_TEXT = "The quick brown fox jumps over the lazy dog, and the river is calm today."


def time_to_first_audio(model: DualAR, dac, frames: int, repeats: int = 3) -> float:
    """Seconds from a request to its first audio samples at batch 1 (prefill, the first frames, their
    codec decode), median of `repeats` after one warm-up."""
    device, times = model.embeddings.weight.device, []
    for seed in range(repeats + 1):
        start = time.perf_counter()
        chunks = dualAR.stream(model, BENCH_TEXT, seed=seed, max_new_tokens=frames, chunk_frames=8)
        with torch.inference_mode():
            next(codec.decode_stream(dac, (c[None].to(device) for c in chunks)))
        synchronize(device)
        times.append(time.perf_counter() - start)
        chunks.close()
    return sorted(times[1:])[repeats // 2]


def quant_agreement(model: DualAR, scheme: str, change=None, against="unquantized"):
    """Quantize `model` (or change(model)) and print its logit error and code agreement against itself
    unquantized (as it was); for int8wo / int4wo also ggml's Q8_0 / Q4_0 of the same weights, the error of a
    well-known scheme beside ours (how large an error is depends on the weights: docs/speed.md)."""
    reference, codes = head_logits(model), seeded_frames(model, CODES_FRAMES)
    ggml = ggml_copy(model, CPU_BITS[scheme]) if scheme in CPU_BITS and not change else None
    model = change(model) if change else quantize.quantize(model, scheme)
    print_logit_error(scheme, reference, head_logits(model), against)
    if ggml is not None:
        print_logit_error(f"ggml Q{CPU_BITS[scheme]}_0 (fp32)", reference, head_logits(ggml), against)
    same = (seeded_frames(model, CODES_FRAMES, codes) == codes).all(-1).float().mean().item()
    print(f"{scheme}: {100 * same:.0f} % of {CODES_FRAMES} seeded frames (eager, each from the"
          f" {against} model's previous frame) have all the {against} model's codes")
    return model


def print_logit_error(what: str, reference: tuple, got: tuple, against: str):
    for part, ref, logits in zip(("slow", "fast"), reference, got, strict=True):
        error = ((logits - ref).abs().max() / ref.abs().max()).item()
        same = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{what} {part} logits vs {against}: max error {100 * error:.2f} % of the largest"
              f" logit, same argmax {100 * same:.0f} %")


GGML_BLOCK = 32  # ggml's Q8_0 and Q4_0: one scale per 32 inputs


def ggml_rounded(w: Tensor, bits: int) -> Tensor:
    """w as ggml's Q8_0 (bits 8: scale = the largest |value| / 127) or Q4_0 (bits 4: scale = the value of
    largest magnitude / -8, q = floor(w / scale + 8.5) capped at 15) stores it, dequantized."""
    blocks = w.float().reshape(-1, GGML_BLOCK)
    if bits == 8:
        scale = blocks.abs().amax(-1, keepdim=True) / 127
        q = torch.round(blocks / scale.clamp(min=1e-12))
    else:
        scale = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / -8
        q = torch.floor(blocks / scale.where(scale != 0, 1) + 8.5).clamp(max=15) - 8
    return (q * scale).view_as(w).to(w.dtype)


def ggml_copy(model: DualAR, bits: int):
    """A copy of the model whose transformers' linear layers hold ggml's rounding of their weights (the fast
    head Q8_0, as ours is int8), in the model's dtype; None where an input count is not whole blocks."""
    linears = [m for part in (model.layers, model.fast_layers) for m in part.modules()
               if isinstance(m, nn.Linear)] + [model.fast_output]
    if any(m.in_features % GGML_BLOCK for m in linears):
        return None
    rounded = copy.deepcopy(model)
    for part in (rounded.layers, rounded.fast_layers):
        for m in part.modules():
            if isinstance(m, nn.Linear):
                m.weight.data = ggml_rounded(m.weight.data, bits)
    rounded.fast_output.weight.data = ggml_rounded(rounded.fast_output.weight.data, 8)
    return rounded


def bench(args):
    device, dtype, compiled = dualAR.model_settings(args)
    print(machine_line(device))
    quant = args.quant if args.quant != "none" else None
    quantize.check_s2(quant, device, dtype)
    if args.checkpoint:
        model, name = dualAR.load(args.checkpoint, device, dtype), Path(args.checkpoint).name
    else:
        # the real size quantized or in half on CPU: drawn block by block, no fp32 model to compare with
        direct = device.type == "cpu" and args.config == "s2-pro" \
            and (quant in CPU_BITS or dtype != torch.float32)
        half = dtype != torch.float32 and not direct  # judged against the same weights in fp32
        model = random_model(args.config, device, torch.float32 if half else dtype, quant if direct else None)
        name = args.config
        if half:
            short = next(k for k, v in common.DTYPES.items() if v == dtype)
            model = quant_agreement(model, short, lambda fp32: cpu_fast.use_half_linears(fp32.to(dtype)),
                                    against="fp32")
    if quant and not model.quant:
        quant_agreement(model, quant)
    dualAR.optimize(model, None, compiled, args.compile_cache, args.fast_prefill)  # as dualAR.load does
    if not args.no_tune:
        cpu_fast.tune(model, rows=max(args.batch))  # as the CLI and the server do
    n_params = sum(m.in_features * m.out_features if isinstance(m, QuantLinear) else
                   sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) / 1e9
    built, per_frame, bandwidth = common.peak_memory_gb(device), frame_bytes(model), copy_bandwidth(device)
    release_freed_memory()
    common.reset_peak_memory(device)  # peak_mem_gb: the model as it runs, not as it was built (or the copy)
    prefill = prefill_speed(model)
    print(f"{name}: {n_params:.2f} G params, {per_frame / 1e9:.2f} GB read per frame step, {dtype}, {device}"
          f" ({torch.get_num_threads()} threads), quant {quant or 'none'}, compile {int(compiled)},"
          f" fast prefill {int(model.fast_prefill)},"
          f" measured copy bandwidth {bandwidth:.1f} GB/s, prefill {prefill:.0f} tokens/s, peak memory"
          f" {built:.2f} GB until here")
    print(f"{'batch':>5} {'frames/s':>9} {'GB/s':>7} {'% bw':>5} {'RTF':>6} {'compile s':>9}")
    seconds_per_frame = codec.hop_length() / codec.CONFIG["sample_rate"]
    short = next(k for k, v in common.DTYPES.items() if v == dtype)
    for batch in args.batch:
        steps, first = time_steps(model, batch, args.frames)
        gbs, fps = per_frame * steps / 1e9, batch * steps
        print(f"{batch:>5} {fps:>9.2f} {gbs:>7.1f} {100 * gbs / bandwidth:>5.0f}"
              f" {1 / steps / seconds_per_frame:>6.2f} {first:>9.1f}")
        print(f"bench config={name} quant={quant or 'none'} compile={int(compiled)} batch={batch}"
              f" device={device.type} dtype={short} frames_per_s={fps:.2f} gb_per_s={gbs:.1f}"
              f" bandwidth_pct={100 * gbs / bandwidth:.0f} prefill_tokens_per_s={prefill:.0f}"
              f" peak_mem_gb={common.peak_memory_gb(device):.2f} compile_s={first if compiled else 0:.1f}"
              f" fast_prefill={int(model.fast_prefill)}")
    if args.ttfa:
        ttfa = time_to_first_audio(model, bench_codec(args, device), args.frames)
        prompt = dualAR.build_prompt(model, [], [], BENCH_TEXT).size(1)
        print(f"time to first audio at batch 1 (prefill {prompt} tokens + first frames + their codec"
              f" decode): {1000 * ttfa:.0f} ms")
        print(f"bench ttfa_ms={1000 * ttfa:.0f} prompt_tokens={prompt}")


# ------------------------------------------------------------------------- one-row linears (`bench.py rows`)
def row_ways(shapes, layers: int, repeats: int = 1) -> dict:
    """{(precision, way): (run, weight bytes it reads)}: one row through `shapes` linears `layers` times,
    the whole pass `repeats` times over the same weights (more than once: from cache, where they fit), each
    precision's weights as the frame step holds them (fp32, fp16 / bf16 HalfLinear's, int8 / int4
    QuantLinear's), run eager (torch's kernel, as eager frame steps run it; fp32 also oneDNN's prepacked) and
    compiled as cpu_fast's fused one-row sum (`one_row_linear`; `int8_one_row`; `int4_one_row`); a run
    returns each pass's products in turn."""
    # a row of its own for each pass: a compiled graph would compute the same sums over the same row once
    rows = [{k: torch.rand(1, k) for k in {k for _, k in shapes}} for _ in range(repeats)]
    ways = {}

    def add(precision, weights, eager: dict, fused=None, fused_weights=None, options=None):
        size = repeats * sum(w.numel() * w.element_size() for w in weights)
        for name, run in eager.items():
            ways[(precision, name)] = (functools.partial(run, rows, weights), size)
        if fused:
            run = torch.compile(fused, fullgraph=True, options=options)
            ways[(precision, "compiled sum")] = (functools.partial(run, rows, fused_weights or weights), size)

    def linears(dtype):
        return lambda rows, ws: [F.linear(xs[w.shape[1]].to(dtype), w) for xs in rows for w in ws]

    def summed(rows, ws):
        return [cpu_fast.one_row_linear(xs[w.shape[1]], w) for xs in rows for w in ws]

    fp32 = [torch.rand(shape) for _ in range(layers) for shape in shapes]
    packed = {id(w): cpu_fast.prepack(w) for w in fp32}

    def prepacked(rows, ws):
        return [cpu_fast.packed_matmul(xs[w.shape[1]], packed[id(w)]) for xs in rows for w in ws]
    add("fp32", fp32, {"torch": linears(torch.float32), "packed": prepacked}, summed)
    for dtype in (torch.float16, torch.bfloat16):
        name = next(name for name, d in common.DTYPES.items() if d == dtype)
        add(name, [w.to(dtype) for w in fp32], {"torch": linears(dtype)}, summed)
    int8 = [quantize.QuantLinear(nn.Linear(k, n, bias=False), 8) for _ in range(layers) for n, k in shapes]
    words = [cpu_fast.held_for(q, one_row=True)[0] for q in int8]  # as OneRowQuantLinear holds them
    scales = {id(w): q.scales for q, word in zip(int8, words) for w in (q.weight, word)}

    def int8_kernel(rows, ws):
        return [torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]].bfloat16(), w, scales[id(w)])
                for xs in rows for w in ws]

    def int8_summed(rows, ws):
        return [cpu_fast.int8_one_row(xs[w.shape[1]], w, scales[id(w)]) for xs in rows for w in ws]

    add("int8", [q.weight for q in int8], {"torch": int8_kernel}, int8_summed, words,
        quantize.CPU_COMPILE_OPTIONS)  # compiled as a quantized frame step is
    int4 = [quantize.QuantLinear(nn.Linear(k, n, bias=False), 4) for _ in range(layers) for n, k in shapes]
    held = [(*cpu_fast.held_for(q, one_row=True), q.group) for q in int4]  # as OneRowQuantLinear holds them
    layer = {id(q.weight): q for q in int4}

    def int4_kernel(rows, ws):
        return [layer[id(w)](xs[layer[id(w)].in_features]) for xs in rows for w in ws]

    def int4_summed(rows, held):
        return [cpu_fast.int4_one_row(xs[w.shape[1] * 2], w, scale, group)
                for xs in rows for w, scale, group in held]

    add("int4", [q.weight for q in int4], {"torch": int4_kernel}, int4_summed, held,
        quantize.CPU_COMPILE_OPTIONS)
    return ways


CACHE_SPLIT = 4  # the set read from cache: one layer of PROBE_SHAPES with a quarter of their outputs


@torch.inference_mode()
def rows_speed(args):
    """`bench.py rows`: one row through a layer's linears (cpu_fast.PROBE_SHAPES, enough layers to read
    them from memory) at each precision, eager and compiled, in interleaved rounds: GB/s of weight bytes
    (min / median / max of the rounds) and the median's % of the measured copy bandwidth; beside it the
    same way's median on a set that stays in cache (`CACHE_SPLIT`), read over and over: the rate its own
    loop allows. A way that reads from memory about as fast as from cache is bound by its loop, not by
    memory."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cpu_fast.keep_freed_memory()
    cached = tuple((n // CACHE_SPLIT, k) for n, k in cpu_fast.PROBE_SHAPES)
    sets = {"memory": row_ways(cpu_fast.PROBE_SHAPES, args.layers),
            "cache": row_ways(cached, 1, repeats=2 * args.layers)}  # half the memory set's bytes a run
    ways = {(where, *key): run_size for where, set_ways in sets.items() for key, run_size in set_ways.items()}
    bandwidth = copy_bandwidth(torch.device("cpu"))
    seconds = {key: [] for key in ways}
    for run, _ in ways.values():
        run()  # compiles
    for _ in range(args.rounds):
        for key, (run, _) in ways.items():
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            seconds[key].append(best)
    rates = {key: sorted(size / t / 1e9 for t in seconds[key]) for key, (_, size) in ways.items()}
    print(f"{machine_line(torch.device('cpu'))} ({' '.join(common.cpu_model())}), copy bandwidth"
          f" {bandwidth:.1f} GB/s")
    print(f"{'precision':9} {'way':12} {'MB':>6} {'GB/s min':>9} {'median':>7} {'max':>6} {'% bw':>5}"
          f" {'in cache':>8} {'of cache':>8}")
    for (precision, way), (_, size) in sets["memory"].items():
        memory, cache = rates[("memory", precision, way)], rates[("cache", precision, way)]
        median, in_cache = statistics.median(memory), statistics.median(cache)
        print(f"{precision:9} {way:12} {size / 1e6:6.0f} {memory[0]:9.1f} {median:7.1f} {memory[-1]:6.1f}"
              f" {100 * median / bandwidth:5.0f} {in_cache:8.1f} {median / in_cache:8.2f}")


# ----------------------------------------------------------------------------- codec (`bench.py codec`)
def matmul_peak(device, dtype, n=2048, repeats=8) -> float:
    """The best GFLOP/s of an n x n matmul, torch's or oneDNN's on a prepacked weight (the codec's fast
    path; MKL's reached half of it on this AMD CPU): the ceiling of compute-bound work such as the codec's."""
    a, b = torch.rand(n, n, device=device, dtype=dtype), torch.rand(n, n, device=device, dtype=dtype)
    ways = [lambda: a @ b]
    if cpu_fast.can_prepack(b):
        packed = cpu_fast.prepack(b.T)
        ways.append(lambda: cpu_fast.packed_matmul(a, packed))
    best = float("inf")
    for way in ways:
        for _ in range(repeats + 1):  # the first one warms up
            synchronize(device)
            start = time.perf_counter()
            way()
            synchronize(device)
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def counted_flops(model: nn.Module, fn) -> int:
    """FLOPs fn() spends in model's convolutions, transposed convolutions and linear layers (the codec's
    arithmetic but for attention scores and element-wise work)."""
    counts = []

    def count(module, inputs, output):
        x, conv = inputs[0], getattr(module, "conv", None)
        if isinstance(module, codec.CausalConvT):  # each input sample meets the whole kernel
            kernel = conv.in_channels * conv.out_channels * conv.kernel_size[0]
            counts.append(x.shape[0] * x.shape[2] * kernel)
        elif isinstance(module, codec.CausalConv):
            counts.append(output.numel() * conv.in_channels // conv.groups * conv.kernel_size[0])
        else:
            counts.append(x.numel() // x.shape[-1] * module.in_features * module.out_features)
    kinds = (codec.CausalConv, codec.CausalConvT, nn.Linear)
    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, kinds)]
    try:
        fn()
    finally:
        for hook in hooks:
            hook.remove()
    return 2 * sum(counts)  # a multiply and an add


def timed_codec_call(dac, fast: bool, fn, device, choices=None, copies=None) -> tuple:
    """fn() once, on the codec's fast path (its ops as `choices` say, the prepacked `copies` kept) or not
    -> (seconds, minor page faults, peak memory GB)."""
    cpu_fast.codec_fast_path(dac, fast, choices, copies)
    common.reset_peak_memory(device)
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    fn().cpu()
    wall, faults = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return wall, faults, common.peak_memory_gb(device)


def codec_speed(args):
    """`python bench.py codec`: encode / decode / streaming speed, page faults and peak memory at the real
    size, random weights; with --compile, cpu_fast's path and the eager one side by side (interleaved,
    min/median/max)."""
    device = common.pick_device(args.device)
    dtype = common.pick_dtype(args.dtype, device, cuda="fp16")
    print(machine_line(device))
    cpu_fast.keep_freed_memory()  # as the CLIs do, for either path
    cfg = codec.read_config(args.config) if args.config else codec.CONFIG
    dac = random_codec(cfg, device, dtype)
    n_params = sum(p.numel() for p in dac.parameters())
    peak = matmul_peak(device, dtype)
    print(f"codec: {n_params / 1e6:.1f} M parameters, {device}, {dtype}, {torch.get_num_threads()} threads,"
          f" matmul peak {peak:.0f} GFLOP/s (2048 x 2048, best of torch and oneDNN)")
    wave = 0.1 * torch.randn(int(args.seconds * cfg["sample_rate"]))
    codes = codec.encode(dac, wave)
    chunk, frames = args.chunk_frames, codes.shape[-1]
    runs = [("encode", chunk, frames, 1, lambda: codec.encode(dac, wave, chunk)),
            ("decode", chunk, frames, 1, lambda: codec.decode(dac, codes, chunk)),
            ("decode", 0, frames, 1, lambda: codec.decode(dac, codes, None))]
    for n in args.stream_frames:  # a stream's first chunks: each costs about what later ones do
        chunks = codes.split(n, -1)[: args.stream_chunks]
        runs.append(("stream", n, sum(c.shape[-1] for c in chunks), len(chunks),
                     lambda chunks=chunks: torch.cat([w.cpu() for w in codec.decode_stream(dac, chunks)], 1)))
    modes, choices = [0, 1] if args.compile else [0], None
    if args.compile:
        start = time.perf_counter()
        choices = cpu_fast.machine_choices(dac)
        steps = {key: [[0, fast]] if isinstance(fast, bool) else fast for key, fast in choices.items()}
        slower = sorted(key for key, value in steps.items() if not any(fast for _, fast in value))
        said = {key: ", ".join(f"{'fast' if fast else 'eager'} from {rows}" for rows, fast in value)
                for key, value in steps.items() if len(value) > 1}
        by_rows = sorted(f"{key} ({value})" for key, value in said.items())
        seconds, kept_in = time.perf_counter() - start, cpu_fast.decisions_file()
        print(f"fast path on this machine: {len(choices) - len(slower)} of {len(choices)} ops fast at some"
              f" size, decided in {seconds:.1f} s ({kept_in}); eager: {', '.join(slower) or 'none'}; by size"
              f" (a linear layer's rows, a conv's positions): {', '.join(by_rows) or 'none'}")
    copies = {}  # the modes alternate: each prepacked weight made once
    for path, chunk, n_frames, n_chunks, fn in runs:
        flops = counted_flops(dac, fn)  # on either path: both do the same arithmetic
        # warm-up: first calls allocate what later calls reuse; the first fast one compiles
        warm = {m: timed_codec_call(dac, m, fn, device, choices, copies)[0] for m in modes}
        if args.compile and path == "encode":  # the first run
            print(f"compile: first fast encode {warm[1]:.1f} s, first eager one {warm[0]:.1f} s "
                  f"(TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')})")
        calls = {m: [] for m in modes}  # (seconds, faults, peak GB) per call, modes interleaved
        for _ in range(args.repeats):
            for m in modes:
                calls[m].append(timed_codec_call(dac, m, fn, device, choices, copies))
        for m in modes:
            walls, (_, faults, memory) = sorted(c[0] for c in calls[m]), calls[m][-1]
            med, audio = walls[len(walls) // 2], n_frames * dac.hop / cfg["sample_rate"]
            rtfs = " / ".join(f"{w / audio:.3f}" for w in (walls[0], med, walls[-1]))
            speed, per_audio = flops / med / 1e9, flops / audio / 1e9
            at_peak = per_audio / peak  # the RTF at the matmul's speed: what the CPU allows
            print(f"{path:6s} chunk={chunk:<3d} {'fast ' if m else 'eager'}: RTF {rtfs} (min / median /"
                  f" max of {len(walls)}), {speed:.0f} GFLOP/s = {100 * speed / peak:.0f} % of the matmul"
                  f" peak ({per_audio:.0f} GFLOP per second of audio: RTF {at_peak:.2f} at the"
                  f" peak), {faults} minor page faults, peak memory {memory:.2f} GB")
            per_chunk = f" ms_per_chunk={1000 * med / n_chunks:.4g}" if path == "stream" else ""
            print(f"codec_bench path={path} chunk={chunk} compile={m} rtf={med / audio:.4g} frames_per_s="
                  f"{n_frames / med:.4g} gflops={speed:.4g} rtf_at_peak={at_peak:.4g}{per_chunk}")
    cpu_fast.codec_fast_path(dac, False)


# ------------------------------------------------------------------------ OmniVoice (`bench.py omnivoice`)
OV_TINY = Path(__file__).resolve().parent / "tests/fixtures/omnivoice-tiny/checkpoint"
OV_TEXT = "The quick brown fox jumps over the lazy dog, then it runs far away into the woods. "
OV_CHARS_PER_SECOND = 14  # about what the length estimate gives English speech
OV_REF_SECONDS = 3  # every request clones a reference of this length (random codes)


def ov_requests(model, args, gen: dict, batch: int) -> list:
    """`batch` clone requests of `--seconds` each (a fixed duration, so the length is exact)."""
    generator = torch.Generator().manual_seed(args.seed)
    C, frames = model.config["num_codebooks"], OV_REF_SECONDS * model.frame_rate
    codes = torch.randint(0, model.audio_tokenizer.codebook_size, (C, frames), generator=generator)
    voice = dict(codes=codes, text=(OV_TEXT * 2)[:OV_CHARS_PER_SECOND * OV_REF_SECONDS], rms=0.05)
    text = (OV_TEXT * math.ceil(args.seconds))[:round(OV_CHARS_PER_SECOND * args.seconds)]
    return omnivoice.plan(model, [text] * batch, language="en", ref_audio=None, ref_text=None,
                          voice=voice, instruct=None, speed=None, duration=args.seconds, gen=gen)


def ov_step_flops(cfg: dict, n_layer: int, rows: int, length: int, targets: list, spans=None) -> int:
    """FLOPs of one unmasking step: every layer over all rows x length positions (padding included, as the
    forward computes it): projections, MLP, attention scores and values (each position over the row's
    `length` keys, or over its own span's of a flat row's (start, end) spans); the heads at the target
    positions of the cond and uncond rows. Norms, RoPE, softmax and sampling are left out."""
    d, h, kv, hd = cfg["dim"], cfg["n_head"], cfg["n_local_heads"], cfg["head_dim"]
    linear = 2 * d * h * hd + 2 * d * kv * hd + 3 * d * cfg["intermediate_size"]  # q, o; k, v; gate, up, down
    keys = rows * length**2 if spans is None else sum((end - start)**2 for start, end in spans)
    attention = 2 * h * hd * keys  # q.k over the keys, p.v over as many values
    heads = 2 * sum(targets) * d * cfg["num_codebooks"] * cfg["audio_vocab_size"]
    return 2 * (n_layer * (rows * length * linear + attention) + heads)  # a multiply and an add


def ov_timed(fn, device, rounds: int) -> tuple:
    """fn() once to warm up (a compiled forward compiles then), then `rounds` times -> (sorted walls, peak
    memory GB of the last call, the warm-up's wall)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    first, walls = time.perf_counter() - start, []
    for _ in range(rounds):
        common.reset_peak_memory(device)
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        walls.append(time.perf_counter() - start)
    return sorted(walls), common.peak_memory_gb(device), first


def ov_spread(values, fmt: str) -> str:
    values = sorted(values)
    return " / ".join(format(v, fmt) for v in (values[0], statistics.median(values), values[-1]))


def ov_build(args, device, dtype) -> tuple:
    """--checkpoint, --config and --layers -> (model, what it is, in words)."""
    if args.checkpoint or args.config == "tiny":
        folder = args.checkpoint or OV_TINY
        model, what = omnivoice.load(folder, device, dtype), str(folder)
    else:
        cfg = dict(omnivoice.CONFIG, n_layer=args.layers or omnivoice.CONFIG["n_layer"])
        tokenizer = common.load_tokenizer(OV_TINY / "tokenizer.json")  # its BPE ids fit any vocab
        model = omnivoice.random_model(cfg, omnivoice_codec.CONFIG, device, dtype, args.seed, tokenizer)
        what = "random weights, real dims"
    full = omnivoice.CONFIG["n_layer"] if what.startswith("random") else len(model.layers)
    model.layers = model.layers[:args.layers or full]
    if len(model.layers) < full:
        what += f", CUT TO {len(model.layers)} OF {full} LAYERS (a partial model: scale the times)"
    return model, what


def ov_bench_unmask(model, args, device, peak: float, batch: int):
    """One unmasking run of `batch` requests (what generate() spends its LM time in), timed `--rounds`
    times."""
    gen = dict(omnivoice.GENERATION, num_step=args.num_step)
    items, generator = ov_requests(model, args, gen, batch), torch.Generator().manual_seed(args.seed)
    targets, layout = [item["target_len"] for item in items], omnivoice.row_layout(ov_packed(args), model)
    built = layout(model, items, gen["denoise"])  # what the LM runs on
    rows, length = built["ids"].shape[0], built["ids"].shape[2]
    spans = None if built["mask"].dtype == torch.bool else built["mask"].tolist()
    run = lambda: omnivoice.unmask(model, items, gen, generator, packed=ov_packed(args))  # noqa: E731
    walls, memory, first = ov_timed(run, device, args.rounds)
    flops = args.num_step * ov_step_flops(model.config, len(model.layers), rows, length, targets, spans)
    audio, codes = sum(targets) / model.frame_rate, sum(targets) * model.config["num_codebooks"]
    gflops = [flops / w / 1e9 for w in walls]
    print(f"unmask: batch {batch}, {targets[0]} frames ({args.seconds:g} s) each, {rows} rows x {length}"
          f" positions ({getattr(layout, 'func', layout).__name__}), {args.num_step} steps,"
          f" {flops / args.num_step / 1e9:.1f} GFLOP per step"
          f" (min / median / max of {args.rounds})")
    print(f"  steps/s {ov_spread([args.num_step / w for w in walls], '.3g')},"
          f" RTF {ov_spread([w / audio for w in walls], '.3g')},"
          f" tokens/s {ov_spread([codes / w for w in walls], '.4g')} ({codes // sum(targets)} codes a frame)")
    print(f"  LM {ov_spread(gflops, '.0f')} GFLOP/s = {ov_spread([100 * g / peak for g in gflops], '.0f')} %"
          f" of the matmul peak, peak memory {memory:.2f} GB")
    if model.compiled_hidden is not None:
        print(f"  compiled forward: the first run (tracing and compiling its graph) took {first:.1f} s")


def ov_packed(args):
    """--packed -> unmask's packed."""
    return bool(args.packed)


def ov_interleaved(runs: dict, device, rounds: int) -> dict:
    """name -> a call: each called once as a warm-up, then all in alternating rounds -> name -> walls (s),
    so that every call sees the same machine."""
    for run in runs.values():
        run()
    walls = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            walls[name].append(time.perf_counter() - start)
    return walls


def ov_race(model, args, device, contenders: list) -> tuple:
    """`model`'s --batch[0] requests unmasked by each (model, packed) of `contenders` in alternating rounds
    (ov_interleaved, in that order) -> (their RTF spreads, their median walls, the requests)."""
    gen = dict(omnivoice.GENERATION, num_step=args.num_step)
    items = ov_requests(model, args, gen, args.batch[0])
    audio = sum(item["target_len"] for item in items) / model.frame_rate
    runs = {i: lambda m=m, packed=packed: omnivoice.unmask(m, items, gen, torch.Generator().manual_seed(
        args.seed), packed=packed) for i, (m, packed) in enumerate(contenders)}
    walls = ov_interleaved(runs, device, args.rounds).values()
    rtfs = [ov_spread([w / audio for w in ws], ".3g") for ws in walls]
    return rtfs, [statistics.median(ws) for ws in walls], items


def ov_compare_packed(model, args, device):
    """upstream's two rows and packed guidance, interleaved -> their RTFs and the speed-up (medians)."""
    (upstream, packed), medians, _ = ov_race(model, args, device, [(model, False), (model, True)])
    print(f"packed vs upstream's rows, interleaved: RTF {packed} vs {upstream}, speed-up"
          f" {medians[0] / medians[1]:.2f}x (medians)")


def ov_compare_compiled(model, args, device):
    """The compiled forward and the same model eager, both packed guidance (on CPU the flat row),
    interleaved -> their RTFs and the speed-up (medians)."""
    eager = copy.copy(model)  # the same modules and weights, without the compiled forward
    eager.compiled_hidden = None
    (compiled, plain), medians, _ = ov_race(model, args, device, [(model, True), (eager, True)])
    print(f"compiled vs eager (packed), interleaved: RTF {compiled} vs {plain}, speed-up"
          f" {medians[1] / medians[0]:.2f}x (medians)")


def ov_compare_quant(model, args, device):
    """The model as it is and a copy quantized with --compare-quant, interleaved (the same request and row
    layout) -> their RTFs, the speed-up (medians), and the share of (codebook, target position) of the
    first forward whose most likely code is unchanged."""
    scheme = args.compare_quant
    low = quantize.quantize(copy.deepcopy(model), scheme)
    low = low if args.no_tune else cpu_fast.tune(low)
    (high_rtf, low_rtf), medians, items = ov_race(model, args, device,
                                                  [(model, ov_packed(args)), (low, ov_packed(args))])
    rows = omnivoice.batch_rows(model, items, omnivoice.GENERATION["denoise"])
    with torch.inference_mode():
        codes = [m(rows["ids"], rows["audio_mask"], rows["mask"]).argmax(-1) for m in (model, low)]
    targets = [(row, slice(start, start + item["target_len"]))
               for (row, start), item in zip(rows["cond"], items)]
    same = [(codes[0][row, :, span] == codes[1][row, :, span]).float().mean().item() for row, span in targets]
    print(f"{scheme} vs unquantized, interleaved: RTF {low_rtf} vs {high_rtf}, speed-up"
          f" {medians[0] / medians[1]:.2f}x (medians); the first forward's most likely code kept at"
          f" {min(same):.1%} of the target positions")


def ov_bench_tokenizer(model, args, device):
    """The audio tokenizer's encode and decode of `--seconds` of noise."""
    sr, generator = model.sample_rate, torch.Generator().manual_seed(args.seed)
    wave = torch.rand(int(args.seconds * sr), generator=generator) * 0.2 - 0.1
    codes = omnivoice.encode(model, wave, sr)
    for what, fn in (("encode", lambda: omnivoice.encode(model, wave, sr)),
                     ("decode", lambda: omnivoice.decode(model, codes))):
        walls, memory, _ = ov_timed(fn, device, args.rounds)
        rtf = ov_spread([w / args.seconds for w in walls], ".3g")
        print(f"audio tokenizer {what} {args.seconds:g} s: RTF {rtf} (min / median / max of {args.rounds}),"
              f" peak memory {memory:.2f} GB")


def add_omnivoice_args(ap: argparse.ArgumentParser):
    ap.add_argument("--config", choices=["omnivoice", "tiny"], default="omnivoice",
                    help="omnivoice: random weights at the real dims; tiny: the fixture checkpoint")
    ap.add_argument("--checkpoint", help="time this OmniVoice folder instead (overrides --config)")
    ap.add_argument("--layers", type=int, help="run only the first N LM layers (a quicker, partial model)")
    ap.add_argument("--seconds", type=float, default=10.0, help="target audio length per request (10)")
    ap.add_argument("--batch", type=batch_sizes, default=[1], help="requests unmasked together, e.g. 1,8 (1)")
    ap.add_argument("--num-step", type=int, default=32, help="unmasking steps (32)")
    ap.add_argument("--packed", action="store_true", help="packed guidance (each request's prompt and its"
                    " target again, side by side; on CPU one flat row) instead of upstream's two rows")
    ap.add_argument("--compare-packed", action="store_true", help="also time both row layouts in"
                    " alternating rounds and print the packed speed-up")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs of each measurement (3)")
    ap.add_argument("--compile", action="store_true", help="the LM's forward compiled (torch.compile,"
                    " on CPU the flat row, elsewhere rows padded to buckets of positions,"
                    " omnivoice.compile_forward)")
    ap.add_argument("--compare-compiled", action="store_true", help="with --compile: also time the"
                    " model eager (packed guidance) against its compiled forward in alternating rounds")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, requests and sampling (0)")
    common.add_device_arg(ap)
    ap.add_argument("--dtype", choices=list(common.DTYPES), help="LM dtype (default bf16 on CUDA, else fp32)")
    ap.add_argument("--quant", choices=quantize.OMNIVOICE_SCHEMES, help="int8wo / int4wo: int8 / int4"
                    " weights; w8a8: int8 weights and activations (CPU)")
    ap.add_argument("--compare-quant", choices=quantize.OMNIVOICE_SCHEMES[1:], help="also time a copy of the"
                    " model in this scheme against it in alternating rounds: the speed-up, the argmax kept")
    ap.add_argument("--no-tune", action="store_true", help="the plain model, without cpu_fast.tune")


def omnivoice_speed(args):
    """`python bench.py omnivoice`: OmniVoice's unmasking and audio tokenizer speed."""
    if args.compare_compiled and not args.compile:
        raise common.UserError("--compare-compiled times the compiled forward against eager: add --compile")
    if args.quant and args.compare_quant:
        raise common.UserError("--compare-quant times a quantized copy against the unquantized model: drop"
                               " --quant")
    optional = [n for n in (args.layers, args.threads) if n is not None]
    if min(args.seconds, args.num_step, args.rounds, *optional) <= 0:
        raise common.UserError("--seconds, --num-step, --rounds, --layers and --threads must be > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = common.pick_device(args.device)
    dtype = common.pick_dtype(args.dtype, device)
    peak_dtype = torch.float32 if quantize.runs_in_fp32(dtype, device) else dtype  # what sequences run in
    peak = matmul_peak(device, peak_dtype)
    print(f"{machine_line(device)}, matmul peak {peak:.0f} GFLOP/s (2048 x 2048,"
          f" {str(peak_dtype).removeprefix('torch.')})")
    model, what = ov_build(args, device, dtype)
    model = quantize.quantize(model, args.quant)
    what += f", {args.quant}" if args.quant else ""
    if args.compile:
        omnivoice.compile_forward(model)
        what += ", compiled forward"
    if not args.no_tune:
        cpu_fast.tune(model)
    tokenizer_params = sum(p.numel() for p in model.audio_tokenizer.parameters())
    params = sum(p.numel() for p in model.parameters()) - tokenizer_params  # it is a submodule
    print(f"model: {what}: LM {params / 1e6:.1f} M parameters ({str(dtype).removeprefix('torch.')}),"
          f" audio tokenizer {tokenizer_params / 1e6:.1f} M (fp32)")
    for batch in args.batch:
        ov_bench_unmask(model, args, device, peak, batch)
    if args.compare_packed:
        ov_compare_packed(model, args, device)
    if args.compare_compiled:
        ov_compare_compiled(model, args, device)
    if args.compare_quant:
        ov_compare_quant(model, args, device)
    ov_bench_tokenizer(model, args, device)



# ---------------------------------------------------------------------------- LoRA training (`bench.py lora`)
def lora_speed(args):
    """`python bench.py lora`: LoRA training steps/s and peak memory at the real S2-Pro size (or --config),
    random weights."""
    device = common.pick_device(args.device)
    dtype = common.pick_dtype(None, device)
    cfg = dict(dualAR.read_config(Path(args.config)) if args.config else dualAR.CONFIG)
    cfg["n_layer"] = args.n_layer or cfg["n_layer"]
    model = random_model(cfg, device, dtype).train()
    params = train_lora.add_lora(model, train_lora.RANK, train_lora.ALPHA, train_lora.DROPOUT)
    optimizer = torch.optim.AdamW(params, lr=train_lora.LR, betas=train_lora.BETAS, eps=train_lora.EPS,
                                  weight_decay=0.0)
    text = "The quick brown fox jumps over the lazy dog."
    prompt = train_lora.sample_tokens(model, text, torch.zeros(cfg["num_codebooks"], 1))[0]
    frames = args.seq_len - prompt.size(1) + 1
    if frames < 1:
        raise common.UserError(f"--seq-len {args.seq_len} leaves no room for codes after the text prompt")
    codes = torch.randint(0, cfg["codebook_size"], (args.batch_size, cfg["num_codebooks"], frames))
    samples = [("", *train_lora.sample_tokens(model, text, c)) for c in codes]  # one micro-batch: all of them
    run = dict(lr=train_lora.LR, warmup=train_lora.WARMUP, batch_size=args.batch_size, grad_accum=1, seed=0)
    n_params, n_lora = (sum(p.numel() for p in ps) / 1e6 for ps in (model.parameters(), params))
    print(f"S2-Pro-shaped model ({n_params:.1f} M params, {cfg['n_layer']} slow layers), {dtype}, {device},"
          f" LoRA rank {train_lora.RANK} ({n_lora:.1f} M), batch {args.batch_size} x {args.seq_len} tokens")
    for checkpointing in (True, False):
        run["checkpointing"] = checkpointing
        common.reset_peak_memory(device)
        try:
            for step in range(args.steps + 1):  # the first step warms up
                if step == 1:
                    synchronize(device)  # the clock waits for the device's queued work
                    start = time.perf_counter()
                train_lora.optimizer_step(model, params, optimizer, run, samples, step)
            synchronize(device)
            rate = args.steps / (time.perf_counter() - start)
            figures = (f"{rate:.3f} steps/s, {rate * args.batch_size * args.seq_len:.0f} tokens/s,"
                       f" peak memory {common.peak_memory_gb(device):.2f} GB")
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            figures = f"out of memory (peak memory {common.peak_memory_gb(device):.2f} GB)"
        print(f"gradient checkpointing {'on ' if checkpointing else 'off'}: {figures}")


# ----------------------------------------------------------------------------- parity (`bench.py parity`)
# What a device in bf16 / fp16 must reach against CPU fp32 on the same weights and inputs (docs/gpu.md).
# rel_error (mean |device - cpu| / mean |cpu| of the logits) and cosine bound the arithmetic; top1, top5,
# codes and unmasked bound what sampling sees: random weights give flat logits whose near-ties a rounding
# may swap, so these are lower than a real checkpoint's (~100 %); decode bounds the codec's relative RMS
# error (decode_error). MSE and the largest difference depend on the logits' scale: printed, not judged.
PARITY_LIMITS = {
    "bf16": dict(rel_error=0.05, cosine=0.995, top1=0.8, top5=0.8, codes=0.5, unmasked=0.8,
                 decode_error=0.05),
    "fp16": dict(rel_error=0.01, cosine=0.9999, top1=0.9, top5=0.9, codes=0.75, unmasked=0.9,
                 decode_error=0.01),
}
S2_TINY = Path(__file__).resolve().parent / "tests/fixtures/s2-tiny/checkpoint"
PARITY_CONFIGS = {  # --config -> each model: random weights of the real dims, or the tiny fixture checkpoints
    "real": dict(s2="s2-pro", omnivoice="omnivoice", codec=None),
    "tiny": dict(s2=S2_TINY, omnivoice="tiny", codec=S2_TINY),
}
PARITY_MODELS = ("s2", "omnivoice", "codec")


def parity_copy(model: nn.Module, device, dtype) -> nn.Module:
    """The CPU fp32 `model` copied to `device` in `dtype`: its weights rounded once. The tokenizers are
    shared, not copied (OmniVoice's audio tokenizer stays fp32 on the CPU: parity does not run it)."""
    kept = {name: getattr(model, name) for name in ("tokenizer", "audio_tokenizer") if hasattr(model, name)}
    for name in kept:
        setattr(model, name, None)
    try:
        moved = copy.deepcopy(model).to(device, dtype)
    finally:
        for name, value in kept.items():
            setattr(model, name, value)
    for name, value in kept.items():
        setattr(moved, name, value)
    if isinstance(moved, DualAR):
        moved.make_rope()  # as dualAR.load builds it (its rounding), not the table cast to dtype
    return moved


def logit_figures(ref: Tensor, got: Tensor) -> dict:
    """Logits (..., V) of CPU fp32 and of the device -> their figures over all positions: mean relative error,
    MSE, max abs difference, mean cosine similarity, top-1 agreement, top-5 overlap (shared / 5)."""
    ref, got = ref.float().flatten(0, -2), got.float().cpu().flatten(0, -2)
    diff = got - ref
    top5_ref, top5_got = ref.topk(5, -1).indices, got.topk(5, -1).indices
    overlap = (top5_ref[:, :, None] == top5_got[:, None, :]).any(-1).float().mean()
    return dict(rel_error=(diff.abs().mean() / ref.abs().mean()).item(), mse=diff.square().mean().item(),
                max_diff=diff.abs().max().item(), cosine=F.cosine_similarity(got, ref, dim=-1).mean().item(),
                top1=(got.argmax(-1) == ref.argmax(-1)).float().mean().item(), top5=overlap.item(),
                positions=ref.shape[0])


def logit_line(what: str, f: dict) -> str:
    return (f"{what} ({f['positions']} positions): mean relative error {100 * f['rel_error']:.3f} %, MSE"
            f" {f['mse']:.3g}, max abs difference {f['max_diff']:.3g}, cosine {f['cosine']:.6f}, top-1"
            f" {100 * f['top1']:.1f} %, top-5 {100 * f['top5']:.1f} %")


@torch.inference_mode()
def greedy_frames(model: DualAR, prompt: Tensor, frames: int, forced: Tensor = None) -> Tensor:
    """`frames` greedy frames after `prompt` (1 + num_codebooks, T), each from the previous frame of `forced`
    if given (teacher forcing: the device judged frame by frame on CPU fp32's history) -> (frames,
    1 + num_codebooks) on the CPU."""
    cfg, device = model.config, model.embeddings.weight.device
    prompt = prompt.to(device)
    model.setup_caches(1, cache_bucket(prompt.size(1) + frames + 1, cfg))
    logits, hidden = model.prefill(prompt)
    p = sampling_params(model, [(1.0, 1.0, 1)])  # top-k 1: the most likely token whatever the noise
    start, stop = model.sampling_rows
    noise = (torch.ones(1, 2, stop - start, device=device),
             torch.ones(1, cfg["num_codebooks"] - 1, cfg["codebook_size"], device=device))
    recent = torch.full((1, RAS_WINDOW), -1, device=device)  # greedy: the hotter draw is the same token
    out = [sample_frame(model, logits, hidden, recent, p, *noise)]
    for i in range(1, frames):
        last = out[-1] if forced is None else forced[i - 1: i].to(device)
        pos = torch.tensor([prompt.size(1) + i - 1], device=device)
        out.append(decode_step(model, last, pos, recent, p, *noise))
    return torch.cat(out).cpu()


@torch.inference_mode()
def teacher_forced_logits(model: DualAR, prompt: Tensor, frames: Tensor) -> tuple:
    """The slow logits (sampling rows) at every position of `prompt` followed by `frames` (N, 1 +
    num_codebooks) but the last, and the fast logits of codebooks 1.. of each frame given its earlier codes
    -> (slow (T + N - 1, rows), fast (N, num_codebooks - 1, codebook_size)), fp32 on the CPU."""
    cfg, device, n = model.config, model.embeddings.weight.device, frames.size(0)
    tokens = torch.cat([prompt, frames[:-1].T], 1).to(device)
    model.setup_caches(n, cache_bucket(tokens.size(1), cfg))
    x, rope = model.embed(tokens[None]), model.rope[: tokens.size(1)]
    for layer in model.layers:  # the prefill's blocks, every position's logits kept
        x = layer(x, rope, 0)
    slow, fast_in = model.head(x[0])
    model.forward_fast(fast_in[-n:, None], 0, logits=False)  # one row per frame
    codes = frames[:, 1:].to(device)
    fast = [model.forward_fast(model.fast_embeddings(codes[:, i - 1])[:, None], i)
            for i in range(1, cfg["num_codebooks"])]
    return slow.float().cpu(), torch.stack(fast, 1).float().cpu()


def s2_parity(args, device, dtype) -> dict:
    """S2-Pro on the device vs CPU fp32: both logits, and greedy codes over --frames teacher-forced frames."""
    folder = args.checkpoint or PARITY_CONFIGS[args.config]["s2"]
    if isinstance(folder, str) and folder in BENCH_CONFIGS:
        model, name = random_model(folder, torch.device("cpu"), torch.float32), folder
    else:
        model, name = dualAR.load(folder), args.config if folder == S2_TINY else Path(folder).name
    moved = parity_copy(model, device, dtype)
    prompt = dualAR.build_prompt(model, [], [], BENCH_TEXT)
    frames = greedy_frames(model, prompt, args.frames)
    ref, got = teacher_forced_logits(model, prompt, frames), teacher_forced_logits(moved, prompt, frames)
    figures = {"slow logits": logit_figures(ref[0], got[0]), "fast logits": logit_figures(ref[1], got[1])}
    for what, f in figures.items():
        print(logit_line(f"s2 {name} {what}", f))
    codes = (greedy_frames(moved, prompt, args.frames, frames) == frames).float().mean().item()
    print(f"s2 {name} greedy codes: {100 * codes:.1f} % of {args.frames} frames x {frames.size(1)} tokens"
          f" equal (each frame from CPU fp32's previous one)")
    return {**{f"s2 {what}": f for what, f in figures.items()}, "s2": dict(codes=codes)}


@torch.inference_mode()
def unmasked_agreement(model, moved, item: dict, gen: dict, seed: int) -> float:
    """Both models unmask `item` step by step, the device from CPU fp32's codes of the step before (teacher
    forcing), with the same seed -> the share of the tokens CPU fp32 reveals over the steps that the device
    reveals too, at the same position with the same code."""
    jobs = [omnivoice.Unmasking(m, item, gen, torch.Generator().manual_seed(seed)) for m in (model, moved)]
    engines = [omnivoice.Scheduler(m, max_batch=1) for m in (model, moved)]
    for engine, job in zip(engines, jobs):
        engine.submit(job)
    same = revealed = 0
    for _ in range(gen["num_step"]):
        before = jobs[0].tokens.clone()
        for engine in engines:
            engine.step()
        ref, got = jobs[0].tokens.cpu(), jobs[1].tokens.cpu()
        new = ref != before
        same, revealed = same + (new & (got == ref)).sum().item(), revealed + new.sum().item()
        jobs[1].tokens.copy_(jobs[0].tokens)
        engines[1].rows = None  # rebuilt from the copied codes
    return same / revealed


def omnivoice_parity(args, device, dtype) -> dict:
    """OmniVoice on the device vs CPU fp32: the first forward's logits at the target positions (conditional
    and unconditional rows), and the tokens revealed over the unmasking steps (a clone request)."""
    size = PARITY_CONFIGS[args.config]["omnivoice"]
    model, _ = ov_build(argparse.Namespace(checkpoint=args.checkpoint, config=size, layers=None,
                                           seed=args.seed), torch.device("cpu"), torch.float32)
    name = Path(args.checkpoint).name if args.checkpoint else size
    moved = parity_copy(model, device, dtype)
    gen = dict(omnivoice.GENERATION)
    items = ov_requests(model, args, gen, 1)
    rows = omnivoice.batch_rows(model, items, gen["denoise"])
    spans = [(row, slice(at, at + items[0]["target_len"])) for row, at in rows["cond"] + rows["uncond"]]
    logits = []
    with torch.inference_mode():
        for m in (model, moved):
            out = m(*(rows[key].to(m.audio_heads.weight.device) for key in ("ids", "audio_mask", "mask")))
            logits.append(torch.cat([out[row, :, span] for row, span in spans], 1).cpu())  # (C, 2T, V)
    figures = logit_figures(*logits)
    print(logit_line(f"omnivoice {name} logits", figures))
    unmasked = unmasked_agreement(model, moved, items[0], gen, args.seed)
    print(f"omnivoice {name} unmasked tokens: {100 * unmasked:.1f} % of CPU fp32's reveals over the"
          f" {gen['num_step']} steps equal (position and code; each step from CPU fp32's codes)")
    return {"omnivoice logits": figures, "omnivoice": dict(unmasked=unmasked)}


def codec_parity(args, device, dtype) -> dict:
    """The codec's decode of --frames random codes on the device vs CPU fp32: the relative RMS error."""
    folder = args.checkpoint or PARITY_CONFIGS[args.config]["codec"]
    if folder is None:
        dac, name = random_codec(codec.CONFIG, torch.device("cpu"), torch.float32), args.config
    else:
        dac, name = codec.load(folder), args.config if folder == S2_TINY else Path(folder).name
    moved = parity_copy(dac, device, dtype)
    generator, cfg = torch.Generator().manual_seed(args.seed), dac.config
    codes = torch.randint(0, cfg["codebook_size"], (1 + cfg["n_codebooks"], args.frames), generator=generator)
    codes[0] = torch.randint(0, cfg["semantic_codebook_size"], (args.frames,), generator=generator)
    with torch.inference_mode():  # not while loading: fold_weight_norm's weights would be no parameters
        ref, got = codec.decode(dac, codes), codec.decode(moved, codes.to(device)).cpu()
    error = ((got - ref).square().mean() / ref.square().mean()).sqrt().item()
    print(f"codec {name} decode of {args.frames} frames: relative RMS error {100 * error:.3f} %"
          f" (SNR {-20 * math.log10(max(error, 1e-12)):.1f} dB)")
    return {"codec": dict(decode_error=error)}


def parity_failures(figures: dict, limits: dict) -> list:
    """What is past its limit, in words (rel_error and decode_error: at most; the others: at least)."""
    failed = []
    for what, values in figures.items():
        for key, value in values.items():
            if key not in limits:
                continue
            low = key in ("rel_error", "decode_error")
            if value > limits[key] if low else value < limits[key]:
                failed.append(f"{what} {key} {value:.6g} {'>' if low else '<'} {limits[key]:g}")
    return failed


def parity(args):
    """`python bench.py parity`: each model's figures on the device in --dtype vs CPU fp32 (same weights,
    same inputs); exit status 1 with one line naming each figure past PARITY_LIMITS."""
    if args.checkpoint and args.model == "all":
        raise common.UserError("--checkpoint is one model's folder: give --model s2, omnivoice or codec")
    if min(args.frames, args.seconds) <= 0:
        raise common.UserError("--frames and --seconds must be > 0")
    device, dtype = common.pick_device(args.device), common.DTYPES[args.dtype]
    print(f"{machine_line(device)}; parity: {device} {args.dtype} vs cpu fp32, same weights and inputs")
    figures = {}
    for name in PARITY_MODELS if args.model == "all" else [args.model]:
        figures.update(dict(s2=s2_parity, omnivoice=omnivoice_parity, codec=codec_parity)[name](
            args, device, dtype))
    failed = parity_failures(figures, PARITY_LIMITS[args.dtype])
    if failed:
        print(f"parity FAILED on {device} {args.dtype}: " + "; ".join(failed))
        sys.exit(1)
    print(f"parity passed on {device} {args.dtype}: every figure within PARITY_LIMITS (docs/gpu.md)")


# ----------------------------------------------------------------------------- CLI
def batch_sizes(text: str) -> list:
    sizes = [int(b) for b in text.split(",")]
    if not sizes or min(sizes) < 1:
        raise ValueError(text)
    return sizes


COMMANDS = ("s2", "rows", "codec", "omnivoice", "lora", "parity")
RUNS = dict(s2=bench, rows=rows_speed, codec=codec_speed, omnivoice=omnivoice_speed, lora=lora_speed,
            parity=parity)


def add_parity_args(ap: argparse.ArgumentParser):
    common.add_device_arg(ap)
    ap.add_argument("--dtype", choices=list(PARITY_LIMITS), default="bf16", help="the device's dtype (bf16)")
    ap.add_argument("--model", choices=[*PARITY_MODELS, "all"], default="all", help="which to check (all)")
    ap.add_argument("--config", choices=list(PARITY_CONFIGS), default="real", help="random weights at the"
                    " real dims (real, the default) or the tiny fixture checkpoints (tiny)")
    ap.add_argument("--checkpoint", help="this checkpoint folder instead of random weights (with --model)")
    ap.add_argument("--frames", type=int, default=16, help="S2 greedy frames and codec frames (16)")
    ap.add_argument("--seconds", type=float, default=3.0, help="OmniVoice's target audio length (3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (0)")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] not in ([c] for c in COMMANDS + ("-h", "--help")):
        argv = ["s2", *argv]  # the frame-step benchmark is the default
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s2 = sub.add_parser("s2", help="S2-Pro's frame steps (the default command)")
    s2.add_argument("--checkpoint", help="time this checkpoint instead of random weights")
    s2.add_argument("--config", choices=list(BENCH_CONFIGS), default="s2-pro",
                    help="random-weight model size (default s2-pro, the real dimensions)")
    s2.add_argument("--batch", type=batch_sizes, default=[1], help="batch sizes, e.g. 1,4,16 (default 1)")
    s2.add_argument("--frames", type=int, default=16, help="timed frame steps (default 16)")
    s2.add_argument("--ttfa", action="store_true", help="also time to first audio at batch 1 (prefill,"
                    " first frames, their codec decode at the real codec size, random weights)")
    dualAR.add_model_args(s2)  # --quant also prints the logit error and code agreement vs unquantized
    c = sub.add_parser("codec", help="the codec's encode / decode / stream RTF at the real size")
    common.add_device_arg(c)
    c.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="default: fp16 on CUDA, else fp32")
    c.add_argument("--chunk-frames", type=int, default=codec.CHUNK_FRAMES,
                   help="frames per encode/decode pass (default %(default)s; 0: one pass)")
    c.add_argument("--config", help="a codec_config.json to time instead of the real size (e.g. tiny's)")
    c.add_argument("--seconds", type=float, default=5.0, help="seconds of audio (default %(default)s)")
    c.add_argument("--stream-frames", type=int, nargs="+", default=[1, 4, 16],
                   help="frames per chunk of each streaming decode timed (default 1 4 16)")
    c.add_argument("--stream-chunks", type=int, default=8, help="chunks per stream (default %(default)s)")
    c.add_argument("--repeats", type=int, default=3, help="timed calls per path (default %(default)s)")
    c.add_argument("--compile", action="store_true", help="also time cpu_fast's path (compiled Snakes, oneDNN"
                   " on prepacked weights) beside eager")
    add_omnivoice_args(sub.add_parser("omnivoice", help="OmniVoice's unmasking and audio tokenizer"))
    lora = sub.add_parser("lora", help="S2-Pro LoRA training steps/s and peak memory, random weights")
    common.add_device_arg(lora)
    lora.add_argument("--config", help="a config.json for smaller dimensions (default: the real S2-Pro)")
    lora.add_argument("--n-layer", type=int, help="override the number of slow layers")
    lora.add_argument("--batch-size", type=int, default=4, help="samples per step (default 4)")
    lora.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    lora.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    rows = sub.add_parser("rows", help="one row through a layer's linears at each precision, eager and"
                          " compiled: GB/s, % of the copy bandwidth, and GB/s from cache")
    rows.add_argument("--layers", type=int, default=6, help="layers of weights read per pass (6:"
                      " 289 MB in fp32)")
    rows.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    rows.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    add_parity_args(sub.add_parser("parity", help="each model on --device in --dtype vs CPU fp32: logits,"
                                   " greedy codes, unmasked tokens, the codec's decode; exit 1 past the"
                                   " limits"))
    args = ap.parse_args(argv)
    if args.command == "codec" and args.chunk_frames < 0:
        raise common.UserError("--chunk-frames must be >= 0")
    if args.command == "lora" and min(args.batch_size, args.seq_len, args.steps) < 1:
        raise common.UserError("--batch-size, --seq-len and --steps must be >= 1")
    RUNS[args.command](args)


if __name__ == "__main__":
    common.cli(main)
