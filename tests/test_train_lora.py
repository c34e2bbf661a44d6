"""train_lora.py against upstream fish-speech's LoRA goldens on the tiny S2-Pro checkpoint (CPU, fp32),
plus tiny end-to-end runs: prepare, train, resume, merge, export, and every bad input's one-line error.

See tests/fixtures/s2-tiny/README.md, section LoRA, for what each golden is and how upstream made it.
"""
import errno
import json
import math
import os
import re
import stat
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

import codec
import bench
import common
import dualAR
import train_lora
from bounds import assert_within, merge_bound
from conftest import CASES, CKPT, GOLDEN, ROOT, free_port, golden
from common import UserError

LORA = CASES["lora"]
LOSSES = json.loads((GOLDEN / "lora_loss.json").read_text())
SAMPLES = [(s["text"], torch.tensor(s["codes"])) for s in LORA["batch"]["samples"]]
TEXTS = ["Hello there, how are you?", "The quick brown fox jumps.", "Thank you very much!",
         "Good morning, world.", "This is a small test.", "Please read this slowly."]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's ops are too small to share: one thread trains several times faster on 2 busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch_of(model, samples: list) -> tuple:
    """[(text, codes)] -> (inputs, labels, padding_mask) as training makes them: each sample tokenized as
    load_samples does (sample_tokens), the batch as batch_loss makes it (collate)."""
    return train_lora.collate([train_lora.sample_tokens(model, text, codes) for text, codes in samples])


def golden_batch():
    names = ("lora_batch_inputs.npy", "lora_batch_labels.npy", "lora_batch_attention_masks.npy")
    return tuple(golden(name) for name in names)


def upstream_figures(case):
    logged = LOSSES[case]["logged"]
    stage = "val" if "val/loss" in logged else "train"
    return {k: logged[f"{stage}/{k}"] for k in ("loss", "base_loss", "semantic_loss")}


def assert_losses(result, case):
    for key, want in upstream_figures(case).items():
        assert result[key].item() == pytest.approx(want, rel=1e-5), key


def lora_model():
    """The base checkpoint with upstream's golden LoRA (dropout 0), in train mode as upstream's golden."""
    model = dualAR.load(CKPT)
    train_lora.load_lora(model, GOLDEN / "lora_weights.safetensors")
    return model.train()


def tree(root: Path) -> dict:
    """Every path under root with its size and mtime: equal before and after = nothing was written."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def write_codes_data(folder: Path, n=6, seed=0):
    """n prepared samples (codes .npy + .lab) in two speaker folders. Codes use few values, so that a
    tiny LoRA can learn something about them in a few steps."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        speaker = folder / f"spk{i % 2}"
        speaker.mkdir(parents=True, exist_ok=True)
        np.save(speaker / f"s{i}.npy", rng.integers(0, 16, size=(10, 12 + i)))
        (speaker / f"s{i}.lab").write_text(TEXTS[i % len(TEXTS)])
    return folder


def write_audio(path: Path, seconds=0.3, rate=16000, channels=1, text="Hello there."):
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 220 * t)
    sf.write(path, np.stack([wave] * channels, 1) if channels > 1 else wave, rate)
    if text is not None:
        path.with_suffix(".lab").write_text(text)


def train(data, out, *extra):
    train_lora.main(["train", str(data), "--checkpoint", str(CKPT), "--out", str(out), "--batch-size", "2",
                     "--val-size", "2", *extra])


def metrics(run: Path) -> list:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- upstream's numbers
@pytest.mark.upstream
def test_batch_from_cases_matches_upstreams_golden_batch(model):
    inputs, labels, padding = batch_of(model, SAMPLES)
    want_inputs, want_labels, want_padding = golden_batch()
    assert torch.equal(inputs, want_inputs)
    assert torch.equal(labels, want_labels)
    assert torch.equal(padding, want_padding)


@pytest.mark.upstream
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_loss_with_golden_lora_matches_upstream(checkpointing):
    # chunk 5: the head runs its 18 scored positions in 4 slices, the fast model its 12 semantic ones in 3
    result = train_lora.training_loss(lora_model(), *golden_batch(), checkpointing=checkpointing, chunk=5)
    assert_losses(result, "train_mode_dropout0")


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = lora_model()
        loss = train_lora.training_loss(model, *golden_batch(), checkpointing=checkpointing, chunk=5)["loss"]
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert len(grads[0]) == 38 and grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.upstream
def test_base_model_training_loss_matches_upstream():
    assert_losses(train_lora.training_loss(dualAR.load(CKPT), *golden_batch()), "base_no_lora_train_mode")


def test_training_path_embeds_without_the_inference_scale():
    """Upstream's training embed() sums token and codebook embeddings at semantic positions and, unlike
    inference, does not divide by sqrt(num_codebooks + 1). Without slow layers, the slow states that
    training_loss reads are that embedding."""
    model = dualAR.load(CKPT)
    model.layers = torch.nn.ModuleList()
    inputs = golden_batch()[0][:1]
    x = model.slow_states(inputs)[0]
    ids, cfg = inputs[0, 0], model.config
    semantic_pos = int(torch.nonzero((ids >= cfg["semantic_begin_id"]) & (ids <= cfg["semantic_end_id"]))[0])
    codes = inputs[0, 1:, semantic_pos]
    rows = codes + torch.arange(cfg["num_codebooks"]) * cfg["codebook_size"]
    want = model.embeddings.weight[ids[semantic_pos]] + model.codebook_embeddings.weight[rows].sum(0)
    torch.testing.assert_close(x[semantic_pos], want, rtol=0, atol=1e-6)
    assert torch.equal(x[0], model.embeddings.weight[ids[0]])  # a text position: its codes are ignored


@pytest.mark.upstream
def test_merged_model_loss_matches_upstream_and_only_base_loss_moves():
    """After merging, the tied head reads the merged embedding table, so base_loss changes while the
    semantic loss stays (upstream's eval_mode_merged vs train_mode_dropout0)."""
    model = lora_model()
    before = train_lora.training_loss(model, *golden_batch())
    merged = train_lora.training_loss(train_lora.merge_lora(model), *golden_batch())
    assert_losses(merged, "eval_mode_merged")
    assert not train_lora.lora_modules(model)
    assert merged["semantic_loss"].item() == pytest.approx(before["semantic_loss"].item(), rel=1e-5)
    assert abs(merged["base_loss"].item() - before["base_loss"].item()) > 1e-2


def assert_merged_as_upstream(written: dict, want: dict):
    """A merge of the golden LoRA against upstream's: every LoRA-targeted weight within two merges' rounding
    of the exact W + (B @ A) alpha/r (bounds.merge_bound: another CPU sums B @ A in another order; equal here
    on the goldens' CPU kind), every other tensor equal, dtypes as upstream's."""
    lora, base = load_file(GOLDEN / "lora_weights.safetensors"), dualAR.load(CKPT).state_dict()
    scaling = LORA["lora_config"]["lora_alpha"] / LORA["lora_config"]["r"]
    assert sorted(written) == sorted(want)
    for key, tensor in want.items():
        assert written[key].dtype == tensor.dtype, key  # LoRA-wrapped fp32, norms bf16 as loaded
        b, a = (lora.get(f"model.{key.removesuffix('.weight')}.lora_{x}") for x in "BA")
        if b is None:
            assert torch.equal(written[key], tensor), key
            continue
        table = base[key].shape != (b.shape[0], a.shape[1])  # an embedding table (num, dim): B @ A transposed
        bound = 2 * merge_bound(base[key].T if table else base[key], b, a, scaling)
        bound = bound.T if table else bound
        assert_within(written[key], tensor, bound, key)


def upstream_torch_lora(tmp_path):
    """Upstream's LoRA as its Lightning checkpoint holds it: a torch file with state_dict."""
    path = tmp_path / "step_000000010.ckpt"
    torch.save({"state_dict": load_file(GOLDEN / "lora_weights.safetensors")}, path)
    return path


@pytest.mark.upstream
@pytest.mark.parametrize("source", ["safetensors", "torch file"])
def test_merge_dual_ar_writes_upstreams_merged_weights(tmp_path, source):
    lora = GOLDEN / "lora_weights.safetensors" if source == "safetensors" else upstream_torch_lora(tmp_path)
    out = tmp_path / "merged"
    train_lora.main(["merge", "--checkpoint", str(CKPT), "--lora", str(lora), "--out", str(out),
                     "--format", "dual_ar"])
    written = torch.load(out / "model.pth", weights_only=True)  # upstream's torch.save of the state_dict
    want = load_file(GOLDEN / "merged_model.safetensors")
    assert_merged_as_upstream(written, want)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "dual_ar" and config["n_layer"] == 2
    reloaded = dualAR.load(out)  # the flat config + model.pth load in dualAR.py too
    assert torch.equal(reloaded.fast_output.weight, written["fast_output.weight"])


@pytest.mark.upstream
def test_merge_hf_shards_a_big_checkpoint_with_an_index(tmp_path, monkeypatch):
    monkeypatch.setattr(train_lora, "SHARD_BYTES", 2**20)
    out = tmp_path / "merged-hf"
    train_lora.main(["merge", "--checkpoint", str(CKPT), "--lora", str(GOLDEN / "lora_weights.safetensors"),
                     "--out", str(out)])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    model = dualAR.load(out, "cpu", None)
    assert_merged_as_upstream(model.state_dict(), load_file(GOLDEN / "merged_model.safetensors"))


def test_merge_hf_gives_a_checkpoint_dualAR_loads_and_generates_with(tmp_path):
    out = tmp_path / "merged-hf"
    train_lora.main(["merge", "--checkpoint", str(CKPT), "--lora", str(GOLDEN / "lora_weights.safetensors"),
                     "--out", str(out)])
    files = {f.name for f in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "codec.pth"} <= files
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask  # not owner-only
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert "text_model.model.embeddings.weight" in load_file(out / "model.safetensors")
    model = dualAR.load(out)
    assert torch.equal(model.layers[1].attention.wqkv.weight, load_file(out / "model.safetensors")[
        "text_model.model.layers.1.attention.wqkv.weight"])
    codes = dualAR.generate(model, "Hello world.", seed=42, max_new_tokens=6)
    assert codes.shape == (10, 5)


# ----------------------------------------------------------------------------- tiny training runs
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """30 steps of rank-8 LoRA on 4 tiny samples (2 held out), lr 1e-3."""
    root = tmp_path_factory.mktemp("run")
    data = write_codes_data(root / "data")
    train(data, root / "run", "--max-steps", "30", "--lr", "1e-3", "--val-every", "10")
    return root / "run"


def test_thirty_steps_lower_the_validation_loss(trained_run):
    records = metrics(trained_run)
    steps = [r for r in records if "loss" in r]
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert set(steps[0]) == {"step", "loss", "lr"}
    assert steps[0]["lr"] == pytest.approx(1e-4)  # 10 warm-up steps
    assert steps[-1]["lr"] == pytest.approx(1e-3)
    assert sorted(vals) == [0, 10, 20, 30]
    assert vals[30] < vals[0] - 1.0  # measured: 22.37 -> 19.33
    run = json.loads((trained_run / "run.json").read_text())
    assert (run["rank"], run["alpha"], len(run["samples"])) == (8, 16, 6)


def test_a_runs_lora_and_state_get_the_permissions_of_any_new_file(trained_run):
    umask = os.umask(0)
    os.umask(umask)
    for name in (train_lora.LORA_FILE, train_lora.STATE_FILE):  # safetensors alone would make lora 0o600
        assert stat.S_IMODE((trained_run / name).stat().st_mode) == 0o666 & ~umask, name


def test_exported_lora_changes_the_generated_codes(model, trained_run, tmp_path):
    train_lora.main(["merge", "--checkpoint", str(CKPT), "--lora", str(trained_run),
                     "--out", str(tmp_path / "m")])
    base = dualAR.generate(model, "Hello world.", seed=7, max_new_tokens=8)
    tuned = dualAR.generate(dualAR.load(tmp_path / "m"), "Hello world.", seed=7, max_new_tokens=8)
    assert not torch.equal(base, tuned)


def assert_same_lora(run, other):
    """The two runs' LoRA weights, bit for bit (38 tensors: A and B of every wrapped module)."""
    weights, others = load_file(run / "lora.safetensors"), load_file(other / "lora.safetensors")
    assert sorted(weights) == sorted(others) and len(weights) == 38
    for key in weights:
        assert torch.equal(weights[key], others[key]), key


def straight_and_resumed(train_run, tmp_path, steps: int, stop: int):
    """Train `steps` steps in one go (straight/), and stopped after `stop` then resumed (resumed/): the
    same LoRA weights, bit for bit."""
    data = write_codes_data(tmp_path / "data")
    common = ["--val-every", "2", "--save-every", "2", "--lr", "1e-3"]
    train_run(data, tmp_path / "straight", "--max-steps", str(steps), *common)
    train_run(data, tmp_path / "resumed", "--max-steps", str(stop), *common)
    train_run(data, tmp_path / "resumed", "--max-steps", str(steps), "--resume", *common)
    assert_same_lora(tmp_path / "straight", tmp_path / "resumed")


def test_resumed_run_ends_with_the_same_lora_as_an_uninterrupted_one(tmp_path):
    """Same seed, 6 steps: once straight, once stopped after 3 and resumed. Dropout is on (0.01), so
    the random state in the checkpoint matters."""
    straight_and_resumed(train, tmp_path, steps=6, stop=3)
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r for r in straight if "loss" in r] == [r for r in resumed if "loss" in r]
    resumed_vals = [r for r in resumed if "val_loss" in r and r["step"] != 3]  # it also validated at its stop
    assert [r for r in straight if "val_loss" in r] == resumed_vals


def test_resume_drops_metrics_logged_after_the_last_checkpoint(tmp_path):
    data = write_codes_data(tmp_path / "data")
    train(data, tmp_path / "run", "--max-steps", "2")
    with open(tmp_path / "run/metrics.jsonl", "a") as f:  # a crash after step 3 was logged, then cut short
        f.write(json.dumps(dict(step=3, loss=1.0, lr=0.0)) + '\n{"step": 4, "lo')
    train(data, tmp_path / "run", "--max-steps", "3", "--resume")
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3]
    assert [r for r in metrics(tmp_path / "run") if "loss" in r][-1]["loss"] != 1.0


def test_batches_visit_every_training_sample_once_per_epoch():
    batches = [train_lora.batch_indices(5, 2, seed=3, k=k) for k in range(6)]
    assert [len(b) for b in batches] == [2, 2, 1, 2, 2, 1]
    assert sorted(sum(batches[:3], [])) == sorted(sum(batches[3:], [])) == list(range(5))
    assert batches[:3] != batches[3:]  # a new order each epoch


class Crash(Exception):
    """A crash (power cut, kill -9) while a file is being written."""


@pytest.mark.parametrize("file", [train_lora.STATE_FILE, train_lora.RUN_FILE])
def test_a_crash_while_the_run_starts_leaves_a_folder_the_same_command_accepts(tmp_path, monkeypatch, file):
    data = write_codes_data(tmp_path / "data")
    write_atomic = train_lora.write_atomic

    def crash_at(path, write):
        if path.name == file:
            raise Crash
        write_atomic(path, write)

    monkeypatch.setattr(train_lora, "write_atomic", crash_at)
    with pytest.raises(Crash):
        train(data, tmp_path / "run", "--max-steps", "1")
    monkeypatch.undo()
    train(data, tmp_path / "run", "--max-steps", "1")
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1]


def test_samples_are_tokenized_once_per_run(tmp_path, monkeypatch):
    calls = []
    sample_tokens = train_lora.sample_tokens
    monkeypatch.setattr(train_lora, "sample_tokens", lambda *a: calls.append(a[1]) or sample_tokens(*a))
    train(write_codes_data(tmp_path / "data"), tmp_path / "run", "--max-steps", "3", "--val-every", "1")
    assert sorted(calls) == sorted(TEXTS)  # 6 samples, each once, for 3 steps and 4 validations


def test_validation_loss_is_the_loss_of_the_whole_held_out_set_as_one_batch(tmp_path):
    """3 held-out samples of 3 lengths in batches of 2 and 1: a mean of the two batch means would weigh
    the third sample as much as the first two."""
    data = write_codes_data(tmp_path / "data")
    train(data, tmp_path / "run", "--max-steps", "1", "--val-size", "3")
    names = json.loads((tmp_path / "run/run.json").read_text())["samples"]
    held_out = [name for name, in train_lora.split_held_out([(n,) for n in names], 3, seed=42)[1]]
    model = dualAR.load(CKPT)
    torch.manual_seed(42)
    train_lora.add_lora(model)  # the run's LoRA at step 0
    samples = [((data / f"{n}.lab").read_text(), torch.from_numpy(np.load(data / f"{n}.npy")))
               for n in held_out]
    inputs, labels, _ = batch_of(model, samples)
    with torch.no_grad():
        whole = train_lora.training_loss(model.eval(), inputs, labels)["loss"].item()
    assert metrics(tmp_path / "run")[0] == dict(step=0, val_loss=pytest.approx(whole, rel=1e-6))


def test_ctrl_c_during_the_first_validation_is_a_one_line_error(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_lora, "validation_loss", interrupted)
    with pytest.raises(UserError, match="^interrupted at step 0: continue from the last checkpoint with"):
        train(write_codes_data(tmp_path / "data"), tmp_path / "run", "--max-steps", "1")


# ----------------------------------------------------------------------------- several processes (torchrun)
def torchrun(*argv, processes=2, ok=True) -> subprocess.CompletedProcess:
    """python -m torch.distributed.run (= torchrun) train_lora.py *argv on `processes` CPU processes (gloo),
    one thread each."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               str(ROOT / "train_lora.py"), *argv]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0 or not ok, run.stderr[-3000:]
    return run


def torchrun_train(data, out, *extra, ok=True) -> subprocess.CompletedProcess:
    return torchrun("train", str(data), "--checkpoint", str(CKPT), "--out", str(out), "--batch-size", "2",
                    "--val-size", "2", *extra, ok=ok)


def train_steps(run: Path) -> list:
    return [r for r in metrics(run) if "loss" in r]


def test_a_worker_ends_its_process_group_with_its_threads_once_the_model_is_loaded():
    """A torchrun worker once aborted at exit (1 run in ~20): dynamo, imported by the model's loading after
    the group existed, imports torch.distributed.nn.functional, whose `group=group.WORLD` defaults then held
    the group, so gloo's threads outlived destroy_process_group and freed a tensor during the interpreter's
    teardown. join_processes imports dynamo first: only the main thread is left (one OpenMP thread, so that
    none of its pool counts). The TCPStore's server thread (pt_tcpstore_uv) ends a moment after destroy
    (seen once in CI): the count may take up to 5 s to fall; held gloo threads never end."""
    script = f"""if True:
        import os, sys, time, torch, torch.distributed as dist
        sys.path.insert(0, {str(ROOT)!r})
        import dualAR, training
        before = len(os.listdir("/proc/self/task"))
        training.join_processes(torch.device("cpu"))
        dualAR.load({str(CKPT)!r})
        dist.destroy_process_group()
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        print(before, len(os.listdir("/proc/self/task")))"""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = map(int, run.stdout.split())
    assert before == after == 1


def test_each_process_weighs_its_micro_batches_by_the_whole_steps_grad_accum(monkeypatch):
    """2 processes, 4 micro-batches a step: this process's 2 each weigh 1/4 (the all-reduce, a no-op here,
    sums the processes' gradients). AdamW barely reacts to a gradient's scale, so it is read before it."""
    model = lora_model()
    params = list(train_lora.lora_params(model).values())
    train_set = [(f"s{i}", *train_lora.sample_tokens(model, *sample)) for i, sample in enumerate(SAMPLES)]
    seen, batch_loss = [], train_lora.batch_loss

    def recorded(model, batch, *rest):
        seen.append(batch)
        return batch_loss(model, batch, *rest)

    monkeypatch.setattr(train_lora, "batch_loss", recorded)
    monkeypatch.setattr(train_lora.dist, "all_reduce", lambda tensor: None)
    monkeypatch.setattr(train_lora, "CLIP", math.inf)  # clipping could hide the scale too
    grads = []
    optimizer = types.SimpleNamespace(param_groups=[{}], zero_grad=lambda set_to_none: None,
                                      step=lambda: grads.extend(p.grad.clone() for p in params))
    run = dict(lr=1e-3, warmup=1, grad_accum=4, batch_size=1, seed=0, checkpointing=False)
    train_lora.optimizer_step(model, params, optimizer, run, train_set, step=0, rank=1, world=2)
    assert len(seen) == 2
    for p in params:
        p.grad = None
    for batch in seen:
        (batch_loss(model, batch, torch.device("cpu"))[0]["loss"] / 4).backward()
    for grad, p in zip(grads, params, strict=True):
        assert torch.equal(grad, p.grad)


def test_two_processes_train_as_one_process_with_twice_the_micro_batches(tmp_path):
    """2 processes x --grad-accum 2 = 1 process x --grad-accum 4: the same micro-batches, each loss
    divided by its own tokens and by 4 in all. Only the order of the fp32 gradient sums differs: measured
    max |difference| of the LoRA weights after 4 steps 1.2e-7 (with --grad-accum 1: bit-identical)."""
    data = write_codes_data(tmp_path / "data")
    common = ["--max-steps", "4", "--lr", "1e-2", "--dropout", "0", "--val-every", "2"]
    stdout = torchrun_train(data, tmp_path / "two", "--grad-accum", "2", *common).stdout
    train(data, tmp_path / "one", "--grad-accum", "4", *common)
    two, one = load_file(tmp_path / "two/lora.safetensors"), load_file(tmp_path / "one/lora.safetensors")
    assert sorted(two) == sorted(one) and len(two) == 38
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-6, msg=key)
    steps = train_steps(tmp_path / "two")  # rank 0 alone writes: each step once
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and stdout.count(" steps/s") == 1
    for got, want in zip(steps, train_steps(tmp_path / "one"), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    vals = {r["step"]: r["val_loss"] for r in metrics(tmp_path / "two") if "val_loss" in r}
    assert sorted(vals) == [0, 2, 4] and vals[4] < vals[0] - 0.5  # measured: 22.37 -> 21.05
    assert json.loads((tmp_path / "two/run.json").read_text())["grad_accum"] == 4


def test_resume_under_torchrun_continues_bit_for_bit(tmp_path):
    """Dropout on: each process's random state is in the checkpoint."""
    straight_and_resumed(torchrun_train, tmp_path, steps=4, stop=2)
    assert metrics(tmp_path / "straight") == metrics(tmp_path / "resumed")


def test_a_two_process_run_resumes_on_one_process_with_the_same_batches(tmp_path, capsys):
    """run.json stores micro-batches per step over all processes (2 here): one process then runs both.
    Without dropout and with one micro-batch per process the gradient sums agree bit for bit."""
    data = write_codes_data(tmp_path / "data")
    common = ["--lr", "1e-2", "--dropout", "0", "--save-every", "2", "--val-every", "2"]
    torchrun_train(data, tmp_path / "run", "--max-steps", "2", *common)
    train(data, tmp_path / "run", "--max-steps", "4", "--resume", *common)
    assert "was saved by 2 process(es), resumed by 1" in capsys.readouterr().err
    train(data, tmp_path / "one", "--max-steps", "4", "--grad-accum", "2", *common)
    resumed, one = load_file(tmp_path / "run/lora.safetensors"), load_file(tmp_path / "one/lora.safetensors")
    assert sorted(resumed) == sorted(one) and len(one) == 38
    for key in one:
        assert torch.equal(resumed[key], one[key]), key
    assert train_steps(tmp_path / "run") == train_steps(tmp_path / "one")


def test_resume_on_processes_that_cannot_share_a_step_is_a_one_line_error(tmp_path):
    data = write_codes_data(tmp_path / "data")
    train(data, tmp_path / "run", "--max-steps", "1")  # one micro-batch per step
    before = tree(tmp_path / "run")
    run = torchrun_train(data, tmp_path / "run", "--max-steps", "2", "--resume", ok=False)
    assert run.returncode != 0
    assert "has 1 micro-batch(es) per step, which 2 processes cannot share: resume on" in run.stderr
    assert tree(tmp_path / "run") == before


# ----------------------------------------------------------------------------- prepare
def test_prepare_encodes_each_audio_once_next_to_it(tmp_path, capsys):
    data = tmp_path / "data"
    (data / "alice").mkdir(parents=True)
    (data / "bob").mkdir()
    write_audio(data / "alice/a.wav", rate=16000)  # resampled by the codec's loader
    write_audio(data / "bob/b.flac", rate=44100, channels=2, text=None)
    (data / "bob/b.txt").write_text("A transcript in a .txt file.")
    train_lora.main(["prepare", str(data), "--checkpoint", str(CKPT)])
    assert "prepared 2 of 2 audio files" in capsys.readouterr().out
    dac = codec.load(CKPT)
    for audio in (data / "alice/a.wav", data / "bob/b.flac"):
        codes = np.load(audio.with_suffix(".npy"))
        assert codes.shape == (10, math.ceil(0.3 * 44100 / 2048))
        assert np.array_equal(codes, codec.encode(dac, codec.load_audio(audio))[0].numpy())
    before = tree(data)
    train_lora.main(["prepare", str(data), "--checkpoint", str(CKPT)])
    assert "0 encoded" in capsys.readouterr().out and tree(data) == before  # cached codes are reused
    write_audio(data / "alice/a.wav", seconds=0.5)  # newer audio: encoded again
    train_lora.main(["prepare", str(data), "--checkpoint", str(CKPT)])
    assert "1 encoded" in capsys.readouterr().out
    assert np.load(data / "alice/a.npy").shape == (10, math.ceil(0.5 * 44100 / 2048))


def test_prepare_under_torchrun_shares_the_files_between_the_processes(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        write_audio(data / f"a{i}.wav", seconds=0.2 + 0.1 * i)
    stdout = torchrun("prepare", str(data), "--checkpoint", str(CKPT)).stdout
    assert stdout.count("prepared 3 of 3 audio files") == 1 and ": 3 encoded in" in stdout
    dac = codec.load(CKPT)
    for i in range(3):
        want = codec.encode(dac, codec.load_audio(data / f"a{i}.wav"))[0].numpy()
        assert np.array_equal(np.load(data / f"a{i}.npy"), want)


def test_audio_without_transcript_is_listed_and_skipped(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write_audio(data / "a.wav")
    write_audio(data / "lonely.wav", text=None)
    train_lora.main(["prepare", str(data), "--checkpoint", str(CKPT)])
    out, err = capsys.readouterr()
    assert "warning: skipped 1 file(s) without a .lab/.txt transcript:" in err and "lonely.wav" in err
    assert "1 skipped (no transcript)" in out
    assert (data / "a.npy").exists() and not (data / "lonely.npy").exists()


# ----------------------------------------------------------------------------- bad input
def renamed_lora(tmp_path, old, new):
    tensors = {k.replace(old, new): v for k, v in load_file(GOLDEN / "lora_weights.safetensors").items()}
    save_file(tensors, str(tmp_path / "lora.safetensors"))
    return tmp_path / "lora.safetensors"


def reshaped_lora(tmp_path):
    tensors = load_file(GOLDEN / "lora_weights.safetensors")
    tensors["model.layers.0.attention.wo.lora_A"] = torch.zeros(8, 32)  # wo reads 64 features
    save_file(tensors, str(tmp_path / "lora.safetensors"))
    return tmp_path / "lora.safetensors"


def audio_folder(tmp_path, *names, transcript="Hi."):
    data = tmp_path / "data"
    data.mkdir()
    for name in names:
        write_audio(data / name, text=transcript)
    return data


def garbage_audio(tmp_path):
    data = audio_folder(tmp_path, "a.wav")
    (data / "bad.wav").write_bytes(b"RIFF but not really a wav file")
    (data / "bad.lab").write_text("Hi.")
    return data


def run_folder(tmp_path, content):
    data = write_codes_data(tmp_path / "data")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / content).write_text("{}")
    return data


def foreign_run(tmp_path):
    data = run_folder(tmp_path, "run.json")
    (tmp_path / "out/state.pt").write_bytes(b"")
    return train_args(tmp_path, data, None, "--resume")


def edited_run(tmp_path):
    """A real run whose run.json was edited afterwards: its checkpoint no longer fits."""
    data = write_codes_data(tmp_path / "data")
    train_lora.main(train_args(tmp_path, data, None, "--max-steps", "1", "--val-every", "1"))
    run = json.loads((tmp_path / "out/run.json").read_text())
    (tmp_path / "out/run.json").write_text(json.dumps(dict(run, rank=4)))
    return train_args(tmp_path, data, None, "--resume", "--max-steps", "2")


def merge_args(t, lora=GOLDEN / "lora_weights.safetensors", out=None):
    return ["merge", "--checkpoint", str(CKPT), "--lora", str(lora), "--out", str(out or t / "merged")]


def train_args(t, data, out=None, *extra):
    return ["train", str(data), "--checkpoint", str(CKPT), "--out", str(out or t / "out"), *extra]


def untranscribed(tmp_path):
    data = audio_folder(tmp_path, "a.wav")
    write_audio(data / "b.wav", text=None)
    return data


def into_non_empty_folder(tmp_path):
    (tmp_path / "merged").mkdir()
    (tmp_path / "merged/keep.txt").write_text("mine")
    return merge_args(tmp_path)


BAD = {  # name: (setup(tmp_path) -> argv, words the error must contain)
    "prepare: empty data folder": (lambda t: ["prepare", str(audio_folder(t))], "no audio files"),
    "prepare: missing transcript with --strict": (lambda t: ["prepare", "--strict", str(untranscribed(t))],
                                                  "have no .lab/.txt transcript (--strict): "),
    "prepare: unreadable audio": (lambda t: ["prepare", str(garbage_audio(t))],
                                  "bad.wav is not a readable audio"),
    "prepare: empty transcript": (lambda t: ["prepare", str(audio_folder(t, "a.wav", transcript=" \n"))],
                                  "a.lab is empty"),
    "train: --dropout out of range": (lambda t: ["train", str(t), "--out", str(t / "o"), "--dropout", "1"],
                                      "--dropout must be in [0, 1)"),
    "train: empty data folder": (lambda t: train_args(t, audio_folder(t)), "no audio files or .npy codes"),
    "train: audio not prepared": (lambda t: train_args(t, audio_folder(t, "a.wav")), "train_lora.py prepare"),
    "train: --out not writable": (lambda t: train_args(t, write_codes_data(t / "data"),
                                                       t / "data/spk0/s0.lab/run"), "is not writable"),
    "train: --out holds another run": (lambda t: train_args(t, run_folder(t, "run.json")),
                                       "holds another run"),
    "train: --out holds other files": (lambda t: train_args(t, run_folder(t, "notes.txt")),
                                       "holds other files"),
    "train: --resume without a run": (lambda t: train_args(t, write_codes_data(t / "data"), None, "--resume"),
                                      "holds no run"),
    "train: --resume a folder that is not our run": (foreign_run, "is not the settings of a train_lora"),
    "train: --resume a run whose settings were edited": (edited_run, "state.pt does not fit this run's LoRA"),
    "merge: LoRA names the base lacks": (lambda t: merge_args(t, renamed_lora(t, "layers.1.", "layers.7.")),
                                         "LoRA for 'layers.7.attention."),
    "merge: LoRA shapes do not fit": (lambda t: merge_args(t, reshaped_lora(t)),
                                      "layers.0.attention.wo.lora_A"),
    "merge: LoRA file is not LoRA": (lambda t: merge_args(t, CKPT / "model-00001-of-00002.safetensors"),
                                     "holds no LoRA weights"),
    "merge: --out not empty": (into_non_empty_folder, "not empty"),
    "merge: --out not writable": (lambda t: merge_args(t, out=CKPT / "config.json/merged"), "not writable"),
}


def test_a_merge_that_cannot_finish_leaves_no_folder(tmp_path, monkeypatch):
    def full_disk(state, folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(train_lora, "save_hf_weights", full_disk)
    with pytest.raises(UserError, match=f"^cannot write {tmp_path}/merged: {os.strerror(errno.ENOSPC)}$"):
        train_lora.main(merge_args(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_gives_one_line_error_and_writes_nothing(tmp_path, case):
    setup, words = BAD[case]
    argv = setup(tmp_path)
    before, before_ckpt = tree(tmp_path), tree(CKPT)
    with pytest.raises(UserError) as error:
        train_lora.main(argv)
    message = str(error.value)
    assert words in message and "\n" not in message
    assert tree(tmp_path) == before and tree(CKPT) == before_ckpt


def test_cli_prints_one_error_line_and_exits_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit:
        common.cli(train_lora.main, ["prepare", str(tmp_path / "empty")])
    out, err = capsys.readouterr()
    assert exit.value.code == 2
    assert err.startswith("error: no audio files under") and err.count("\n") == 1
    assert out == ""


def test_bench_reports_steps_per_second_with_and_without_checkpointing(capsys):
    bench.main(["lora", "--device", "cpu", "--config", str(CKPT / "config.json"), "--seq-len", "160",
                "--steps", "1"])
    out = capsys.readouterr().out
    assert "batch 4 x 160 tokens" in out
    line = r"gradient checkpointing (on |off): ([\d.]+) steps/s, (\d+) tokens/s, peak memory ([\d.]+) GB"
    figures = re.findall(line, out)
    assert [on for on, *_ in figures] == ["on ", "off"] and out.count("steps/s") == 2
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    for _, steps, tokens, peak in figures:
        assert abs(int(tokens) - float(steps) * 4 * 160) <= 0.5 + 4 * 160 * 0.0005  # the rounding of steps/s
        assert float(steps) > 0 and 0.1 < float(peak) < ram  # this process's memory: torch alone is > 0.1 GB
    # the high-water mark restarts before each setting, then only grows: the last one's peak is the mark now
    assert float(figures[-1][3]) <= common.peak_memory_gb(torch.device("cpu")) + 0.005
