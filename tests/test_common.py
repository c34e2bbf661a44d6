"""common.py: the helpers every model shares."""
import collections
import contextlib
import os
import re
import stat
import threading

import pytest
import torch
from safetensors.torch import save_file

import common
import training
from common import write_atomic
from conftest import free_port


def test_a_file_written_atomically_gets_the_usual_permissions_not_safetensors_owner_only(tmp_path):
    def folder(tmp):  # a checkpoint folder's way: its files written inside it
        tmp.mkdir()
        save_file({"x": torch.zeros(1)}, str(tmp / "model.safetensors"))

    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "x.safetensors", lambda tmp: save_file({"x": torch.zeros(1)}, str(tmp)))
        write_atomic(tmp_path / "checkpoint-1", folder)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o644  # safetensors makes 0o600
    assert stat.S_IMODE((tmp_path / "checkpoint-1/model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "checkpoint-1").stat().st_mode) == 0o755


def test_a_trainers_command_leaves_the_process_group_even_when_it_fails():
    import argparse
    import torch.distributed as dist
    ran = []

    def broken(args):
        ran.append(args.command)
        raise RuntimeError("out of memory")

    for command in ("ok", "broken"):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        with pytest.raises(RuntimeError) if command == "broken" else contextlib.nullcontext():
            training.run_command({"ok": lambda args: ran.append(args.command), "broken": broken},
                                 argparse.Namespace(command=command))
        assert not dist.is_initialized()
    assert ran == ["ok", "broken"]


def test_a_growing_wav_can_be_read_after_each_chunk_and_a_failure_leaves_no_file(tmp_path):
    import soundfile as sf
    path, seen = tmp_path / "out.wav", []
    chunks = [torch.full((100,), 0.5), torch.full((1, 50), -2.0)]  # any shape of one channel; clamped
    for _ in common.write_growing_wav(path, chunks, 8000):
        seen.append(sf.info(str(path)).frames)  # the header is up to date while the file is still open
    assert seen == [100, 150]
    wave, rate = sf.read(str(path))
    assert rate == 8000 and wave[0] == 0.5 and wave[-1] == -1.0

    def broken():
        yield torch.zeros(10)
        raise RuntimeError("the engine failed")

    with pytest.raises(RuntimeError, match="engine failed"):
        for _ in common.write_growing_wav(tmp_path / "broken.wav", broken(), 8000):
            pass
    assert not (tmp_path / "broken.wav").exists()


def test_each_cpu_kind_compiles_and_times_into_a_folder_of_its_own(monkeypatch, tmp_path):
    """Kernels compiled and choices timed on one CPU kind are never read on another that shares the folder:
    a capability or a library cap makes another folder, whichever folder the user names; naming the kind's
    folder itself adds nothing."""
    kind = common.cpu_kind()
    assert common.cache_for_this_cpu(tmp_path) == tmp_path / kind
    assert common.cache_for_this_cpu(tmp_path / kind) == tmp_path / kind
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert common.compile_cache_folder() == tmp_path / kind
    assert common.use_compile_cache(tmp_path / "mine") == tmp_path / "mine" / kind
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine" / kind)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert common.cpu_kind() == f"{kind}-ONEDNN_MAX_CPU_ISA=AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert common.cpu_kind().endswith("-DEFAULT-ONEDNN_MAX_CPU_ISA=AVX2") and common.cpu_kind() != kind


# ----------------------------------------------------------------------------- the engine thread
class Countdown(common.Job):
    """A job of `steps` steps; codes() waits for its end -> the steps it ran."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.ran = steps, 0

    def codes(self) -> int:
        with self.changed:
            self.changed.wait_for(lambda: self.done, timeout=30)
        if self.error:
            raise self.error
        return self.ran


class Rows:
    """Every verb common.EngineThread drives, and no model: `slots` rows; step() admits waiting jobs into free
    rows, runs one step of each, ends those that ran all theirs. Clear `go` to hold the steps."""

    def __init__(self, slots: int):
        self.slots, self.rows, self.waiting, self.closed = slots, [], collections.deque(), False
        self.go = threading.Event()
        self.go.set()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def running(self) -> int:
        return len(self.rows)

    def submit(self, job: Countdown) -> Countdown:
        if self.closed:
            raise common.EngineClosed("the engine was closed")
        self.waiting.append(job)  # one deque operation: atomic, as the step thread's popleft
        return job

    def step(self):
        self.go.wait(30)
        while self.waiting and len(self.rows) < self.slots:
            self.rows.append(self.waiting.popleft())
        for job in self.rows:
            job.ran += 1
        for job in [job for job in self.rows if job.ran == job.steps]:
            self.rows.remove(job)
            job.finish()

    def fail(self, error: Exception):
        jobs, self.rows = self.rows, []
        for job in jobs:
            job.finish(error)

    def close(self):
        self.closed = True
        for job in [*self.rows, *self.waiting]:
            job.finish(common.EngineClosed("the engine was closed"))
        self.rows, self.waiting = [], collections.deque()


def test_an_engine_thread_steps_any_scheduler_and_bounds_its_queue():
    """submit() starts the thread, which steps a job to its end; a free row and max_queue waiting jobs are
    taken, one more is refused (never a request's next part); close() stops the thread, then refuses."""
    scheduler = Rows(slots=1)
    engine = common.EngineThread(scheduler, max_queue=1)
    try:
        assert engine.wait(engine.submit(Countdown(3))) == 3 and engine.thread.is_alive()
        assert engine.stats() == dict(slots=1, busy=0, free=1, queued=0)
        scheduler.go.clear()  # the thread's next step waits: what comes now waits for a row
        first, second = engine.submit(Countdown(2)), engine.submit(Countdown(2))  # the free row, the queue
        with pytest.raises(common.QueueFull):
            engine.submit(Countdown(2))
        later = engine.submit(Countdown(1), new_request=False)
        assert engine.stats() == dict(slots=1, busy=0, free=1, queued=3)
        scheduler.go.set()
        assert [engine.wait(job) for job in (first, second, later)] == [2, 2, 1]
    finally:
        scheduler.go.set()
        engine.close()
    assert not engine.thread.is_alive() and scheduler.closed
    with pytest.raises(common.EngineClosed):
        engine.submit(Countdown(1))


# ----------------------------------------------------------------------------- issue 45: user input rules
def test_one_voice_name_rule_and_a_voices_files_of_every_model(tmp_path):
    assert common.voice_name("stereo one") == "stereo one"  # what the server saves, the CLIs take
    for bad in ("my.voice", "../evil", " lead", "a/b", "", "x" * 65, 5):
        with pytest.raises(common.UserError, match=r"^--save-voice .* is not allowed: use 1-64 letters"):
            common.voice_name(bad, "--save-voice")
    for name in ("stereo one.npy", "stereo one.txt", "stereo one.omnivoice.safetensors", "stereo onex.npy",
                 "stereo.npy", ".stereo one.npy.part"):
        (tmp_path / name).touch()
    assert [p.name for p in common.voice_files(tmp_path, "stereo one")] == [
        "stereo one.npy", "stereo one.omnivoice.safetensors", "stereo one.txt"]
    assert common.voice_files(tmp_path / "absent", "stereo one") == []


def test_a_seed_is_0_to_2_63_for_the_clis_and_the_server():
    assert common.check_seed(0) == 0 and common.check_seed(2**63 - 1) == 2**63 - 1
    assert common.check_seed(None) is None
    for bad in (-1, 2**63, True, 1.5):
        with pytest.raises(common.UserError) as error:
            common.check_seed(bad, "--seed")
        assert str(error.value) == f"--seed must be an integer from 0 to 2**63 - 1, got {bad!r}"


def test_added_tokens_of_the_tokenizer_in_user_text_are_found_and_named():
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(
        pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.add_special_tokens(["<|im_end|>", "<|speaker:0|>"])
    tokenizer.add_tokens(["<think>"])  # an added token that is not special is read as one id too
    text = "Hi <|speaker:0|>there [laughter] <|im_end||>"
    assert common.control_tokens(tokenizer, text) == ["<|speaker:0|>"]
    tag = re.compile(r"<\|speaker:\d+\|>")
    assert common.control_tokens(tokenizer, "Hi <|speaker:0|>there", tag) == []
    assert common.control_tokens(tokenizer, "a<think>b<|im_end|>c<think>", tag) == ["<think>", "<|im_end|>"]
    with pytest.raises(common.UserError) as error:
        common.check_plain_text(tokenizer, "Hello<|im_end|>", "input", tag)
    assert str(error.value) == ("input contains '<|im_end|>', a control token of the model's tokenizer: text"
                                " may not hold one (write it otherwise)")


def test_a_compiled_function_takes_its_own_recompile_limit_and_leaves_dynamos_as_it_was(monkeypatch):
    """common.compiled(fn, n): fn compiles a graph for each of n shapes (dynamo's default limit, 8, would
    stop a full graph at the 9th) and the process's limit stays as it was; a torch.compile that takes no
    limit of its own (an older torch) gets dynamo's raised instead."""
    limit = torch._dynamo.config.recompile_limit

    def double(x):
        return x * 2

    fn = common.compiled(double, limit + 2, fullgraph=True, dynamic=False, backend="eager")
    for n in range(1, limit + 3):
        assert torch.equal(fn(torch.ones(n)), torch.full((n,), 2.0))
    assert torch._dynamo.config.recompile_limit == limit
    plain = torch.compile(lambda x: x * 2, fullgraph=True, dynamic=False, backend="eager")
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # torch.compile's default limit
        for n in range(1, limit + 3):
            plain(torch.ones(n))
    real = torch.compile
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", limit)  # put back after this test
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real(fn, **options))  # no limit of its own
    common.compiled(double, 3 * limit, backend="eager")
    assert torch._dynamo.config.recompile_limit == 3 * limit
