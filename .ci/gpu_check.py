"""Step (b) of `bash .ci/gpu`: the device paths against upstream's tiny goldens. One line per check; the
exit status is the number of checks that failed (every check runs, also after a failure).

    python3 .ci/gpu_check.py                                     # CUDA: fp32 eager, bf16 compiled
    python3 .ci/gpu_check.py --device cpu --backend eager    # the CPU smoke run: same checks, no codegen
"""
import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import dualAR  # noqa: E402

TINY = ROOT / "tests/fixtures/s2-tiny"
GOLDEN = TINY / "golden"
CASES = json.loads((GOLDEN / "cases.json").read_text())
BF16_LOGITS = 0.03  # eager vs compiled bf16 logits: max difference as a share of the largest logit
FAILED = []


def golden(name):
    return torch.from_numpy(np.load(GOLDEN / name))


def check(name):
    """Run one check, print its line (PASS/FAIL and what it measured), go on whatever happens."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args):
            start = time.perf_counter()
            try:
                ok, detail = fn(*args)
            except Exception as e:
                traceback.print_exc()
                ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"check {name}: {'PASS' if ok else 'FAIL'} ({time.perf_counter() - start:.1f} s) {detail}",
                  flush=True)
            if not ok:
                FAILED.append(name)
        return run
    return wrap


def case_codes(model, name):
    call = CASES[name]["call"]
    refs = [(golden("codec_codes.npy"), call["prompt_text"][0])] if call["prompt_text"] else []
    return dualAR.generate(model, call["text"], refs, seed=call["torch_manual_seed"],
                           temperature=call["temperature"], top_p=call["top_p"], top_k=call["top_k"],
                           max_new_tokens=call["max_new_tokens"], chunk_length=call["chunk_length"]).cpu()


def agreement(codes, expected) -> str:
    share = (codes == expected).float().mean().item() if codes.shape == expected.shape else 0.0
    return f"{100 * share:.1f} % of upstream's codes"


@check("fp32 eager greedy and no-reference codes == upstream")
def eager_goldens(model):
    results = {name: case_codes(model, name) for name in ("greedy", "noref_greedy")}
    same = {n: torch.equal(c, golden(f"{n}_codes.npy")) for n, c in results.items()}
    return all(same.values()), ", ".join(f"{n}: {agreement(c, golden(f'{n}_codes.npy'))}"
                                        for n, c in results.items())


REQUESTS = [dict(text=CASES[n]["call"]["text"], seed=i, max_new_tokens=12 + 5 * i)
            for i, n in enumerate(["greedy", "seeded", "seeded_topp", "noref_greedy", "seeded_dialogue"])]


@check("bf16 compiled generate_many (4 slots) rows == their solo codes")
def batched(model, solo):
    many = [m.cpu() for m in dualAR.generate_many(model, REQUESTS, slots=4)]
    same = [torch.equal(m, s) for m, s in zip(many, solo, strict=True)]
    return all(same), f"rows equal: {same}"


@check("bf16 compiled stream (chunks of 3) == generate")
def streamed(model, solo):
    chunks = list(dualAR.stream(model, chunk_frames=3, **REQUESTS[1]))
    return torch.equal(torch.cat(chunks, 1).cpu(), solo[1]), f"{len(chunks)} chunks"


@check("bf16 compiled engine thread (4 slots) rows == their solo codes")
def threaded(model, solo):
    with common.EngineThread(dualAR.Scheduler(model, slots=4)).start() as engine:
        handles = [engine.submit(dualAR.Request(model, **r)) for r in REQUESTS]
        rows = [h.codes().cpu() for h in handles]
    same = [torch.equal(r, s) for r, s in zip(rows, solo, strict=True)]
    return all(same), f"rows equal: {same}"


@check(f"bf16 teacher-forced frame logits, compiled vs eager, within {100 * BF16_LOGITS:.0f} %")
def teacher_forced(model, backend):
    prompt, frames = golden("prompt_tokens.npy"), golden("continuation_frames.npy")
    device = model.embeddings.weight.device
    frame, pos = frames[None, :, 0].to(device), torch.tensor([prompt.size(1)], device=device)
    model.setup_caches(1, 256)
    with torch.inference_mode():
        model.prefill(prompt.to(device))
        compiled = torch.compile(functools.partial(model.forward_slow, full=True), backend=backend,
                                 fullgraph=True, dynamic=False)
        got = compiled(frame, pos)[0].float()
        ref = model.forward_slow(frame, pos, full=True)[0].float()  # eager: SDPA with a mask, not flex
    error = ((got - ref).abs().max() / ref.abs().max()).item()
    return error <= BF16_LOGITS, f"max difference {100 * error:.2f} % of the largest logit"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor",
                    help="torch.compile backend (eager: the same graph capture, no codegen)")
    args = ap.parse_args()
    device = torch.device(args.device)
    eager_goldens(dualAR.load(TINY / "checkpoint", device, torch.float32))
    model = dualAR.load(TINY / "checkpoint", device, torch.bfloat16)
    dualAR.compile_model(model, backend=args.backend)
    start = time.perf_counter()
    solo = [dualAR.generate(model, **r).cpu() for r in REQUESTS]
    print(f"bf16 solo runs (compile of the batch-1 step included): {time.perf_counter() - start:.1f} s")
    batched(model, solo)
    streamed(model, solo)
    threaded(model, solo)
    teacher_forced(model, args.backend)
    print(f"gpu_check: {5 - len(FAILED)} passed, {len(FAILED)} failed")
    return len(FAILED)


if __name__ == "__main__":
    sys.exit(main())
