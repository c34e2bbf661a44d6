"""common.py: the helpers every model shares."""
import os
import stat
import subprocess
import sys

import torch
from safetensors.torch import save_file

from common import write_atomic
from conftest import ROOT

# the repository's modules
FILES = ("common", "codec", "dualAR", "bench", "omnivoice", "omnivoice_codec", "app", "train_lora")


def imported_with(module: str) -> set:
    """The other repository modules that `import module` brings in, in a fresh process."""
    script = f"import sys, {module}; print(*(m for m in {FILES!r} if m in sys.modules and m != {module!r}))"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return set(run.stdout.split())


def test_imports_point_one_way_common_below_the_models_and_no_model_below_its_benchmark():
    assert imported_with("common") == set()  # no model: a model file is copied with common.py alone
    assert imported_with("codec") == {"common"}  # not dualAR.py: the codec stands alone
    assert imported_with("dualAR") == {"common", "codec"}  # bench.py is imported only to run a benchmark
    assert imported_with("omnivoice_codec") == {"common"}
    assert imported_with("omnivoice") == {"common", "omnivoice_codec"}  # copying OmniVoice drags in no S2


def test_a_file_written_atomically_gets_the_usual_permissions_not_safetensors_owner_only(tmp_path):
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "x.safetensors", lambda tmp: save_file({"x": torch.zeros(1)}, str(tmp)))
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o644  # safetensors makes 0o600
