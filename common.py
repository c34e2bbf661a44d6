"""What every fishfast model and tool shares, and nothing model-specific: the error users see, device and
dtype choice, atomic writes, audio files, peak memory, the engine thread. It imports no model file, so a
model file can be copied with this one alone.

Sections: errors and the CLI wrapper, devices and dtypes, files (atomic writes, audio, the compile cache),
CPU weight-only quantization (QuantLinear), oneDNN's and MKL's prepacked matmuls and the decisions timed once
per machine (FewRowsLinear, ManyRowsLinear, machine_decision), half-precision linears (HalfLinear), memory,
engines (Job, and EngineThread: the thread that steps either model's Scheduler).
"""
import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import numpy as np
import soundfile as sf
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- errors, the CLI wrapper
class UserError(ValueError):
    """Bad input: the CLI prints the message as one line and writes nothing."""


class QueueFull(RuntimeError):
    """An engine's rows are busy and its waiting queue is full (a server answers 503, Retry-After)."""


class EngineClosed(RuntimeError):
    """An engine was closed: a server error (the server is shutting down), not bad input."""


def unreadable(path, error: Exception) -> UserError:
    """One line for a file that exists but cannot be parsed."""
    lines = str(error).strip().splitlines()
    detail = f"no key {error}" if isinstance(error, KeyError) else lines[0] if lines else type(error).__name__
    return UserError(f"cannot read {path}: {detail}")


def cli(main, argv=None):
    """Run a CLI's main(argv): bad input is one `error: ...` line and exit status 2; anything else is a
    bug and keeps its traceback."""
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------- devices and dtypes
def pick_device(name: str = None) -> torch.device:
    """--device as given (cpu, mps, cuda, cuda:N), else cuda > mps > cpu."""
    kind, _, index = (name or "").partition(":")
    available = dict(cpu=True, cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available())
    if kind and not available.get(kind, False):
        raise UserError(f"--device {name}: no {kind} device on this machine")
    if index and int(index) >= torch.cuda.device_count():
        raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return torch.device(name or next(kind for kind in ("cuda", "mps", "cpu") if available[kind]))


def pick_dtype(name: str, device: torch.device, cuda: str = "bf16") -> torch.dtype:
    """--dtype as given, else `cuda` on CUDA and fp32 elsewhere."""
    return DTYPES[name or (cuda if device.type == "cuda" else "fp32")]


def device_name(text: str) -> str:
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text}: use cpu, mps, cuda or cuda:N")
    return text


# ----------------------------------------------------------------------------- files
def default_compile_cache() -> Path:
    """Where compiled kernels (and the codec's fast-path decisions) are kept unless told:
    $XDG_CACHE_HOME/fishfast/compile."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fishfast" / "compile"


def use_compile_cache(cache=None) -> Path:
    """The compile-cache folder: `cache` if given, else the user's $TORCHINDUCTOR_CACHE_DIR, else
    default_compile_cache(); points inductor at it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    # importing torch._dynamo sets the variable to torch's /tmp default: that one is not the user's choice
    if cache is not None or os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache or default_compile_cache()).expanduser())
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def write_atomic(path, write):
    """write(tmp) fills a temp file (or folder) next to `path`, which then replaces `path`: a failure (a
    full disk, a missing folder) is one UserError and never leaves a half-written file."""
    from safetensors import SafetensorError
    path = Path(path)
    tmp = path.with_name(f".{path.name}.part")
    try:
        write(tmp)
        usual_permissions(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: torch.save's and safetensors' own
        raise UserError(f"cannot write {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def usual_permissions(path: Path):
    """safetensors makes files only their owner can read: give them the permissions of any new file."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def read_audio(path) -> tuple:
    """Any file soundfile reads -> (float32 array (frames, channels), sample rate); a missing, unreadable
    or empty file is one UserError."""
    if not Path(path).is_file():
        raise UserError(f"audio file {path} not found")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:
        detail = str(e).strip().splitlines()[-1]
        raise UserError(f"{path} is not a readable audio file ({detail})") from None
    if data.shape[0] == 0:
        raise UserError(f"{path} contains no audio samples")
    return data, rate


def save_wav(path, wave, sample_rate: int):
    """Mono float waveform -> PCM-16 .wav, atomically."""
    data = torch.as_tensor(wave).detach().float().cpu().reshape(-1).clamp(-1, 1).numpy()
    write_atomic(path, lambda tmp: sf.write(tmp, data, sample_rate, format="WAV", subtype="PCM_16"))


def save_npy(path, array):
    """An integer array (codes) -> .npy, atomically."""
    def write(tmp):  # a file object: np.save would add .npy to the temp file's name
        with open(tmp, "wb") as f:
            np.save(f, torch.as_tensor(array).cpu().numpy().astype(np.int64))
    write_atomic(path, write)


# ----------------------------------------------------------------------------- CPU weight-only quantization
INT4_GROUP = 128  # int4 inputs sharing one scale and zero
INT8_MATMUL_ROWS = 128  # from here on one matmul of the converted int8 weight beats torch's int8 kernel: 1.4x
# at 128 rows, 1.9x at 1000 on an AVX2 EPYC (fp32 there; below ~96 rows the kernel wins): docs/speed.md
# torch's CPU kernels read whole vectors (16 lanes on AVX-512, 8 on AVX2) with no tail: the int8 one's inputs
# and the int4 one's outputs must come in whole 16s, or they crash or return garbage (torch 2.13)
KERNEL_LANES = 16


def int8_rows(t: Tensor) -> tuple:
    """Each row of t rounded to int8 with a scale of its own (symmetric: its largest |value| -> 127) ->
    (int8 values, scales (..., 1)); a row of zeros stays zeros."""
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(t / scale).to(torch.int8), scale


class QuantLinear(nn.Module):
    """nn.Linear with int8 weights (a scale per output row) or int4 ones (a scale and zero per INT4_GROUP
    inputs, w = (q - 8) * scale + zero), gpt-fast style, read by torch's own CPU kernels (aten
    _weight_int8pack_mm, _weight_int4pack_mm_for_cpu; inductor calls the same ones). They are fast with
    bf16 activations only (fp32 takes a scalar path, 10-30x slower): x goes in as bf16, y out in x's dtype.
    matmul_rows: from this many rows on (compute-bound work: a prefill, OmniVoice's whole sequences) an int8
    weight is converted to bf16 (exactly: |q| <= 127) once per call and run through a bf16 matmul, which
    those kernels, written for a few rows, are slower than; the scales multiply its output (fp32 where the
    CPU has no bf16 matrix units: runs_in_fp32), as at any row count for a shape the kernel cannot take."""

    def __init__(self, linear: nn.Linear, bits: int, matmul_rows: int = INT8_MATMUL_ROWS):
        super().__init__()
        self.matmul_rows = matmul_rows
        w = linear.weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.group = math.gcd(INT4_GROUP, self.in_features)
        # the int4 kernel takes groups of 32 to 256 inputs and whole KERNEL_LANES of outputs
        self.bits = 8 if self.group < 32 or self.out_features % KERNEL_LANES else bits
        self.kernel = self.bits == 4 or self.in_features % KERNEL_LANES == 0
        if self.bits == 8:
            weight, scale = int8_rows(w)  # (out, in), (out, 1)
            scale = scale[:, 0]
        else:
            groups = w.view(self.out_features, -1, self.group)
            low, scale = groups.amin(-1), (groups.amax(-1) - groups.amin(-1)).clamp(min=1e-12) / 15
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
            weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(w.shape), 1)  # (out, in / 2)
            scale = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1)  # (in / group, out, 2)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scales = nn.Parameter(scale.to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = linear.bias

    one_row = False  # compiled int8 graphs' one row as `one_row_linear` (use_one_row_sums)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        one_row = self.one_row and self.bits == 8 and x2.shape[0] == 1 and x.is_cpu
        if one_row and torch.compiler.is_compiling():
            y = one_row_linear(x2.float(), self.weight) * self.scales  # the kernel's bf16 x, an fp32 sum
        elif self.bits == 8 and (x2.shape[0] >= self.matmul_rows or not self.kernel):
            w = self.weight.to(torch.float32 if runs_in_fp32(torch.bfloat16, x.device) else torch.bfloat16)
            y = F.linear(x2.to(w.dtype), w) * self.scales  # one pass over the weight
        elif self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group, self.scales)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


CPU_FLAGS = torch._C._cpu._get_cpu_capability()  # what this CPU has: {"avx2": True, "avx512_vnni": ...}
# Whether this CPU has int8 dot products (VNNI, AMX) for torch._int_mm: without them (an AVX2 EPYC) it ran
# OmniVoice's layers 20x slower than fp32 (docs/omnivoice.md). A constant: dynamo reads it so.
INT8_UNITS = any(CPU_FLAGS.get(unit) for unit in ("avx512_vnni", "avx_vnni", "amx_int8"))
EXACT_TERMS = 2 ** 24 // 127 ** 2  # 1040 int8 x int8 products: each partial sum an exact fp32 integer


def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """torch._int_mm(a, b) (int8 (M, K) @ (K, N) -> int32, exact). On a CPU without int8 units, fp32
    matmuls of EXACT_TERMS inputs at a time: their sums are exact integers in any order, so the int32
    result is _int_mm's, bit for bit, at fp32's speed."""
    if INT8_UNITS or not a.is_cpu:
        return torch._int_mm(a, b)
    parts = [(a[:, k:k + EXACT_TERMS].float() @ b[k:k + EXACT_TERMS].float()).to(torch.int32)
             for k in range(0, a.shape[1], EXACT_TERMS)]
    return torch.stack(parts).sum(0, dtype=torch.int32)


class W8A8Linear(nn.Module):
    """nn.Linear as int8 x int8 products summed exactly in int32 (`int_mm`: oneDNN's VNNI kernels on a CPU
    that has them): int8 weights with a scale per output row (as QuantLinear's) and each input row rounded
    on the fly to int8 with a scale of its own (dynamic, symmetric: OpenVINO's W8A8). For compute-bound
    whole sequences: 2.3x oneDNN's fp32 matmul at 323 rows on a Zen 4. Rounding the activations too costs
    more argmax agreement than the weight-only schemes do (docs/omnivoice.md)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        self.out_features, self.in_features = w.shape
        if self.in_features > 2 ** 31 // 127 ** 2:  # the int32 sums could overflow
            raise UserError(f"w8a8: a linear layer of {self.in_features} inputs is over int32's sums")
        weight, scale = int8_rows(w)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scales = nn.Parameter(scale[:, 0], requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        xq, x_scale = int8_rows(x.reshape(-1, self.in_features).float())
        y = int_mm(xq, self.weight.t()).float().mul_(x_scale).mul_(self.scales)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def swap_linears(module: nn.Module, make):
    """Every nn.Linear inside module -> make(linear): e.g. partial(QuantLinear, bits=4), W8A8Linear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            swap_linears(child, make)


# ----------------------------------------------------------------------------- prepacked matmuls (CPU)
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


def machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a timed decision holds for: the CPU kind, oneDNN's ISA cap, torch, threads, device, dtype."""
    return (f"{torch.backends.cpu.get_cpu_capability()} {os.environ.get('ONEDNN_MAX_CPU_ISA', '')} torch"
            f" {torch.__version__} threads {torch.get_num_threads()} {device.type} {dtype}")


def machine_decision(path: Path, machine: str, valid, decide, what: str):
    """A decision timed once per machine and kept in the file `path` ({machine: value}, in the compile
    cache): the stored value where valid(value), else decide(the stored value or None), said on stderr
    (`what`) and stored beside the other machines'. A file that cannot be read or written only costs the
    timing again."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    if valid(known.get(machine)):
        return known[machine]
    print(f"{what}, once for this machine (kept in {path})", file=sys.stderr)
    value = decide(known.get(machine))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dict(known, **{machine: value}), indent=1)
        write_atomic(path, lambda tmp: Path(tmp).write_text(text))
    except (OSError, UserError):
        pass
    return value


ROWS_FILE = "few_rows_linear.json"  # in the compile cache folder: {machine: row_steps}
ROW_PROBES = (1, 2, 3, 4, 8, 16, 32, 64)  # the row counts of a frame step (batch 1 to 64) timed
PROBE_SHAPES = ((1536, 1024), (1024, 1024), (6144, 1024), (1024, 3072))  # a transformer layer's linears
PROBE_LAYERS = 3  # 144 MB of fp32 weights: read from memory, as a real model's, not from a 32-96 MB cache


def few_rows_steps() -> list:
    """This machine's `row_steps` for fp32 linears: at which row counts oneDNN's matmul on a prepacked weight
    is no slower than torch's own (MKL reads a weight for one row at ~40 GB/s on a Xeon but ~12 on an AMD
    EPYC, where oneDNN reads ~24: docs/speed.md). Timed once (`timed_row_steps`), kept in ROWS_FILE."""
    return machine_decision(use_compile_cache() / ROWS_FILE, machine_key(torch.device("cpu"), torch.float32),
                            is_row_steps, lambda old: timed_row_steps(), "timing oneDNN's few-row matmuls")


@torch.inference_mode()
def timed_row_steps(repeats=3) -> list:
    """A layer's linears PROBE_LAYERS times (random fp32 weights) at each of ROW_PROBES rows, F.linear and
    prepacked in turn (the best of `repeats` each) -> `row_steps`. About 2 s."""
    weights = [torch.rand(shape) for _ in range(PROBE_LAYERS) for shape in PROBE_SHAPES]
    packed = [prepack(w) for w in weights]

    def seconds(rows, matmul, ws):
        xs = {i: torch.rand(rows, i) for i in {w.shape[1] for w in weights}}
        start = time.perf_counter()
        for w, plain in zip(ws, weights):
            matmul(xs[plain.shape[1]], w)
        return time.perf_counter() - start

    wins = {}
    for rows in ROW_PROBES:
        best = {F.linear: [], packed_matmul: []}
        for _ in range(1 + repeats):  # the first round warms up
            for matmul, ws in ((F.linear, weights), (packed_matmul, packed)):
                best[matmul].append(seconds(rows, matmul, ws))
        wins[rows] = min(best[packed_matmul][1:]) <= min(best[F.linear][1:])
    return row_steps(wins)


# Whether compiled graphs may run few-row linears on oneDNN's prepacked weights too, where the steps take
# them: on an AVX2-only CPU (an AMD EPYC: inductor's 4-row matmul read a weight at a third of oneDNN's speed)
# or where MKL loses even at one row (an AVX-512 EPYC); on an AVX-512 Xeon, whose MKL wins at one row,
# inductor's own 4-row plan beat the op though eager oneDNN won (docs/speed.md).
AVX2_ONLY = torch.backends.cpu.get_cpu_capability() == "AVX2"


class FewRowsLinear(nn.Linear):
    """nn.Linear whose inference on CPU fp32 runs oneDNN on the weight `prepacked` at the row counts its
    `steps` take it at (`row_steps`: this machine's `few_rows_steps` by default), eager, and compiled (as
    the opaque `packed_linear`) at those its `compiled_steps` take; a compiled graph's one row is
    `one_row_linear` where `one_row` says so, and the rows its `frozen_steps` take are F.linear (the graph
    is compiled on frozen weights there: `use_frozen_gemms`); any other call is nn.Linear's. The copy
    doubles the layer's memory, made at its first such call."""

    steps = compiled_steps = frozen_steps = [[0, False]]
    one_row = False

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


def one_row_linear(x: Tensor, weight: Tensor, bias: Tensor = None) -> Tensor:
    """F.linear of one row as a product and a sum: inductor fuses them into one pass over the weight (32 GB/s
    on a Zen 4, where oneDNN's matmul read 24 and MKL's 12). Eager it would make the whole product: compiled
    graphs only."""
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias


ONE_ROW_KEY = "compiled one row"  # ROWS_FILE's entry for `compiled_one_row_wins`, after the machine key


def compiled_one_row_wins(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this machine's compiled graphs run a one-row linear of `dtype` weights (fp32, or int8 as
    QuantLinear's) faster as `one_row_linear` than the matmuls eager takes for it. Timed once
    (`timed_one_row`: it compiles, 5-15 s), kept in ROWS_FILE."""
    machine = f"{machine_key(torch.device('cpu'), dtype)} {ONE_ROW_KEY}"
    return machine_decision(use_compile_cache() / ROWS_FILE, machine, lambda value: isinstance(value, bool),
                            lambda old: timed_one_row(dtype), f"timing compiled one-row {dtype} linears")


@torch.inference_mode()
def timed_one_row(dtype: torch.dtype = torch.float32, repeats=5) -> bool:
    """A layer's linears at one row, PROBE_LAYERS times for fp32 and 4x that for int8 (the same bytes):
    `one_row_linear` compiled by inductor against torch's own matmul and, for fp32, oneDNN's prepacked one
    (the best of `repeats` each, after a warm-up that compiles)."""
    xs = {i: torch.rand(1, i) for i in {shape[1] for shape in PROBE_SHAPES}}
    if dtype == torch.int8:
        weights = [torch.randint(-127, 128, shape, dtype=torch.int8)
                   for _ in range(4 * PROBE_LAYERS) for shape in PROBE_SHAPES]
        scales = {w.shape[0]: torch.rand(w.shape[0]).bfloat16() for w in weights}
        fused = torch.compile(lambda ws: [one_row_linear(xs[w.shape[1]], w) * scales[w.shape[0]] for w in ws],
                              fullgraph=True)
        kernel = torch.ops.aten._weight_int8pack_mm
        runs = {"torch": lambda: [kernel(xs[w.shape[1]].bfloat16(), w, scales[w.shape[0]]) for w in weights]}
    else:
        weights = [torch.rand(shape) for _ in range(PROBE_LAYERS) for shape in PROBE_SHAPES]
        fused = torch.compile(lambda ws: [one_row_linear(xs[w.shape[1]], w) for w in ws], fullgraph=True)
        packed = [prepack(w) for w in weights]
        runs = {"torch": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
                "packed": lambda: [packed_matmul(xs[w.shape[1]], p) for w, p in zip(weights, packed)]}
    runs["fused"] = lambda: fused(weights)
    return beats_the_others(runs, "fused", repeats)


def beats_the_others(runs: dict, name: str, repeats: int) -> bool:
    """Whether runs[name] is strictly faster than every other run of `runs` ({name: fn}), each the best of
    `repeats` calls, the runs taking turns after a first round that warms up (and compiles)."""
    best = {}
    for _ in range(1 + repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            best.setdefault(key, []).append(time.perf_counter() - start)
    fastest = min(best.pop(name)[1:])
    return all(fastest < min(seconds[1:]) for seconds in best.values())


MANY_ROWS_KEY = "many rows matmul"  # ROWS_FILE's entry for `many_rows_matmul`, after the machine key
MANY_ROWS_PROBE = 320  # a whole sequence's rows (OmniVoice's flat row: a 3 s prompt, 4 s of audio twice)
MANY_ROWS_MATMULS = ("torch", "onednn", "mkl")  # F.linear; oneDNN's or MKL's matmul on a packed weight


def many_rows_matmul() -> str:
    """Which fp32 matmul of MANY_ROWS_MATMULS runs a whole sequence's rows fastest here: oneDNN on a prepacked
    weight ran 323-row products 1.2-1.5x faster than torch's own (MKL's plain sgemm) on a Zen 4 and no faster
    on a Xeon, where MKL's packed sgemm ran them 1.1-1.3x faster (docs/omnivoice.md). Timed once
    (`timed_many_rows`, about 1 s), kept in ROWS_FILE."""
    machine = f"{machine_key(torch.device('cpu'), torch.float32)} {MANY_ROWS_KEY}"
    return machine_decision(use_compile_cache() / ROWS_FILE, machine, MANY_ROWS_MATMULS.__contains__,
                            lambda old: timed_many_rows(), "timing the many-row matmuls")


def mkl_packs() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@torch.inference_mode()
def timed_many_rows(repeats=3) -> str:
    """A layer's linears (random fp32 weights) at MANY_ROWS_PROBE rows on each matmul in turn, the best of
    `repeats` each after a warm-up: compute-bound, so one copy of the layer is enough. A packed matmul is
    taken only if strictly faster than torch's, each only where this torch has it, MKL's only where its packed
    copy gives F.linear's products at other row counts too."""
    weights = [torch.rand(shape) for shape in PROBE_SHAPES]
    xs = [torch.rand(MANY_ROWS_PROBE, w.shape[1]) for w in weights]
    runs = {"torch": lambda: [F.linear(x, w) for x, w in zip(xs, weights)]}
    if torch.backends.mkldnn.is_available():
        packed = [prepack(w) for w in weights]
        runs["onednn"] = lambda: [packed_matmul(x, p) for x, p in zip(xs, packed)]
    if mkl_packs() and mkl_packs_any_rows(weights):
        runs["mkl"] = lambda: [mkl_packed_matmul(x, w) for x, w in zip(xs, weights)]
    best = {name: [] for name in runs}
    for _ in range(1 + repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name].append(time.perf_counter() - start)
    return min(runs, key=lambda name: (min(best[name][1:]), name != "torch"))  # a tie: torch's


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
    """nn.Linear whose fp32 CPU inference runs `matmul` ("onednn" or "mkl") on a packed copy of its weight,
    made at its first such call and kept on the weight (twice its memory); any other call is nn.Linear's."""

    matmul = "torch"

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled():
            if self.matmul == "mkl":
                return mkl_packed_matmul(x, self.weight, self.bias)
            if self.matmul == "onednn":
                return packed_matmul(x, prepacked(self.weight), self.bias)
        return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def prepacked_linears(*modules: nn.Module):
    """Within it, the plain fp32 CPU nn.Linears inside `modules` run this machine's `many_rows_matmul` on
    packed copies of their weights (ManyRowsLinear, eager inference), where it is not torch's and the copies
    not yet made fit in half of the memory available now; after it, nn.Linear again. The copies stay on the
    weights (twice their memory). One forward at a time: it changes the modules while it lasts."""
    linears = [m for module in modules for m in module.modules() if type(m) is nn.Linear
               and m.weight.dtype == torch.float32 and m.weight.is_cpu] if not torch.is_grad_enabled() else []
    matmul = many_rows_matmul() if linears else "torch"
    copy = {"onednn": "prepacked", "mkl": "mkl_prepacked"}.get(matmul)  # torch's: none
    missing = sum(m.weight.numel() * 4 for m in linears if getattr(m.weight, copy or "", None) is None)
    if not (copy and missing <= available_memory_bytes() / 2):
        linears = []
    for m in linears:
        m.__class__, m.matmul = ManyRowsLinear, matmul
    try:
        yield
    finally:
        for m in linears:
            m.__class__ = nn.Linear
            vars(m).pop("matmul", None)  # not `del`: a forward in another thread may have restored it


def use_few_rows_linears(module: nn.Module, steps: list = None):
    """Every plain fp32 CPU nn.Linear inside module -> FewRowsLinear (the same parameters and names) with
    `steps` (default: this machine's `few_rows_steps`; compiled graphs: the same where AVX2_ONLY or they
    take one row), where torch has oneDNN, some row count takes it and the prepacked copies fit in half of
    the memory available now (else nothing changes)."""
    linears = [m for m in module.modules() if type(m) in (nn.Linear, FewRowsLinear)
               and m.weight.dtype == torch.float32 and m.weight.is_cpu]
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if linears and torch.backends.mkldnn.is_available() and size <= available_memory_bytes() / 2:
        steps = few_rows_steps() if steps is None else steps
        compiled = steps if AVX2_ONLY or step_at(steps, 1) else [[0, False]]
        for m in linears if any(fast for _, fast in steps) else ():
            m.__class__, m.steps, m.compiled_steps = FewRowsLinear, steps, compiled


def use_one_row_sums(module: nn.Module, wins: dict = None):
    """For a module that runs compiled on CPU: its fp32 linear layers (as FewRowsLinear) and int8 QuantLinears
    run one row as `one_row_linear` in compiled graphs where `wins` ({torch.float32: bool, torch.int8: bool})
    says so; a dtype it lacks: this machine's `compiled_one_row_wins`, asked only if the module has one."""
    layers = [m for m in module.modules() if (type(m) in (nn.Linear, FewRowsLinear) and m.weight.dtype
              == torch.float32 or type(m) is QuantLinear and m.bits == 8) and m.weight.is_cpu]
    wins = dict(wins or {})
    for m in layers:
        dtype = m.weight.dtype
        if dtype not in wins:
            wins[dtype] = compiled_one_row_wins(dtype)
        if type(m) is nn.Linear and wins[dtype]:  # the same parameters, FewRowsLinear's forward
            m.__class__ = FewRowsLinear
        m.one_row = wins[dtype]


FROZEN_KEY = "compiled frozen rows"  # ROWS_FILE's entry for `frozen_rows_steps`, after the machine key
FROZEN_PROBES = (4, 8, 16)  # the batched frame steps' row counts (dualAR.batch_bucket) that are timed
# Inductor's own GEMM (its CPP template: a register-blocked kernel on a copy of the weight it packs when it
# compiles) takes only a graph's constants, so the weights are frozen; ATEN: a matmul the template cannot take
FROZEN_GEMMS = dict(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP")


def frozen_gemms():
    """Graphs compiled within it take their weights as constants and their fp32 matmuls as inductor's GEMM
    template where it applies. Only compiling reads it: a graph already compiled runs as it was compiled."""
    return torch._inductor.config.patch(FROZEN_GEMMS)


def frozen_rows_steps() -> list:
    """This machine's `row_steps` for compiled graphs of fp32 linears: at which row counts the graph runs
    them faster on frozen weights (`frozen_gemms`) than on the matmuls it takes otherwise (torch's, or
    oneDNN's prepacked): at 4 rows a Zen 4 read a weight at 23 GB/s so, oneDNN at 17, MKL at 6; at 8 rows
    the template lost (docs/speed.md). Timed once (`timed_frozen_rows`: it compiles, about a minute), kept
    in ROWS_FILE."""
    machine = f"{machine_key(torch.device('cpu'), torch.float32)} {FROZEN_KEY}"
    return machine_decision(use_compile_cache() / ROWS_FILE, machine, is_row_steps,
                            lambda old: timed_frozen_rows(), "timing compiled matmuls on frozen weights")


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
        xs, known = {i: torch.rand(rows, i) for i in {w.shape[1] for w in weights}}, len(modules)

        def probe():
            return [m(xs[m.in_features]) for m in linears]

        runs = {"frozen": torch.compile(probe, fullgraph=True, dynamic=False),
                "torch": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
                "packed": lambda: [packed_matmul(xs[w.shape[1]], p) for w, p in zip(weights, packed)]}
        with frozen_gemms():
            wins[rows] = beats_the_others(runs, "frozen", repeats)
        torch._C._dynamo.eval_frame.reset_code(probe.__code__)  # the graph and its weights' copies freed:
        for module in modules[known:]:  # inductor keeps each module it loads with constants, and them
            sys.modules.pop(module.__name__, None)
        del modules[known:]
    return row_steps(wins)


def frozen_rows(module: nn.Module) -> list:
    """The row counts (`row_steps`) at which a CPU fp32 unquantized module's compiled graphs go on frozen
    weights: this machine's `frozen_rows_steps`, where its linear layers fit in an eighth of the memory
    available now (each such graph packs its own copy, and compiling one peaked at ~5x their bytes at
    s2-mid-b); else none."""
    modules = list(module.modules())
    size = sum(m.weight.numel() * 4 for m in modules if isinstance(m, nn.Linear))
    if (size and not any(isinstance(m, (QuantLinear, W8A8Linear)) for m in modules)
            and all(w.is_cpu and w.dtype == torch.float32 for w in module.parameters())
            and size <= available_memory_bytes() / 8):
        return frozen_rows_steps()
    return [[0, False]]


def frozen_graphs(compiled, steps: list, x: Tensor, *inputs):
    """compiled(x, *inputs), whose graph for a row count of x (its first dim) that `steps` take is compiled
    on frozen weights (`frozen_gemms`), every other plainly."""
    if not step_at(steps, x.size(0)):
        return compiled(x, *inputs)
    with frozen_gemms():
        return compiled(x, *inputs)


def use_frozen_gemms(module: nn.Module, steps: list):
    """Every fp32 CPU nn.Linear inside module -> FewRowsLinear (the same parameters) whose compiled graphs run
    F.linear at the rows `steps` take (`row_steps`), for graphs compiled there within `frozen_gemms`."""
    for m in module.modules():
        if type(m) in (nn.Linear, FewRowsLinear) and m.weight.dtype == torch.float32 and m.weight.is_cpu:
            m.__class__, m.frozen_steps = FewRowsLinear, steps


# ----------------------------------------------------------------------------- half-precision linears (CPU)
MANY_ROWS = 32  # from here on an fp32 matmul of the upcast weight beats a half one (AVX2 EPYC): docs/speed.md
# Whether this CPU has matrix instructions for fp16 / bf16 (oneDNN's fast half-precision GEMMs): without them
# torch's many-row half matmuls are 4-5x slower than fp32 (an AVX2 EPYC). Constants: dynamo reads them so.
HALF_UNITS = {torch.bfloat16: CPU_FLAGS.get("avx512_bf16") or CPU_FLAGS.get("amx_bf16") or False,
              torch.float16: CPU_FLAGS.get("avx512_fp16") or CPU_FLAGS.get("amx_fp16") or False}


class HalfLinear(nn.Linear):
    """nn.Linear with fp16 or bf16 weights on a CPU without matrix units for them: from MANY_ROWS rows on
    (a prefill, OmniVoice's sequences: compute-bound) it runs in fp32, the weight upcast for the call and
    the output rounded back, so the sum is fp32 as in the half GEMM; fewer rows (memory-bound frames) read
    half the bytes in half precision, which is why the weight stays half."""

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() // self.in_features >= MANY_ROWS and x.is_cpu and x.dtype == self.weight.dtype:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def runs_in_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether many-row linears of `dtype` on `device` run in fp32 (HalfLinear): half ones on such a CPU."""
    return device.type == "cpu" and dtype in HALF_UNITS and not HALF_UNITS[dtype]


def use_half_linears(module: nn.Module) -> nn.Module:
    """Every plain nn.Linear inside module whose weight is fp16 or bf16 on a CPU without matrix units for
    it -> HalfLinear (the same parameters and names) -> module."""
    for m in module.modules():
        if type(m) is nn.Linear and runs_in_fp32(m.weight.dtype, m.weight.device):
            m.__class__ = HalfLinear
    return module


# ----------------------------------------------------------------------------- memory
def reset_peak_memory(device: torch.device):
    """Restart `peak_memory_gb` from the memory in use now (where the platform allows it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif Path("/proc/self/clear_refs").exists():  # Linux: the peak RSS (VmHWM) restarts from the current RSS
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:  # some containers forbid it: the peak is then the process's so far
            pass


def available_memory_bytes() -> int:
    """Linux's MemAvailable (0 where it cannot be read)."""
    try:
        return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())[1]) * 1024
    except (OSError, TypeError):
        return 0


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory since `reset_peak_memory`: CUDA allocations, else the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    status = Path("/proc/self/status")
    if status.is_file():
        return int(re.search(r"VmHWM:\s+(\d+)", status.read_text())[1]) / 1e6  # kB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, kB elsewhere
    return peak / (1e9 if sys.platform == "darwin" else 1e6)


# ----------------------------------------------------------------------------- engines
class Job:
    """What an engine's unit of work shares (dualAR.Request, omnivoice.Unmasking): `done`, `cancelled` and
    `error`, with `changed` notified when it ends. The subclass calls Job.__init__ first."""

    def __init__(self):
        self.done, self.cancelled, self.error, self.changed = False, False, None, threading.Condition()

    def finish(self, error: Exception = None):
        """It is over (an error is raised to its reader; the first one is kept)."""
        with self.changed:
            self.done, self.error = True, self.error or error
            self.changed.notify_all()

    def cancel(self):
        """Stop it: the engine drops it before its next step (frees its row)."""
        self.cancelled = True


class EngineThread:
    """A scheduler stepped by a thread of its own, so one thread owns the model: `submit(job)` from any
    thread (the first starts the thread), the thread steps the scheduler while it is busy, `close()` ends
    it. `max_queue` jobs may wait beyond the scheduler's free rows (QueueFull past that; 0: no waiting room,
    a free row still takes a job). The scheduler (dualAR.Scheduler, omnivoice.Scheduler, tests/test_common's
    tiny one) speaks these verbs:
        submit(job)    queue a Job (EngineClosed once closed), from any thread
        step()         one step: admit waiting jobs into free rows, run them, end those that are done
        busy           whether a job runs or waits
        slots, running how many jobs its rows hold, and hold now
        waiting        the deque of jobs waiting for a row
        fail(error)    end the running jobs with `error` (a step broke): the waiting ones run next
        close()        end every job (EngineClosed)
    and is given `thread` when the thread starts (dualAR's then keeps its model's KV caches even while idle:
    work may come at any moment)."""

    def __init__(self, scheduler, max_queue: int = 16):
        self.scheduler, self.max_queue = scheduler, max_queue
        self.thread, self.wake, self.closed = None, threading.Event(), False
        self.lock = threading.Lock()  # a job's room checked and taken at once

    def start(self):
        if self.closed:
            raise EngineClosed("the engine was closed")
        if self.thread is None:
            self.thread = threading.Thread(target=self.loop, name="fishfast-engine", daemon=True)
            self.scheduler.thread = self.thread
            self.thread.start()
        return self

    def submit(self, job, new_request: bool = True):
        """Queue `job` -> `job`, starting the thread if `start()` was not called. new_request=False: the
        next part of a request already taken (a sentence of an omnivoice.Speech) is never refused."""
        self.start()
        with self.lock:
            if new_request:
                self.check_room()
            self.scheduler.submit(job)
        self.wake.set()
        return job

    def wait(self, job):
        """`job`'s codes() once the thread has run it (omnivoice.Scheduler's `wait` steps it instead: an
        omnivoice.Speech runs on either)."""
        return job.codes()

    def queued(self) -> int:
        """Jobs waiting for a row (not those cancelled meanwhile)."""
        return sum(not job.cancelled for job in list(self.scheduler.waiting))

    def check_room(self):
        """QueueFull if a new job could neither take a free row nor wait for one (a server asks before costly
        work)."""
        free = self.scheduler.slots - self.scheduler.running
        if self.queued() >= self.max_queue + free:
            raise QueueFull(f"{self.max_queue} requests are waiting already: try again later")

    def stats(self) -> dict:
        slots, busy = self.scheduler.slots, self.scheduler.running
        return dict(slots=slots, busy=busy, free=slots - busy, queued=self.queued())

    def loop(self):
        scheduler = self.scheduler
        with torch.inference_mode():
            while not self.closed:
                if not scheduler.busy:
                    self.wake.wait(0.1)
                    self.wake.clear()
                    continue
                try:
                    scheduler.step()
                except Exception as e:  # a bug or a device error: fail the jobs in flight, keep serving
                    traceback.print_exc()
                    scheduler.fail(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))

    def close(self):
        """Stop the thread (after its step), then close the scheduler: what is left ends with EngineClosed."""
        self.closed = True
        self.wake.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        self.scheduler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
