"""`.ci/gpu` cannot rot between the rare GPU runs: its CPU smoke run takes every step at the tiny size."""
import json
import os
import subprocess
import sys
from pathlib import Path

import cpu_fast
from conftest import untimed_compile_cache

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["a preflight", "b goldens (tiny)", "c frame step + ttfa (tiny)", "d codec bench (tiny)",
         "e lora bench", "f batch 4, int8wo (tiny)", "f omnivoice bench (tiny)", "f parity (tiny, cpu bf16)"]


def test_gpu_script_cpu_smoke_runs_every_step_and_prints_the_summary(tmp_path):
    cache = untimed_compile_cache(tmp_path / "compile")
    choices = json.loads((cache / cpu_fast.DECISIONS).read_text())
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, TORCHINDUCTOR_CACHE_DIR=str(cache))
    result = subprocess.run(["bash", str(ROOT / ".ci/gpu"), "--cpu-smoke"], env=env, capture_output=True,
                            text=True, timeout=600)
    log = (tmp_path / "gpu.log").read_text()
    assert result.returncode == 0, log[-4000:]
    assert "gpu_check: 5 passed, 0 failed" in log
    summary = log[log.index("step                         status"):].splitlines()
    assert [row[:28].strip() for row in summary[1:-1]] == STEPS
    assert all(row[28:38].strip() == "ok" for row in summary[1:-1])
    assert "ttfa_ms=" in summary[3] and "frames_per_s=" in summary[6]  # the key figure of each step
    assert "RTF" in summary[7]
    assert "parity passed on cpu bf16" in summary[8]
    assert json.loads((cache / cpu_fast.DECISIONS).read_text()) == choices  # found there: nothing timed
    assert summary[-1].startswith("total ") and summary[-1].endswith(" 0 step(s) failed or timed out")
