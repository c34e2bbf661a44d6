"""train_omnivoice.py's training (model, loss, LoRA, optimizer, run folder, export) against upstream
OmniVoice 0.2.1's own training of the tiny checkpoint (tests/fixtures/omnivoice-tiny/train, CPU fp32,
1 thread).

The batches are the goldens' (`golden/<case>_batches.npz`), handed to `train` as its batch source, so
these tests check what happens to a batch: losses, learning rates, gradients, clipping, AdamW, LoRA, the
epoch's base seed, checkpoints, resume and export. Tolerances are the fixture README's, except for what
AdamW and a merge make of the gradients: another CPU kind sums in another order, so the trained weights,
Adam's moments and the merged exports are held to the bounds of tests/bounds.py (docs/tests.md says why,
and on which CPU they are byte-identical to upstream's).
"""
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import omnivoice
import train_omnivoice as T
from bounds import adamw_bounds, assert_within, merge_bound, ulp, uniform_bound
from common import UserError

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests/fixtures/omnivoice-tiny/train"
CKPT, OVERLAY, GOLD = FIX.parent / "checkpoint", FIX / "init_tokenizer", FIX / "golden"
CASES = json.loads((FIX / "cases.json").read_text())
BATCH_KEYS = ("input_ids", "labels", "audio_mask", "position_ids", "attention_mask")
ALL = ("full_w1", "lora_w1", "full_w2", "lora_w2")
# A gradient's error on another CPU kind, in ULPs of its tensor's largest element: at step 1 (rounding alone)
# up to 11, later steps also carry the earlier steps' weight differences (LoRA A's gradient is B^T times the
# rest, and B moved); the moments trained on a Zen 3 need 34 to meet the Zen 4's goldens (docs/tests.md).
GRAD_ULPS = 64


@pytest.fixture(autouse=True)
def one_thread():
    """The goldens' setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def golden_batches(case: str, rank=None, world=1, seeds=None):
    """batches_for_epoch from the case's recorded micro-batches; rank r of `world` gets every world-th."""
    npz = np.load(GOLD / f"{case}_batches.npz")
    steps = CASES["train"][case]["micro_steps"]

    def batches(epoch, base_seed):
        if seeds is not None:
            seeds.append(base_seed)
        for m in steps:
            if m["epoch"] == epoch and (rank is None or m["index"] % world == rank):
                batch = {k: torch.from_numpy(npz[f"mb{m['index']}_{k}"]) for k in BATCH_KEYS}
                yield dict(batch, ids=m["samples"], worker=m["sample_workers"])  # as the loader's
    return batches


def case_argv(case: str, folder: Path, *extra) -> list:
    """The case's train command: its exact upstream train config (checkpoint given by flag), the overlay."""
    c = CASES["train"][case]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.json").write_text(json.dumps(c["train_config"]))
    (folder / "data.json").write_text(json.dumps({"train": [{"manifest_path": ["tokens/data.lst"]}]}))
    argv = ["train", "--train-config", str(folder / "train.json"), "--data-config", str(folder / "data.json"),
            "--checkpoint", str(CKPT), "--tokenizer", str(OVERLAY), "--out", str(folder / "run"),
            "--device", "cpu"]
    if c["method"] == "lora":
        (folder / "lora.json").write_text(json.dumps(CASES["lora"]["lora_config"]))
        argv += ["--method", "lora", "--lora-config", str(folder / "lora.json"),
                 "--lora-seed", str(CASES["lora"]["stage_seed"])]
    return argv + list(extra)


def metrics(run_dir: Path) -> tuple:
    lines = [json.loads(line) for line in (run_dir / T.METRICS).read_text().splitlines()]
    return [r for r in lines if "micro_step" in r], [r for r in lines if "step" in r]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each case trained once (cached): its run folder, base seeds drawn, step-1 gradients (before
    clipping), every step's gradients as the optimizer took them (clipped), the run."""
    done = {}

    def get(case: str) -> dict:
        if case not in done:
            folder, seeds, grads, steps = tmp_path_factory.mktemp(case), [], [], []
            clip = T.clip_gradients

            def recording_clip(params, max_norm):
                if not grads:
                    grads.extend(p.grad.clone() for p in params)
                norms = clip(params, max_norm)
                steps.append([p.grad.clone() for p in params])
                return norms
            T.clip_gradients = recording_clip
            threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
            torch.set_num_threads(1)
            torch.use_deterministic_algorithms(True)
            try:
                with torch.random.fork_rng():
                    run = T.train(T.parse_args(case_argv(case, folder)), golden_batches(case, seeds=seeds))
            finally:
                torch.use_deterministic_algorithms(deterministic)
                T.clip_gradients = clip
                torch.set_num_threads(threads)
            names = [name for name, _ in run["trainable"]]
            done[case] = dict(folder=folder, run_dir=folder / "run", seeds=seeds, run=run,
                              grads=dict(zip(names, grads)), steps=[dict(zip(names, s)) for s in steps])
        return done[case]
    return get


@functools.cache
def initial_weights(case: str) -> dict:
    """What a case's training starts from: the checkpoint (full) or the LoRA init (equal to ours within its
    draws' rounding: test_lora_init_draws_as_peft)."""
    full = CASES["train"][case]["method"] == "full"
    return load_file(CKPT / "model.safetensors" if full else GOLD / f"{case}_lora_init.safetensors")


def adamw_bound(got: dict, case: str, name: str) -> dict:
    """bounds.adamw_bounds for trained parameter `name` of a case's run: how far its weight and moments may
    be from upstream's when every step's gradient is GRAD_ULPS ULPs of its largest element away."""
    c, start = CASES["train"][case], initial_weights(case)
    grads = [step[name] for step in got["steps"]]
    errors = [GRAD_ULPS * ulp(g.abs().max()).expand(g.shape) for g in grads]
    weight = start[name if c["method"] == "full" else T.peft_name(name, saved=False)]
    return adamw_bounds(weight, grads, [o["lr_used"] for o in c["optimizer_steps"]], errors,
                        weight_decay=c["train_config"].get("weight_decay", 0.01),  # upstream's default
                        start_error=0.0 if c["method"] == "full" else uniform_bound(weight))  # LoRA's draws


def lora_pair(adapter: dict, name: str) -> tuple:
    """An adapter's (B, A) for base weight `name` (peft's saved names)."""
    prefix = "base_model.model." + name.removesuffix(".weight")
    return adapter[f"{prefix}.lora_B.weight"], adapter[f"{prefix}.lora_A.weight"]


# ----------------------------------------------------------------------------- losses, lr, norms
@pytest.mark.upstream
@pytest.mark.parametrize("case", ALL)
def test_losses_lrs_and_norms_match_upstream(trained, case):
    c, got = CASES["train"][case], trained(case)
    micro, steps = metrics(got["run_dir"])
    assert [m["micro_step"] for m in micro] == list(range(len(c["micro_steps"])))
    for m, want in zip(micro, c["micro_steps"]):
        assert abs(m["loss"] - want["loss"]) <= 1e-5, (m, want["loss"])
        assert m["epoch"] == want["epoch"] and m["ids"] == want["samples"]
    assert [s["step"] for s in steps] == [o["step"] for o in c["optimizer_steps"]] == [1, 2, 3, 4]
    for s, want in zip(steps, c["optimizer_steps"]):
        assert s["lr"] == want["lr_used"] and s["lr_after"] == want["lr_after"]  # exact
        assert s["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert s["clip_coef"] == pytest.approx(want["clip_coef"], rel=1e-5)
    assert steps[0]["lr"] == 0.0  # warm-up's first step


@pytest.mark.upstream
@pytest.mark.parametrize("case", ALL)
def test_epoch_base_seeds_match_upstream(trained, case):
    """Full: consecutive draws after seed 42. LoRA: epoch 1's seed comes after 5 or 6 micro-steps of
    dropout draws (q, k, v, o, gate, up, down per layer), so it checks their number, shapes and order."""
    assert trained(case)["seeds"] == CASES["train"][case]["base_seeds"]


@pytest.mark.upstream
@pytest.mark.parametrize("case", ALL)
def test_step1_gradients_match_upstream(trained, case):
    """Accumulated gradients of optimizer step 1, before clipping, in upstream's parameter order."""
    c, got = CASES["train"][case], trained(case)
    names = [T.peft_name(n, saved=False) if c["method"] == "lora" else n for n in got["grads"]]
    assert names == c["param_order_with_grad"]
    grads = dict(zip(names, got["grads"].values()))
    file = GOLD / f"{case}_grads_step1.safetensors"  # full_w2 has the per-tensor norms alone
    want = load_file(file) if case != "full_w2" else {}
    assert want.keys() <= grads.keys() and (len(want) >= 16 or not file.exists())
    for name, tensor in want.items():
        torch.testing.assert_close(grads[name], tensor, rtol=1e-5, atol=1e-8, msg=name)
    norms = [float(torch.linalg.vector_norm(g)) for g in got["grads"].values()]
    assert norms == pytest.approx(c["optimizer_steps"][0]["tensor_norms"], rel=1e-5, abs=1e-12)


def test_cli_batch_source_is_the_data_sections_loader(trained, tmp_path, monkeypatch, capsys):
    """Without a batch source, train reads the data config's shards (paths from its folder) and asks
    epoch_batches for each epoch with the run's settings, tokenizer, base seed and --num-workers; the
    samples its length filter skipped are counted and named at the end."""
    calls, source = [], golden_batches("full_w1")

    def epoch_batches(shards, settings, tokenizer, epoch, base_seed, num_workers, rank=0, world=1, **more):
        calls.append((shards, settings["batch_tokens"], tokenizer.get_vocab_size(), epoch, base_seed,
                      num_workers, rank, world))
        more["dropped"].extend(["long_clip", "short_clip"])  # both epochs skip them: said once
        return source(epoch, base_seed)
    monkeypatch.setattr(T, "train_shards", lambda data, base: [data["train"], base])
    monkeypatch.setattr(T, "epoch_batches", epoch_batches)
    with torch.random.fork_rng():
        T.train(T.parse_args(case_argv("full_w1", tmp_path, "--num-workers", "3")))
    shards = [[{"manifest_path": ["tokens/data.lst"]}], tmp_path]
    seeds = CASES["train"]["full_w1"]["base_seeds"]
    assert calls == [(shards, 320, 1040, e, seeds[e], 3, 0, 1) for e in (0, 1)]
    whole = trained("full_w1")["run_dir"]
    logged = (tmp_path / "run" / T.METRICS).read_text()
    assert logged == (whole / T.METRICS).read_text() + '{"skipped": ["long_clip", "short_clip"]}\n'
    assert "\n2 samples skipped by the length filter (long_clip, short_clip): outside 50-" in (
        capsys.readouterr().err)


# ----------------------------------------------------------------------------- LoRA
@pytest.mark.upstream
def test_lora_init_draws_as_peft():
    """After torch.manual_seed(stage seed): per targeted Linear in module order, peft's three draws."""
    model = T.build_model(CKPT, OVERLAY)
    q = model.layers[0].self_attn.q_proj
    with torch.random.fork_rng():
        torch.manual_seed(CASES["lora"]["stage_seed"])
        T.add_lora(model, T.lora_config(CASES["lora"]["lora_config"]))
    got = {T.peft_name(n, saved=False): p for n, p in T.trainable_parameters(model)}
    for case in ("lora_w1", "lora_w2"):
        want = load_file(GOLD / f"{case}_lora_init.safetensors")
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():  # A: the draws' rounding (equal here from AVX2 up); B: zero
            assert_within(got[name], tensor, uniform_bound(tensor) if "lora_A" in name else 0.0, name)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert len(frozen) == 26 and all(".lora_" not in n for n in frozen)  # every base weight, none copied
    lora = model.layers[0].self_attn.q_proj
    assert lora.base_layer is q and lora.scaling == 2.0 and lora.lora_dropout.p == 0.05


def test_lora_settings_and_modules_to_save():
    """Another rank, alpha, dropout and targets; modules_to_save train fully, saved under peft's names."""
    model = T.build_model(CKPT, OVERLAY)
    lora = T.lora_config(dict(r=4, lora_alpha=6, lora_dropout=0.0, target_modules=["q_proj", "down_proj"],
                              modules_to_save=["audio_heads"], task_type=None))
    wrapped = T.add_lora(model, lora)
    assert wrapped == ["layers.0.self_attn.q_proj", "layers.0.down_proj", "layers.1.self_attn.q_proj",
                       "layers.1.down_proj"]
    q = model.layers[0].self_attn.q_proj
    assert q.scaling == 1.5 and isinstance(q.lora_dropout, torch.nn.Identity)
    assert q.lora_A.weight.shape == (4, 64)
    names = [T.peft_name(n) for n, _ in T.trainable_parameters(model)]
    assert names[:2] == ["base_model.model.llm.layers.0.self_attn.q_proj.lora_A.weight",
                         "base_model.model.llm.layers.0.self_attn.q_proj.lora_B.weight"]
    assert names[-1] == "base_model.model.audio_heads.weight" and len(names) == 9
    with pytest.raises(UserError, match="audio_embeddings is an nn.Embedding, not an nn.Linear"):
        T.add_lora(T.build_model(CKPT, OVERLAY), T.lora_config(dict(target_modules=["audio_embeddings"])))
    with pytest.raises(UserError, match="unknown key 'rank'"):
        T.lora_config(dict(rank=8))


def test_adamw_decays_every_trained_parameter_the_norm_weights_too(tmp_path):
    """Upstream's AdamW has one group: the train config's weight_decay on every trained parameter, the 1-D
    norm weights included (no exclusion list, as transformers' Trainer would make)."""
    argv = case_argv("full_w1", tmp_path)
    config = dict(CASES["train"]["full_w1"]["train_config"], weight_decay=0.25)  # not the default 0.01
    (tmp_path / "train.json").write_text(json.dumps(config))
    run = T.start_run(T.parse_args(argv), 0, 1, torch.device("cpu"))
    names = {id(p): name for name, p in run["trainable"]}
    decay = [(names.get(id(p)), group["weight_decay"]) for group in run["optimizer"].param_groups
             for p in group["params"]]
    assert [name for name, _ in decay] == list(names.values())  # each once, in upstream's order
    assert {value for _, value in decay} == {0.25} and len(decay) == 26
    norms = [name for name, p in run["trainable"] if p.ndim == 1]
    assert len(norms) == 9 and norms[0] == "llm.layers.0.self_attn.q_norm.weight"
    assert norms[-1] == "llm.norm.weight"


@pytest.mark.upstream
@pytest.mark.parametrize("case", ("lora_w1", "lora_w2"))
def test_lora_adapter_and_adam_state_match_upstream(trained, case):
    """The adapter and AdamW's moments within their bounds of upstream's (adamw_bound), its config as
    upstream's."""
    got = trained(case)
    ckpt = got["run_dir"] / "checkpoint-4"
    adapter, want = load_file(ckpt / T.ADAPTER_FILE), load_file(GOLD / f"{case}_adapter_model.safetensors")
    assert adapter.keys() == want.keys()
    optimizer = got["run"]["optimizer"]
    adam = load_file(GOLD / f"{case}_adam_state.safetensors")
    for name, p in got["run"]["trainable"]:
        bound, key = adamw_bound(got, case, name), T.peft_name(name, saved=False)
        assert_within(adapter[T.peft_name(name)], want[T.peft_name(name)], bound["weight"], name)
        state = optimizer.state[p]
        assert float(state["step"]) == CASES["train"][case]["adam_step"]
        for moment in ("exp_avg", "exp_avg_sq"):
            assert_within(state[moment], adam[f"{key}.{moment}"], bound[moment], f"{key}.{moment}")
    config = json.loads((ckpt / T.ADAPTER_CONFIG).read_text())
    golden_config = json.loads((GOLD / f"{case}_adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(CKPT)
    assert {**config, "base_model_name_or_path": "<init checkpoint>"} == golden_config


# ----------------------------------------------------------------------------- export
def tensor_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.upstream
def test_full_export_is_upstreams_file_within_adamw_bounds(trained, tmp_path):
    """The export is the run's last checkpoint, as upstream's file (names, order, dtypes, the buffer): every
    trained tensor within its bound of upstream's (byte-identical on the goldens' CPU kind: docs/tests.md),
    the rest equal; the checkpoint's tokenizer overlay and config.json as they were."""
    got = trained("full_w1")
    out = tmp_path / "export"
    T.main(["export", str(got["run_dir"]), "--out", str(out)])
    last = got["run_dir"] / "checkpoint-4/model.safetensors"
    assert (out / "model.safetensors").read_bytes() == last.read_bytes()
    state, golden = load_file(out / "model.safetensors"), load_file(GOLD / "full_w1_export_model.safetensors")
    assert list(state) == list(golden)
    assert [t.dtype for t in state.values()] == [t.dtype for t in golden.values()]
    trained_names = {name for name, _ in got["run"]["trainable"]}
    for name, tensor in golden.items():
        if name in trained_names:
            assert_within(state[name], tensor, adamw_bound(got, "full_w1", name)["weight"], name)
        else:
            assert torch.equal(state[name], tensor), name
    assert (out / "tokenizer.json").read_bytes() == (OVERLAY / "tokenizer.json").read_bytes()
    assert (out / "config.json").read_bytes() == (CKPT / "config.json").read_bytes()
    assert not (out / "adapter").exists()
    model = omnivoice.load(out)  # what omnivoice.py --checkpoint OUT does
    assert model.audio_tokenizer is not None and model.tokenizer.get_vocab_size() == 1040
    # full_w2: its partial golden elementwise; the tensors known by their sha256 alone by their largest
    # change from the initial weights (that moves no further than the elements do)
    got, start = trained("full_w2"), initial_weights("full_w2")
    state = load_file(got["run_dir"] / "checkpoint-4/model.safetensors")
    partial = load_file(GOLD / "full_w2_export_partial.safetensors")
    for name, info in CASES["train"]["full_w2"]["export"]["tensors"].items():
        if name not in trained_names:
            assert tensor_sha(state[name]) == info["sha256"], name
            continue
        bound = adamw_bound(got, "full_w2", name)["weight"]
        if name in partial:
            assert_within(state[name], partial[name], bound, name)
        else:
            change = (state[name].double() - start[name].double()).abs().max()
            assert_within(change, torch.tensor(info["max_abs_delta"]), bound.max() + ulp(change), name)


@pytest.mark.upstream
@pytest.mark.parametrize("case", ("lora_w1", "lora_w2"))
def test_lora_export_merges_as_peft(trained, tmp_path, case):
    """Each targeted weight is W + (B @ A) x scaling of the run's adapter, within a merge's rounding of
    upstream's merge of its own adapter (bounds.merge_bound, plus how far the adapters are apart); every other
    tensor is the base checkpoint's; the adapter ships beside it."""
    got = trained(case)
    out = tmp_path / "export"
    T.main(["export", str(got["run_dir"]), "--out", str(out), "--step", "4"])
    state, base = load_file(out / "model.safetensors"), load_file(CKPT / "model.safetensors")
    assert state.keys() == base.keys()
    ours = load_file(got["run_dir"] / "checkpoint-4" / T.ADAPTER_FILE)
    theirs = load_file(GOLD / f"{case}_adapter_model.safetensors")
    merged = load_file(GOLD / "lora_w1_export_merged.safetensors") if case == "lora_w1" else {}
    config = CASES["lora"]["lora_config"]
    scaling = CASES["lora"].get("scaling", config["lora_alpha"] / config["r"])
    tensors = CASES["train"][case]["export"]["tensors"]
    for name, info in tensors.items():
        if not info["changed"]:
            assert torch.equal(state[name], base[name]), name
            continue
        (b, a), (b_up, a_up) = lora_pair(ours, name), lora_pair(theirs, name)
        bound = merge_bound(base[name], b, a, scaling)  # ours from the exact merge of our adapter
        bound += scaling * (b.double() @ a.double() - b_up.double() @ a_up.double()).abs()  # the adapters'
        if name in merged:  # upstream's merge of its adapter, which rounded too
            bound += merge_bound(base[name], b_up, a_up, scaling)
            assert_within(state[name], merged[name], bound, name)
        else:  # upstream's by its sha256 alone: the exact merge of its adapter
            assert_within(state[name], base[name].double() + scaling * (b_up.double() @ a_up.double()), bound,
                          name)
    assert sum(info["changed"] for info in tensors.values()) == 14
    assert len(merged) == (14 if case == "lora_w1" else 0)
    for name in (T.ADAPTER_FILE, T.ADAPTER_CONFIG):
        assert (out / "adapter" / name).read_bytes() == (got["run_dir"] / "checkpoint-4" / name).read_bytes()
    assert omnivoice.load(out).config["vocab_size"] == 1040


# ----------------------------------------------------------------------------- resume
@pytest.mark.parametrize("case", ("full_w1", "lora_w1"))
def test_resume_is_bit_for_bit(trained, tmp_path, case):
    """Checkpoint at step 2 (inside epoch 0), the run killed after it; --resume ends where the whole run did:
    same weights, AdamW state and metrics (LoRA: epoch 1's base seed after restored dropout draws)."""
    whole = trained(case)["run_dir"]
    argv = case_argv(case, tmp_path, "--save-steps", "2")
    with torch.random.fork_rng():
        T.train(T.parse_args(argv), golden_batches(case))
    run_dir = tmp_path / "run"
    shutil.rmtree(run_dir / "checkpoint-4")  # killed after checkpoint-2
    seeds = []
    with torch.random.fork_rng():
        T.train(T.parse_args(argv + ["--resume"]), golden_batches(case, seeds=seeds))
    assert seeds == CASES["train"][case]["base_seeds"]  # epoch 0's from the checkpoint, epoch 1's drawn
    assert (run_dir / T.METRICS).read_text() == (whole / T.METRICS).read_text()
    for f in sorted((whole / "checkpoint-4").iterdir()):
        if f.name != T.STATE:
            assert (run_dir / "checkpoint-4" / f.name).read_bytes() == f.read_bytes(), f.name
    a, b = (torch.load(d / "checkpoint-4" / T.STATE, weights_only=True) for d in (run_dir, whole))
    loop = ("step", "micro_step", "epoch", "position", "base_seed")
    assert [a[k] for k in loop] == [b[k] for k in loop] == [4, 8, 1, 3, CASES["train"][case]["base_seeds"][1]]
    assert all(torch.equal(x["torch"], y["torch"]) for x, y in zip(a["rng"], b["rng"]))
    for p, q in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(p[k], q[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_checkpointing_changes_no_number(trained, tmp_path):
    """--checkpointing recomputes each layer in backward, its LoRA dropout replayed from the saved random
    state: the same losses, epoch seeds and adapter as without it."""
    seeds = []
    with torch.random.fork_rng():
        T.train(T.parse_args(case_argv("lora_w1", tmp_path, "--checkpointing")),
                golden_batches("lora_w1", seeds=seeds))
    whole = trained("lora_w1")["run_dir"]
    assert seeds == CASES["train"]["lora_w1"]["base_seeds"]
    assert (tmp_path / "run" / T.METRICS).read_text() == (whole / T.METRICS).read_text()
    assert (tmp_path / "run/checkpoint-4" / T.ADAPTER_FILE).read_bytes() == \
        (whole / "checkpoint-4" / T.ADAPTER_FILE).read_bytes()


# ----------------------------------------------------------------------------- several processes
WORKER = """
import os, sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
torch.set_num_threads(1)
import train_omnivoice as T
import test_train_omnivoice as t
try:
    T.train(T.parse_args({argv!r}), t.golden_batches("full_w1", int(os.environ["RANK"]), 2))
finally:
    T.dist.destroy_process_group()
"""


def test_two_processes_give_one_process_update(trained, tmp_path):
    """torchrun, 2 CPU processes (gloo), 1 micro-batch each per step = 1 process accumulating 2: the same
    gradients (halved, then summed), so upstream's norms and this CPU's one-process weights, here bit for bit
    (stated: 1e-6); metrics.jsonl names both processes' samples (rank 0's, then rank 1's)."""
    script = tmp_path / "worker.py"
    argv = case_argv("full_w1", tmp_path, "--grad-accum", "1")
    script.write_text(WORKER.format(root=str(ROOT), tests=str(ROOT / "tests"), argv=argv))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    micro, steps = metrics(tmp_path / "run")
    one = [m["ids"] for m in metrics(trained("full_w1")["run_dir"])[0]]
    assert [m["ids"] for m in micro] == [a + b for a, b in zip(one[0::2], one[1::2])]
    want = CASES["train"]["full_w1"]["optimizer_steps"]
    assert [s["grad_norm"] for s in steps] == pytest.approx([o["grad_norm"] for o in want], rel=1e-5)
    state = load_file(tmp_path / "run/checkpoint-4/model.safetensors")
    one_process = load_file(trained("full_w1")["run_dir"] / "checkpoint-4/model.safetensors")
    for name, tensor in one_process.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_memory_tool_runs_small(capsys):
    """tools/omnivoice_train_memory.py (the docs' memory figures) on the tiny dims: LoRA trains 2 x r x
    (in + out) per projection, full every parameter."""
    spec = importlib.util.spec_from_file_location("mem", ROOT / "tools/omnivoice_train_memory.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with torch.random.fork_rng():
        lora = tool.main(["--config", str(CKPT / "config.json"), "--length", "60", "--checkpointing"])
        full = tool.main(["--config", str(CKPT / "config.json"), "--length", "60", "--method", "full"])
    per_layer = 16 * ((64 + 128) + 2 * (64 + 64) + (128 + 64) + 2 * (64 + 96) + (96 + 64))  # r 16
    assert lora["trained"] == 2 * per_layer
    assert full["trained"] == sum(t.numel() for t in load_file(CKPT / "model.safetensors").values()) - 8
    assert lora["peak_gib"] >= lora["built_gib"] > 0
    assert "lora, checkpointing True, 60 tokens: 0.0 M trained parameters" in capsys.readouterr().out


# ----------------------------------------------------------------------------- errors
def test_overlay_pads_the_tokenizer_to_the_embedding_as_the_fixtures_overlay(tmp_path, capsys):
    T.main(["overlay", "--checkpoint", str(CKPT), "--out", str(tmp_path / "overlay")])
    assert (tmp_path / "overlay/tokenizer.json").read_bytes() == (OVERLAY / "tokenizer.json").read_bytes()
    assert "733 tokens + 307 placeholders" in capsys.readouterr().out
    T.build_model(CKPT, tmp_path / "overlay")  # trains without the size error


def test_a_run_stopped_before_its_first_checkpoint_starts_over_and_resume_says_so(tmp_path, capsys):
    """Issue 58 item 10: interrupted before its first checkpoint, a run leaves only its config and metrics;
    --resume says to start it over, and the same command does so (it was refused as "not empty")."""
    argv, run = case_argv("full_w1", tmp_path), tmp_path / "run"

    def interrupted(epoch, base_seed):
        raise KeyboardInterrupt
        yield

    with torch.random.fork_rng():
        said = "^interrupted at step 0, before the first checkpoint: run the same command again to start"
        with pytest.raises(UserError, match=said + " over$"):
            T.train(T.parse_args(argv), interrupted)
    assert sorted(p.name for p in run.iterdir()) == [T.RUN_CONFIG]
    (run / T.METRICS).write_text('{"step": 1}\n')  # as a run stopped after its first logged step leaves it
    said = f"^--resume: {re.escape(str(run))}'s run stopped before its first checkpoint: run the same"
    with pytest.raises(UserError, match=said + " command without --resume to start it over$"):
        T.train(T.parse_args(argv + ["--resume"]), golden_batches("full_w1"))
    with torch.random.fork_rng():
        T.train(T.parse_args(argv), golden_batches("full_w1"))
    assert "its run stopped before its first checkpoint: starting over" in capsys.readouterr().err
    (micro, steps), c = metrics(run), CASES["train"]["full_w1"]
    assert [m["step"] for m in steps] == [o["step"] for o in c["optimizer_steps"]]  # the old line is gone
    assert all(abs(m["loss"] - want["loss"]) <= 1e-5 for m, want in zip(micro, c["micro_steps"], strict=True))
    assert T.checkpoints(run)


def test_errors_are_one_line(trained, tmp_path):
    base = case_argv("full_w1", tmp_path / "a")
    without_overlay = [a for a in base if a not in ("--tokenizer", str(OVERLAY))]
    with pytest.raises(UserError, match=r"has 733 tokens, .* 1040 rows: pass --tokenizer DIR, .* overlay"):
        T.train(T.parse_args(without_overlay), golden_batches("full_w1"))
    s2 = [str(ROOT / "tests/fixtures/s2-tiny/checkpoint") if a == str(CKPT) else a for a in base]
    trains_elsewhere = r"is an S2-Pro checkpoint \(fish_qwen3_omni\): fine-tune it with train_lora.py$"
    with pytest.raises(UserError, match=trains_elsewhere):
        T.train(T.parse_args(s2), golden_batches("full_w1"))
    with pytest.raises(UserError, match=trains_elsewhere):
        T.main(["overlay", "--checkpoint", s2[s2.index("--checkpoint") + 1], "--out", str(tmp_path / "o")])
    with pytest.raises(UserError, match="^cannot read /dev/null: Expecting value"):  # it "did not exist"
        T.run_config(T.parse_args(base + ["--method", "lora", "--lora-config", "/dev/null"]))
    with pytest.raises(UserError, match=f"^--lora-config {tmp_path} is a folder, not a JSON file$"):
        T.run_config(T.parse_args(base + ["--method", "lora", "--lora-config", str(tmp_path)]))
    underscored = T.parse_args([a.replace("-config", "_config") for a in base])  # upstream's spelling too
    assert (underscored.train_config, underscored.data_config) == (base[2], base[4])
    for keep in ("0", "-2"):
        said = f"keep_last_n_checkpoints must be -1 (all) or an integer >= 1 (it is {keep})"
        with pytest.raises(UserError, match=f"^{re.escape(said)}$"):
            T.run_config(T.parse_args(base + ["--keep-last", keep]))
    (tmp_path / "bad.json").write_text(json.dumps({"learning_rat": 1e-3}))
    with pytest.raises(UserError, match="unknown field 'learning_rat'"):
        T.run_config(T.parse_args(base[:2] + [str(tmp_path / "bad.json")] + base[3:]))
    (tmp_path / "six.json").write_text(json.dumps({"num_audio_codebook": 6}))
    with pytest.raises(UserError, match="num_audio_codebook is 6, .*config.json's 8: leave it out"):
        T.run_config(T.parse_args(base[:2] + [str(tmp_path / "six.json")] + base[3:]))
    for lr in ("-1", "nan", "0"):  # issue 58 item 12: torch's ValueError was a traceback
        said = f"^learning_rate must be a number > 0 \\(it is {float(lr)!r}\\)$"
        with pytest.raises(UserError, match=said):
            T.run_config(T.parse_args(base + ["--lr", lr]))
    defaults = T.run_config(T.parse_args(base[:1] + base[3:]))["train_config"]  # no --train-config
    fields = ("audio_vocab_size", "audio_mask_id", "num_audio_codebook")
    assert [defaults[k] for k in fields] == [1025, 1024, 8]  # the checkpoint's
    (tmp_path / "lora.json").write_text(json.dumps({"r": 4, "use_dora": True}))
    with pytest.raises(UserError, match="use_dora=True is not supported"):
        T.run_config(T.parse_args(base + ["--method", "lora", "--lora-config", str(tmp_path / "lora.json")]))
    done = trained("full_w1")["folder"]
    again = case_argv("full_w1", done)
    with pytest.raises(UserError, match="is not empty: pass --resume"):
        T.train(T.parse_args(again), golden_batches("full_w1"))
    with pytest.raises(UserError, match=r"with train_config.learning_rate=0.001, this command gives 0.5"):
        T.train(T.parse_args(again + ["--resume", "--lr", "0.5"]), golden_batches("full_w1"))
    with pytest.raises(UserError, match="started with method='full', this command gives 'lora'"):
        T.train(T.parse_args(again + ["--resume", "--method", "lora"]), golden_batches("full_w1"))
    with pytest.raises(UserError, match="has no checkpoint-7"):
        T.export(T.parse_args(["export", str(done / "run"), "--out", str(tmp_path / "x"), "--step", "7"]))
    assert not (tmp_path / "x").exists() and not (tmp_path / "a" / "run").exists()


# ----------------------------------------------------------------------------- the three commands
@pytest.mark.upstream
@pytest.mark.parametrize("case", ("full_w1", "lora_w2"))
def test_the_three_commands_from_the_clips_give_upstreams_run(trained, tmp_path, case):
    """tokens from the dataset's clips, train on those tokens with the case's own config files, export: the
    data and training sections joined by the CLI alone give upstream's batches, losses, learning rates and
    norms, and the export of the run trained on upstream's recorded batches (full: the file itself; LoRA: the
    adapter), which the tests above hold to upstream's."""
    T.main(["tokens", "--input-jsonl", str(FIX / "data/data.jsonl"), "--checkpoint", str(CKPT),
            "--out", str(tmp_path / "tokens"), "--samples-per-shard", "4", "--min-num-shards", "3"])
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng():
            T.main(case_argv(case, tmp_path))  # its data config names tokens/data.lst beside it
    finally:
        torch.use_deterministic_algorithms(deterministic)
    c = CASES["train"][case]
    micro, steps = metrics(tmp_path / "run")
    assert [m["ids"] for m in micro] == [m["samples"] for m in c["micro_steps"]]
    assert max(abs(m["loss"] - want["loss"]) for m, want in zip(micro, c["micro_steps"], strict=True)) <= 1e-5
    for s, want in zip(steps, c["optimizer_steps"], strict=True):
        assert s["lr"] == want["lr_used"] and s["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    T.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    same_batches = trained(case)["run_dir"] / "checkpoint-4"
    if case == "full_w1":
        exported = (tmp_path / "export/model.safetensors").read_bytes()
        assert exported == (same_batches / "model.safetensors").read_bytes()
    else:
        exported = (tmp_path / "export/adapter" / T.ADAPTER_FILE).read_bytes()
        assert exported == (same_batches / T.ADAPTER_FILE).read_bytes()


# ----------------------------------------------------------------------------- a run, as users run it
def test_a_run_records_absolute_paths_so_export_and_resume_work_from_any_folder(tmp_path, monkeypatch,
                                                                                capsys):
    """Issue 58 item 9: trained with relative paths, as the docs show them, then exported and resumed from
    another folder: the overlay's tokenizer ships (it was the checkpoint's 733 tokens), resume finds its data
    config; a path given again is compared resolved; an export whose tokenizer is gone is one line."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    argv = case_argv("full_w1", work, "--save-steps", "2")
    shutil.copytree(OVERLAY, work / "overlay")
    data = json.loads((work / "data.json").read_text())
    (work / "data.json").write_text(json.dumps(dict(data, dev=[{"manifest_path": ["dev/data.lst"]}])))
    relative = {str(work / "train.json"): "train.json", str(work / "data.json"): "data.json",
                str(CKPT): os.path.relpath(CKPT, work), str(OVERLAY): "overlay", str(work / "run"): "run"}
    monkeypatch.chdir(work)
    with torch.random.fork_rng():
        T.train(T.parse_args([relative.get(a, a) for a in argv]), golden_batches("full_w1"))
    config = json.loads((work / "run" / T.RUN_CONFIG).read_text())
    assert [config["train_config"]["init_from_checkpoint"], config["tokenizer"], config["data_config"]] == [
        str(CKPT), str(work / "overlay"), str(work / "data.json")]
    assert "note: the data config's 'dev' entries are not read" in capsys.readouterr().err
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    T.main(["export", str(work / "run"), "--out", "export"])
    assert (elsewhere / "export/tokenizer.json").read_bytes() == (OVERLAY / "tokenizer.json").read_bytes()
    shutil.rmtree(work / "run/checkpoint-4")
    resume = ["train", "--out", str(work / "run"), "--resume", "--device", "cpu"]
    with torch.random.fork_rng():
        T.train(T.parse_args(resume), golden_batches("full_w1"))
    assert f"note: resumed from {work / 'run/checkpoint-2'} (step 2 of 4)\n" in capsys.readouterr().err
    assert [p.name for p in T.checkpoints(work / "run")] == ["checkpoint-2", "checkpoint-4"]
    (elsewhere / "data.json").write_text((work / "data.json").read_text())  # the same text, another file
    said = (f"was started with data_config='{work / 'data.json'}', this command gives"
            f" '{elsewhere / 'data.json'}'")
    with pytest.raises(UserError, match=re.escape(said)):
        T.train(T.parse_args(resume + ["--data-config", "data.json"]), golden_batches("full_w1"))
    monkeypatch.chdir(work)  # here data.json is the run's own
    T.train(T.parse_args(resume + ["--data-config", "data.json"]), golden_batches("full_w1"))
    assert "is already at step 4 of 4: nothing to do" in capsys.readouterr().out
    (work / "overlay/tokenizer.json").unlink()
    with pytest.raises(UserError, match=f"^the run's tokenizer {re.escape(str(work / 'overlay'))} has no"
                                        " tokenizer.json: the run was trained with it"):
        T.main(["export", str(work / "run"), "--out", str(elsewhere / "again")])
    assert not (elsewhere / "again").exists()


def test_the_last_n_checkpoints_are_kept_and_a_full_disk_is_said_before_writing(tmp_path, monkeypatch,
                                                                                 capsys):
    """Issue 58 item 14: --keep-last N removes the oldest checkpoints (default 3, where upstream's -1 keeps
    all: 7.2 GB each at the real size) and may change on --resume; a checkpoint the disk cannot hold stops
    the run in one line before anything is written."""
    argv = case_argv("full_w1", tmp_path / "a", "--save-steps", "1", "--keep-last", "2")
    with torch.random.fork_rng():
        T.train(T.parse_args(argv), golden_batches("full_w1"))
    run = tmp_path / "a/run"
    assert [p.name for p in T.checkpoints(run)] == ["checkpoint-3", "checkpoint-4"]
    shutil.rmtree(run / "checkpoint-4")
    with torch.random.fork_rng():
        T.train(T.parse_args(argv[:-1] + ["1", "--resume"]), golden_batches("full_w1"))
    assert [p.name for p in T.checkpoints(run)] == ["checkpoint-4"]
    defaults = T.run_config(T.parse_args(argv[:1] + argv[3:-2]))["train_config"]  # no --train-config
    assert defaults["keep_last_n_checkpoints"] == 3
    free = types.SimpleNamespace(free=10**5)  # bytes: less than the tiny model's weights and AdamW state
    monkeypatch.setattr(T.shutil, "disk_usage", lambda path: free)
    with pytest.raises(UserError, match=r"^step 1: .*run has 0.00 GB free, a checkpoint needs 0.\d\d GB: free"
                                        r" some space \(--keep-last N keeps fewer\), then --resume$"):
        with torch.random.fork_rng():
            T.train(T.parse_args(case_argv("full_w1", tmp_path / "b", "--save-steps", "1")),
                    golden_batches("full_w1"))
    assert sorted(p.name for p in (tmp_path / "b/run").iterdir()) == [T.RUN_CONFIG, T.METRICS]
