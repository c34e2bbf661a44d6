"""common.py: the helpers every model shares."""
import os
import stat

import torch
from safetensors.torch import save_file

from common import write_atomic


def test_a_file_written_atomically_gets_the_usual_permissions_not_safetensors_owner_only(tmp_path):
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "x.safetensors", lambda tmp: save_file({"x": torch.zeros(1)}, str(tmp)))
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o644  # safetensors makes 0o600
