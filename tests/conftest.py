"""What every test file shares: the fixture paths, the goldens, the CLI runners, the tiny models loaded once
per session, and the guard that gives each test the process-wide compile settings and random state it
started with.

The session models are read-only by convention: a test that changes a model's weights, quantizes, compiles
or wraps it loads its own (`dualAR.load(CKPT)` takes ~0.05 s once the first load has imported everything).
KV caches are sized and overwritten by each generation, so sharing them is safe (the engine tests check
it); a test that swaps a method on a shared model puts it back in a `finally`.
"""
import contextlib
import functools
import io
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch.utils._python_dispatch import TorchDispatchMode

import codec
import common
import dualAR

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests/fixtures/s2-tiny"
CKPT, GOLDEN = TINY / "checkpoint", TINY / "golden"
CASES = json.loads((GOLDEN / "cases.json").read_text())
REAL = json.loads((ROOT / "tests/fixtures/s2-pro-shapes.json").read_text())
CLIP = GOLDEN / "audio_in.wav"
OV_TINY = ROOT / "tests/fixtures/omnivoice-tiny"  # OmniVoice's checkpoint and goldens
OV_CKPT, OV_GOLDEN = OV_TINY / "checkpoint", OV_TINY / "golden"
OV_CASES = json.loads((OV_GOLDEN / "cases.json").read_text(encoding="utf-8"))


def worker_threads() -> int:
    """The threads each pytest-xdist worker (`-n auto`: the README's command) runs torch on: its share of the
    cores. Two workers on 2 OpenMP threads each on 2 cores slow each other down many times."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # a worker: torch, and every process it starts, on its share
    os.environ["OMP_NUM_THREADS"] = str(worker_threads())
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


class MatmulDtypes(TorchDispatchMode):
    """The weight dtypes of the matrix products run inside it: aten linear (as inference mode leaves it), or
    mm / addmm / bmm (what it becomes where autograd records)."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.linear:
            self.dtypes.append(args[1].dtype)
        elif func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.dtypes.append(args[-1].dtype)
        return func(*args, **(kwargs or {}))


def golden(name):
    """A golden array of tests/fixtures/s2-tiny/golden as a tensor."""
    return torch.from_numpy(np.load(GOLDEN / name))


def ov_golden(name):
    """A golden array of tests/fixtures/omnivoice-tiny/golden as a tensor."""
    return torch.from_numpy(np.load(OV_GOLDEN / name))


def max_diff(a, b):
    """The largest absolute difference of two arrays or tensors, in float64."""
    return np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max()


def chunk_sizes(schedule, total):
    """The schedule's sizes, repeated, cut to add up to total."""
    sizes = []
    for n in itertools.cycle(schedule):
        if sum(sizes) >= total:
            return sizes[:-1] + [total - sum(sizes[:-1])]
        sizes.append(n)


def run_main(main, args, cwd):
    """A CLI's main(argv) run as `python <script> args` would run it, in the folder cwd but in this process
    (no second start of Python and torch) -> its exit status, stdout and stderr. common.cli turns bad input
    into status 2 and one `error:` line, as the scripts' entry points do."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            common.cli(main, [str(arg) for arg in args])
            status = 0
        except SystemExit as e:
            status = e.code
    return types.SimpleNamespace(returncode=status, stdout=out.getvalue(), stderr=err.getvalue())


def run_script(script, args, cwd, timeout=300):
    """`python <script> args...` in a fresh process (for what only a process shows: exit status, stderr),
    its compile cache a folder of its own with this session's untimed decisions (`untimed_compile_cache`)
    -> CompletedProcess with text stdout and stderr."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(untimed_compile_cache(Path(cwd) / ".compile-cache")))
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


UNTIMED = dict(few_rows=[[0, False], [4, True], [65, False]],  # oneDNN at 4-64 rows (a Xeon's timing)
               one_row=True, many_rows="onednn",  # compiled one-row sums; the flat row on oneDNN
               frozen=[[0, False], [4, True], [8, False]])  # 4-row graphs on frozen weights (a Zen 4's)
EVERY_SIZE = [[0, True], [1 << 62, False]]  # a prepacked codec op at every size


@functools.cache
def untimed_decisions() -> dict:
    """cpu_fast's decisions as a machine would keep them, for every thread count of this one (UNTIMED; the
    test codecs' ops all fast): a CLI, server or benchmark that tunes with them times nothing, and runs
    alike on every machine."""
    import cpu_fast
    codecs = [codec.load(CKPT), dualAR.demo_models("cpu", torch.float32)[1]]
    ops = {cpu_fast.op_key(m): True if cpu_fast.op_key(m) == "snake" else EVERY_SIZE
           for dac in codecs for m in dac.modules() if cpu_fast.op_key(m) is not None}
    threads, known = torch.get_num_threads(), {}
    try:
        for n in range(1, max(os.cpu_count() or 1, threads) + 1):
            torch.set_num_threads(n)
            fp32 = cpu_fast.machine_key(torch.device("cpu"), torch.float32)
            known[fp32] = UNTIMED["few_rows"]
            for dtype in cpu_fast.ONE_ROW_DTYPES:
                known[cpu_fast.one_row_key(dtype)] = UNTIMED["one_row"]
            known[f"{fp32} {cpu_fast.MANY_ROWS_KEY}"] = UNTIMED["many_rows"]
            known[f"{fp32} {cpu_fast.FROZEN_KEY}"] = UNTIMED["frozen"]
            known[f"{fp32} {cpu_fast.CODEC_KEY}"] = ops
    finally:
        torch.set_num_threads(threads)
    return known


def untimed_compile_cache(folder: Path) -> Path:
    """A compile-cache folder for a CLI or server run in a process of its own (pass it as
    $TORCHINDUCTOR_CACHE_DIR), holding cpu_fast's `untimed_decisions`: that process times nothing either,
    and the user's cache gets no file."""
    import cpu_fast
    folder = common.cache_for_this_cpu(folder)  # where a process pointed at it looks (this CPU kind's)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / cpu_fast.DECISIONS).write_text(json.dumps(untimed_decisions(), indent=1))
    return folder


def wyoming_args(port: int, **flags) -> types.SimpleNamespace:
    """What app.serve_wyoming reads of app.py's flags: their defaults on 127.0.0.1, but `flags`."""
    return types.SimpleNamespace(**dict(dict(host="127.0.0.1", wyoming_host=None, wyoming_port=port,
                                             max_connections=256, wyoming_allow=None), **flags))


def serve(*flags):
    """app.py's server on CPU, on a free port of 127.0.0.1, with these flags, answering from a thread."""
    import app  # the server's tests alone need it
    server = app.make_server(app.parse_args(["--device", "cpu", "--port", "0", *map(str, flags)]))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop_server(server):
    server.shutdown()
    server.server_close()
    server.app.close()


def running(server):
    """A server fixture's body, `yield from running(serve(...))`: the server, stopped as the fixture ends."""
    yield server
    stop_server(server)


def save_s2_voice(folder: Path, name: str, text: str):
    """An S2-Pro voice in folder (made if missing): random codes (10, 20) in NAME.npy, a transcript in
    NAME.txt."""
    folder.mkdir(exist_ok=True)
    codec.save_codes(folder / f"{name}.npy", torch.randint(0, 1024, (10, 20)))
    (folder / f"{name}.txt").write_text(text + "\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- models, once per session
@pytest.fixture(scope="session")
def model():
    """The tiny S2-Pro (fp32, eager), tuned as the CLI and the server tune it (cpu_fast, this session's
    untimed decisions: oneDNN's matmul at 4-64 rows), shared: do not change its weights or keep it busy
    after a test. A test of the plain model loads its own (`dualAR.load(CKPT)`)."""
    import cpu_fast
    return cpu_fast.tune(dualAR.load(CKPT))


@pytest.fixture(scope="session")
def eos_checkpoint(tmp_path_factory):
    """checkpoint-eos stores only the files that differ from checkpoint/ (see the fixture README)."""
    d = tmp_path_factory.mktemp("checkpoint-eos")
    for src in (CKPT, TINY / "checkpoint-eos"):
        for f in src.iterdir():
            shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="session")
def eos_model(eos_checkpoint):
    """The tiny checkpoint whose weights make <|im_end|> come early (shared, read-only)."""
    return dualAR.load(eos_checkpoint)


@pytest.fixture(scope="session")
def compiled_model():
    """The tiny S2-Pro with its frame step compiled by inductor, shared by every compiled test: each shape
    it meets is compiled once per session (a few seconds with a warm cache) instead of once per test. Tuned
    (cpu_fast: one-row sums, 4-row graphs on frozen weights), as the CLI and the server run it."""
    import cpu_fast
    return cpu_fast.tune(dualAR.load(CKPT, compile=True))


@pytest.fixture(scope="session")
def dac():
    """The tiny codec (fp32), shared, read-only."""
    return codec.load(CKPT)


@pytest.fixture(scope="session")
def one_shot(dac):
    """codes_random (40 frames) and, as a second row, the same codes reversed -> each batch size's decode
    without chunks (shared, read-only): what every chunked and streamed decode, eager or fast, must equal."""
    codes = golden("codes_random.npy")
    codes = torch.stack([codes, codes.flip(-1)])
    return codes, {b: codec.decode(dac, codes[:b], chunk_frames=None) for b in (1, 2)}


# ----------------------------------------------------------------------------- no state leaks between tests
@pytest.fixture(scope="session", autouse=True)
def inductor_cache():
    """One inductor cache folder for every in-process compile of the session: this CPU kind's folder in
    $TORCHINDUCTOR_CACHE_DIR if the user set it, else in fishfast's default (`common.compile_cache_folder`),
    as `common.use_compile_cache` picks it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(common.compile_cache_folder()))
        yield


@pytest.fixture(scope="session", autouse=True)
def decisions_kept(tmp_path_factory):
    """cpu_fast keeps its decisions in a file of this session's (`untimed_decisions`), not the user's: the
    CLIs, servers and benchmarks run here tune without timing, alike on every machine."""
    import cpu_fast
    path = untimed_compile_cache(tmp_path_factory.mktemp("decisions")) / cpu_fast.DECISIONS
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_fast, "decisions_file", lambda: path)
        yield path


@pytest.fixture(autouse=True)
def process_state_restored():
    """Each test gets back the process-wide state it started with: the inductor cache folder (which
    `dualAR.compile_model` sets: inductor has no other setting for it) and torch's global random state
    (seeded by the demo models, `bench.random_model` and tests)."""
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with torch.random.fork_rng(devices=[]):
        yield
    if cache_dir is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
