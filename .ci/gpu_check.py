"""GPU checks CI cannot run (no GPU there): the CUDA paths run, and how close they stay to upstream.

    python .ci/gpu_check.py    # part of `bash .ci/gpu`: one line per check, stops at the first error
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import dualAR  # noqa: E402

TINY = ROOT / "tests/fixtures/s2-tiny"
CASES = json.loads((TINY / "golden/cases.json").read_text())
CLONE = torch.from_numpy(np.load(TINY / "golden/codec_codes.npy")), CASES["seeded"]["call"]["prompt_text"][0]


def run(model, name):
    call = CASES[name]["call"]
    return dualAR.generate(model, call["text"], [CLONE] if call["prompt_text"] else [],
                           seed=call["torch_manual_seed"], temperature=call["temperature"],
                           top_p=call["top_p"], top_k=call["top_k"], max_new_tokens=call["max_new_tokens"],
                           chunk_length=call["chunk_length"]).cpu()


def agreement(codes, golden) -> str:
    return f"{(codes == golden).float().mean().item():.3f}" if codes.shape == golden.shape else "other length"


def main():
    assert torch.cuda.is_available(), "no CUDA device"
    print(torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    names = ["greedy", "seeded", "seeded_topp", "noref_greedy", "seeded_dialogue"]
    for dtype in (torch.float32, torch.bfloat16):
        eager = dualAR.load(TINY / "checkpoint", "cuda", dtype)
        start = time.perf_counter()
        compiled = dualAR.load(TINY / "checkpoint", "cuda", dtype, compile=True)
        run(compiled, "greedy")
        print(f"{dtype}: compiled (CUDA graphs) in {time.perf_counter() - start:.0f} s")
        for name in names:
            file = CASES[name].get("codes_file", "seeded_dialogue_codes.npy")
            golden = torch.from_numpy(np.load(TINY / "golden" / file))
            a, b = run(eager, name), run(compiled, name)
            print(f"  {name:14s} share of upstream's codes: eager {agreement(a, golden)},"
                  f" compiled {agreement(b, golden)}; compiled == eager: {torch.equal(a, b)}")
        requests = [dict(text=CASES[n]["call"]["text"], seed=i, max_new_tokens=20)
                    for i, n in enumerate(names)]
        many = dualAR.generate_many(compiled, requests)
        solo = [dualAR.generate(compiled, **r).cpu() for r in requests]
        print(f"  generate_many rows == solo: {[torch.equal(m.cpu(), s) for m, s in zip(many, solo)]}")
        chunks = list(dualAR.stream(compiled, requests[0]["text"], seed=0, max_new_tokens=20, chunk_frames=3))
        assert torch.equal(torch.cat(chunks, 1).cpu(), solo[0]), "stream != generate"
        with dualAR.Engine(compiled, slots=4).start() as engine:
            handles = [engine.submit(r) for r in requests]
            threaded = [torch.cat(list(h), 1).cpu() for h in handles]
        print(f"  engine thread rows == solo: {[torch.equal(t, s) for t, s in zip(threaded, solo)]}")
    print("gpu checks done")


if __name__ == "__main__":
    main()
