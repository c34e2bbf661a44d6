"""CPU speed-ups for fishfast's models, applied from outside after loading, as gpt-fast's quantize.py swaps
nn.Linear: the model files hold plain modules and know nothing of this machine. Each faster module takes
the plain one's place in its parent (the same parameters, no copy), so `print(model)` names what runs.

    model = cpu_fast.tune(dualAR.load("s2-pro", compile=True))   # S2-Pro's frame step
    dac = cpu_fast.tune(codec.load("s2-pro"))                       # the codec's encode and decode
    ov = cpu_fast.tune(omnivoice.load("omnivoice"))                 # OmniVoice's flat row
    python cpu_fast.py [--again]                # this machine's decisions (and where they are kept)

Each speed-up is a faster matmul for the same arithmetic (oneDNN's or MKL's packed weights, a fused one-row
sum, inductor's GEMM on frozen weights, fp32 sums of half weights), equal to the plain model's to fp32
rounding, and each is taken only where this machine's timing says it wins: timed once, at the first `tune`
that needs it, and kept in `decisions_file()` for every later process. A timing during which other
processes used the CPU records nothing (it would be wrong for good). The CLIs, app.py and bench.py call
`tune` after loading (`--no-tune` skips it); what it saves and costs: docs/speed.md. It imports no model
file (they import it inside their CLIs): a faster module calls what the plain one it replaced calls (its
`eager` class's methods), and the codec's choices are timed through the model's own chunk methods.

Sections: the entry point, modules in place of others, decisions (a file, a key per machine, a busy
machine), prepacked matmuls (oneDNN, MKL), S2's frame steps (few-row linears, one-row sums, frozen graphs),
OmniVoice's flat row (many-row linears), half-precision linears, the codec's fast path, the CLI.
"""
import argparse
import contextlib
import ctypes
import functools
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import common
import quantize
from common import UserError, write_atomic
from quantize import QuantLinear, W8A8Linear, replaced


# ----------------------------------------------------------------------------- the entry point
def tune(model: nn.Module, rows: int = None, again: bool = False) -> nn.Module:
    """A loaded model on CPU (dualAR's DualAR, after `compile_model` if it is compiled; codec's DAC;
    omnivoice's OmniVoice) made fast on this CPU, in place -> the model. rows: the most rows one of S2's frame
    steps will run (an engine's slots; None: any), so that no choice is timed for batches that never come.
    again: time every choice anew (replacing those kept). A model on another device is left as it is."""
    if next(model.parameters()).device.type != "cpu":
        return model
    tuners = {"DualAR": tune_s2, "DAC": tune_codec, "OmniVoice": tune_omnivoice}
    kind = type(model).__name__
    if kind not in tuners:
        raise TypeError(f"cpu_fast.tune takes a DualAR, DAC or OmniVoice, not {kind}")
    return tuners[kind](model, rows=rows, again=again)


def tune_s2(model: nn.Module, rows: int = None, again: bool = False) -> nn.Module:
    """S2-Pro: half linears where the CPU has no half matmul units; fp32 linears on oneDNN's prepacked
    weights at the row counts that win (eager and compiled); compiled graphs' one row as a fused sum;
    compiled batched steps on frozen weights (inductor's GEMM), if batches of their rows come; the sampler's
    top-k/top-p filter orders only the best candidates (`dualAR.TopFilter(candidates=True)`)."""
    model.top_filter.candidates = True
    use_half_linears(model)
    if any(type(m) is nn.Linear and m.weight.dtype == torch.float32 for m in model.modules()):
        use_few_rows_linears(model, few_rows_steps(again))
    if model.compiled_step is None or getattr(model.compiled_step, "func", None) is frozen_graphs:
        return model  # eager, or tuned already
    use_one_row_sums(model, again=again, rows=rows)
    frozen = frozen_rows(model, again) if rows is None or rows > 1 else [[0, False]]
    if any(on for _, on in frozen):
        use_frozen_gemms(model, frozen)
        model.compiled_step = functools.partial(frozen_graphs, model.compiled_step, frozen)
    return model


def tune_omnivoice(model: nn.Module, rows: int = None, again: bool = False) -> nn.Module:
    """OmniVoice: half linears where the CPU has no half matmul units; the flat row's fp32 linears (the
    layers' and the audio heads') on this machine's fastest many-row matmul (`many_rows_matmul`), within
    `common.loose_matmuls` (the flat row does not round as upstream's rows anyway; those keep F.linear)."""
    use_half_linears(model)
    linears = {m for module in (model.layers, model.audio_heads) for m in module.modules()
               if type(m) is nn.Linear and m.weight.dtype == torch.float32}
    if linears and sum(m.weight.numel() * 4 for m in linears) <= available_memory_bytes() / 2:
        matmul = many_rows_matmul(again)
        if matmul != "torch":
            replaced(model, lambda m: rebuilt(ManyRowsLinear, m, matmul=matmul) if m in linears else None)
    return model


def tune_codec(model: nn.Module, rows: int = None, again: bool = False) -> nn.Module:
    """The codec: `codec_fast_path` with this machine's choices. (Its decode runs faster still where freed
    memory is kept for reuse, `keep_freed_memory`: process-wide, so the CLIs set it, not this.)"""
    return codec_fast_path(model, choices=machine_choices(model, again))


# ----------------------------------------------------------------------------- modules in place of others
def rebuilt(cls, module: nn.Module, **settings) -> nn.Module:
    """A new cls holding module's own state (its parameters, buffers, submodules and attributes: nothing
    is copied) and `settings`: what takes module's place in its parent (`replaced`). cls reads no state
    but module's own and its settings (an nn.Linear kind for a linear layer, say)."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    for store in ("_parameters", "_buffers", "_modules"):  # its own registries: a later setattr on one of
        new.__dict__[store] = dict(module.__dict__[store])  # the two modules leaves the other as it was
    new.__dict__.update(settings)
    return new


# ----------------------------------------------------------------------------- memory
def available_memory_bytes() -> int:
    """Linux's MemAvailable (0 where it cannot be read)."""
    try:
        return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())[1]) * 1024
    except (OSError, TypeError):
        return 0


# ----------------------------------------------------------------------------- decisions
DECISIONS = "cpu_fast.json"  # {machine key + what: value}
BUSY_SLACK = 0.25  # core-seconds per second others may use beyond the cores our threads leave free
BUSY_MIN_SECONDS = 0.5


def decisions_file() -> Path:
    """Where decisions are kept: DECISIONS in the compile cache folder (common.compile_cache_folder)."""
    return common.compile_cache_folder() / DECISIONS


def machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a timed decision holds for: the CPU kind (with its capability and the libraries' caps), torch,
    threads, device, dtype."""
    return (f"{common.cpu_kind()} torch {torch.__version__} threads {torch.get_num_threads()} {device.type}"
            f" {dtype}")


def read_decisions(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    return known if isinstance(known, dict) else {}


def decision(key: str, valid, decide, what: str, again=False):
    """A decision timed once per machine and kept in `decisions_file()` under `key`: the kept value where
    valid(value) (and not `again`), else decide(the kept value or None), said on stderr in one line (what,
    how long, where) and kept beside the others, unless other processes used the CPU meanwhile (`busy`):
    then it is used this once and not kept. A file that cannot be read or written costs the timing again."""
    path = decisions_file()
    known = read_decisions(path)
    if not again and valid(known.get(key)):
        return known[key]
    start, others = time.perf_counter(), others_cpu_seconds()
    value = decide(known.get(key))
    wall = time.perf_counter() - start
    busy = busy_share(others, others_cpu_seconds(), wall)
    shown = f": {value}" if not isinstance(value, dict) else ""
    if busy is not None:
        print(f"cpu_fast: {what} took {wall:.1f} s{shown}, NOT kept: other processes used {busy:.0%} of a"
              " core meanwhile (time it again on an idle machine: python cpu_fast.py --again)",
              file=sys.stderr)
        return value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dict(read_decisions(path), **{key: value}), indent=1)
        write_atomic(path, lambda tmp: Path(tmp).write_text(text))
        where = f"kept in {path}"
    except (OSError, UserError):
        where = f"not kept: {path} cannot be written"
    print(f"cpu_fast: {what} took {wall:.1f} s{shown} ({where})", file=sys.stderr)
    return value


def others_cpu_seconds() -> Optional[float]:
    """CPU seconds spent so far by every process but this one and its children (inductor's compile workers):
    Linux's /proc (None elsewhere)."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = sum(ticks) - ticks[3] - ticks[4]  # user nice system idle iowait irq softirq steal
        return (busy - family_ticks()) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def family_ticks() -> int:
    """CPU ticks of this process and its descendants, living (utime + stime of each, from /proc/<pid>/stat)
    or ended and waited for (cutime + cstime: the compilers inductor runs)."""
    parents, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended meanwhile
        pid = int(stat.parent.name)
        parents[pid], ticks[pid] = int(fields[1]), sum(map(int, fields[11:15]))
    family, me = 0, os.getpid()
    for pid in ticks:
        p = pid
        while p not in (0, 1, me) and p in parents:
            p = parents[p]
        family += ticks[pid] if p == me else 0
    return family


def busy_share(before: Optional[float], after: Optional[float], wall: float) -> Optional[float]:
    """Others' share of a core during a timing (`others_cpu_seconds` before and after it) when it is more
    than the cores this process leaves free can take (plus BUSY_SLACK); None where it was not more, or cannot
    be known (no /proc, or a timing shorter than BUSY_MIN_SECONDS: the kernel counts CPU time in ticks of
    ~10 ms)."""
    if before is None or after is None or wall < BUSY_MIN_SECONDS:
        return None
    free = max(0, (os.cpu_count() or 1) - torch.get_num_threads())
    share = (after - before) / wall
    return share if share > free + BUSY_SLACK else None


def show_decisions(argv=None):
    """`python cpu_fast.py`: this machine's decisions as kept; --again times the linear-layer choices (S2's
    and OmniVoice's) anew, on random weights of the real layer shapes."""
    ap = argparse.ArgumentParser(description="This machine's CPU speed-up decisions (cpu_fast.py).")
    ap.add_argument("--again", action="store_true", help="time the linear-layer choices anew and keep them")
    args = ap.parse_args(argv)
    if args.again:
        fp32 = machine_key(torch.device("cpu"), torch.float32)
        few_rows_steps(again=True)
        for dtype in ONE_ROW_DTYPES:
            compiled_one_row_wins(dtype, again=True)
        many_rows_matmul(again=True)
        frozen_rows_steps(again=True)
        print(f"timed again for {fp32} (the codec's choices: `cpu_fast.tune(dac, again=True)`)")
    path = decisions_file()
    known = read_decisions(path)
    print(f"{path}: {len(known)} decision(s)" if known else f"{path}: no decisions kept yet")
    for key, value in known.items():
        print(f"  {key}: {json.dumps(value) if not isinstance(value, dict) else f'{len(value)} ops'}")


# ----------------------------------------------------------------------------- prepacked matmuls
def prepack(weight: Tensor) -> Tensor:  # (out, in) -> oneDNN's own layout, made once
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_matmul(x: Tensor, packed: Tensor, bias: Tensor = None) -> Tensor:  # x @ W^T + bias, W `prepack`ed
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepacked(weight: Tensor) -> Tensor:
    """`prepack`(weight), made once and kept on it (made again if it changed in place; an inference tensor,
    made in inference mode, has no version counter to tell)."""
    return kept_copy(weight, "prepacked", prepack)


def kept_copy(weight: Tensor, name: str, make) -> Tensor:
    version = None if weight.is_inference() else weight._version
    kept = getattr(weight, name, None)
    if kept is None or kept[0] != version:
        kept = version, make(weight)
        setattr(weight, name, kept)
    return kept[1]


MANY_ROWS_PROBE = 320  # a whole sequence's rows (OmniVoice's flat row: a 3 s prompt, 4 s of audio twice)


def mkl_pack(weight: Tensor) -> Tensor:
    """(out, in) fp32 -> MKL's packed copy (cblas_sgemm_pack: an opaque tensor that must not be copied, since
    MKL's packed data points into itself; torch.save refuses it, deepcopy drops it)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), MANY_ROWS_PROBE)


def mkl_prepacked(weight: Tensor) -> Tensor:  # `mkl_pack`(weight), made once and kept on it as `prepacked`
    return kept_copy(weight, "mkl_prepacked", mkl_pack)


def mkl_packed_matmul(x: Tensor, weight: Tensor, bias: Tensor = None) -> Tensor:
    """x @ weight^T + bias on `mkl_prepacked`(weight). `_mkl_linear` takes the packed copy only when told the
    rows it was packed for (else it multiplies `weight`); the copy serves any rows, so it is told x's
    (`timed_many_rows` checks that on this machine, a test at many row counts)."""
    return torch.ops.mkl._mkl_linear(x, mkl_prepacked(weight), weight, bias, x.numel() // x.shape[-1])


@torch.library.custom_op("fishfast::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """`packed_matmul` on `prepacked`(weight) as one opaque op for compiled graphs (inductor cannot take
    oneDNN's packed tensors as graph inputs: the op finds the copy kept on the weight)."""
    return packed_matmul(x, prepacked(weight), bias)


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fishfast::mkl_packed_linear", mutates_args=())
def mkl_packed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """`mkl_packed_matmul` as one opaque op for compiled graphs (packed_linear's reason)."""
    return mkl_packed_matmul(x, weight, bias)


@mkl_packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def step_at(steps, rows):  # steps [[from rows, choice], ...], the first from 0 -> the choice for rows
    choice = steps[0][1]
    for start, value in steps:  # a plain loop: compiled graphs trace it as constants
        choice = value if start <= rows else choice
    return choice


def row_steps(wins) -> list:
    """{rows: prepacked no slower} -> [[from rows, prepacked], ...]: each timed row count gets its own choice,
    a row count between two timed ones the choice of the one below it (the first step starts from 0 rows),
    and one above every timed one torch's own: untimed (a prefill, a one-shot decode's hundreds of rows)."""
    steps = []
    for rows in sorted(wins):
        if not steps or wins[rows] != steps[-1][1]:
            steps.append([rows if steps else 0, wins[rows]])
    return (steps + [[max(wins) + 1, False]]) if steps[-1][1] else steps


def is_row_steps(value) -> bool:
    """Whether a decision file's value is `row_steps`: from 0 rows, rising, ending on torch's own."""
    steps = value if isinstance(value, list) else []
    if not all(isinstance(step, list) and [type(v) for v in step] == [int, bool] for step in steps):
        return False
    starts = [start for start, _ in steps]
    return starts[:1] == [0] and starts == sorted(set(starts)) and steps[-1][1] is False


def best_seconds(runs: dict, repeats: int, clock=time.perf_counter) -> dict:
    """{name: the fastest of `repeats` calls of runs[name]()}: the runs take turns, after a first round that
    only warms up (and compiles)."""
    times = {name: [] for name in runs}
    for _ in range(1 + repeats):
        for name, run in runs.items():
            start = clock()
            run()
            times[name].append(clock() - start)
    return {name: min(seconds[1:]) for name, seconds in times.items()}


def beats_the_others(best: dict, name: str) -> bool:  # best: `best_seconds`
    return all(best[name] < seconds for other, seconds in best.items() if other != name)


# ----------------------------------------------------------------------------- S2's frame steps
ROW_PROBES = (1, 2, 3, 4, 8, 16, 32, 64)  # the row counts of a frame step (batch 1 to 64) timed
PROBE_SHAPES = ((1536, 1024), (1024, 1024), (6144, 1024), (1024, 3072))  # a transformer layer's linears
PROBE_LAYERS = 3  # 144 MB of fp32 weights: read from memory, as a real model's, not from a 32-96 MB cache


def few_rows_steps(again=False) -> list:
    """This machine's `row_steps` for fp32 linears: at which row counts oneDNN's matmul on a prepacked weight
    is no slower than torch's own (MKL reads a weight for a few rows at a third of the bandwidth on some
    CPUs, where oneDNN reads it faster: docs/speed.md). Timed once (`timed_row_steps`, ~2 s)."""
    return decision(machine_key(torch.device("cpu"), torch.float32), is_row_steps,
                    lambda old: timed_row_steps(), "timing oneDNN's few-row matmuls", again)


def probe_weights(layers=PROBE_LAYERS, dtype=torch.float32) -> list:
    """A layer's linears (PROBE_SHAPES) `layers` times, random weights of `dtype` (int8: bytes but -128;
    uint8: int4 values, 0-15, as int32)."""
    if dtype == torch.uint8:
        return [torch.randint(0, 16, shape, dtype=torch.int32) for _ in range(layers)
                for shape in PROBE_SHAPES]
    if dtype == torch.int8:
        return [torch.randint(-127, 128, shape, dtype=dtype) for _ in range(layers) for shape in PROBE_SHAPES]
    return [torch.rand(shape, dtype=dtype) for _ in range(layers) for shape in PROBE_SHAPES]


def probe_rows(weights: list, rows: int) -> dict:  # {in features: a random (rows, in) input}
    return {i: torch.rand(rows, i) for i in {w.shape[1] for w in weights}}


def matmul_runs(xs: dict, weights: list, packed: list = None) -> dict:
    """{"torch": F.linear, "onednn": oneDNN's matmul on the `packed` weights} over every weight, each on its
    xs; each run returns its products."""
    runs = {"torch": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}
    if packed is not None:
        runs["onednn"] = lambda: [packed_matmul(xs[w.shape[1]], p) for w, p in zip(weights, packed)]
    return runs


@torch.inference_mode()
def timed_row_steps(repeats=3) -> list:
    """A layer's linears PROBE_LAYERS times (random fp32 weights) at each of ROW_PROBES rows, F.linear and
    prepacked in turn (`best_seconds`) -> `row_steps`."""
    weights = probe_weights()
    packed = [prepack(w) for w in weights]
    wins = {}
    for rows in ROW_PROBES:
        best = best_seconds(matmul_runs(probe_rows(weights, rows), weights, packed), repeats)
        wins[rows] = best["onednn"] <= best["torch"]
    return row_steps(wins)


# Whether compiled graphs may run few-row linears on oneDNN's prepacked weights too, where the steps take
# them: on an AVX2-only CPU inductor's 4-row matmul read a weight far slower than oneDNN, and so did MKL at
# one row on some AVX-512 CPUs; where MKL wins at one row, inductor's own 4-row plan beat the op though eager
# oneDNN won (docs/speed.md).
AVX2_ONLY = torch.backends.cpu.get_cpu_capability() == "AVX2"


class FewRowsLinear(nn.Linear):
    """nn.Linear whose inference on CPU fp32 runs oneDNN on the weight `prepacked` at the row counts its
    `steps` take it at (`row_steps`), eager, and compiled (as the opaque `packed_linear`) at those its
    `compiled_steps` take; a compiled graph's one row is `one_row_linear` where `one_row` says so, and the
    rows its `frozen_steps` take are F.linear (the graph is compiled on frozen weights there:
    `use_frozen_gemms`); any other call is nn.Linear's. The copy doubles the layer's memory, made at its
    first such call."""

    steps = compiled_steps = frozen_steps = [[0, False]]
    one_row = False

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, steps={self.steps}, compiled_steps={self.compiled_steps},"
                f" frozen_steps={self.frozen_steps}, one_row={self.one_row}")

    def forward(self, x: Tensor) -> Tensor:
        compiling, rows = torch.compiler.is_compiling(), x.numel() // self.in_features
        fp32_inference = x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled()
        if compiling and self.one_row and rows == 1 and fp32_inference:
            return one_row_linear(x, self.weight, self.bias)
        if compiling and step_at(self.frozen_steps, rows) and fp32_inference:
            return F.linear(x, self.weight, self.bias)  # a graph on frozen weights: inductor's own GEMM
        if step_at(self.compiled_steps if compiling else self.steps, rows) and fp32_inference:
            if not compiling:
                return packed_matmul(x, prepacked(self.weight), self.bias)
            return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def is_fp32_linear(m: nn.Module) -> bool:  # a plain or FewRowsLinear fp32 CPU linear layer
    return type(m) in (nn.Linear, FewRowsLinear) and m.weight.dtype == torch.float32 and m.weight.is_cpu


def as_few_rows(m: nn.Module, **settings) -> nn.Module:
    """An fp32 linear layer as FewRowsLinear with `settings`: a plain one rebuilt (its place to take), a
    FewRowsLinear changed where it is (None: nothing to put in its place)."""
    if type(m) is FewRowsLinear:
        vars(m).update(settings)
        return None
    return rebuilt(FewRowsLinear, m, **settings)


def use_few_rows_linears(module: nn.Module, steps: list) -> nn.Module:
    """Every plain fp32 CPU nn.Linear inside module -> FewRowsLinear (the same parameters and names) with
    `steps` (compiled graphs: the same where AVX2_ONLY or they take one row), where torch has oneDNN, some
    row count takes it and the prepacked copies fit in half of the memory available now (else nothing)
    -> module (or its FewRowsLinear, where module is such a linear layer itself)."""
    linears = {m for m in module.modules() if is_fp32_linear(m)}
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if not (linears and torch.backends.mkldnn.is_available() and size <= available_memory_bytes() / 2
            and any(fast for _, fast in steps)):
        return module
    compiled = steps if AVX2_ONLY or step_at(steps, 1) else [[0, False]]
    return replaced(module, lambda m: as_few_rows(m, steps=steps, compiled_steps=compiled)
                    if m in linears else None)


def realized(x: Tensor) -> Tensor:
    """x as a buffer of its own in a compiled graph (an identity view, for which inductor must write x out).
    A one-row sum reads x once per output row: left an expression, x's producer (a norm's rsqrt and gain) is
    computed again there, which made int8 rows 1.7x slower (docs/speed.md). Realize the layer's input as
    it comes: a conversion realized after an attention template became its epilogue, which inductor's flex
    attention template cannot take."""
    return x.as_strided(x.shape, x.stride())


def one_row_linear(x: Tensor, weight: Tensor, bias: Tensor = None) -> Tensor:
    """F.linear of one row as a product and a sum: inductor fuses them into one pass over the weight, which
    read it faster than oneDNN's or MKL's matmul on some CPUs (docs/speed.md). Eager it would make the whole
    product: compiled graphs only."""
    y = (realized(x).float().unsqueeze(-2) * weight).sum(-1)  # (half weights: fp32 sums)
    return y if bias is None else y + bias


def int8_one_row(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """One row x (K,) times an int8 weight (N, K) in `byte_columns` order, times the scales -> (N,), x and
    the sums in fp32; in compiled graphs only (eager it would make the whole product). Inductor reads each 4
    bytes as one fp32 word (int8 and int32 loads it copies through memory, 3x slower) and splits it in
    registers: byte i of word j, moved to the top bits, converts exactly to its value times 2^24 and pairs
    with x[i * K/4 + j]."""
    words = weight.view(torch.float32).view(torch.int32)  # (N, K / 4)
    xs, top = realized(x).float().reshape(4, -1), -(1 << 24)  # top: the high byte's bits
    y = (xs[0] * (words << 24).float() + xs[1] * ((words << 16) & top).float()
         + xs[2] * ((words << 8) & top).float() + xs[3] * (words & top).float()).sum(-1)
    return y * (scales.float() * 2.0 ** -24)  # a power of two: the products round as the bytes' would


def byte_columns(t: Tensor) -> Tensor:
    """t (..., K) with its columns in the order `int8_one_row` reads an int8 weight's: column i * K/4 + j at
    4 j + i (the reverse: `natural_columns`)."""
    return t.unflatten(-1, (4, t.shape[-1] // 4)).transpose(-1, -2).reshape(t.shape)


def natural_columns(t: Tensor) -> Tensor:
    return t.unflatten(-1, (t.shape[-1] // 4, 4)).transpose(-1, -2).reshape(t.shape)


NIBBLE_PLACES = torch.tensor([2.0 ** (-4 * i) for i in range(7)] + [1.0])  # x's factor for nibble i in place


def int4_one_row(x: Tensor, weight: Tensor, scales: Tensor, group: int) -> Tensor:
    """One row x (K,) times an int4 weight in `nibble_bytes` order (N, K/2), w = (q - 8) * scale + zero per
    `group` inputs (scales: `group_scales`) -> (N,), x and the sums in fp32; in compiled graphs only.
    Inductor reads each 8 inputs' nibbles as one fp32 word (as `int8_one_row`) and masks each in place (q
    2^4i, exactly; the top one shifted down), paired with x[8 j + i] 2^-4i; each group's sum is scaled, and
    sum(x) over the group times (zero - 8 scale) added."""
    n, k = weight.shape[0], weight.shape[1] * 2
    words = weight.view(torch.float32).view(torch.int32).view(n, k // group, group // 8)  # (N, groups, j)
    x = realized(x).float()
    xs = x.view(k // group, group // 8, 8).permute(2, 0, 1) * NIBBLE_PLACES.view(8, 1, 1)
    xs = realized(xs.contiguous())  # (nibble i, group, j): read whole vectors along j
    scale, zero = scales
    y = ((zero - 8 * scale) * x.view(-1, group).sum(-1)).sum(-1)
    for nibbles in (range(4), range(4, 8)):  # two sums of four: one of eight inductor would write out whole
        p = sum(xs[i] * ((words & (15 << 4 * i)) if i < 7 else (words >> 28) & 15).float() for i in nibbles)
        y = y + (p * scale[..., None]).sum((-1, -2))
    return y


def nibble_bytes(q: Tensor) -> Tensor:
    """int4 values q (N, K), 0-15 -> (N, K/2) uint8, input 2 b in byte b's low nibble and 2 b + 1 in its high
    one (each 4 bytes then hold 8 inputs in order, as `int4_one_row` reads them; the reverse:
    `nibble_values`)."""
    return (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8).contiguous()  # (q's strides may be permuted)


def nibble_values(weight: Tensor) -> Tensor:  # (N, K) uint8
    return torch.stack([weight & 15, weight >> 4], -1).view(weight.shape[0], -1)


def group_scales(scales: Tensor) -> Tensor:
    """QuantLinear's int4 scales (K / group, N, 2: scale, zero) in bf16, as the kernel reads them -> (2, N,
    K / group) in fp32, as `int4_one_row` does (bf16 loads in its sum made inductor's vectors 16 lanes wide,
    its words' reads 1.3x slower); the reverse: `kernel_scales`."""
    return scales.float().permute(2, 1, 0).contiguous()


def kernel_scales(scales: Tensor) -> Tensor:
    return scales.permute(2, 1, 0).bfloat16().contiguous()


def int4_weight(weight: Tensor, scales: Tensor, group: int) -> Tensor:  # `nibble_bytes` -> fp32 (N, K)
    w = nibble_values(weight).float()
    scale, zero = scales[..., None]
    w.unflatten(-1, (-1, group)).sub_(8).mul_(scale).add_(zero)  # in place: a prefill's peak, 5 B a weight
    return w


class OneRowQuantLinear(QuantLinear):
    """QuantLinear whose weight is held as a compiled one-row sum reads it: int8 with its columns in
    `byte_columns` order, int4 in `nibble_bytes` order (its scales as `group_scales`). A compiled graph's
    one row is `int8_one_row` or `int4_one_row` (x in fp32, as inductor ran the kernel's bf16 rounding of
    it before: it drops a rounding undone at once); anything else int8: QuantLinear's, on x's columns put in
    the same order (the same products, summed in another order); int4 (which no kernel reads so): the
    dequantized weight's matmul."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.numel() == self.in_features and x.is_cpu:
            row = x.reshape(-1)
            y = int8_one_row(row, self.weight, self.scales) if self.bits == 8 else \
                int4_one_row(row, self.weight, self.scales, self.group)
        elif self.bits == 4:
            w = int4_weight(self.weight, self.scales, self.group)
            w = w if quantize.runs_in_fp32(torch.bfloat16, x.device) else w.bfloat16()
            y = F.linear(x.to(w.dtype), w)
        else:
            return super().forward(byte_columns(x))
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


ONE_ROW_KEY = "compiled one row in one graph"  # the decision's key, after the machine key (a timing
# under the older key compiled a graph a layer: stale)
# weights a fused sum can read (uint8: int4, two values a byte)
ONE_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8)


def one_row_key(dtype: torch.dtype) -> str:  # int8's times `int8_one_row` (a timing of an older sum is stale)
    words = {torch.int8: " as words", torch.uint8: " of int4, two a byte"}.get(dtype, "")
    return f"{machine_key(torch.device('cpu'), dtype)} {ONE_ROW_KEY}{words}"


def compiled_one_row_wins(dtype: torch.dtype = torch.float32, again=False) -> bool:
    """Whether this machine's compiled graphs run a one-row linear of `dtype` weights (fp32, fp16 / bf16 as
    HalfLinear's, int8 or int4 (uint8) as QuantLinear's: `int8_one_row`, `int4_one_row`) faster as a fused
    sum than the matmuls eager takes for it. Timed once (`timed_one_row`: it compiles, cold 1-25 s, int4's
    96 sums ~100 s on a 2-core Zen 3)."""
    return decision(one_row_key(dtype),
                    lambda value: isinstance(value, bool), lambda old: timed_one_row(dtype),
                    f"timing compiled one-row {dtype} linears", again)


def one_row_runs(dtype: torch.dtype, compile=True) -> dict:
    """A layer's linears at one row, PROBE_LAYERS times for fp32, 2x that for half, 4x for int8 and 8x for
    int4 (uint8; the same bytes): {"fused": the sum (`one_row_linear`, `int8_one_row`, `int4_one_row`), every
    layer's linears in one graph compiled by inductor, as a frame step's graph runs them (a graph a layer
    paid ~0.3 ms a call: fp16's sum then timed as torch's matmul on a Zen 3 where it made the frame step
    1.2x faster), "torch": torch's own matmul (its int8 or int4 kernel), for fp32 "onednn": oneDNN's
    prepacked one}; each run returns its products."""
    layers = PROBE_LAYERS * {torch.float16: 2, torch.bfloat16: 2, torch.int8: 4, torch.uint8: 8}.get(dtype, 1)
    weights = probe_weights(layers, dtype)
    xs = probe_rows(weights, 1)
    if dtype == torch.uint8:  # int4 values, 0-15, a scale and zero per group
        group = quantize.INT4_GROUP
        scales = [torch.rand(q.shape[1] // group, q.shape[0], 2).bfloat16() for q in weights]
        packed = [quantize.int4_packed(q) for q in weights]
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
        runs = {"torch": lambda: [kernel(xs[q.shape[1]].bfloat16(), p, group, scale)
                                  for q, p, scale in zip(weights, packed, scales)]}
        one_row = int4_one_row  # on the weights and scales as OneRowQuantLinear holds them
        calls = [(xs[q.shape[1]], nibble_bytes(q), group_scales(scale), group)
                 for q, scale in zip(weights, scales)]
    elif dtype == torch.int8:
        scales = {w.shape[0]: torch.rand(w.shape[0]).bfloat16() for w in weights}
        kernel = torch.ops.aten._weight_int8pack_mm
        runs = {"torch": lambda: [kernel(xs[w.shape[1]].bfloat16(), w, scales[w.shape[0]]) for w in weights]}
        one_row = int8_one_row
        calls = [(xs[w.shape[1]], byte_columns(w), scales[w.shape[0]]) for w in weights]
    else:
        runs = matmul_runs(xs, weights, [prepack(w) for w in weights]) if dtype == torch.float32 else \
            {"torch": lambda: [F.linear(xs[w.shape[1]].to(dtype), w) for w in weights]}
        one_row, calls = one_row_linear, [(xs[w.shape[1]], w) for w in weights]

    def layers(calls):
        return [one_row(*args) for args in calls]

    options = quantize.CPU_COMPILE_OPTIONS if dtype in (torch.int8, torch.uint8) else None  # as the model's
    layers = torch.compile(layers, fullgraph=True, dynamic=False, options=options) if compile else layers
    runs["fused"] = lambda: layers(calls)
    return runs


@torch.inference_mode()
def timed_one_row(dtype: torch.dtype = torch.float32, repeats=5) -> bool:
    """Whether the fused one-row sum of `one_row_runs` is strictly faster than each matmul (`best_seconds`:
    its warm-up compiles)."""
    return beats_the_others(best_seconds(one_row_runs(dtype), repeats), "fused")


def use_one_row_sums(module: nn.Module, wins: dict = None, again=False, rows: int = None) -> nn.Module:
    """For a module that runs compiled on CPU: its fp32 linear layers (as FewRowsLinear), HalfLinears and int8
    QuantLinears (as OneRowQuantLinear) run one row as a fused sum in compiled graphs where `wins` ({weight
    dtype: bool}) says so; a dtype it lacks: this machine's `compiled_one_row_wins`, asked only if the
    module has one. int4 QuantLinears too where rows (the most rows a step runs) is 1: their order is no
    kernel's, so more rows run the dequantized weight's matmul (a prefill's rows: fine; a batch's: slow)
    -> module (or what takes its place, where it is such a layer itself)."""
    layers = [m for m in module.modules() if is_fp32_linear(m) or type(m) is HalfLinear and m.weight.is_cpu
              or type(m) in (QuantLinear, OneRowQuantLinear) and m.weight.is_cpu
              and (m.bits == 8 and m.in_features % 4 == 0 or m.bits == 4 and reads_nibbles(m))]
    wins = dict(wins or {})
    if rows != 1:
        wins[torch.uint8] = False  # int4 (two values a byte): its one-row order would slow batches
    for m in layers:  # in the module's order: a dtype's timing asked for where the first of it is
        if m.weight.dtype not in wins:
            wins[m.weight.dtype] = compiled_one_row_wins(m.weight.dtype, again)
    members = set(layers)

    def one_row(m):
        if m not in members:
            return None
        win = wins[m.weight.dtype]
        if type(m) is HalfLinear:
            m.one_row = win
            return None
        if isinstance(m, QuantLinear):
            kind = OneRowQuantLinear if win else QuantLinear
            if type(m) is kind:
                return None
            m.weight.data, m.scales.data = held_for(m, win)
            return rebuilt(kind, m)
        return as_few_rows(m, one_row=win) if win or type(m) is FewRowsLinear else None

    return replaced(module, one_row)


def reads_nibbles(m: QuantLinear) -> bool:  # whether an int4 layer's weight can be held in `nibble_bytes`
    block = quantize.INT4_BLOCK
    return type(m) is OneRowQuantLinear or m.out_features % block == 0 and \
        quantize.int4_values(m.weight.data[:block]) is not None


def held_for(m: QuantLinear, one_row: bool) -> tuple:
    """m's weight and scales as OneRowQuantLinear (one_row) or QuantLinear holds them."""
    weight, scales = m.weight.data, m.scales.data
    if m.bits == 8:
        return (byte_columns if one_row else natural_columns)(weight), scales
    if one_row:
        return nibble_bytes(quantize.int4_values(weight)), group_scales(scales)
    return quantize.int4_packed(nibble_values(weight)), kernel_scales(scales)


FROZEN_KEY = "compiled frozen rows"  # the decision's key, after the machine key
FROZEN_PROBES = (4, 8, 16)  # the batched frame steps' row counts (dualAR's batch_bucket) that are timed
# Inductor's own GEMM (its CPP template: a register-blocked kernel on a copy of the weight it packs when it
# compiles) takes only a graph's constants, so the weights are frozen; ATEN: a matmul the template cannot take
FROZEN_GEMMS = dict(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP")


@contextlib.contextmanager
def frozen_gemms():
    """Graphs compiled within it take their weights as constants and their fp32 matmuls as inductor's GEMM
    template where it applies. Only compiling reads it: a graph already compiled runs as it was compiled."""
    with torch._inductor.config.patch(FROZEN_GEMMS), templates_parsed_once():
        yield


@contextlib.contextmanager
def templates_parsed_once():
    """Inductor parses a C++ template's Jinja source anew at each render, ~20 a linear on frozen weights
    (a fifth of such a graph's compile: docs/speed.md); within it, once per source (the same template)."""
    from torch._inductor.codegen.common import KernelTemplate
    parse = KernelTemplate.__dict__["_template_from_string"]  # a staticmethod
    KernelTemplate._template_from_string = staticmethod(functools.cache(parse.__func__))
    try:
        yield
    finally:
        KernelTemplate._template_from_string = parse


def frozen_rows_steps(again=False) -> list:
    """This machine's `row_steps` for compiled graphs of fp32 linears: at which row counts the graph runs
    them faster on frozen weights (`frozen_gemms`) than on the matmuls it takes otherwise (torch's, or
    oneDNN's prepacked). Timed once (`timed_frozen_rows`: it compiles, about a minute). Inductor does not
    cache frozen graphs across processes: each process compiles its own (docs/speed.md)."""
    return decision(f"{machine_key(torch.device('cpu'), torch.float32)} {FROZEN_KEY}", is_row_steps,
                    lambda old: timed_frozen_rows(), "timing compiled matmuls on frozen weights", again)


@torch.inference_mode()
def timed_frozen_rows(repeats=3) -> list:
    """A layer's linears PROBE_LAYERS times (random fp32 weights) at each of FROZEN_PROBES rows: one graph
    of them compiled within `frozen_gemms`, against F.linear and oneDNN's prepacked matmul eager (what a
    plain graph calls), the best of `repeats` each after a warm-up that compiles -> `row_steps` (one row:
    not frozen, the one-row sums are plain graphs)."""
    linears = nn.ModuleList(nn.Linear(i, o, bias=False) for _ in range(PROBE_LAYERS) for o, i in PROBE_SHAPES)
    weights = [m.weight for m in linears]
    packed = [prepack(w) for w in weights]
    from torch._inductor.codecache import PyCodeCache

    wins, modules = {1: False}, PyCodeCache.modules  # what inductor loads, kept for good
    for rows in FROZEN_PROBES:
        xs, known = probe_rows(weights, rows), len(modules)

        def probe():
            return [m(xs[m.in_features]) for m in linears]

        runs = matmul_runs(xs, weights, packed)
        runs["frozen"] = torch.compile(probe, fullgraph=True, dynamic=False)
        with frozen_gemms():
            wins[rows] = beats_the_others(best_seconds(runs, repeats), "frozen")
        torch._C._dynamo.eval_frame.reset_code(probe.__code__)  # the graph and its weights' copies freed:
        for module in modules[known:]:  # inductor keeps each module it loads with constants, and them
            sys.modules.pop(module.__name__, None)
        del modules[known:]
    return row_steps(wins)


def frozen_rows(module: nn.Module, again=False) -> list:
    """The row counts (`row_steps`) at which a CPU fp32 unquantized module's compiled graphs go on frozen
    weights: this machine's `frozen_rows_steps`, where its linear layers fit in an eighth of the memory
    available now (each such graph packs its own copy, and compiling one peaked at ~5x their bytes);
    else none."""
    modules = list(module.modules())
    size = sum(m.weight.numel() * 4 for m in modules if isinstance(m, nn.Linear))
    if (size and not any(isinstance(m, (QuantLinear, W8A8Linear)) for m in modules)
            and all(w.is_cpu and w.dtype == torch.float32 for w in module.parameters())
            and size <= available_memory_bytes() / 8):
        return frozen_rows_steps(again)
    return [[0, False]]


def frozen_graphs(compiled, steps: list, x: Tensor, *inputs):
    """compiled(x, *inputs), whose graph for a row count of x (its first dim) that `steps` take is compiled
    on frozen weights (`frozen_gemms`), every other plainly."""
    if not step_at(steps, x.size(0)):
        return compiled(x, *inputs)
    with frozen_gemms():
        return compiled(x, *inputs)


def use_frozen_gemms(module: nn.Module, steps: list) -> nn.Module:
    """Every fp32 CPU nn.Linear inside module -> FewRowsLinear (the same parameters) whose compiled graphs run
    F.linear at the rows `steps` take (`row_steps`), for graphs compiled there within `frozen_gemms` ->
    module (or its FewRowsLinear, where module is such a linear layer itself)."""
    return replaced(module, lambda m: as_few_rows(m, frozen_steps=steps) if is_fp32_linear(m) else None)


# ----------------------------------------------------------------------------- OmniVoice's flat row
MANY_ROWS_KEY = "many rows matmul"  # the decision's key, after the machine key
MANY_ROWS_MATMULS = ("torch", "onednn", "mkl")  # F.linear; oneDNN's or MKL's matmul on a packed weight


def many_rows_matmul(again=False) -> str:
    """Which fp32 matmul of MANY_ROWS_MATMULS runs a whole sequence's rows fastest here: oneDNN on a prepacked
    weight, MKL's packed sgemm or torch's own (MKL's plain sgemm, which packs the weight again at every call)
    win on different CPUs (docs/speed.md). Timed once (`timed_many_rows`, about 1 s)."""
    return decision(f"{machine_key(torch.device('cpu'), torch.float32)} {MANY_ROWS_KEY}",
                    MANY_ROWS_MATMULS.__contains__, lambda old: timed_many_rows(),
                    "timing the many-row matmuls", again)


def mkl_packs() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@torch.inference_mode()
def timed_many_rows(repeats=3) -> str:
    """The `fastest` of `many_rows_runs` (`best_seconds`): compute-bound, so one copy of the layer is
    enough; a packed matmul is taken only if strictly faster than torch's."""
    return fastest(best_seconds(many_rows_runs(), repeats))


def fastest(best: dict) -> str:  # best: `best_seconds`; a tie goes to torch's
    return min(best, key=lambda name: (best[name], name != "torch"))


def many_rows_runs() -> dict:
    """{matmul of MANY_ROWS_MATMULS: a run of it} on a layer's linears (random fp32 weights) at
    MANY_ROWS_PROBE rows, each only where this torch has it; MKL's only where its copy packed for these rows
    gives F.linear's products at other row counts. Each run returns its products."""
    weights = probe_weights(layers=1)
    xs = probe_rows(weights, MANY_ROWS_PROBE)
    runs = matmul_runs(xs, weights, [prepack(w) for w in weights] if torch.backends.mkldnn.is_available()
                       else None)
    if mkl_packs() and mkl_packs_any_rows(weights):
        runs["mkl"] = lambda: [mkl_packed_matmul(xs[w.shape[1]], w) for w in weights]
    return runs


def mkl_packs_any_rows(weights: list) -> bool:
    """Whether MKL's copies packed for MANY_ROWS_PROBE rows give F.linear's products (to fp32 rounding) at
    other row counts too, as `mkl_packed_matmul` assumes."""
    for rows in (1, 7, MANY_ROWS_PROBE + 13):
        for w in weights:
            x = torch.rand(rows, w.shape[1])
            expected = F.linear(x, w)
            if not torch.allclose(mkl_packed_matmul(x, w), expected, rtol=1e-4, atol=1e-3):
                return False
    return True


class ManyRowsLinear(nn.Linear):
    """nn.Linear whose fp32 CPU inference within `common.loose_matmuls` or a compiled forward (packed
    guidance, never upstream's rows) runs `matmul` ("onednn" or "mkl") on a packed copy of its weight, made
    at its first such call and kept on the weight (twice its memory), as one op; any other call is
    nn.Linear's."""

    matmul = "torch"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, matmul={self.matmul}"

    def forward(self, x: Tensor) -> Tensor:
        # dynamo cannot read a ContextVar: checked first, so that a compiled forward never reaches it
        loose = torch.compiler.is_compiling() or common.LOOSE_MATMULS.get()
        if loose and x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled():
            if self.matmul == "mkl":
                return mkl_packed_linear(x, self.weight, self.bias)
            if self.matmul == "onednn":
                return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


# ----------------------------------------------------------------------------- half-precision linears
MANY_ROWS = 32  # from here on an fp32 matmul of the upcast weight beats a half one (AVX2 CPUs): docs/speed.md


class HalfLinear(nn.Linear):
    """nn.Linear with fp16 or bf16 weights on a CPU without matrix units for them: from MANY_ROWS rows on
    (a prefill, OmniVoice's sequences: compute-bound) it runs in fp32, the weight upcast for the call and
    the output rounded back, so the sum is fp32 as in the half GEMM; fewer rows (memory-bound frames) read
    half the bytes in half precision, which is why the weight stays half. A compiled graph's one row is
    `one_row_linear` in fp32 where `one_row` says so (`use_one_row_sums`), rounded back as the GEMM's."""

    one_row = False

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, one_row={self.one_row}"

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        if torch.compiler.is_compiling() and self.one_row and rows == 1 and x.is_cpu \
                and x.dtype == self.weight.dtype and not torch.is_grad_enabled():
            bias = None if self.bias is None else self.bias.float()
            return one_row_linear(x, self.weight, bias).to(x.dtype)
        if rows >= MANY_ROWS and x.is_cpu and x.dtype == self.weight.dtype:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def use_half_linears(module: nn.Module) -> nn.Module:
    """Every plain nn.Linear inside module whose weight is fp16 or bf16 on a CPU without matrix units for
    it (quantize.runs_in_fp32) -> HalfLinear (the same parameters and names) -> module (or its HalfLinear)."""
    return replaced(module, lambda m: rebuilt(HalfLinear, m) if type(m) is nn.Linear
                    and quantize.runs_in_fp32(m.weight.dtype, m.weight.device) else None)


# ----------------------------------------------------------------------------- the codec's fast path
def keep_freed_memory():
    """glibc only (elsewhere nothing): keep freed blocks of up to 32 MB for reuse, not unmapped."""
    # glibc unmaps freed blocks and faults them back in zeroed: chunks (tensors under 32 MB) alone take 5 s of
    # audio from ~2 M minor faults to 0.1-0.3 M, these settings to ~0 (4-10% less wall time, same peak RSS).
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        return
    libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: larger blocks still come from (and go back to) the OS
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap


# oneDNN reorders bf16 weights only on CPUs that convert bf16 in hardware (its own error says which)
BF16_PREPACK = bool(quantize.CPU_FLAGS.get("avx_ne_convert")
                    or all(quantize.CPU_FLAGS.get(f) for f in ("avx512_bw", "avx512_vl", "avx512_dq")))


def can_prepack(t):  # whether oneDNN runs this tensor's device and dtype (CPU, fp32, bf16 where it can)
    ok = t.dtype == torch.float32 or t.dtype == torch.bfloat16 and BF16_PREPACK
    return t.is_cpu and ok and torch.backends.mkldnn.is_available()


def linear_rows(shape):  # a linear layer's input (..., in): how many rows of `in` it multiplies
    return math.prod(shape[:-1])


def op_rows(module, shape):  # what a prepacked op's steps choose by: a linear layer's rows, a conv's B * L
    return linear_rows(shape) if isinstance(module, nn.Linear) else shape[0] * shape[-1]


class FastOp:
    """What the fast path's modules share: the eager class whose place they took (`eager`), and the sizes
    (`row_steps` of `op_rows`) at which they run on `packed`, their weight prepacked for oneDNN."""

    def extra_repr(self) -> str:
        steps = getattr(self, "steps", None)
        return f"in place of {self.eager.__name__}" + (f", packed at rows {steps}" if steps else "")


class PackedLinear(FastOp, nn.Linear):
    """The fast path's nn.Linear: the same parameters, and oneDNN's matmul on its weight prepacked (`packed`)
    at the row counts its `steps` take it at (`row_steps`); at the others nn.Linear's own matmul."""

    def forward(self, x):
        if step_at(self.steps, linear_rows(x.shape)):
            return packed_matmul(x, self.packed, self.bias)
        return super().forward(x)


class PackedConv(FastOp, nn.Module):
    """The fast path's codec.CausalConv (its `eager` class): on its weight prepacked for oneDNN at the sizes
    its `steps` take (a 1-kernel conv as one matmul), its input and output channels-last, (B, L, C) in
    memory; at the other sizes the eager conv."""

    @property
    def matmul(self) -> bool:  # a 1-kernel conv: one matmul on channels-last x
        return self.conv.kernel_size[0] == 1 and self.conv.groups == 1

    @property
    def geo(self) -> tuple:  # as a conv2d over (1, L)
        c = self.conv
        return [0, 0], [1, c.stride[0]], [1, c.dilation[0]], c.groups

    def forward(self, x, cache=None):  # (B, C, L) -> (B, C', L / stride)
        conv, fast = self.conv, step_at(self.steps, op_rows(self, x.shape))
        if self.matmul:  # channels-last x needs no copy for one matmul
            return packed_matmul(x.mT, self.packed, conv.bias).mT if fast else conv(x)
        if not fast:  # the eager layout: a one-shot decode's long inputs take this
            return self.eager.forward(self, x, cache)
        x = self.padded(x, cache, channels_last=True)[:, :, None]
        y = torch.ops.mkldnn._convolution_pointwise(x, self.packed, conv.bias, *self.geo, "none", [], "")
        return y[:, :, 0]  # (B, C, 1, pad + L) in, (B, C', 1, L') out

    def padded(self, x, cache, channels_last=False):  # the eager class's (its forward calls it on self)
        return self.eager.padded(self, x, cache, channels_last)


class PackedConvT(FastOp, nn.Module):
    """The fast path's codec.CausalConvT (its `eager` class): its one matmul on the weight prepacked for
    oneDNN at the sizes its `steps` take, the output channels-last; at the other sizes the eager one."""

    def forward(self, x, cache=None):  # (B, C, L) -> (B, C', L * stride)
        if not step_at(self.steps, op_rows(self, x.shape)):
            return self.eager.forward(self, x, cache)
        B, _, L = x.shape
        y = packed_matmul(x.mT, self.packed).view(B, L, self.conv.weight.shape[2], -1)  # (.., kernel, C')
        y = y.unflatten(2, (1 + self.overlap, self.stride))
        out = y[:, :, 0]  # (B, L, stride, C'): what each input sample writes into its own block
        if self.overlap:  # ... plus what the one before it writes into the next block
            out = out + self.overlap_from_before(y[:, :, 1], cache)
        return out.reshape(B, L * self.stride, -1).mT + self.conv.bias[:, None]

    def overlap_from_before(self, overlaps, cache):  # the eager class's (its forward calls it on self)
        return self.eager.overlap_from_before(self, overlaps, cache)


class CompiledSnake(FastOp, nn.Module):
    """The fast path's codec.Snake (its `eager` class): one compiled kernel instead of five passes over x."""

    def forward(self, x, cache=None):
        return fused_snake(self.eager.snake)(x, self.alpha.view(1, -1, 1))  # a view: a static shape


@functools.cache
def fused_snake(snake):  # one compiled snake for all models; it compiles on first use, a graph per batch size
    return torch.compile(snake, dynamic=True)  # (made here, not at import: torch.compile imports dynamo)


FAST_CLASSES = {"Snake": CompiledSnake, "CausalConv": PackedConv, "CausalConvT": PackedConvT}


def eager_class(module):
    return getattr(module, "eager", type(module))


def codec_fast_path(model, on=True, choices=None, copies=None):
    """The codec's faster CPU path (on=False: eager), equal to eager within 1e-5; returns the model. Snakes
    compiled (dynamic shapes: one kernel for all layers and chunk sizes); tensors stay channels-last; convs,
    linear layers and transposed convs (as one matmul each) run on weights prepacked once for oneDNN, where
    torch and mkldnn are there: eager mkldnn reorders a conv's weight on every call, and MKL reads a linear
    layer's weight for a stream's few rows slowly on some CPUs (docs/speed.md). Each of these is taken only
    where it is faster on this machine: choices {`op_key`: True, False or, for a prepacked op, the sizes it
    runs prepacked at (`row_steps` of `op_rows`: a linear layer's rows, a conv's positions)} (a key left out:
    True), by default this machine's (`machine_choices`). copies: {} that keeps each prepacked weight for
    the next call given it (turning ops fast and eager again and again, as timing both sides does: making
    and freeing hundreds of MB between timed calls churned the heap, so that a one-shot decode timed so lost
    where a model kept fast won: docs/speed.md)."""
    pack = on and can_prepack(next(model.parameters()))
    if on and choices is None:
        choices = machine_choices(model)

    def fast_or_eager(module):
        key = op_key(module)
        if key is None:
            return None
        takes = on and (pack or eager_class(module).__name__ == "Snake")
        return use_fast(module, choices.get(key, True) if takes else False, copies) or module

    return replaced(model, fast_or_eager)


def op_key(module):
    """What a fast-path choice is made for: Snake (one compiled kernel for all), and each prepacked op by its
    weight's shape and its geometry (None: no choice to make)."""
    name = eager_class(module).__name__
    if name == "Snake":
        return "snake"
    if type(module) in (nn.Linear, PackedLinear):
        return f"linear {list(module.weight.shape)}"
    if name in ("CausalConv", "CausalConvT"):
        c = module.conv
        return f"{name} {list(c.weight.shape)} stride {c.stride[0]} dilation {c.dilation[0]}"
    return None


def use_fast(module, on, copies: dict = None):
    """One op (its eager or fast module) fast (on: Snake compiled, another op on its prepacked weight) or
    eager -> the module to take its place (None: it is that already); on, for a prepacked op, can also be
    the sizes it runs prepacked at (`row_steps` of `op_rows`). copies: as `codec_fast_path`'s."""
    eager = eager_class(module)
    steps = on if isinstance(on, list) else [[0, bool(on)]]
    if not any(fast for _, fast in steps):  # a copy of the weight only where it is used
        if type(module) is eager:
            return None
        new = rebuilt(eager, module)
        for name in ("eager", "steps", "packed"):
            vars(new).pop(name, None)
        return new
    if eager.__name__ == "Snake":
        return rebuilt(CompiledSnake, module, eager=eager)
    cls = PackedLinear if eager is nn.Linear else FAST_CLASSES[eager.__name__]
    return rebuilt(cls, module, eager=eager, steps=steps, packed=prepacked_copy(module, copies))


def prepacked_weight(module):
    if isinstance(module, nn.Linear):
        return prepack(module.weight)
    if eager_class(module).__name__ == "CausalConvT":  # (C, C', kernel) -> one matmul's (kernel * C', C)
        return prepack(module.conv.weight.mT.flatten(1).T)
    c = module.conv
    if PackedConv.matmul.fget(module):
        return prepack(c.weight[:, :, 0])
    return torch.ops.mkldnn._reorder_convolution_weight(c.weight[:, :, None], *PackedConv.geo.fget(module),
                                                        [1, c.in_channels, 1, 1024])


def prepacked_copy(module, copies: dict = None):
    """`prepacked_weight`(module), made once per op in `copies` (keyed by the op's first parameter, which
    its eager and fast modules share) where given."""
    if copies is None:
        return prepacked_weight(module)
    key = id(next(module.parameters()))
    if key not in copies:
        copies[key] = prepacked_weight(module)
    return copies[key]


CODEC_KEY = "codec fast path"  # the decision's key, after the machine key: {op key: taken}
PROBE_FRAMES = (1, 4, 16)  # chunk sizes a choice must not lose at: streams, and encode/decode's chunks


def machine_choices(model, again=False):
    """This machine's choices for the model's ops, kept or timed once (`timed_choices`, then
    `checked_choices`). A value that does not decide every op of the model (`is_choice`) costs the timing
    again (the ops timed now join those kept, for codecs of other sizes)."""
    ops = {op_key(m): m for m in model.modules() if op_key(m) is not None}
    p = next(model.parameters())

    def valid(choices):
        return isinstance(choices, dict) and all(is_choice(m, choices.get(key)) for key, m in ops.items())

    def decide(old):
        return checked_choices(model, dict(old if isinstance(old, dict) else {}, **timed_choices(model)))

    choices = decision(f"{machine_key(p.device, p.dtype)} {CODEC_KEY}", valid, decide,
                       "codec: timing each fast-path op against eager", again)
    return {key: choices[key] for key in ops if key in choices}  # this model's (the file has others' too)


def is_choice(module, value):
    """Whether a kept value decides this op: True or False for Snake; for a prepacked op its `row_steps`."""
    return isinstance(value, bool) if op_key(module) == "snake" else is_row_steps(value)


@torch.inference_mode()
def timed_choices(model, repeats=3):
    """Each op eager and fast on the inputs it gets in an encode and in a stream of each PROBE_FRAMES chunk
    size (`probe_inputs`): Snake is kept fast only if it is no slower in any of them (all calls at once).
    A prepacked op is timed by its inputs' sizes instead (`op_rows`) and decided for each (`row_steps`):
    its prepacked weight can win on a stream's few positions and lose on an encode's many, or the reverse,
    and a one-shot decode's lengths, above every timed one, stay eager."""
    p = next(model.parameters())
    inputs, pack = probe_inputs(model), can_prepack(p)
    by_rows = {op_key(m) for m in inputs if op_key(m) != "snake"}
    model, copies = codec_fast_path(model, on=False), {}
    times = {}  # (op key, probe; a prepacked op's: size) -> [eager seconds, fast seconds]
    for module, probes in inputs.items():
        key = op_key(module)
        if key != "snake" and not pack:
            continue
        ways = {False: module, True: use_fast(module, True, copies)}
        for probe, shapes in probes.items():
            for shape in shapes:
                where = op_rows(module, shape) if key in by_rows else probe
                total = times.setdefault((key, where), [0.0, 0.0])
                x, best = probe_tensor(module, shape, p), {}
                for fast in (False, True, False, True):  # the first pair warms up (and compiles)
                    best[fast] = min(seconds(ways[fast], x) for _ in range(repeats))
                total[0] += best[False]
                total[1] += best[True]
    wins = {}  # op key -> {probe or rows: fast no slower than eager}
    for (key, where), (eager, fast) in times.items():
        wins.setdefault(key, {})[where] = fast <= eager
    return {key: row_steps(won) if key in by_rows else all(won.values()) for key, won in wins.items()}


def probe_tensor(module, shape, like):
    """A random input of `shape` for timing `module`, laid out as the fast path hands it over: a conv's
    channels-last, (B, L, C) in memory (on contiguous inputs some convs' timing sent them eager where the
    decode ran faster with them prepacked: docs/speed.md)."""
    if eager_class(module).__name__ in ("CausalConv", "CausalConvT"):
        B, C, L = shape
        return torch.rand(B, L, C, dtype=like.dtype, device=like.device).mT
    return torch.rand(shape, dtype=like.dtype, device=like.device)


ONE_SHOT_FRAMES = 64  # the one-shot decode the whole-path check times (3 s): its convs see a clip's lengths
ENCODE_FRAMES = 16  # the probes' encode chunks (codec.CHUNK_FRAMES: what its encode runs)


@torch.inference_mode()
def probe_encode(model, chunks=2):
    """An encode of silence in `chunks` chunks of ENCODE_FRAMES, as the codec's `encode` runs it."""
    p, cache = next(model.parameters()), {}
    for _ in range(chunks):
        model.encode_chunk(torch.zeros(1, 1, ENCODE_FRAMES * model.hop, device=p.device), cache)


@torch.inference_mode()
def probe_decode(model, frames, chunks=1):
    """A decode of zero codes in `chunks` chunks of `frames`, as the codec's `decode_stream` runs it."""
    p, cache = next(model.parameters()), {}
    for _ in range(chunks):
        model.decode_chunk(torch.zeros(1, model.config["n_codebooks"] + 1, frames, dtype=torch.long,
                                       device=p.device), cache)


def probe_paths(model):
    """{path: run} of what `checked_choices` times whole: an encode in the codec's chunks, a stream of each
    PROBE_FRAMES chunk size (two chunks) and a one-shot decode of ONE_SHOT_FRAMES."""
    paths = {"encode": functools.partial(probe_encode, model)}
    paths.update({f"stream {n}": functools.partial(probe_decode, model, n, 2) for n in PROBE_FRAMES})
    paths["one shot"] = functools.partial(probe_decode, model, ONE_SHOT_FRAMES)
    return paths


def fallbacks(choices):
    """`choices`, then fewer and fewer ops fast: the convs eager, then every prepacked op eager (the Snakes
    alone compiled), then none."""
    eager = {key: False if key == "snake" else [[0, False]] for key in choices}
    convs = {key: value for key, value in eager.items() if key.startswith("Causal")}
    return [choices, dict(choices, **convs), dict(eager, snake=choices.get("snake", True)), eager]


@torch.inference_mode()
def checked_choices(model, choices, rounds=2, clock=time.perf_counter):
    """Whole paths, not ops, decide at the end: each op can win alone and a path still lose (an eager op
    handed a fast one's channels-last tensor; a one-shot decode's convs at lengths no probe timed). Each of
    `probe_paths` is timed eager and with a candidate of `fallbacks`(choices) in turn (`rounds` times, the
    best kept; the candidate's first run warms up); the first candidate no slower on any path is kept, else
    every op eager. Leaves the model eager."""
    paths, candidates, copies = probe_paths(model), [], {}
    for candidate in fallbacks(choices):  # each one once (where no conv was fast, two are the same)
        candidates += [candidate] if candidate not in candidates else []
    for candidate in candidates[:-1]:
        best = {False: {}, True: {}}
        for turn in [True] + [False, True] * rounds:  # the candidate's first turn only warms up
            codec_fast_path(model, turn, candidate, copies)
            for name, run in paths.items():
                start = clock()
                run()
                best[turn].setdefault(name, []).append(clock() - start)
        codec_fast_path(model, on=False)
        ratios = {name: min(best[False][name]) / min(best[True][name][1:]) for name in paths}
        fast = sum(value is True or isinstance(value, list) and any(v for _, v in value)
                   for value in candidate.values())
        print(f"codec: whole paths with {fast} of {len(candidate)} ops fast, fast / eager speed: "
              + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()), file=sys.stderr)
        if all(ratio >= 1 for ratio in ratios.values()):
            return candidate
    return candidates[-1]


def probe_inputs(model):
    """{module: {probe: input shapes}} of an eager encode in the codec's chunks and of a decoding stream in
    chunks of each PROBE_FRAMES size (two chunks: the second has a past)."""
    seen, probe = {}, [None]

    def record(module, args):
        seen.setdefault(module, {}).setdefault(probe[0], set()).add(tuple(args[0].shape))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if op_key(m) is not None]
    try:
        codec_fast_path(model, on=False)
        probe[0] = "encode"
        probe_encode(model)
        for frames in PROBE_FRAMES:
            probe[0] = f"stream {frames}"
            probe_decode(model, frames, chunks=2)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def seconds(module, x):
    start = time.perf_counter()
    module(x) if isinstance(module, nn.Linear) else module(x, None)
    return time.perf_counter() - start


if __name__ == "__main__":
    show_decisions()
