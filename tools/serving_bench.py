"""The serving load run: --load requests arriving at --rate per second into an engine of --slots rows, each
one's audio decoded by the codec in its own thread as its codes come (as app.py serves them) -> frames/s in
all and per request, time to first audio p50 / p95, and one machine-readable `bench load=...` line.

It lives outside the library because it is one measurement, made for the README's serving table, of how
the engine and the codec share one machine under load, not a benchmark a user of dualAR.py needs:
`bench.py s2` keeps the frame step and the time to first audio at batch 1.

    python tools/serving_bench.py --config tiny --load 8 --rate 2 --slots 4 --frames 16
    python tools/serving_bench.py --config s2-mid --load 8 --rate 2 --slots 8 --frames 64   # README's table
"""
import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # dualAR.py and codec.py, from anywhere
import bench  # noqa: E402
import cpu_fast  # noqa: E402
import codec  # noqa: E402
import common  # noqa: E402
import dualAR  # noqa: E402
import quantize  # noqa: E402

TEXT = bench.BENCH_TEXT


def timed_request(engine: common.EngineThread, dac, seed: int, frames: int, delay: float = 0.0) -> dict:
    """Submit one request after `delay` s and decode its audio as it streams -> its figures (seconds since
    submission: first audio samples ready, last frame)."""
    time.sleep(delay)
    model = engine.scheduler.model
    request = engine.submit(dualAR.Request(model, TEXT, seed=seed, max_new_tokens=frames, chunk_frames=8))
    first, made, device = None, 0, engine.scheduler.pos.device
    with torch.inference_mode():
        for samples in codec.decode_stream(dac, (c[None].to(device) for c in request)):
            bench.synchronize(device)
            first = first or time.perf_counter() - request.submitted
            made += samples.size(-1) // codec.hop_length()
    return dict(ttfa=first, frames=made, seconds=time.perf_counter() - request.submitted)


def percentile(values: list, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def load_run(model: dualAR.DualAR, dac, args) -> dict:
    """The engine warmed up (and compiled) by one request, then the timed arrivals -> the figures."""
    prompt = dualAR.build_prompt(model, [], [], TEXT).size(1)
    context = dualAR.cache_bucket(prompt + args.frames + 1, model.config)
    scheduler = dualAR.Scheduler(model, slots=args.slots, context=context)
    with common.EngineThread(scheduler, max_queue=args.load).start() as engine:
        timed_request(engine, dac, 0, args.frames)
        results = [None] * args.load

        def client(i):
            results[i] = timed_request(engine, dac, i, args.frames, delay=i / args.rate)

        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.load)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    each = [r["frames"] / r["seconds"] for r in results]
    ttfas = [1000 * r["ttfa"] for r in results]
    return dict(requests=len(results), frames_per_s=sum(r["frames"] for r in results) / wall,
                request_min=min(each), request_max=max(each), ttfa_p50_ms=percentile(ttfas, 0.5),
                ttfa_p95_ms=percentile(ttfas, 0.95))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="fishfast serving load run (the README's serving table).")
    ap.add_argument("--checkpoint", help="S2-Pro checkpoint dir (default: random weights of --config)")
    ap.add_argument("--config", choices=list(bench.BENCH_CONFIGS), default="s2-mid",
                    help="random-weight model size (default s2-mid, the README's table)")
    dualAR.add_model_args(ap)
    ap.add_argument("--frames", type=int, default=64, help="frames each request makes (default 64)")
    ap.add_argument("--load", type=int, default=8, help="requests in the run (default 8)")
    ap.add_argument("--rate", type=float, default=2.0, help="requests arriving per second (default 2)")
    ap.add_argument("--slots", type=int, default=8, help="engine rows (default 8)")
    args = ap.parse_args(argv)
    if min(args.frames - 1, args.load, args.slots) < 1 or not args.rate > 0:
        ap.error("--frames must be >= 2, --load and --slots >= 1, --rate > 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype, compiled = dualAR.model_settings(args)
    quantize.check_s2(args.quant, device, dtype)
    if args.checkpoint:
        model = dualAR.load(args.checkpoint, device, dtype, args.quant, compiled, args.compile_cache,
                            args.fast_prefill)
    else:
        model = dualAR.optimize(bench.random_model(args.config, device, dtype), args.quant, compiled,
                                args.compile_cache, args.fast_prefill)
    if not args.no_tune:
        cpu_fast.tune(model, rows=args.slots)  # as the server does
    got = load_run(model, bench.bench_codec(args, device), args)
    print(f"load: {args.load} requests at {args.rate:g}/s into {args.slots} slots, {args.frames} frames each:"
          f" {got['frames_per_s']:.1f} frames/s in all, per request {got['request_min']:.1f}.."
          f"{got['request_max']:.1f} frames/s (real time: 21.5), time to first audio p50"
          f" {got['ttfa_p50_ms']:.0f} ms, p95 {got['ttfa_p95_ms']:.0f} ms")
    print(f"bench load={args.load} rate={args.rate:g} slots={args.slots}"
          f" frames_per_s={got['frames_per_s']:.1f} request_frames_per_s_min={got['request_min']:.1f}"
          f" ttfa_p50_ms={got['ttfa_p50_ms']:.0f}"
          f" ttfa_p95_ms={got['ttfa_p95_ms']:.0f}")
    return got


if __name__ == "__main__":
    common.cli(main)
