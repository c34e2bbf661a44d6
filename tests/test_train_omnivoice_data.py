"""train_omnivoice.py's tokens (stage 0) and data (stage 1's batches) against upstream's own run on the tiny
checkpoint (tests/fixtures/omnivoice-tiny/train, see its README): codes, shards, labels and data.lst; every
micro-batch of the four training cases, its sample ids and workers, and every processor draw."""
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

import common
import omnivoice_codec
import train_omnivoice as T
from common import UserError
from conftest import OV_CKPT, OV_TINY, ROOT

TRAIN = OV_TINY / "train"
CASES = json.loads((TRAIN / "cases.json").read_text(encoding="utf-8"))
TOKENS = CASES["tokens"]
RECORDS = [json.loads(line) for line in (TRAIN / "data/data.jsonl").read_text(encoding="utf-8").splitlines()]
ARRAYS = ("input_ids", "labels", "audio_mask", "position_ids", "attention_mask")


@contextlib.contextmanager
def one_thread():
    """The goldens ran with 1 torch thread (the codec's convolutions sum in another order with more)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tokens(*argv):
    """`python train_omnivoice.py tokens ARGV` -> stdout."""
    out = io.StringIO()
    with one_thread(), contextlib.redirect_stdout(out):
        T.main(["tokens", *map(str, argv)])
    return out.getvalue()


def fixture_args(out, *more):
    return ["--checkpoint", OV_CKPT, "--out", out, "--samples-per-shard", 4, "--min-num-shards", 3, *more]


def members(tar_path) -> list:
    with tarfile.open(tar_path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]


def labels(path) -> list:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def jsonl_tokens(tmp_path_factory):
    """Stage 0 on the fixture's data.jsonl, as upstream ran it (3 shards of 4) -> (TOKENS folder, stdout)."""
    out = tmp_path_factory.mktemp("jsonl") / "tokens"
    return out, tokens("--input-jsonl", TRAIN / "data/data.jsonl", *fixture_args(out))


@pytest.fixture(scope="module")
def fixture_shards(tmp_path_factory) -> list:
    """The fixture's tokens/ as upstream's shards (tars of its codes, in its member order), read back."""
    folder = tmp_path_factory.mktemp("fixture-tokens")
    (folder / "audios").mkdir()
    shutil.copytree(TRAIN / "tokens/txts", folder / "txts")
    shutil.copy(TRAIN / "tokens/data.lst", folder / "data.lst")
    for shard in TOKENS["shards"]:
        T.write_tar(folder / shard["tar"], [(m[:-4], (TRAIN / "tokens/codes" / m).read_bytes())
                                             for m in shard["members"]])
    return T.read_manifest(folder / "data.lst")


@pytest.fixture(scope="module")
def tokenizer():
    return common.load_tokenizer(TRAIN / "init_tokenizer/tokenizer.json")


# ----------------------------------------------------------------------------- stage 0
@pytest.mark.upstream
def test_tokens_codes_are_upstreams_bytes_in_its_shard_order(jsonl_tokens):
    out, _ = jsonl_tokens
    assert sorted(os.listdir(out)) == ["audios", "data.lst", "txts"]
    for shard in TOKENS["shards"]:
        got = members(out / shard["tar"])
        assert [name for name, _ in got] == shard["members"]
        for name, data in got:  # np.save of the int16 codes [C, T], byte for byte
            assert data == (TRAIN / "tokens/codes" / name).read_bytes(), name
    order = [name[:-4] for shard in TOKENS["shards"] for name in shard["members"]]
    assert order == TOKENS["reader_order"]


def test_tokens_manifest_and_labels_are_upstreams(jsonl_tokens):
    out, stdout = jsonl_tokens
    lines = (out / "data.lst").read_text().splitlines()
    want = (TRAIN / "tokens/data.lst").read_text().splitlines()
    assert len(lines) == len(want) == 3
    for line, expected in zip(lines, want):  # upstream writes absolute paths; the fixture's are made relative
        tar, jsonl, *rest = line.split(" ")
        assert Path(tar).is_absolute() and Path(jsonl).is_absolute()
        assert " ".join([os.path.relpath(tar, out), os.path.relpath(jsonl, out), *rest]) == expected
    for shard in TOKENS["shards"]:
        want = (TRAIN / "tokens" / shard["jsonl"]).read_text(encoding="utf-8").split("\n")
        lines = (out / shard["jsonl"]).read_text(encoding="utf-8").split("\n")
        for line, expected in zip(lines, want, strict=True):
            if not expected:
                assert line == ""  # the last newline
                continue
            # the input's audio_path as written (from data/), the fixture's made relative to tokens/
            ours, theirs = json.loads(line)["audio_path"], json.loads(expected)["audio_path"]
            assert (TRAIN / "data" / ours).resolve() == (TRAIN / "tokens" / theirs).resolve()
            assert line == expected.replace(json.dumps(theirs), json.dumps(ours))  # key order, Chinese as is
    assert "tokens: 12 clips (0.009 h) in 3 shard(s) of up to 4" in stdout


def upstreams_order(seed: int) -> list:
    """The input's ids as upstream shuffles them: the global random reseeded, then random.shuffle."""
    ids, state = [record["id"] for record in RECORDS], random.getstate()
    try:
        random.seed(seed)
        random.shuffle(ids)
    finally:
        random.setstate(state)
    return ids


def test_the_shuffle_seed_picks_the_shard_and_sample_order_and_42_is_the_default(tmp_path):
    """--shuffle-seed 7 writes upstream's seed-7 order, 4 samples a shard; the default order is the goldens'
    (upstream's default 42, as --shuffle-seed 42 gives it); another seed, another order; --no-shuffle keeps
    the input's."""
    out = tmp_path / "tokens"
    tokens("--input-jsonl", TRAIN / "data/data.jsonl", *fixture_args(out, "--shuffle-seed", 7))
    shards = [[name for name, _ in members(out / f"audios/{T.SHARD % i}.tar")] for i in range(3)]
    seven = upstreams_order(7)
    assert shards == [[f"{key}.npy" for key in seven[start:start + 4]] for start in (0, 4, 8)]

    def order(*flags) -> list:  # the records' order alone: what the shards are cut from
        argv = ["tokens", "--input-jsonl", TRAIN / "data/data.jsonl", "--out", tmp_path / "other", *flags]
        return [record["id"] for record in T.tokens_input(T.parse_args(list(map(str, argv))))[0]]
    assert order("--shuffle-seed", 7) == seven
    assert order("--shuffle-seed", 8) == upstreams_order(8) != seven
    assert order() == order("--shuffle-seed", 42) == upstreams_order(42) == TOKENS["reader_order"]
    assert order("--no-shuffle") == [record["id"] for record in RECORDS]


def test_encode_inputs_are_upstreams():
    """Byte for byte from AVX2 up (not marked `upstream`: below AVX2, ATen's scalar sin and cos build another
    resampling kernel, 4 ULPs of the peak away; docs/tests.md)."""
    tokenizer = omnivoice_codec.load(OV_CKPT / "audio_tokenizer")
    for key, golden in TOKENS["encode_inputs"].items():  # s02: 16 kHz resampled; s03: stereo
        with one_thread():
            wave, n = T.codec_input(TRAIN / "data/wavs" / f"{key}.wav", tokenizer)
        want = np.load(TRAIN / golden)
        assert wave.shape == (1, 1, want.shape[-1]) and n == want.shape[-1]
        assert np.array_equal(wave.numpy().reshape(-1), want.reshape(-1)), key
    # s09 (1.1 s = 26400 samples) is padded with zeros to 28 whole hops
    wave, n = T.codec_input(TRAIN / "data/wavs/s09.wav", tokenizer)
    assert n == 26400 and wave.shape[-1] == 28 * 960 and not wave[..., n:].any()


def test_shard_size_is_upstreams_rule():
    assert T.shard_size(12, 4, 3) == 4
    assert T.shard_size(12, 1000, 32) == 1  # upstream's defaults: one-sample shards for a small dataset
    assert T.shard_size(100, 1000, 3) == 33  # 4 shards: 33, 33, 33, 1
    assert T.shard_size(5000, 1000, 3) == 1000


def write_folder(folder: Path, ids=None) -> Path:
    """The fixture's clips as a folder form: <id>.wav + <id>.txt (s04's transcript as .lab)."""
    folder.mkdir()
    for record in RECORDS:
        if ids is None or record["id"] in ids:
            shutil.copy(TRAIN / "data" / record["audio_path"], folder)
            suffix = ".lab" if record["id"] == "s04" else ".txt"
            (folder / f"{record['id']}{suffix}").write_text(record["text"] + "\n", encoding="utf-8")
    return folder


def test_folder_form_builds_the_same_records_and_reuses_its_codes(tmp_path, monkeypatch):
    clips, out = write_folder(tmp_path / "clips"), tmp_path / "tokens"
    stdout = tokens(clips, *fixture_args(out))
    assert "0 clip(s) reused" in stdout and "12 encoded" in stdout
    for shard in TOKENS["shards"]:  # sorted stems = data.jsonl's order, so the same shuffle
        assert members(out / shard["tar"]) == [(m, (TRAIN / "tokens/codes" / m).read_bytes())
                                               for m in shard["members"]]
        for got, expected in zip(labels(out / shard["jsonl"]), labels(TRAIN / "tokens" / shard["jsonl"]),
                                 strict=True):
            assert got == dict(id=expected["id"], audio_path=str((clips / f"{got['id']}.wav").resolve()),
                               text=expected["text"], audio_duration=expected["audio_duration"],
                               num_tokens=expected["num_tokens"])

    def written():
        return {p.name: p.read_bytes() for p in out.rglob("*") if p.suffix in (".jsonl", ".lst")}
    before = written()

    encoded = []
    encode = omnivoice_codec.AudioTokenizer.encode
    monkeypatch.setattr(omnivoice_codec.AudioTokenizer, "encode",
                        lambda self, x: encoded.append(x.shape) or encode(self, x))
    stdout = tokens(clips, *fixture_args(out))  # a second run: every clip's codes from its cache
    assert encoded == [] and "12 clip(s) reused their cached codes" in stdout
    assert written() == before and len(before) == 4
    cache = clips / f"s05{T.CODES_CACHE}"
    assert cache.read_bytes() == (TRAIN / "tokens/codes/s05.npy").read_bytes()
    os.utime(clips / "s05.wav", (cache.stat().st_mtime + 5,) * 2)  # newer than its codes: encoded again
    stdout = tokens(clips, *fixture_args(out))
    assert len(encoded) == 1 and "11 clip(s) reused" in stdout
    assert members(out / "audios/shard-000000.tar")[1] == ("s05.npy", cache.read_bytes())
    tokens(clips, *fixture_args(tmp_path / "xx"), "--language-id", "xx")  # a new language: every clip's label
    assert {label.get("language_id") for shard in TOKENS["shards"]
            for label in labels(tmp_path / "xx" / shard["jsonl"])} == {"xx"}
    sf.write(clips / "cut.wav", np.full(8, 0.1), 24000)  # 8 samples: a cut file, named in a note
    (clips / "cut.txt").write_text("Cut.")
    said = tokens(clips, *fixture_args(tmp_path / "c"))
    assert "\nnote: 1 clip(s) last under 0.5 s (cut): check them" in said
    with pytest.raises(UserError, match="^--language-id is for a FOLDER of clips"):
        T.main(["tokens", "--input-jsonl", str(TRAIN / "data/data.jsonl"), "--out", str(tmp_path / "j"),
                "--language-id", "xx"])


def bad_jsonl(tmp_path, change) -> Path:
    """The fixture's s00 and s01 (their clips copied beside), s01 changed by change(record, folder)."""
    records = [dict(r) for r in RECORDS[:2]]
    (tmp_path / "wavs").mkdir()
    for record in records:
        shutil.copy(TRAIN / "data" / record["audio_path"], tmp_path / "wavs")
    change(records[1], tmp_path)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def no_text(record, folder):
    del record["text"]


def empty_text(record, folder):
    record["text"] = "  "


def unreadable_clip(record, folder):
    (folder / record["audio_path"]).write_text("not audio")


def silent_clip(record, folder):
    sf.write(folder / record["audio_path"], np.zeros(24000, dtype=np.float32), 24000)


def missing_clip(record, folder):
    record["audio_path"] = "wavs/none.wav"


def dotted_id(record, folder):
    record["id"] = "s01.a"


BAD = {no_text: "s01 has a missing or empty transcript", empty_text: "s01 has a missing or empty transcript",
       unreadable_clip: "s01: .*s01.wav is not a readable audio file", silent_clip: "s01.wav is silent",
       missing_clip: "s01: .*none.wav is not a readable audio file",
       dotted_id: "id 's01.a' must be a non-empty string without '.' or '/'"}


@pytest.mark.parametrize("change", list(BAD), ids=lambda f: f.__name__)
def test_bad_data_is_one_line_and_writes_nothing(tmp_path, change):
    path, out = bad_jsonl(tmp_path, change), tmp_path / "tokens"
    with pytest.raises(UserError, match=BAD[change]) as error:
        tokens("--input-jsonl", path, *fixture_args(out, "--no-shuffle"))
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "wavs"]  # no tokens/, no .part


def test_a_failed_run_keeps_the_earlier_tokens(tmp_path):
    out = tmp_path / "tokens"
    tokens("--input-jsonl", bad_jsonl(tmp_path, lambda r, f: None), *fixture_args(out))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    silent_clip(RECORDS[1], tmp_path)  # s01 is encoded after s00: the run fails half-way
    with pytest.raises(UserError, match="s01.wav is silent"):
        tokens("--input-jsonl", tmp_path / "data.jsonl", *fixture_args(out, "--no-shuffle"))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "tokens", "wavs"]


def test_folder_without_a_transcript_is_one_line(tmp_path):
    clips = write_folder(tmp_path / "clips", ids={"s00", "s01"})
    (clips / "s01.txt").unlink()
    with pytest.raises(UserError, match=r"^1 clip\(s\) have no .lab/.txt transcript: .*s01.wav$"):
        tokens(clips, *fixture_args(tmp_path / "tokens"))
    (clips / "s01.txt").write_text("\n")
    with pytest.raises(UserError, match="s01 has a missing or empty transcript"):
        tokens(clips, *fixture_args(tmp_path / "tokens"))
    assert not (tmp_path / "tokens").exists()


def test_wrong_checkpoints_and_outputs_are_one_line(tmp_path):
    data = bad_jsonl(tmp_path, lambda r, f: None)
    s2 = ROOT / "tests/fixtures/s2-tiny/checkpoint"
    with pytest.raises(UserError, match=f"^{s2} has no audio_tokenizer/: pass a k2-fsa/OmniVoice checkpoint"):
        tokens("--input-jsonl", data, "--checkpoint", s2, "--out", tmp_path / "tokens")
    wrong = tmp_path / "ckpt/audio_tokenizer"
    wrong.mkdir(parents=True)
    (wrong / "config.json").write_text(json.dumps(dict(model_type="dac")))
    with pytest.raises(UserError, match="model_type 'dac' is not higgs_audio_v2_tokenizer"):
        tokens("--input-jsonl", data, "--checkpoint", wrong.parent, "--out", tmp_path / "tokens")
    with pytest.raises(UserError, match="exists and is not a tokens folder"):
        tokens("--input-jsonl", data, "--checkpoint", OV_CKPT, "--out", tmp_path)
    assert not (tmp_path / "tokens").exists()


# ----------------------------------------------------------------------------- stage 1
def micro_batches(shards, case: str, tokenizer, dropped=None) -> list:
    """The trainer's micro-steps: the next batch; an exhausted epoch starts the next one (its base seed) for
    the same micro-step -> [(epoch, batch)]."""
    train = CASES["train"][case]
    steps, got = len(train["micro_steps"]), []
    for epoch, base_seed in enumerate(train["base_seeds"]):
        batches = T.epoch_batches(shards, train["train_config"], tokenizer, epoch, base_seed,
                                  train["num_workers"], dropped=dropped)
        got += [(epoch, batch) for batch, _ in zip(batches, range(steps - len(got)))]
    assert len(got) == steps
    return got


@pytest.mark.upstream
@pytest.mark.parametrize("case", list(CASES["train"]))
def test_every_micro_batch_is_upstreams(fixture_shards, tokenizer, case):
    golden = np.load(TRAIN / CASES["train"][case]["files"]["batches"])
    for (epoch, batch), step in zip(micro_batches(fixture_shards, case, tokenizer),
                                    CASES["train"][case]["micro_steps"], strict=True):
        i = step["index"]
        for name in ARRAYS:
            want, got = golden[f"mb{i}_{name}"], batch[name].numpy()
            assert got.dtype == want.dtype and np.array_equal(got, want), (i, name)
        assert list(batch["input_ids"].shape) == step["shape"]
        assert batch["ids"] == step["samples"] and epoch == step["epoch"]
        assert [batch["worker"]] * len(batch["ids"]) == step["sample_workers"]
        assert batch["attention_mask"][:, 0, 0].sum(1).tolist() == step["sample_lengths"]


def test_base_seeds_are_the_global_generators_draws():
    for case in ("full_w1", "full_w2"):
        torch.manual_seed(CASES["train"][case]["train_config"]["seed"])
        assert [T.draw_base_seed() for _ in CASES["train"][case]["base_seeds"]] == \
            CASES["train"][case]["base_seeds"]


def test_a_generator_gives_the_global_stream_on_cpu():
    torch.manual_seed(3421126067)
    want = torch.rand(8, 62)
    assert torch.equal(torch.rand(8, 62, generator=torch.Generator().manual_seed(3421126067)), want)


class Recording(random.Random):
    """python random that keeps every uniform draw and its range."""

    def __init__(self, seed):
        super().__init__(seed)
        self.draws = []

    def uniform(self, a, b):
        value = super().uniform(a, b)
        self.draws.append((value, [a, b]))
        return value


@pytest.mark.parametrize("case", ["full_w1", "full_w2"])
def test_every_processor_draw_is_upstreams(fixture_shards, tokenizer, case):
    train = CASES["train"][case]
    settings, workers = train["train_config"], train["num_workers"]
    for replay in train["processor_calls"]:
        epoch, w = replay["epoch"], replay["worker"]
        seed = T.worker_seed(train["base_seeds"][epoch], w, workers, 0)
        assert seed == replay["worker_seed"]
        shards = T.worker_shards(fixture_shards, epoch, workers, 0, 1)[w]
        samples = list(T.shuffled((s for tar, jsonl, _, _ in shards for s in T.read_shard(tar, jsonl)),
                                  random.Random(epoch)))
        assert [s["id"] for s in samples] == [call["id"] for call in replay["calls"]]
        rng, generator = Recording(seed), torch.Generator().manual_seed(seed)
        rng.randint(0, 1000000)  # webdataset's unused seed
        for sample, call in zip(samples, replay["calls"]):
            rng.draws = []
            ahead = torch.Generator().set_state(generator.get_state())
            processed = T.process_sample(sample, settings, tokenizer, rng, generator)
            assert [v for v, _ in rng.draws] == call["uniform"]
            assert [r for _, r in rng.draws] == call["uniform_ranges"]
            (shape,) = call["rand_shapes"]
            rand = torch.rand(shape, generator=ahead).numpy().tobytes()
            assert [hashlib.sha256(rand).hexdigest()] == call["rand_sha256"]
            assert torch.equal(ahead.get_state(), generator.get_state())  # one rand of that shape, no more
            assert processed["length"] == call["length"]
            assert (settings["min_sample_tokens"] <= processed["length"] <= settings["max_sample_tokens"]) \
                == call["kept"]


@pytest.mark.parametrize("case", ["full_w1", "full_w2"])
def test_the_length_filter_drops_and_counts_as_upstreams(fixture_shards, tokenizer, case):
    dropped = []
    micro_batches(fixture_shards, case, tokenizer, dropped)
    calls = CASES["train"][case]["processor_calls"]
    want = [c["id"] for replay in calls if replay["epoch"] == 0 for c in replay["calls"] if not c["kept"]]
    assert dropped[:len(want)] == want and want  # epoch 0 was read whole; epoch 1 only in part


def test_shards_per_epoch_node_and_worker(fixture_shards):
    names = lambda shards: [Path(tar).name for tar, *_ in shards]  # noqa: E731
    for epoch in CASES["train"]["full_w1"]["epochs"]:
        assert names(T.worker_shards(fixture_shards, epoch["epoch"], 1, 0, 1)[0]) == epoch["urls"]
        # webdataset: split_by_node takes every world-th shard from rank, then split_by_worker every nw-th
        ranks = [T.worker_shards(fixture_shards, epoch["epoch"], 1, r, 2)[0] for r in (0, 1)]
        assert [names(shards) for shards in ranks] == [epoch["urls"][0::2], epoch["urls"][1::2]]
    assert T.worker_seed(2 ** 32 - 1, 1, 2, 1) == 2  # (base + w) mod 2**32, then + num_workers x rank
    with pytest.raises(UserError, match=r"^3 shard\(s\) for 4 loader worker\(s\) x 1 process\(es\)"):
        T.worker_shards(fixture_shards, 0, 4, 0, 1)
    with pytest.raises(UserError, match=r"^3 shard\(s\) for 2 loader worker\(s\) x 2 process\(es\)"):
        T.worker_shards(fixture_shards, 0, 2, 1, 2)  # rank 1 holds one shard for two workers


def test_n_processes_with_one_worker_each_read_what_one_process_reads_with_n(fixture_shards, tokenizer):
    """The rule docs/omnivoice-fine-tuning.md states: rank r of 2 with one loader worker gets worker r's
    shards and seed of one process with 2 workers, so the micro-batches taken in turn are that process's,
    in its order (until the first worker runs out of batches in the epoch)."""
    case = CASES["train"]["full_w1"]
    settings, seed = case["train_config"], case["base_seeds"][0]
    one = list(T.epoch_batches(fixture_shards, settings, tokenizer, 0, seed, 2))
    ranks = [list(T.epoch_batches(fixture_shards, settings, tokenizer, 0, seed, 1, r, 2)) for r in (0, 1)]
    taken_in_turn = [batch for pair in zip(*ranks) for batch in pair]
    assert len(taken_in_turn) >= 4 and [b["worker"] for b in one[:4]] == [0, 1, 0, 1]
    for a, b in zip(one, taken_in_turn):
        assert a["ids"] == b["ids"]
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_data_config_reads_upstreams_files(tmp_path, fixture_shards):
    manifest = Path(fixture_shards[0][0]).parent.parent / "data.lst"
    shutil.copytree(manifest.parent, tmp_path / "tok")
    config = {"train": [{"manifest_path": ["tok/data.lst"], "repeat": 2, "language_id": "en"}], "dev": []}
    shards = T.train_shards(config, tmp_path)
    assert [(tar.name, jsonl.name, n, s) for tar, jsonl, n, s in shards] == 2 * [
        (f"shard-00000{i}.tar", f"shard-00000{i}.jsonl", 4, d) for i, d in enumerate((11.8, 11.5, 8.2))]
    assert all(tar.is_file() for tar, *_ in shards)
    with pytest.raises(UserError, match="^data config: manifest .*none.lst not found$"):
        T.train_shards({"train": [{"manifest_path": ["none.lst"]}]}, tmp_path)
    with pytest.raises(UserError, match="^data config: unknown field\\(s\\) weight in a 'train' entry$"):
        T.train_shards({"train": [{"manifest_path": ["tok/data.lst"], "weight": 1}]}, tmp_path)
    with pytest.raises(UserError, match="^data config has no 'train' entries$"):
        T.train_shards({"dev": []}, tmp_path)
    (tmp_path / "bad.lst").write_text("a.tar b.jsonl four 1.0\n")
    with pytest.raises(UserError, match="bad.lst:1: expected 'tar_path label_jsonl_path num_items num_"):
        T.read_manifest(tmp_path / "bad.lst")


def test_loader_settings_upstream_refuses_are_one_line(fixture_shards, tokenizer):
    settings = CASES["train"]["full_w1"]["train_config"]
    with pytest.raises(UserError, match="^num_workers must be at least 1"):
        next(T.epoch_batches(fixture_shards, settings, tokenizer, 0, 0, 0))
    six = r"^sample s\d\d has 8 codebooks, the train config's num_audio_codebook is 6$"
    with pytest.raises(UserError, match=six):
        next(T.epoch_batches(fixture_shards, dict(settings, num_audio_codebook=6), tokenizer, 0, 0, 1))


def test_the_sample_shuffle_reads_two_and_emits_one_until_the_end():
    """webdataset's buffer: a sample and one more per step (below bufsize); an emission once `initial` are
    held, at randint(0, len - 1), the last moved into its slot."""
    read = []
    emitted = T.shuffled((read.append(i) or i for i in range(300)), random.Random(7))
    first = next(emitted)
    assert len(read) == 100 and first == random.Random(7).randint(0, 99)
    for k in range(2, 50):
        next(emitted)
        assert len(read) == 100 + 2 * (k - 1)
    read = []
    emitted = list(T.shuffled((read.append(i) or i for i in range(300)), random.Random(7)))
    assert sorted(emitted) == list(range(300)) and emitted[0] == first
    read = []
    capped = T.shuffled((read.append(i) or i for i in range(30)), random.Random(0), bufsize=10, initial=5)
    next(capped)
    assert len(read) == 6  # 2 + 2 + 2 read, 6 >= 5 held
    assert len(list(capped)) == 29 and len(read) == 30


def test_the_mask_ratio_is_compared_in_float32(tokenizer, fixture_shards):
    """torch rounds the python ratio to float32 before comparing: a draw equal to that rounding stays
    unmasked even though the float64 ratio is a hair above it."""
    sample = next(T.read_shard(*fixture_shards[0][:2]))
    settings = dict(CASES["train"]["full_w1"]["train_config"], drop_cond_ratio=0.0, prompt_ratio_range=[0, 0])
    draw = torch.rand(1, generator=torch.Generator().manual_seed(5)).item()  # the mask's first draw
    ratio = draw + 1e-12
    assert np.float32(ratio) == np.float32(draw) and draw < ratio
    processed = T.process_sample(sample, dict(settings, mask_ratio_range=[ratio, ratio]), tokenizer,
                                 random.Random(0), torch.Generator().manual_seed(5))
    start = int(processed["audio_mask"].int().argmax())
    assert processed["labels"][0, start] == T.IGNORE
    assert processed["input_ids"][0, start] == sample["codes"][0, 0] != settings["audio_mask_id"]


def test_a_denoise_label_keeps_its_condition_and_prompt(tokenizer, fixture_shards):
    """clean_start_token_idx: no condition-dropout draw, <|denoise|> first, the prompt up to that frame."""
    sample = next(T.read_shard(*fixture_shards[0][:2]))
    sample["label"] = dict(sample["label"], clean_start_token_idx=30)
    settings = dict(CASES["train"]["full_w1"]["train_config"], drop_cond_ratio=1.0, mask_ratio_range=[1, 1])
    rng = Recording(0)
    processed = T.process_sample(sample, settings, tokenizer, rng, torch.Generator().manual_seed(0))
    assert [r for _, r in rng.draws] == [[0.0, 0.3], [0, 1], [0, 1], [1, 1]]  # no drop draw
    assert processed["input_ids"][0, 0] == tokenizer.token_to_id("<|denoise|>")
    start = int(processed["audio_mask"].int().argmax())
    audio_labels = processed["labels"][:, start:]
    assert (audio_labels[:, :30] == T.IGNORE).all()
    assert torch.equal(audio_labels[:, 30:], sample["codes"][:, 30:].long())


def test_evaluation_reads_shards_and_samples_in_order(tokenizer, fixture_shards, monkeypatch):
    seen = []
    process = T.process_sample
    monkeypatch.setattr(T, "process_sample",
                        lambda sample, *args: seen.append(sample["id"]) or process(sample, *args))
    settings = CASES["train"]["full_w1"]["train_config"]
    batches = list(T.epoch_batches(fixture_shards, settings, tokenizer, 3, 0, 1, evaluation=True))
    assert seen == TOKENS["reader_order"]  # data.lst's shards, each in member order
    assert sorted(i for b in batches for i in b["ids"]) == sorted(i for i in seen if i != "s09")


def test_a_tokenizer_without_omnivoices_tokens_is_one_line(fixture_shards):
    from tokenizers import Tokenizer, models
    settings = CASES["train"]["full_w1"]["train_config"]
    missing = r"^the tokenizer has no <\|endoftext\|>, <\|denoise\|>, .*, <\|text_end\|>: give an OmniVoice"
    with pytest.raises(UserError, match=missing):
        next(T.epoch_batches(fixture_shards, settings, Tokenizer(models.BPE()), 0, 0, 1))


def test_each_rank_reads_its_own_shards_with_its_own_seeds(fixture_shards, tokenizer, monkeypatch):
    seeds = []
    batches = T.worker_batches
    monkeypatch.setattr(T, "worker_batches", lambda shards, s, t, e, seed, *rest: seeds.append(seed) or
                        batches(shards, s, t, e, seed, *rest))
    settings, base = CASES["train"]["full_w2"]["train_config"], CASES["train"]["full_w2"]["base_seeds"][0]
    urls = CASES["train"]["full_w2"]["epochs"][0]["urls"]  # epoch 0: shard-000000, 000002, 000001
    ids = {rank: [i for batch in T.epoch_batches(fixture_shards, settings, tokenizer, 0, base, 1, rank, 2)
                  for i in batch["ids"]] for rank in (0, 1)}
    members = {s["tar"].split("/")[1]: {m[:-4] for m in s["members"]} for s in TOKENS["shards"]}
    assert set(ids[1]) <= members[urls[1]] and set(ids[0]) <= members[urls[0]] | members[urls[2]]
    assert seeds == [base % 2 ** 32, base % 2 ** 32 + 1]  # one worker each: + num_workers x rank
