"""Two one-off measurements behind figures in the README (Speed), kept outside the library because no
user needs them to run or tune fishfast:
- the matmul ceiling: frames/s if a frame step were nothing but its weight matmuls (eager F.linear on
  the same weights), to see how much of a frame is matmul;
- decode attention in one layer: SDPA with a mask over the whole cache (eager) against flex-decoding
  (compiled), caches of 4096 and 32768 positions.

    python tools/frame_ceilings.py --config s2-mid --batch 1,4
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402  (the repository root, where this tool's models come from)
import common  # noqa: E402
from bench import synchronize  # noqa: E402
from quantize import QuantLinear  # noqa: E402
from dualAR import DualAR, decode_attention  # noqa: E402


@torch.inference_mode()
def matmul_ceiling(model: DualAR, batch: int, repeats: int = 8) -> float:
    """Frame steps per second if a step were nothing but its weight matmuls (eager, the same weights,
    `batch` rows): what torch's own F.linear can read."""
    device, n = model.embeddings.weight.device, model.config["num_codebooks"]
    slow = [m for m in model.layers.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    fast = [m for m in model.fast_layers.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    start, stop = model.sampling_rows
    head = model.embeddings.weight[start:stop]
    calls = slow + fast * n + [model.fast_output] * (n - 1)
    inputs = {m.in_features: torch.rand(batch, m.in_features, device=device, dtype=head.dtype)
              for m in calls}
    for m in calls:  # warm-up
        m(inputs[m.in_features])
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for m in calls:
            m(inputs[m.in_features])
        F.linear(inputs[head.size(1)], head)
    synchronize(device)
    return repeats / (time.perf_counter() - t0)


@torch.inference_mode()
def bench_attention(model: DualAR, contexts=(4096, 32768), filled=300):
    """One decode step's attention in one layer, a row `filled` positions into caches of several sizes:
    SDPA with a mask over the whole cache (the eager path) against flex-decoding (the compiled path)."""
    cfg, device, dtype = model.config, model.embeddings.weight.device, model.embeddings.weight.dtype
    q = torch.rand(1, cfg["n_head"], 1, cfg["head_dim"], device=device, dtype=dtype)
    pos = torch.tensor([filled], device=device)
    flex = torch.compile(decode_attention, fullgraph=True, dynamic=False)
    for context in contexts:
        keys, values = torch.rand(2, 1, cfg["n_local_heads"], context, cfg["head_dim"], device=device,
                                  dtype=dtype)
        times = []
        for attend in (decode_attention, flex):  # eager: SDPA with a mask; compiled: flex-decoding
            attend(q, keys, values, pos)
            synchronize(device)
            start = time.perf_counter()
            for _ in range(20):
                attend(q, keys, values, pos)
            synchronize(device)
            times.append((time.perf_counter() - start) / 20 * 1e6)
        print(f"decode attention, one layer, cache {context}, row at position {filled}: SDPA + mask"
              f" {times[0]:.0f} us, flex-decoding {times[1]:.0f} us")



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=list(bench.BENCH_CONFIGS), default="s2-mid")
    ap.add_argument("--batch", type=bench.batch_sizes, default=[1])
    common.add_device_arg(ap)
    ap.add_argument("--dtype", choices=list(common.DTYPES))
    args = ap.parse_args()
    device = common.pick_device(args.device)
    model = bench.random_model(args.config, device, common.pick_dtype(args.dtype, device))
    for batch in args.batch:
        ceiling = batch * matmul_ceiling(model, batch)
        print(f"{args.config} batch {batch}: matmul ceiling {ceiling:.2f} frames/s")
    bench_attention(model)


if __name__ == "__main__":
    main()
