"""How far a trained or merged float32 result may move on another kind of CPU: the derivations behind the
trainers' tolerances (docs/tests.md, "Results on every CPU kind").

Another CPU kind sums a matrix product in another order (other vector widths, other blocking, FMA or
not), so a gradient comes out a few units in the last place (ULPs) of its tensor's largest element away
from the goldens' (measured: docs/tests.md). What that becomes is arithmetic, computed here in float64 along
our own run:
- a product W + s (B @ A) (a LoRA merge): the product's rounding in any order, then the scaling's and the
  sum's (`merge_bound`);
- AdamW's weights and moments after T steps, to first order in each step's gradient error
  (`adamw_bounds`): an element whose gradient is near eps moves by up to lr x error / eps a step, one whose
  gradient is large hardly at all (Adam's update does not depend on its gradient's scale), plus one ULP
  of each result per step for its own rounding.
"""
import torch

U = 2.0 ** -24  # float32's unit roundoff


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The float32 spacing at |x|, elementwise, in float64."""
    a = x.abs().float()
    return (torch.nextafter(a, torch.tensor(float("inf"))) - a).double()


def assert_within(got: torch.Tensor, want: torch.Tensor, bound, what: str):
    """Every element of got within its bound (a tensor or a number) of want, in float64."""
    over = (got.double() - want.double()).abs() - bound
    assert got.shape == want.shape and over.max() <= 0, (what, f"{over.max().item():.3g} over its bound")


def matmul_rounding(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|fl(a @ b) - a @ b| at most, whatever the order of the sums (gamma_k |a| @ |b|, k the inner size)."""
    k = a.shape[-1]
    return k * U / (1 - k * U) * (a.double().abs() @ b.double().abs())


def uniform_bound(t: torch.Tensor) -> torch.Tensor:
    """How far a draw of torch's uniform_(-b, b) may be from another CPU's (the same random bits): it rounds
    from + u (to - from) once (FMA) or twice, whose terms are as large as b -> one ULP of b (as a tensor)."""
    return ulp(t.abs().max())


def merge_bound(w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float) -> torch.Tensor:
    """|fl(w + scaling fl(b @ a)) - (w + scaling b @ a)| at most, on any CPU: two CPUs' merges of the same
    adapter differ by twice this at most."""
    delta = scaling * (b.double() @ a.double())
    return scaling * matmul_rounding(b, a) + ulp(delta) + ulp(w.double() + delta)


def adamw_bounds(weight: torch.Tensor, grads: list, lrs: list, grad_error: list, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, start_error=0.0) -> dict:
    """How far torch's AdamW (single tensor, as upstream's) moves one parameter's weight (initially `weight`)
    and moments after the steps of `grads` (each step's gradient as the optimizer saw it, clipped) at
    learning rates `lrs` when step s's gradient moves by grad_error[s] elementwise -> {"weight", "exp_avg",
    "exp_avg_sq"}: elementwise bounds (float64), first order in the errors, plus one ULP per step of the
    largest value the result took on the way, for its rounding (a weight that ends near 0 after updates that
    cancel keeps the rounding of the larger values before). start_error: how far the initial weight may be
    (weight decay only shrinks it).

    Per step t: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; d = sqrt(v / c2) + eps; r = m / c1 / d;
    p = p (1 - lr wd) - lr r (c1, c2 the bias corrections), so dp_T/dg_s = -sum over t >= s of
    lr_t (later decays) dr_t/dg_s, with dr_t/dg_s = dm_t/dg_s / (c1 d) - m / c1 dd_t/dg_s / d^2."""
    b1, b2 = betas
    g, err, steps = [x.double() for x in grads], grad_error, len(grads)
    p, m, v = weight.double(), torch.zeros_like(g[0]), torch.zeros_like(g[0])
    dp = [torch.zeros_like(x) for x in g]  # dp_T / dg_s, summed over t as the steps go
    moved, p_peak, m_peak, v_peak = 0, p.abs(), torch.zeros_like(m), torch.zeros_like(v)
    for t in range(1, steps + 1):
        m = b1 * m + (1 - b1) * g[t - 1]
        v = b2 * v + (1 - b2) * g[t - 1] ** 2
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        d = (v / c2).sqrt() + eps
        lr = lrs[t - 1]
        p = p * (1 - lr * weight_decay) - lr * m / c1 / d
        p_peak, m_peak, v_peak = p_peak.maximum(p.abs()), m_peak.maximum(m.abs()), v_peak.maximum(v)
        for s in range(1, t + 1):
            dm = (1 - b1) * b1 ** (t - s)
            dv = 2 * (1 - b2) * b2 ** (t - s) * g[s - 1]
            dd = torch.where(v > 0, dv / (2 * (c2 * v).sqrt().clamp_min(1e-300)), 0.0)
            dr = dm / (c1 * d) - m / c1 * dd / d ** 2
            dp[s - 1] = dp[s - 1] * (1 - lr * weight_decay) - lr * dr  # later decays scale earlier terms
        moved += lr > 0
    weight = sum(j.abs() * e for j, e in zip(dp, err)) + moved * ulp(p_peak) + start_error
    later = range(1, steps + 1)
    exp_avg = sum((1 - b1) * b1 ** (steps - s) * err[s - 1] for s in later)
    exp_avg_sq = sum(2 * (1 - b2) * b2 ** (steps - s) * g[s - 1].abs() * err[s - 1] for s in later)
    return {"weight": weight, "exp_avg": exp_avg + steps * ulp(m_peak),
            "exp_avg_sq": exp_avg_sq + steps * ulp(v_peak)}
