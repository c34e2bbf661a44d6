"""The goldens hold on another kind of CPU, tried at home: the tests marked `upstream` (each compares our
numbers with upstream's, eagerly) run again in a process whose torch, oneDNN and MKL are limited to a smaller
instruction set than this CPU's, so they sum in another order, as another machine would. A result asserted
to the bit where only a tolerance is promised fails here, on every machine, not first in a CI run on another
kind of CPU (docs/tests.md, "Results on every CPU kind")."""
import os
import subprocess
import sys

import pytest
import torch

import common
from conftest import ROOT

# the limits an AVX2-only CPU has (on an AVX-512 or AMX machine), and those of a CPU without AVX2 (on an
# AVX2 one): the environment variables of common.CAP_VARIABLES
SMALLER = {"AVX2": dict(ATEN_CPU_CAPABILITY="default", ONEDNN_MAX_CPU_ISA="SSE41",
                        MKL_ENABLE_INSTRUCTIONS="SSE4_2"),
           "AVX512": dict(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2",
                          MKL_ENABLE_INSTRUCTIONS="AVX2")}


def test_the_upstream_goldens_hold_on_a_smaller_instruction_set(tmp_path):
    capability = torch.backends.cpu.get_cpu_capability()
    limits = SMALLER.get("AVX512" if capability.startswith("AVX512") else capability)
    if limits is None:
        pytest.skip(f"no smaller instruction set to limit torch to from capability {capability}")
    env = dict(os.environ, **limits)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the limited kind's own folder (common.cache_for_this_cpu)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "upstream", "-p", "no:cacheprovider",
                          str(ROOT / "tests")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    print(f"limited to {limits} (this CPU: {capability}, {common.cpu_kind()}): {summary}")
    assert run.returncode == 0 and " passed" in summary and "deselected" in summary, run.stdout[-6000:]
