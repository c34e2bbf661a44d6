"""What every fishfast model and tool shares, and nothing model-specific: the error users see, device and
dtype choice, checkpoint and audio files, atomic writes, where a model's matmuls may round otherwise, peak
memory, the engine thread. It imports no model file, so a model file can be copied with this one alone.
(Quantization is quantize.py's; what makes a model faster on one kind of CPU is cpu_fast.py's, applied from
outside.)

Sections: errors and the CLI wrapper, user input (voice names, seeds, control tokens: the CLIs' and the
server's one rule each), devices and dtypes, files (atomic writes, a checkpoint's weights and tokenizer,
audio, the compile cache), loose matmuls, memory, engines (Job, the queue, and EngineThread: the thread that
steps either model's Scheduler).
"""
import argparse
import contextlib
import contextvars
import functools
import glob
import importlib
import inspect
import json
import os
import platform
import re
import resource
import shutil
import sys
import threading
import traceback
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- errors, the CLI wrapper
class UserError(ValueError):
    """Bad input: the CLI prints the message as one line and writes nothing."""


def shorten(text: str, limit: int) -> str:
    """A value a message echoes, cut to `limit` characters with an ellipsis: an error stays one line."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


class QueueFull(RuntimeError):
    """An engine's rows are busy and its waiting queue is full (a server answers 503, Retry-After)."""


class EngineClosed(RuntimeError):
    """An engine was closed: a server error (the server is shutting down), not bad input."""


def unreadable(path, error: Exception) -> UserError:
    """One line for a file that exists but cannot be parsed."""
    lines = str(error).strip().splitlines()
    detail = f"no key {error}" if isinstance(error, KeyError) else lines[0] if lines else type(error).__name__
    return UserError(f"cannot read {path}: {detail}")


def cli(main, argv=None):
    """Run a CLI's main(argv): bad input is one `error: ...` line and exit status 2; anything else is a
    bug and keeps its traceback."""
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # a bad command line is one `error: ...` line, like every other error
        self.exit(2, f"error: {message}\n")


# ----------------------------------------------------------------------------- user input
VOICE_NAME = re.compile(r"[A-Za-z0-9_ -]{1,64}")  # upstream's rule for reference ids, at most 64 characters
MAX_SEED = 2**63  # a request's seed is 0 <= seed < MAX_SEED: what a JSON client and both generators take


def is_voice_name(name) -> bool:
    return isinstance(name, str) and bool(VOICE_NAME.fullmatch(name)) and name.strip() == name


def voice_name(name, what="voice name") -> str:
    """The one rule for a saved voice's name, the server's and the CLIs', checked before any path is built
    from it: no separators, dots or odd characters (a voice's files are <name>.<suffix> in the folder)."""
    if not is_voice_name(name):
        raise UserError(f"{what} {str(name)[:80]!r} is not allowed: use 1-64 letters, digits, '_', '-' or"
                        " inner spaces")
    return name


def voice_files(folder, name: str) -> list:
    """Every model's files of voice `name` in a voices folder: <name>.<suffix> (a voice name has no dot)."""
    folder = Path(folder)
    found = folder.glob(glob.escape(voice_name(name)) + ".*") if folder.is_dir() else []
    return sorted(path for path in found if path.name.partition(".")[0] == name)


def new_voice(folder, name, force: bool, what="--save-voice") -> str:
    """A CLI's name for a voice it will save: the rule above, and a name taken by a voice of either model
    refused unless force (--force; the server answers 409)."""
    taken = voice_files(folder, voice_name(name, what))
    if taken and not force:
        raise UserError(f"{what} {name!r}: voice {name!r} exists already ({taken[0]}): give --force to"
                        " replace it, or another name")
    return name


def check_seed(seed, what="seed"):
    """A request's seed (None: drawn), the CLIs' and the server's range."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
        raise UserError(f"{what} must be an integer from 0 to 2**63 - 1, got {seed!r:.40}")
    return seed


def control_tokens(tokenizer, text: str, allowed=None) -> list:
    """The tokenizer's added tokens (<|im_end|>, <|text_end|>, ...: ids a prompt is built of) that `text`
    is tokenized into, but those the regex `allowed` matches (the model's documented tags), in order."""
    added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}: read from the tokenizer, never a list
    ids = dict.fromkeys(tokenizer.encode(text, add_special_tokens=False).ids)
    return [added[i].content for i in ids
            if i in added and not (allowed and allowed.fullmatch(added[i].content))]


def check_plain_text(tokenizer, text: str, what: str, allowed=None):
    """User text is text: an added token in it would reach the model as control (`<|text_end|>` closes the
    text and what follows is read as style), so it is refused, named."""
    found = control_tokens(tokenizer, text, allowed)
    if found:
        raise UserError(f"{what} contains {found[0][:40]!r}, a control token of the model's tokenizer: text"
                        " may not hold one (write it otherwise)")


# ----------------------------------------------------------------------------- devices and dtypes
DEVICE_ORDER = ("npu", "cuda", "xpu", "mps", "cpu")  # --device auto: the first of these this machine has
DEVICE_HELP = "auto (default: the first found of npu, cuda, xpu, mps, cpu), cuda, cuda:N, npu, xpu, mps, cpu"


def device_available(kind: str) -> bool:
    """Whether this machine has a device of `kind` (npu: where Huawei's torch_npu imports)."""
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")  # Huawei's plugin: it adds torch.npu
        except ImportError:
            return False
    module = dict(cuda=torch.cuda, mps=torch.backends.mps).get(kind) or getattr(torch, kind, None)
    return kind == "cpu" or bool(module is not None and module.is_available())


def device_count(kind: str) -> int:
    return 1 if kind in ("cpu", "mps") else getattr(torch, kind).device_count()


def first_available() -> str:
    """--device auto: the first kind of DEVICE_ORDER this machine has."""
    return next(kind for kind in DEVICE_ORDER if device_available(kind))


def pick_device(name: str = None) -> torch.device:
    """--device as given (cpu, mps, cuda, cuda:N, npu, npu:N, xpu, xpu:N), or auto / None: the first of
    DEVICE_ORDER this machine has. A device it lacks is one UserError."""
    if name in (None, "auto"):
        return torch.device(first_available())
    kind, _, index = name.partition(":")
    if not device_available(kind):
        raise UserError(f"--device {name}: no {kind} device on this machine")
    if index and int(index) >= device_count(kind):
        raise UserError(f"--device {name}: this machine has {device_count(kind)} {kind.upper()} devices")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, cuda: str = "bf16") -> torch.dtype:
    """--dtype as given, else `cuda` on CUDA and fp32 elsewhere."""
    return DTYPES[name or (cuda if device.type == "cuda" else "fp32")]


def device_name(text: str) -> str:
    """argparse's type of every CLI's --device."""
    if not re.fullmatch(r"auto|cpu|mps|(cuda|npu|xpu)(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text}: use auto, cuda, cuda:N, npu, xpu, mps or cpu")
    return text


def add_device_arg(parser: argparse.ArgumentParser, more: str = ""):
    """Every CLI's --device (auto by default: pick_device)."""
    parser.add_argument("--device", type=device_name, default="auto", help=DEVICE_HELP + more)


# ----------------------------------------------------------------------------- files
@functools.cache
def cpu_model() -> list:
    """[vendor, family, model] of this CPU (Linux's /proc/cpuinfo), else [the machine's architecture]."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's fields are enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    cpu = [fields.get(k) for k in ("vendor_id", "cpu family", "model")]
    return cpu if all(cpu) else [platform.machine() or "cpu"]


# What the environment may cap torch's own kernels, oneDNN and MKL at (an emulated smaller CPU: docs/tests.md)
CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpu_kind() -> str:
    """This CPU as compiled kernels and timings see it: `cpu_model`, torch's capability, and any cap the
    environment sets on the libraries (CAP_VARIABLES: an emulated smaller CPU) -> a folder name, e.g.
    'AuthenticAMD-25-1-AVX2', 'GenuineIntel-6-143-AVX2-ATEN_CPU_CAPABILITY=avx2-ONEDNN_MAX_CPU_ISA=AVX2'."""
    caps = [f"{v}={os.environ[v]}" for v in CAP_VARIABLES if os.environ.get(v)]
    name = "-".join([*cpu_model(), torch.backends.cpu.get_cpu_capability(), *caps])
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", name)


def default_compile_cache() -> Path:
    """Where compiled kernels (and cpu_fast's decisions) are kept unless told:
    $XDG_CACHE_HOME/fishfast/compile, in a folder of this CPU kind's (`cache_for_this_cpu`)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fishfast" / "compile"
    return cache_for_this_cpu(base)


def cache_for_this_cpu(folder: Path) -> Path:
    """folder/<cpu_kind()> (folder itself if it is one already): kernels compiled, and choices timed, on one
    kind of CPU are never loaded on another that shares the folder (a network home, a disk image); on an AMX
    Xeon limited to AVX2, graphs compiled natively gave wrong codes."""
    kind = cpu_kind()
    return folder if folder.name == kind else folder / kind


def compile_cache_folder() -> Path:
    """The compile-cache folder in use: this CPU kind's folder (`cache_for_this_cpu`) in the user's
    $TORCHINDUCTOR_CACHE_DIR, else default_compile_cache()."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # importing torch._dynamo sets the variable to torch's /tmp default: that one is not the user's choice
    if given in (None, default_cache_dir()):
        return default_compile_cache()
    return cache_for_this_cpu(Path(given))


def use_compile_cache(cache=None) -> Path:
    """Points inductor at the compile-cache folder (process-wide, for good): this CPU kind's folder in
    `cache` if given, else `compile_cache_folder()` -> the folder."""
    folder = cache_for_this_cpu(Path(cache).expanduser()) if cache is not None else compile_cache_folder()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def compiled(fn, recompile_limit: int, **options):
    """torch.compile(fn, **options) allowed `recompile_limit` graphs (dynamo's default, 8, is a few
    shapes): for fn alone where torch.compile takes the limit (torch 2.13 does); an older torch has only
    dynamo's global limit, which is then raised to it for the process."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, recompile_limit=recompile_limit, **options)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, recompile_limit)
    return torch.compile(fn, **options)


def write_atomic(path, write):
    """write(tmp) fills a temp file (or folder) next to `path`, which then replaces `path`: a failure (a
    full disk, a missing folder) is one UserError and never leaves a half-written file."""
    from safetensors import SafetensorError
    path = Path(path)
    tmp = path.with_name(f".{path.name}.part")
    try:
        write(tmp)
        usual_permissions(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: torch.save's and safetensors' own
        raise UserError(f"cannot write {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def usual_permissions(path: Path):
    """safetensors makes files only their owner can read: give them (a folder's too) the permissions of any
    new file."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def weight_files(ckpt: Path, download: str, pth: bool = False) -> list:
    """A checkpoint folder's weight files: the shards model.safetensors.index.json names, else
    model.safetensors (else model.pth, upstream's training save, where `pth`). download: what to fetch."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise unreadable(index, e) from None
        missing = [name for name in shards if not (ckpt / name).is_file()]
        if missing:
            raise UserError(f"{index} names shard {missing[0]}, which is not in {ckpt}")
        return [ckpt / name for name in shards]
    names = ("model.safetensors", "model.pth") if pth else ("model.safetensors",)
    found = [ckpt / name for name in names if (ckpt / name).is_file()]
    if not found:
        raise UserError(f"checkpoint dir {ckpt} has no {' or '.join(names)} — download {download}"
                        " (see README)")
    return found[:1]


def read_tensors(files: list):
    """Yield (key, tensor) one at a time from memory-mapped files (safetensors, or a torch save whose
    `state_dict` keys lose their `model.` prefix): a tensor is held twice only while the caller casts it.
    A truncated or foreign file is one UserError that names it."""
    from safetensors import safe_open
    for f in files:
        try:
            if f.suffix == ".pth":
                state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
                yield from ((k.removeprefix("model."), v) for k, v in state.get("state_dict", state).items())
                continue
            with safe_open(f, framework="pt", device="cpu") as st:
                for key in st.keys():
                    yield key, st.get_tensor(key)
        except Exception as e:
            raise unreadable(f, e) from None


def load_tokenizer(path: Path):
    """tokenizer.json -> a `tokenizers.Tokenizer`; an unreadable one is one UserError."""
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise unreadable(path, e) from None


def byte_tokenizer(specials: list, use_regex: bool = True):
    """A byte-level tokenizer without merges (every byte one token) and the given special tokens: what the
    demo models speak through."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    return tokenizer


AUDIO_EXTENSIONS = {".wav", ".flac", ".ogg", ".mp3", ".opus", ".aiff", ".aif"}  # what soundfile reads


def read_audio(path) -> tuple:
    """Any file soundfile reads -> (float32 array (frames, channels), sample rate); a missing, unreadable
    or empty file is one UserError."""
    if not Path(path).is_file():
        raise UserError(f"audio file {path} not found")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:
        detail = str(e).strip().splitlines()[-1]
        raise UserError(f"{path} is not a readable audio file ({detail})") from None
    if data.shape[0] == 0:
        raise UserError(f"{path} contains no audio samples")
    return data, rate


def save_wav(path, wave, sample_rate: int):
    """Mono float waveform -> PCM-16 .wav, atomically."""
    data = torch.as_tensor(wave).detach().float().cpu().reshape(-1).clamp(-1, 1).numpy()
    write_atomic(path, lambda tmp: sf.write(tmp, data, sample_rate, format="WAV", subtype="PCM_16"))


def write_growing_wav(path, chunks, sample_rate: int):
    """Mono float sample chunks -> a PCM-16 .wav whose header is brought up to date after each chunk (a player
    can open it as it grows); yields after writing each. A failure leaves no half-written file behind."""
    try:
        with sf.SoundFile(str(path), "w", sample_rate, 1, "PCM_16", format="WAV") as wav:
            for samples in chunks:
                wav.write(torch.as_tensor(samples).float().cpu().reshape(-1).clamp(-1, 1).numpy())
                wav.flush()
                yield
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise


def save_npy(path, array):
    """An integer array (codes) -> .npy, atomically."""
    def write(tmp):  # a file object: np.save would add .npy to the temp file's name
        with open(tmp, "wb") as f:
            np.save(f, torch.as_tensor(array).cpu().numpy().astype(np.int64))
    write_atomic(path, write)


# ----------------------------------------------------------------------------- loose matmuls
# what a model runs within where it need not round as upstream does (OmniVoice's flat row): there a linear
# layer may take another matmul (cpu_fast's many-row one); by default nothing changes
LOOSE_MATMULS = contextvars.ContextVar("fishfast loose matmuls", default=False)


@contextlib.contextmanager
def loose_matmuls():
    token = LOOSE_MATMULS.set(True)  # in this thread (and its context) only
    try:
        yield
    finally:
        LOOSE_MATMULS.reset(token)


# ----------------------------------------------------------------------------- memory
def reset_peak_memory(device: torch.device):
    """Restart `peak_memory_gb` from the memory in use now (where the platform allows it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif Path("/proc/self/clear_refs").exists():  # Linux: the peak RSS (VmHWM) restarts from the current RSS
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:  # some containers forbid it: the peak is then the process's so far
            pass


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory since `reset_peak_memory`: CUDA allocations, else the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    status = Path("/proc/self/status")
    if status.is_file():
        return int(re.search(r"VmHWM:\s+(\d+)", status.read_text())[1]) / 1e6  # kB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, kB elsewhere
    return peak / (1e9 if sys.platform == "darwin" else 1e6)


# ----------------------------------------------------------------------------- engines
class Job:
    """What an engine's unit of work shares (dualAR.Request, omnivoice.Unmasking): `done`, `cancelled` and
    `error`, with `changed` notified when it ends. The subclass calls Job.__init__ first."""

    def __init__(self):
        self.done, self.cancelled, self.error, self.changed = False, False, None, threading.Condition()

    def finish(self, error: Exception = None):
        """It is over (an error is raised to its reader; the first one is kept)."""
        with self.changed:
            self.done, self.error = True, self.error or error
            self.changed.notify_all()

    def cancel(self):
        """Stop it: the engine drops it before its next step (frees its row)."""
        self.cancelled = True


def queue_job(waiting, job: Job):
    """A scheduler's queue gets `job`, and the jobs cancelled while they waited (their clients hung up) leave
    it, finished: they take no room. The caller holds the lock that guards `waiting`."""
    for gone in [j for j in waiting if j.cancelled]:
        waiting.remove(gone)
        gone.finish()
    waiting.append(job)


def next_job(waiting, lock):
    """The first job of a scheduler's queue that is not cancelled (those leave it finished), or None."""
    with lock:
        while waiting:
            job = waiting.popleft()
            if not job.cancelled:
                return job
            job.finish()
    return None


class EngineThread:
    """A scheduler stepped by a thread of its own, so one thread owns the model: `submit(job)` from any
    thread (the first starts the thread), the thread steps the scheduler while it is busy, `close()` ends
    it. `max_queue` jobs may wait beyond the scheduler's free rows (QueueFull past that; 0: no waiting room,
    a free row still takes a job). The scheduler (dualAR.Scheduler, omnivoice.Scheduler, tests/test_common's
    tiny one) speaks these verbs:
        submit(job)    queue a Job (EngineClosed once closed), from any thread
        step()         one step: admit waiting jobs into free rows, run them, end those that are done
        busy           whether a job runs or waits
        slots, running how many jobs its rows hold, and hold now
        waiting        the deque of jobs waiting for a row
        fail(error)    end the running jobs with `error` (a step broke): the waiting ones run next
        close()        end every job (EngineClosed)
    and is given `thread` when the thread starts (dualAR's then keeps its model's KV caches even while idle:
    work may come at any moment)."""

    def __init__(self, scheduler, max_queue: int = 16):
        self.scheduler, self.max_queue = scheduler, max_queue
        self.thread, self.wake, self.closed = None, threading.Event(), False
        self.lock = threading.Lock()  # a job's room checked and taken at once

    def start(self):
        if self.closed:
            raise EngineClosed("the engine was closed")
        if self.thread is None:
            self.thread = threading.Thread(target=self.loop, name="fishfast-engine", daemon=True)
            self.scheduler.thread = self.thread
            self.thread.start()
        return self

    def submit(self, job, new_request: bool = True):
        """Queue `job` -> `job`, starting the thread if `start()` was not called. new_request=False: the
        next part of a request already taken (a sentence of an omnivoice.Speech) is never refused."""
        self.start()
        with self.lock:
            if new_request:
                self.check_room()
            self.scheduler.submit(job)
        self.wake.set()
        return job

    def wait(self, job):
        """`job`'s codes() once the thread has run it (omnivoice.Scheduler's `wait` steps it instead: an
        omnivoice.Speech runs on either)."""
        return job.codes()

    def queued(self) -> int:
        """Jobs waiting for a row (not those cancelled meanwhile)."""
        return sum(not job.cancelled for job in list(self.scheduler.waiting))

    def check_room(self):
        """QueueFull if a new job could neither take a free row nor wait for one (a server asks before costly
        work)."""
        free = self.scheduler.slots - self.scheduler.running
        if self.queued() >= self.max_queue + free:
            raise QueueFull(f"{self.max_queue} requests are waiting already: try again later")

    def stats(self) -> dict:
        slots, busy = self.scheduler.slots, self.scheduler.running
        return dict(slots=slots, busy=busy, free=slots - busy, queued=self.queued())

    def loop(self):
        scheduler = self.scheduler
        with torch.inference_mode():
            while not self.closed:
                if not scheduler.busy:
                    self.wake.wait(0.1)
                    self.wake.clear()
                    continue
                try:
                    scheduler.step()
                except Exception as e:  # a bug or a device error: fail the jobs in flight, keep serving
                    traceback.print_exc()
                    scheduler.fail(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))

    def close(self):
        """Stop the thread (after its step), then close the scheduler: what is left ends with EngineClosed."""
        self.closed = True
        self.wake.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        self.scheduler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
