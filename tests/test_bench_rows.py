"""`python bench.py rows`: one row through a layer's linears at each precision, each way it can run (torch's
kernel eager, cpu_fast's fused sum compiled), timed on the same weights: the ways of a precision compute
the same product, so that their GB/s compare like for like."""
import argparse

import torch

import bench
import cpu_fast

SHAPES = ((32, 64), (64, 32))  # (out, in): small, so that the four fused sums compile in seconds


def test_each_precisions_ways_compute_the_same_product_from_the_bytes_they_are_timed_on():
    torch.manual_seed(0)
    ways = bench.row_ways(SHAPES, layers=2, repeats=2)
    assert sorted(ways) == sorted([("fp32", "torch"), ("fp32", "packed"), ("fp32", "compiled sum"),
                                   ("fp16", "torch"), ("fp16", "compiled sum"), ("bf16", "torch"),
                                   ("bf16", "compiled sum"), ("int8", "torch"), ("int8", "compiled sum"),
                                   ("int4", "torch"), ("int4", "compiled sum")])
    weights = 2 * 2 * sum(n * k for n, k in SHAPES)  # 2 layers, the whole pass run twice
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
            assert len(first) == 2 * 2 * len(SHAPES)
            passes = first[:2 * len(SHAPES)], first[2 * len(SHAPES):]  # the same weights, a row of its own
            assert all(not torch.equal(a, b) for a, b in zip(*passes, strict=True))
            for other in others:
                for a, b in zip(first, other, strict=True):
                    a, b = a.float().reshape(-1), b.float().reshape(-1)  # (1, out) or (out,)
                    assert (a - b).abs().max() <= close[precision] * a.abs().max()


def test_the_table_sets_each_ways_rate_from_memory_beside_its_rate_from_cache(monkeypatch, capsys):
    """Each way is timed on PROBE_SHAPES (`--layers` layers: from memory) and on one layer with a quarter of
    their outputs read twice as many times (from cache): % bw is the memory median's share of the copy
    bandwidth, "of cache" the memory median over the cache median (near 1: the way's loop bounds it)."""
    built, clock = [], [0.0]
    rates = {"memory": {"fp32": 20.0, "int4": 9.0}, "cache": {"fp32": 80.0, "int4": 10.0}}  # GB/s

    def row_ways(shapes, layers, repeats=1):
        built.append((shapes, layers, repeats))
        where = "memory" if repeats == 1 else "cache"
        size = repeats * layers * sum(n * k for n, k in shapes)

        def run(rate):
            clock[0] += size / rate / 1e9
        return {(p, "compiled sum"): (lambda rate=rate: run(rate), size) for p, rate in rates[where].items()}

    monkeypatch.setattr(bench, "row_ways", row_ways)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 25.0)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    bench.rows_speed(argparse.Namespace(layers=3, rounds=3, threads=None))  # `bench.py rows --layers 3`
    quarter = tuple((n // 4, k) for n, k in cpu_fast.PROBE_SHAPES)
    assert built == [(cpu_fast.PROBE_SHAPES, 3, 1), (quarter, 1, 6)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["precision", "way", "MB", "GB/s", "min", "median", "max", "%", "bw", "in",
                                "cache", "of", "cache"]
    mb = 3 * sum(n * k for n, k in cpu_fast.PROBE_SHAPES) / 1e6
    assert lines[2].split() == ["fp32", "compiled", "sum", f"{mb:.0f}", "20.0", "20.0", "20.0", "80", "80.0",
                                "0.25"]
    assert lines[3].split() == ["int4", "compiled", "sum", f"{mb:.0f}", "9.0", "9.0", "9.0", "36", "10.0",
                                "0.90"]
