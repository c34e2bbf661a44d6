"""Weight quantization of fishfast's models, in one file (as gpt-fast's quantize.py): what each scheme stores
and computes, which layers of each model take which bits, and what this CPU's units allow. Applied to a
loaded model, or by a model's `load` as it reads the weights (S2-Pro's blocks one at a time on CPU):

    model = quantize.quantize(dualAR.load("s2-pro"), "int4wo")  # or dualAR.load("s2-pro", quant="int4wo")
    ov = quantize.quantize(omnivoice.load(), "int8wo")          # or omnivoice.load(quant="int8wo")

A model file imports this only where a scheme is asked for: a model copied with common.py alone loads and
runs unquantized. (Faster kernels for the same arithmetic, timed per machine, are cpu_fast.py's.)

Sections: this CPU's units, CPU kernels (QuantLinear, W8A8Linear: torch's own kernels), GPU (torchao's
schemes), S2-Pro, OmniVoice, the entry point.
"""
import functools
import importlib
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from common import CAP_VARIABLES, UserError


# ----------------------------------------------------------------------------- this CPU's units
AVX2_OR_LESS = {"DEFAULT", "SSE41", "SSE4_2", "AVX", "AVX2"}


def usable_cpu_flags(flags: dict, env) -> dict:
    """A CPU's flags as the libraries may use them: where `env` caps any of them (CAP_VARIABLES) at AVX2 or
    below, the AVX-512, AMX and VNNI units count as absent (a library so capped sums int8 products without
    VNNI, in saturating 16 bits: w8a8 lost its argmax share on an AMX Xeon limited to AVX2)."""
    capped = any(env.get(v, "").upper() in AVX2_OR_LESS for v in CAP_VARIABLES)
    return {k: bool(v) and not (capped and k.startswith(("avx512", "amx", "avx_vnni", "avx_ne")))
            for k, v in flags.items()}


# what this CPU has, as the libraries may use it: {"avx2": True, "avx512_vnni": ...}
CPU_FLAGS = usable_cpu_flags(torch._C._cpu._get_cpu_capability(), os.environ)
# Whether this CPU has int8 dot products (VNNI, AMX) for torch._int_mm: without them (AVX2 only) it ran
# OmniVoice's layers 20x slower than fp32 (docs/omnivoice.md). A constant: dynamo reads it so.
INT8_UNITS = any(CPU_FLAGS.get(unit) for unit in ("avx512_vnni", "avx_vnni", "amx_int8"))
# Whether this CPU has matrix instructions for fp16 / bf16 (oneDNN's fast half-precision GEMMs): without them
# torch's many-row half matmuls are several times slower than fp32 (AVX2 CPUs). Constants: dynamo reads them
# so.
HALF_UNITS = {torch.bfloat16: CPU_FLAGS.get("avx512_bf16") or CPU_FLAGS.get("amx_bf16") or False,
              torch.float16: CPU_FLAGS.get("avx512_fp16") or CPU_FLAGS.get("amx_fp16") or False}
EXACT_TERMS = 2 ** 24 // 127 ** 2  # 1040 int8 x int8 products: each partial sum an exact fp32 integer


def runs_in_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether many-row linears of `dtype` on `device` are better run in fp32: half ones on a CPU without
    half matrix units (QuantLinear's converted weights; cpu_fast.HalfLinear)."""
    return device.type == "cpu" and dtype in HALF_UNITS and not HALF_UNITS[dtype]


# ----------------------------------------------------------------------------- CPU kernels
INT4_GROUP = 128  # int4 inputs sharing one scale and zero
# from here on one matmul of the converted int8 weight beats torch's int8 kernel, which is written for a few
# rows (docs/speed.md)
INT8_MATMUL_ROWS = 128
# torch's CPU kernels read whole vectors (16 lanes on AVX-512, 8 on AVX2) with no tail: the int8 one's inputs
# and the int4 one's outputs must come in whole 16s, or they crash or return garbage (torch 2.13)
KERNEL_LANES = 16
# how a quantized model's graphs compile on CPU: inductor's C++ may contract a * b + c into one fused
# multiply-add (its default: off), a rounding fewer; the one-row int4 sum (cpu_fast.int4_one_row), bound by
# the instructions a weight takes on AVX2, runs 1.25x faster so, s2-mid-b's frame step 1.2x (docs/speed.md)
CPU_COMPILE_OPTIONS = {"cpp.enable_floating_point_contract_flag": "fast"}


def int8_rows(t: Tensor) -> tuple:
    """Each row of t rounded to int8 with a scale of its own (symmetric: its largest |value| -> 127) ->
    (int8 values, scales (..., 1)); a row of zeros stays zeros."""
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(t / scale).to(torch.int8), scale


def int4_packed(q: Tensor) -> Tensor:
    """int4 values q (N, K), 0-15 -> (N, K/2) bytes as torch's CPU int4 kernel reads them (the reverse:
    `int4_values`)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)


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
            weight = int4_packed(q.view(w.shape))  # (out, in / 2)
            scale = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1)  # (in / group, out, 2)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scales = nn.Parameter(scale.to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.bits == 8 and (x2.shape[0] >= self.matmul_rows or not self.kernel):
            w = self.weight.to(torch.float32 if runs_in_fp32(torch.bfloat16, x.device) else torch.bfloat16)
            y = F.linear(x2.to(w.dtype), w) * self.scales  # one pass over the weight
        elif self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group, self.scales)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


INT4_BLOCK = 32  # the int4 kernel's packing interleaves the output rows of blocks of this many


def int4_values(packed: Tensor) -> Tensor:
    """The int4 values (N, K) uint8, 0-15, that `int4_packed` packed into (N, K/2) bytes, for N a whole
    number of INT4_BLOCKs: each block in lines of 8 inputs x 16 bytes, its row j in the low nibbles and j +
    16 in the high ones (torch 2.13's layout) -> None where torch packs otherwise (its first block, packed
    again, differs) or N is not such a number."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if n % INT4_BLOCK or k % 8:
        return None
    lines = packed.view(n // INT4_BLOCK, k // 8, 8, INT4_BLOCK // 2)  # (block, k / 8, k % 8, row)
    q = torch.cat([lines & 15, lines >> 4], -1).permute(0, 3, 1, 2).reshape(n, k)
    block = int4_packed(q[:INT4_BLOCK])
    return q if torch.equal(block, packed[:INT4_BLOCK]) else None


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
    whole sequences; rounding the activations too costs more argmax agreement than the weight-only schemes
    do (docs/omnivoice.md has both)."""

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


def replaced(module: nn.Module, make) -> nn.Module:
    """module, with each module inside it for which make(m) gives another put in m's place in its parent
    (setattr: print(model) names what runs) -> module, or what make gave for module itself."""
    new = make(module)
    if new is not None:
        return new
    for name, child in list(module.named_children()):
        setattr(module, name, replaced(child, make))
    return module


def swap_linears(module: nn.Module, make):
    """Every nn.Linear inside module -> make(linear): e.g. partial(QuantLinear, bits=4), W8A8Linear."""
    replaced(module, lambda m: make(m) if isinstance(m, nn.Linear) else None)


# ----------------------------------------------------------------------------- GPU
# GPU weight quantization is torchao's: its tile-packed int4 (tinygemm) needs Ampere, fp8 dynamic per-row and
# nvfp4 their tensor-core kernels, and these three bf16 weights
TORCHAO_CAPABILITY = {"int4wo": (8, 0), "fp8": (8, 9), "nvfp4": (10, 0)}


def check_torchao(scheme: str, device: torch.device, dtype, capability: tuple = None):
    """What torchao's `scheme` needs (torchao itself, the GPU, bf16), said before any weight is read.
    capability: the CUDA device's (major, minor), by default the device's own."""
    try:
        importlib.import_module("torchao.quantization")  # only whether it imports
    except Exception as e:  # missing, or built for another torch
        raise UserError(f"--quant {scheme} needs torchao, which does not import here: {type(e).__name__}:"
                        f" {(str(e).splitlines() or [''])[0]} (pip install torchao==0.18.0)") from None
    cuda, need = device.type == "cuda", TORCHAO_CAPABILITY.get(scheme)
    if need and cuda and capability is None:
        capability = torch.cuda.get_device_capability(device)
    if need and not (cuda and capability >= need):
        have = f"compute capability {capability}" if cuda else device.type
        raise UserError(f"--quant {scheme} needs an NVIDIA GPU of compute capability >= {need[0]}.{need[1]}"
                        f" (this device: {have})")
    if need and dtype != torch.bfloat16:
        raise UserError(f"--quant {scheme} needs bf16 weights (torchao's kernels): add --dtype bf16")


def torchao_config(scheme: str):
    """A scheme's name (int8wo, int4wo, fp8, nvfp4) -> torchao's config for `quantize_`."""
    import torchao.quantization as tq
    if scheme == "int8wo":
        return tq.Int8WeightOnlyConfig()
    if scheme == "int4wo":
        return tq.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    if scheme == "fp8":
        return tq.Float8DynamicActivationFloat8WeightConfig(granularity=tq.PerRow())
    from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig
    return NVFP4DynamicActivationNVFP4WeightConfig()


# ----------------------------------------------------------------------------- S2-Pro
S2_SCHEMES = ("none", "int8wo", "int4wo", "fp8", "nvfp4")
CPU_BITS = {"int8wo": 8, "int4wo": 4}  # on CPU: torch's own kernels (QuantLinear), any model dtype


def check_s2(scheme, device: torch.device, dtype, capability: tuple = None):
    """What each S2-Pro scheme needs, said before any weight is read (torchao's: `check_torchao`)."""
    if scheme is None or scheme == "none":
        return
    if scheme not in S2_SCHEMES:
        raise UserError(f"quantization {scheme!r} is not one of {', '.join(S2_SCHEMES)}")
    if not (device.type == "cpu" and scheme in CPU_BITS):
        check_torchao(scheme, device, dtype, capability)


def block_scheme(scheme: str, fast: bool, cpu: bool) -> str:
    """Group-wise int4 (tinygemm) breaks the fast transformer on GPU (reported): it gets int8 there. On CPU
    int4 there costs about the logit error and codes of int4 in the slow transformer alone, and makes the
    frame's linear layers faster than int8 there (docs/speed.md)."""
    return "int8wo" if fast and scheme == "int4wo" and not cpu else scheme


def quantize_s2(model: nn.Module, scheme: str):
    """dualAR's DualAR: the linear layers of both transformers, on CPU int8wo/int4wo as QuantLinear (and
    the fast head in int8), else through torchao. The embeddings and the slow head stay as they are."""
    check_s2(scheme, model.embeddings.weight.device, model.embeddings.weight.dtype)
    if model.embeddings.weight.device.type == "cpu" and scheme in CPU_BITS:
        for fast, layers in ((False, model.layers), (True, model.fast_layers)):
            for block in layers:  # block by block: one layer's fp32 copy at a time
                swap_linears(block, s2_linear(scheme, fast))
        quantize_fast_head(model)
    else:
        from torchao.quantization import quantize_
        quantize_(model.layers, torchao_config(scheme))
        quantize_(model.fast_layers, torchao_config(block_scheme(scheme, True, cpu=False)))
    model.quant = scheme


def s2_linear(scheme: str, fast: bool):
    """What swap_linears makes of each linear layer of a block on CPU: a QuantLinear of the block's bits."""
    return functools.partial(QuantLinear, bits=CPU_BITS[block_scheme(scheme, fast, cpu=True)])


def quantize_fast_head(model: nn.Module):
    """CPU: the fast head in int8, one scale per row. It is read once per codebook, 9 times a frame: in fp32
    it was a third of an int4 frame's weight bytes (docs/speed.md)."""
    model.fast_output = QuantLinear(model.fast_output, 8)


def s2_blocks_as_read(scheme: str, device: torch.device):
    """What dualAR's loader calls on each transformer block as soon as its last tensor is read (block,
    fast: whether it is the fast transformer's), so that the unquantized model never exists whole: CPU
    int8wo/int4wo's QuantLinears; None for any other scheme or device (the whole model, after loading)."""
    if torch.device(device).type != "cpu" or scheme not in CPU_BITS:
        return None
    return lambda block, fast: swap_linears(block, s2_linear(scheme, fast))


# ----------------------------------------------------------------------------- OmniVoice
OMNIVOICE_SCHEMES = ("none", "int8wo", "int4wo", "w8a8")
OMNIVOICE_LINEARS = {"int8wo": functools.partial(QuantLinear, bits=8, matmul_rows=1),
                     "int4wo": functools.partial(QuantLinear, bits=4, matmul_rows=1),
                     "w8a8": W8A8Linear}


def check_omnivoice(scheme, device: torch.device):
    if scheme not in (None, *OMNIVOICE_SCHEMES):
        raise UserError(f"quant {scheme!r}: use one of {', '.join(OMNIVOICE_SCHEMES)}")
    if scheme in OMNIVOICE_LINEARS and torch.device(device).type != "cpu":
        raise UserError(f"{scheme} is built for CPU (torch's kernels); on a GPU use dtype bf16")


def quantize_omnivoice(model: nn.Module, scheme) -> nn.Module:
    """omnivoice's OmniVoice. int8wo: the transformer's linear layers hold int8 weights (a scale per output
    row), converted to bf16 (fp32 on a CPU without bf16 matrix units) for each whole-sequence matmul
    (compute-bound: torch's int8 kernels are written for a few rows); int4wo: int4 weights (a scale and zero
    per 128 inputs) through torch's int4 kernel, bf16 activations; w8a8: int8 weights and each row of their
    inputs rounded to int8, int8 products (W8A8Linear), but for the MLP's down projection (as int8wo).
    Embeddings and heads stay in the model's dtype."""
    check_omnivoice(scheme, model.audio_heads.weight.device)
    if scheme in OMNIVOICE_LINEARS:
        for layer in model.layers:
            if scheme == "w8a8":  # SwiGLU's products have the outliers a row's int8 clips worst (SmoothQuant)
                layer.down_proj = OMNIVOICE_LINEARS["int8wo"](layer.down_proj)
            swap_linears(layer, OMNIVOICE_LINEARS[scheme])
    return model


# ----------------------------------------------------------------------------- the entry point
def quantize(model: nn.Module, scheme) -> nn.Module:
    """A loaded model (dualAR's DualAR, omnivoice's OmniVoice) with `scheme`'s weights, in place -> the
    model (None or "none": as it is)."""
    kinds = {"DualAR": quantize_s2, "OmniVoice": quantize_omnivoice}
    kind = type(model).__name__
    if kind not in kinds:
        raise TypeError(f"quantize takes a DualAR or an OmniVoice, not {kind}")
    if scheme in (None, "none"):
        return model
    kinds[kind](model, scheme)
    return model
