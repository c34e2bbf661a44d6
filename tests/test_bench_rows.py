"""`python bench.py rows`: one row through a layer's linears at each precision, each way it can run (torch's
kernel eager, cpu_fast's fused sum compiled), timed on the same weights: the ways of a precision compute
the same product, so that their GB/s compare like for like."""
import torch

import bench

SHAPES = ((32, 64), (64, 32))  # (out, in): small, so that the four fused sums compile in seconds


def test_each_precisions_ways_compute_the_same_product_from_the_bytes_they_are_timed_on():
    torch.manual_seed(0)
    ways = bench.row_ways(SHAPES, layers=2)
    assert sorted(ways) == sorted([("fp32", "torch"), ("fp32", "packed"), ("fp32", "compiled sum"),
                                   ("fp16", "torch"), ("fp16", "compiled sum"), ("bf16", "torch"),
                                   ("bf16", "compiled sum"), ("int8", "torch"), ("int8", "compiled sum"),
                                   ("int4", "torch"), ("int4", "compiled sum")])
    weights = 2 * sum(n * k for n, k in SHAPES)
    bytes_per_weight = dict(fp32=4, fp16=2, bf16=2, int8=1, int4=0.5)
    # how far a way may be from the precision's first: its output's rounding (the int8 and int4 kernels'
    # bf16; the half ones' own dtype; fp32 sums in another order)
    close = dict(fp32=1e-5, fp16=2 ** -10, bf16=2 ** -7, int8=2 ** -7, int4=2 ** -7)
    with torch.inference_mode():
        for precision in bytes_per_weight:
            runs = {way: run() for (p, way), (run, size) in ways.items() if p == precision}
            assert {size for (p, _), (_, size) in ways.items() if p == precision} == {
                weights * bytes_per_weight[precision]}
            first, *others = runs.values()
            assert len(first) == 2 * len(SHAPES)
            for other in others:
                for a, b in zip(first, other, strict=True):
                    a, b = a.float().reshape(-1), b.float().reshape(-1)  # (1, out) or (out,)
                    assert (a - b).abs().max() <= close[precision] * a.abs().max()
