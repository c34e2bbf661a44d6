"""The README's Python API example runs as written, on the tiny checkpoint (copied to ./s2-pro) on the
CPU: the only edits are the device and what CUDA alone can do; each text batch is cut to 8 frames. CI runs
the README's test command, each test worker on its share of the cores."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import dualAR
from conftest import CKPT, CLIP, ROOT


def readme_python_blocks() -> list:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)


def test_the_readme_api_example_runs(tmp_path, monkeypatch):
    (example,) = [b for b in readme_python_blocks() if "dualAR.load(" in b]
    for cuda_only, cpu in (('device="cuda"', 'device="cpu"'), ("torch.bfloat16", "torch.float32"),
                           ("compile=True", "compile=False")):
        assert cuda_only in example
        example = example.replace(cuda_only, cpu)
    shutil.copytree(CKPT, tmp_path / "s2-pro")
    (tmp_path / "prompt").mkdir()
    shutil.copy(CLIP, tmp_path / "prompt/me.wav")
    monkeypatch.chdir(tmp_path)
    example = example.replace("...", "pass")
    budget = dualAR.Request.frame_budget  # 8 frames a text batch: the example's calls, quickly
    monkeypatch.setattr(dualAR.Request, "frame_budget", lambda request: min(8, budget(request)))
    names = {}
    exec(compile(example, "README.md", "exec"), names)
    assert Path("hello.wav").stat().st_size > 44
    assert names["codes"].shape[0] == 10 and len(names["many"]) == 2
    assert isinstance(names["model"], dualAR.DualAR) and names["engine"].closed
    assert torch.is_tensor(names["ref"])


def test_the_readme_omnivoice_example_runs(tmp_path, monkeypatch):
    import numpy as np
    import omnivoice
    (example,) = [b for b in readme_python_blocks() if "omnivoice.load(" in b]
    shutil.copytree(ROOT / "tests/fixtures/omnivoice-tiny/checkpoint", tmp_path / "OmniVoice")
    (tmp_path / "prompt").mkdir()
    shutil.copy(ROOT / "tests/fixtures/omnivoice-tiny/golden/clip_ref_alt.wav", tmp_path / "me.wav")
    monkeypatch.chdir(tmp_path)
    names = {}
    exec(compile(example, "README.md", "exec"), names)
    assert names["audio"].dtype == np.float32 and len(names["audios"]) == 2
    assert names["codes"].shape == names["tokens"][0].shape
    assert omnivoice.load_voice("prompt/me.omnivoice.safetensors")["text"] == "what me.wav says."


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"## Tests\n\n```bash\n(.*?)\n```", readme, re.S)[1].split(" && ")[-1]
    assert command == "python -m pytest -q -n auto tests"
    assert (ROOT / ".ci/run").read_text().rstrip().splitlines()[-1] == command


def test_a_test_worker_and_the_processes_it_starts_run_on_its_share_of_the_cores():
    """Under `-n auto` each worker's torch takes cores / workers threads, and so does a CLI or server a test
    starts; run without workers, torch keeps its own default (a process started alike takes the same)."""
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
        share = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        assert torch.get_num_threads() == share == int(os.environ["OMP_NUM_THREADS"])
    assert int(child.stdout) == torch.get_num_threads()
