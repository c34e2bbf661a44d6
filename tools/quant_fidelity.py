"""Is int8wo/int4wo's logit error on random weights a defect or the weights? (docs/speed.md, Quantized
fidelity: the table there is this script's output, 1 thread, about 13 min.)

    python tools/quant_fidelity.py [--weights bench norms1 tailed outliers] [--frames 64]

For the same s2-mid-b random weights, the quantized model's logits against fp32 computed
  ours      : quantize.quantize (quantize.QuantLinear, torch's int8/int4 kernels, bf16 activations)
  deq       : the same bits (our q, our bf16 scales/zeros) dequantized to fp32, F.linear in fp32
  deq32     : our q, fp32 scales/zeros (what bf16 scale rounding costs)
  ggml      : Q8_0 / Q4_0 (blocks of 32), fp32 matmul (fast head Q8_0 under Q4_0, as s2.cpp's file)
  bf16act   : fp32 weights, linear inputs and outputs rounded to bf16 (the activation part of ours)
  noise     : fp32 weights + gaussian noise of deq's per-weight relative error (the model's sensitivity)
  ours-head32 / headonly : ours with the fast head left fp32 / only the fast head in int8 (int8wo rows only)
"""
import argparse
import copy
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

torch.set_num_threads(1)
import bench  # noqa: E402
import quantize  # noqa: E402
from quantize import INT4_GROUP, KERNEL_LANES, int8_rows, swap_linears  # noqa: E402

CPU = torch.device("cpu")


# ------------------------------------------------------------------ weight-only schemes in plain fp32
def ours_bits(w, bits, scale_dtype=torch.bfloat16):
    """quantize.QuantLinear's q and scales (same choices), dequantized in fp32."""
    out_f, in_f = w.shape
    group = math.gcd(INT4_GROUP, in_f)
    bits = 8 if group < 32 or out_f % KERNEL_LANES else bits
    if bits == 8:
        q, scale = int8_rows(w)
        return q.float() * scale.to(scale_dtype).float()
    g = w.view(out_f, -1, group)
    low, scale = g.amin(-1), (g.amax(-1) - g.amin(-1)).clamp(min=1e-12) / 15
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15)
    s, z = scale.to(scale_dtype).float(), (low + 8 * scale).to(scale_dtype).float()
    return ((q - 8) * s[..., None] + z[..., None]).view(w.shape)


def q8_0(w):
    b = w.reshape(-1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    d = d.half().float()  # ggml stores d in fp16
    q = torch.where(d > 0, torch.round(b / d.clamp(min=1e-30)), 0).clamp(-127, 127)
    return (q * d).view(w.shape)


def q4_0(w):
    b = w.reshape(-1, 32)
    idx = b.abs().argmax(-1, keepdim=True)
    mx = b.gather(-1, idx)  # the max by absolute value, signed
    d = (mx / -8).half().float()
    q = torch.where(d != 0, torch.round(b / torch.where(d != 0, d, 1) + 8), 8).clamp(0, 15)
    return ((q - 8) * d).view(w.shape)


def fixed_linear(lin, deq):
    new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    new.weight = nn.Parameter(deq(lin.weight.detach().float()), requires_grad=False)
    new.bias = lin.bias
    return new


class Bf16Act(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x.bfloat16().float()).bfloat16().float()


def scheme_funcs(scheme):
    """(slow-block deq, fast-block deq, fast-head deq) for `deq`-like variants, per scheme (CPU choices)."""
    bits = {"int8wo": 8, "int4wo": 4}[scheme]
    fast_bits = quantize.CPU_BITS[quantize.block_scheme(scheme, True, cpu=True)]
    return bits, fast_bits


def variant(model, scheme, kind, rel=None):
    m = copy.deepcopy(model)
    if kind == "ours":
        quantize.quantize(m, scheme)
        return m
    if kind == "ours-head32":  # ours, the fast head left in fp32
        quantize.quantize(m, scheme)
        m.fast_output = copy.deepcopy(model.fast_output)
        return m
    if kind == "headonly":  # only the fast head in int8 (QuantLinear), everything else fp32
        quantize.quantize_fast_head(m)
        return m
    bits, fast_bits = scheme_funcs(scheme)
    if kind in ("deq", "deq32"):
        sd = torch.bfloat16 if kind == "deq" else torch.float32
        slow = lambda w: ours_bits(w, bits, sd)  # noqa: E731
        fast = lambda w: ours_bits(w, fast_bits, sd)  # noqa: E731
        head = lambda w: ours_bits(w, 8, sd)  # noqa: E731
    elif kind == "ggml":
        slow = q8_0 if bits == 8 else q4_0
        fast = q8_0 if fast_bits == 8 else q4_0
        head = q8_0
    elif kind == "noise":
        g = torch.Generator().manual_seed(1)
        def noisy(w):
            return w + torch.randn(w.shape, generator=g) * rel * w.pow(2).mean().sqrt()
        slow = fast = head = noisy
    if kind == "bf16act":
        for layers in (m.layers, m.fast_layers):
            swap_linears(layers, Bf16Act)
        m.fast_output = Bf16Act(m.fast_output)
        return m
    for layers, f in ((m.layers, slow), (m.fast_layers, fast)):
        swap_linears(layers, lambda lin, f=f: fixed_linear(lin, f))
    m.fast_output = fixed_linear(m.fast_output, head)
    return m


def weight_errors(model, scheme):
    """Per-weight ||W - deq(W)|| / ||W|| over all quantized linears (norm-weighted): ours vs ggml."""
    bits, fast_bits = scheme_funcs(scheme)
    num = {"ours": 0.0, "ours_fp32scale": 0.0, "ggml": 0.0}
    den = 0.0
    for layers, b in ((model.layers, bits), (model.fast_layers, fast_bits), ([model.fast_output], 8)):
        for mod in layers.modules() if isinstance(layers, nn.Module) else layers:
            if isinstance(mod, nn.Linear):
                w = mod.weight.detach().float()
                num["ours"] += (w - ours_bits(w, b)).pow(2).sum().item()
                num["ours_fp32scale"] += (w - ours_bits(w, b, torch.float32)).pow(2).sum().item()
                num["ggml"] += (w - (q8_0(w) if b == 8 else q4_0(w))).pow(2).sum().item()
                den += w.pow(2).sum().item()
    return {k: math.sqrt(v / den) for k, v in num.items()}


# ------------------------------------------------------------------ weights
def reshaped(model, tails=True, outliers=False, norms=True, seed=1):
    """The same model with weights shaped more like a trained model's, torch.rand only:
    norms: RMSNorm gains around 1 (1 + (rand - 0.5) * 0.4) instead of bench's (rand - 0.5) * 0.1;
    tails: each linear's weights sign * u^3 (kurtosis ~5.4 vs uniform's 1.8) with per-row scales over e^(+-1),
    rms 0.5 / sqrt(in); outliers: also 1 input column in 256 of each linear x8. Embeddings stay as drawn."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and norms:
                p.copy_(1 + (torch.rand(p.shape, generator=g) - 0.5) * 0.4)
            elif p.dim() == 2 and "embeddings" not in name and tails:
                u = torch.rand(p.shape, generator=g) * 2 - 1
                w = u.sign() * u.abs() ** 3
                w = w * torch.exp((torch.rand(p.shape[0], 1, generator=g) - 0.5) * 2)
                if outliers:
                    cols = torch.randperm(p.shape[1], generator=g)[: max(1, p.shape[1] // 256)]
                    w[:, cols] *= 8
                p.copy_(w / w.pow(2).mean().sqrt() * (0.5 / math.sqrt(p.shape[1])))
    return m


WEIGHTS = {
    "bench": ("bench.random_model (uniform (rand-0.5)*0.1, norms too)", lambda m: m),
    "norms1": ("bench's linears, RMSNorm gains ~1", lambda m: reshaped(m, tails=False)),
    "tailed": ("heavy-tailed linears (sign*u^3, row scales), gains ~1", lambda m: reshaped(m)),
    "outliers": ("heavy-tailed + outlier input columns x8, gains ~1", lambda m: reshaped(m, outliers=True)),
}


# ------------------------------------------------------------------ measures
def measure(ref, got):
    out = []
    for r, g in zip(ref, got):
        err = ((g - r).abs().max() / r.abs().max()).item()
        same = (g.argmax(-1) == r.argmax(-1)).float().mean().item()
        out += [100 * err, 100 * same]
    return out


def margins(ref):
    """fp32 logits' top-2 margin as % of the largest |logit|, per row (slow: 1 row, fast: 10)."""
    res = []
    for r in ref:
        top = r.topk(2, -1).values
        res.append((100 * (top[:, 0] - top[:, 1]) / r.abs().max()).tolist())
    return res


def run(model, label, frames):
    ref = bench.head_logits(model)
    codes = bench.seeded_frames(model, frames) if frames else None
    ms, mf = margins(ref)
    print(f"\n== {label} weights: fp32 max |logit| slow {ref[0].abs().max():.4g}"
          f" fast {ref[1].abs().max():.4g};"
          f" top-2 margin % of max |logit|: slow {ms[0]:.3f}, fast rows median"
          f" {sorted(mf)[len(mf) // 2]:.3f} min {min(mf):.3f}")
    print(f"{'scheme':7} {'way':11} {'slow err%':>9} {'slow arg%':>9} {'fast err%':>9} {'fast arg%':>9}"
          f" {'frames%':>7} {'fast rows w/ margin<err':>23}")
    for scheme in ("int8wo", "int4wo"):
        werr = weight_errors(model, scheme)
        print(f"{scheme}: per-weight rel error ours {100 * werr['ours']:.3f} %, ours fp32 scales"
              f" {100 * werr['ours_fp32scale']:.3f} %, ggml {'Q8_0' if scheme == 'int8wo' else 'Q4_0'}"
              f" {100 * werr['ggml']:.3f} %")
        for kind in ("ours", "deq", "deq32", "ggml", "bf16act", "noise", "ours-head32", "headonly"):
            if kind in ("bf16act", "headonly") and scheme == "int4wo":
                continue
            m = variant(model, scheme, kind, rel=werr["ours"])
            got = bench.head_logits(m)
            e = measure(ref, got)
            same = ((bench.seeded_frames(m, frames, codes) == codes).all(-1).float().mean().item() * 100
                    if frames else float("nan"))
            near = sum(x < e[2] for x in mf)
            name = "-" if kind in ("bf16act", "headonly") else scheme
            print(f"{name:7} {kind:11} {e[0]:9.2f} {e[1]:9.0f} {e[2]:9.2f} {e[3]:9.0f} {same:7.0f}"
                  f" {near:>20}/{len(mf)}")
            del m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    ap.add_argument("--frames", type=int, default=64)
    args = ap.parse_args()
    model = bench.random_model("s2-mid-b", CPU, torch.float32)
    for w in args.weights:
        label, make = WEIGHTS[w]
        run(make(model), label, args.frames)


if __name__ == "__main__":
    main()
