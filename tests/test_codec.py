"""codec.py against the upstream goldens in tests/fixtures/s2-tiny (see its README) and the S2-Pro shapes."""
import itertools
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf
import torch
from torch.nn.utils import parametrize

import bench
import codec
import common
from conftest import CKPT, GOLDEN, REAL, ROOT, run_main

WAVE_ATOL = 1e-4  # fixture README: codec waveforms in fp32


@pytest.fixture
def model(dac):
    """The session's tiny codec (conftest's `dac`): in this file, the model."""
    return dac


def gold(name):
    return np.load(GOLDEN / name)


def max_diff(a, b):
    return np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max()


@pytest.mark.parametrize("chunk", [None, 1, 16])
def test_encode_matches_upstream_codes(model, chunk):
    codes = codec.encode(model, codec.load_audio(GOLDEN / "audio_in.wav"), chunk_frames=chunk)
    assert codes.shape == (1, 10, 54) and codes.dtype == torch.int64
    np.testing.assert_array_equal(codes[0].numpy(), gold("codec_codes.npy"))


def test_encode_of_long_clip_pins_encoder_window_512(model):
    wave = codec.load_audio(GOLDEN / "audio_in_long.wav")
    np.testing.assert_array_equal(codec.encode(model, wave)[0].numpy(), gold("codec_codes_long.npy"))
    attention = model.encoder.block[4].block[5]
    attention.window = 511  # README: 511 changes 6 codes of this clip
    try:
        assert (codec.encode(model, wave)[0].numpy() != gold("codec_codes_long.npy")).sum() == 6
    finally:
        attention.window = 512


def test_decode_matches_upstream_waveform(model):
    wave = codec.decode(model, gold("codec_codes.npy"))
    assert wave.shape == (1, 54 * 2048) and wave.dtype == torch.float32
    assert max_diff(wave[0], gold("codec_decoded.npy")) <= WAVE_ATOL


def test_decode_of_random_codes_matches_upstream(model):
    wave = codec.decode(model, torch.from_numpy(gold("codes_random.npy"))[None])
    assert max_diff(wave[0], gold("codec_decoded_from_given_codes.npy")) <= WAVE_ATOL


def test_decode_clamps_wide_codes_like_upstream_without_touching_caller(model):
    wide = torch.from_numpy(gold("codes_random_wide.npy"))
    before = wide.clone()
    wave = codec.decode(model, wide)
    assert max_diff(wave[0], gold("codec_decoded_wide.npy")) <= WAVE_ATOL
    clamped = before.clone()
    clamped[1:] = clamped[1:].clamp(max=1023)
    assert torch.equal(codec.decode(model, clamped), wave)  # upstream: bit-identical to pre-clamped codes
    assert torch.equal(wide, before)  # upstream clamps the caller's tensor in place; we do not


@pytest.fixture(scope="module")
def one_shot(dac):
    """codes_random (40 frames) and, as a second row, the same codes reversed -> each batch size's decode
    without chunks: what every chunked and streamed decode below must equal."""
    codes = torch.from_numpy(gold("codes_random.npy"))
    codes = torch.stack([codes, codes.flip(-1)])
    return codes, {b: codec.decode(dac, codes[:b], chunk_frames=None) for b in (1, 2)}


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_decode_equals_one_shot(model, one_shot, chunk):
    codes, waves = one_shot
    assert max_diff(codec.decode(model, codes[:1], chunk_frames=chunk), waves[1]) <= 1e-5


def chunk_sizes(schedule, total):
    """The schedule's sizes, repeated, cut to add up to total."""
    sizes = []
    for n in itertools.cycle(schedule):
        if sum(sizes) >= total:
            return sizes[:-1] + [total - sum(sizes[:-1])]
        sizes.append(n)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("schedule", [[1], [3], [7], [2, 5, 1, 9, 4]])
def test_stream_decode_equals_one_shot(model, one_shot, batch, schedule):
    codes, waves = one_shot
    chunks = codes[:batch].split(chunk_sizes(schedule, 40), -1)
    pieces = list(codec.decode_stream(model, [c[0] for c in chunks] if batch == 1 else chunks))
    assert [tuple(p.shape) for p in pieces] == [(batch, c.shape[-1] * 2048) for c in chunks]
    assert all(p.dtype == torch.float32 for p in pieces)
    assert max_diff(torch.cat(pieces, -1), waves[batch]) <= 1e-5


def test_stream_decode_clamps_wide_codes_like_decode_without_touching_caller(model):
    wide = torch.from_numpy(gold("codes_random_wide.npy"))  # 24 frames, acoustic codes up to 4095
    before = wide.clone()
    wave = torch.cat(list(codec.decode_stream(model, wide.split(5, -1))), -1)
    assert max_diff(wave[0], gold("codec_decoded_wide.npy")) <= WAVE_ATOL
    assert torch.equal(wide, before)  # the chunks are views of the caller's tensor


@pytest.fixture(scope="module")
def fast_model():
    return codec.fast_path(codec.load(CKPT), choices={})  # every op fast, whatever this machine would pick


def test_fast_path_one_shot_and_chunked_equal_eager_and_upstream(model, fast_model):
    codes = torch.from_numpy(gold("codes_random.npy"))  # 40 frames
    for chunk in None, 16:
        wave = codec.decode(fast_model, codes, chunk_frames=chunk)
        assert max_diff(wave, codec.decode(model, codes, chunk_frames=chunk)) <= 1e-5
        assert max_diff(wave[0], gold("codec_decoded_from_given_codes.npy")) <= WAVE_ATOL
    codes = codec.encode(fast_model, codec.load_audio(GOLDEN / "audio_in.wav"))
    np.testing.assert_array_equal(codes[0].numpy(), gold("codec_codes.npy"))
    eager = codec.fast_path(codec.load(CKPT), on=False)
    assert eager.decoder.model[-2].fn is codec.snake
    linears = [type(m) for m in fast_model.modules() if isinstance(m, torch.nn.Linear)]
    assert set(linears) == {codec.PackedLinear}  # oneDNN's matmul on prepacked weights
    assert {type(m) for m in eager.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    assert all(getattr(m, "packed", None) is None for m in eager.modules())


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("schedule", [[1], [3], [4], [2, 5, 1, 9, 4]])
def test_fast_path_stream_equals_eager(fast_model, one_shot, batch, schedule):
    codes, waves = one_shot
    chunks = codes[:batch].split(chunk_sizes(schedule, 40), -1)
    fast = list(codec.decode_stream(fast_model, chunks))
    assert [tuple(p.shape) for p in fast] == [(batch, c.shape[-1] * 2048) for c in chunks]
    # eager streams equal eager one-shot decodes to 1e-5 (test_stream_decode_equals_one_shot)
    assert max_diff(torch.cat(fast, -1), waves[batch]) <= 1e-5


TIMED_CHOICES = codec.timed_choices  # as imported: conftest's session fixture replaces it for every test
CHECKED_CHOICES = codec.checked_choices  # the same


def alternating_choices(model):
    """Every other op key fast, the rest eager: tensors cross between the two layouts everywhere."""
    keys = sorted({codec.op_key(m) for m in model.modules()} - {None})
    steps = {True: [[0, True], [4096, False]], False: [[0, False]]}  # prepacked at every size seen here
    return {key: i % 2 == 0 if key == "snake" else steps[i % 2 == 0] for i, key in enumerate(keys)}


def test_fast_path_takes_a_cached_decision_files_choices_without_timing(model, one_shot, tmp_path,
                                                                        monkeypatch):
    """A decision file for this machine decides each op (no timing), and any mix of fast and eager ops
    still decodes, streams and encodes as eager does."""
    monkeypatch.setattr(codec, "choices_folder", lambda: tmp_path)
    monkeypatch.setattr(codec, "timed_choices", lambda model: pytest.fail("timed although the file decides"))
    mixed = codec.load(CKPT)
    choices = alternating_choices(mixed)
    other = {key: True for key in choices}
    decisions = {codec.machine_key(mixed): choices, "other": other}
    (tmp_path / codec.CHOICES_FILE).write_text(json.dumps(decisions))
    codec.fast_path(mixed)
    fast = {key: choice if isinstance(choice, bool) else choice[0][1] for key, choice in choices.items()}
    for module in mixed.modules():
        key = codec.op_key(module)
        if key == "snake":
            assert (module.fn is codec.snake) != fast[key]
        elif key is not None:
            assert (getattr(module, "packed", None) is not None) == fast[key], key
    assert {False, True} == set(fast.values())
    codes, waves = one_shot
    assert max_diff(codec.decode(mixed, codes[:2], chunk_frames=None), waves[2]) <= 1e-5
    stream = torch.cat(list(codec.decode_stream(mixed, codes[:1].split(chunk_sizes([2, 5, 1], 40), -1))), -1)
    assert max_diff(stream, waves[1]) <= 1e-5
    audio = codec.load_audio(GOLDEN / "audio_in.wav")
    np.testing.assert_array_equal(codec.encode(mixed, audio)[0].numpy(), gold("codec_codes.npy"))


def test_a_machine_without_decisions_is_timed_once_and_added_to_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "choices_folder", lambda: tmp_path / "cache")
    timed = []
    dac = codec.load(CKPT)
    monkeypatch.setattr(codec, "timed_choices", lambda model: timed.append(1) or alternating_choices(model))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / codec.CHOICES_FILE).write_text(json.dumps({"another machine": {"snake": False}}))
    codec.fast_path(dac)
    codec.fast_path(codec.load(CKPT))  # the next load (a next process alike) reads the file
    assert timed == [1]
    kept = json.loads((tmp_path / "cache" / codec.CHOICES_FILE).read_text())
    assert kept == {"another machine": {"snake": False}, codec.machine_key(dac): alternating_choices(dac)}
    (tmp_path / "cache" / codec.CHOICES_FILE).write_text("{not json")  # unreadable: timed again, rewritten
    codec.fast_path(dac)
    assert timed == [1, 1] and json.loads((tmp_path / "cache" / codec.CHOICES_FILE).read_text())


@pytest.mark.parametrize("edit, timed_again", [
    (lambda entry, linear: entry, False),
    (lambda entry, linear: dict(entry, **{linear: True}), True),  # the older format's one bool for all rows
    (lambda entry, linear: dict(entry, **{linear: [[1, True]]}), True),  # no choice below 1 row
    (lambda entry, linear: dict(entry, **{linear: [[0, True]]}), True),  # prepacked beyond its timed rows
    (lambda entry, linear: dict(entry, **{linear: [[0, True], [0, False]]}), True),
    (lambda entry, linear: dict(entry, **{linear: [[0, 1]]}), True),
    (lambda entry, linear: dict(entry, snake=1), True),
    (lambda entry, linear: dict(entry, snake=[[0, True], [8, False]]), True),
    (lambda entry, linear: dict(entry, **{next(k for k in entry if k.startswith("Causal")): True}), True),
    (lambda entry, linear: [entry], True)])
def test_an_older_or_odd_decision_file_is_timed_again_and_replaced(tmp_path, monkeypatch, edit, timed_again):
    """A decision file decides an op only with a value of its kind: a bool for Snake, size steps for a
    prepacked op (a linear layer, a conv). Anything else (the older format's bool for a linear layer or a
    conv, steps that leave sizes undecided or end prepacked, an entry that is not a dict) is timed again and
    replaced, never a crash."""
    monkeypatch.setattr(codec, "choices_folder", lambda: tmp_path)
    dac = codec.load(CKPT)
    keys = sorted({codec.op_key(m) for m in dac.modules()} - {None})
    linear = next(key for key in keys if key.startswith("linear "))
    steps = {True: [[0, False], [4, True], [65, False]], False: [[0, True], [16, False]]}[timed_again]
    timed = {key: True if key == "snake" else steps for key in keys}
    monkeypatch.setattr(codec, "timed_choices", lambda model: timed)
    decided = {key: True if key == "snake" else [[0, True], [16, False]] for key in keys}
    entry = edit(decided, linear)
    (tmp_path / codec.CHOICES_FILE).write_text(json.dumps({codec.machine_key(dac): entry}))
    codec.fast_path(dac)
    kept = json.loads((tmp_path / codec.CHOICES_FILE).read_text())[codec.machine_key(dac)]
    assert kept == (timed if timed_again else entry)
    assert {str(m.steps) for m in dac.modules() if isinstance(m, codec.PackedLinear)} == {str(steps)}


def fast_kinds(model):
    """Which kinds of op run fast now: a conv on its prepacked weight, a linear layer's, a compiled Snake."""
    kinds = {"conv": any(getattr(m, "packed", None) is not None for m in model.modules()
                         if isinstance(m, (codec.CausalConv, codec.CausalConvT))),
             "linear": any(isinstance(m, codec.PackedLinear) for m in model.modules()),
             "snake": any(m.fn is not codec.snake for m in model.modules() if isinstance(m, codec.Snake))}
    return frozenset(kind for kind, fast in kinds.items() if fast)


@pytest.mark.parametrize("costs, kept", [
    ({"encode": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 0.5}}, "choices"),
    ({"one shot": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 1.2,
                   frozenset({"linear", "snake"}): 0.9}}, "convs eager"),
    ({"stream 4": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 1.1,
                   frozenset({"linear", "snake"}): 1.1, frozenset({"snake"}): 1.0}}, "snake only"),
    ({"encode": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 0.5},
      "stream 1": {frozenset(): 1, frozenset({"conv", "linear", "snake"}): 1.5,
                   frozenset({"linear", "snake"}): 2, frozenset({"snake"}): 1.01}}, "eager")])
def test_checked_choices_keep_the_first_fallback_no_slower_on_any_whole_path(monkeypatch, capsys, costs,
                                                                             kept):
    """Each op can win alone and a whole path still lose: checked_choices times every probe path eager and
    with each fallback in turn (a fake clock: each path costs what its table says for the kinds of op fast
    now, 1 where it does not say) and keeps the first that loses on none; the model is left eager."""
    dac = codec.load(CKPT)
    choices = {key: [[0, True], [4096, False]] if key.startswith("linear ") else True
               for key in {codec.op_key(m) for m in dac.modules()} - {None}}
    now, runs = [0.0], []

    def path(name):
        def run():
            runs.append(name)
            now[0] += costs.get(name, {}).get(fast_kinds(dac), 1)
        return run

    monkeypatch.setattr(codec, "probe_paths", lambda model: {name: path(name) for name in
                                                             ["encode", "stream 1", "stream 4", "one shot"]})
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    candidates = codec.fallbacks(choices)
    names = {"choices": 0, "convs eager": 1, "snake only": 2, "eager": 3}
    assert CHECKED_CHOICES(dac, choices) == candidates[names[kept]]
    assert fast_kinds(dac) == frozenset()
    tried = min(names[kept] + 1, 3)
    assert len(runs) == 4 * 5 * tried  # 4 paths, 5 turns (a warm-up) per candidate tried
    said = capsys.readouterr().err.splitlines()  # each candidate's speed on each path, said as it is timed
    assert len(said) == tried and said[0].startswith("codec: whole paths with ")
    if "encode" in costs:
        assert "encode 2.00x" in said[0]


def test_fallbacks_turn_the_convs_then_every_prepacked_op_eager():
    conv, convt = "CausalConv [8, 8, 7] stride 1 dilation 1", "CausalConvT [8, 4, 4] stride 2 dilation 1"
    choices = {"snake": True, "linear [8, 8]": [[0, True], [65, False]], conv: True, convt: True}
    choices_, convs, snake, eager = codec.fallbacks(choices)
    assert choices_ == choices
    assert convs == dict(choices, **{conv: [[0, False]], convt: [[0, False]]})
    assert snake == {"snake": True, "linear [8, 8]": [[0, False]], conv: [[0, False]], convt: [[0, False]]}
    assert eager == dict(snake, snake=False)


def test_checked_choices_on_the_tiny_codec_time_its_real_paths_and_keep_a_fallback():
    """Untimed by a fake clock: whichever fallback wins here, it is one of them, every op is decided, and
    the model is left eager and still decodes as eager does."""
    dac = codec.load(CKPT)
    choices = alternating_choices(dac)
    assert set(codec.probe_paths(dac)) == {"encode", "stream 1", "stream 4", "stream 16", "one shot"}
    kept = CHECKED_CHOICES(dac, choices, rounds=1)
    assert kept in codec.fallbacks(choices) and set(kept) == set(choices)
    assert fast_kinds(dac) == frozenset()


def test_timed_choices_time_every_op_in_every_probe_and_leave_the_model_eager(monkeypatch):
    """The timing itself (its figures replaced by a fake clock: tests time nothing): Snake is fast only if
    it is no slower in every probe (an encode, streams of 1, 4 and 16 frames), a prepacked op at each of its
    sizes in them (here a conv that loses at a 1-frame stream's), and the model is left eager. A conv is
    timed on a channels-last input, as the fast path hands it over (timed on contiguous ones, the convs that
    won inside a 16-frame decode went eager on an AVX2 CPU)."""
    dac = codec.load(CKPT)
    probes = codec.probe_inputs(dac)
    assert {probe for by_probe in probes.values() for probe in by_probe} == {"encode", "stream 1", "stream 4",
                                                                            "stream 16"}
    loser = dac.decoder.model[0]  # fast loses only in 1-frame streams (the first of its probes)
    losing = probes[loser]["stream 1"]
    assert len(probes[loser]) == 3 and not losing & (probes[loser]["stream 4"] | probes[loser]["stream 16"])
    assert {codec.op_rows(loser, x) for x in losing} == {4}  # the latent's 4 positions a frame

    layouts = set()  # (kind of op, its input channels-last in memory)

    def fake_seconds(module, x):
        if isinstance(module, (codec.CausalConv, codec.CausalConvT)):
            layouts.add((type(module).__name__, x.mT.is_contiguous()))
        return 2.0 if runs_fast(module) and module is loser and tuple(x.shape) in losing else 1.0

    monkeypatch.setattr(codec, "seconds", fake_seconds)
    choices = TIMED_CHOICES(dac)
    assert layouts == {("CausalConv", True), ("CausalConvT", True)}
    keys = {codec.op_key(m) for m in dac.modules()} - {None}
    top = {}  # a prepacked op's largest size in any probe: eager above it
    for m, by_probe in probes.items():
        if not isinstance(m, codec.Snake):
            rows = max(codec.op_rows(m, x) for xs in by_probe.values() for x in xs)
            top[codec.op_key(m)] = max(top.get(codec.op_key(m), 0), rows)
    assert top[codec.op_key(loser)] == 64  # a 16-frame stream's
    want = {key: [[0, True], [top[key] + 1, False]] for key in top}
    want.update({"snake": True, codec.op_key(loser): [[0, False], [16, True], [65, False]]})
    assert choices == want
    assert all(getattr(m, "packed", None) is None for m in dac.modules())
    assert all(m.fn is codec.snake for m in dac.modules() if isinstance(m, codec.Snake))


def runs_fast(module):
    return module.fn is not codec.snake if isinstance(module, codec.Snake) else module.packed is not None


def test_timed_choices_decide_a_linear_layer_for_each_row_count(monkeypatch):
    """A linear layer is timed by its inputs' rows (streams: 1 to 64 here, an encode 16 to 64) and takes
    what won at each; a row count between two timed ones, what won at the one below it; above them, eager."""
    dac = codec.load(CKPT)
    attention, convnext = dac.quantizer.post_module.layers[0].attention, dac.quantizer.upsample[0][1]
    qkv, out, pointwise = (codec.op_key(m) for m in (attention.wqkv, attention.wo, convnext.pwconv1))
    losing = {qkv: lambda rows: rows >= 16, out: lambda rows: rows == 1, pointwise: lambda rows: rows == 8}

    def fake_seconds(module, x):
        loses = losing.get(codec.op_key(module), lambda rows: False)
        return 2.0 if runs_fast(module) and loses(codec.linear_rows(x.shape)) else 1.0

    monkeypatch.setattr(codec, "seconds", fake_seconds)
    choices = TIMED_CHOICES(dac)
    assert {key: choices[key] for key in losing} == {  # qkv and out: rows 1, 4, 16, 64; pointwise: 2 to 64
        qkv: [[0, True], [16, False]], out: [[0, False], [4, True], [65, False]],
        pointwise: [[0, True], [8, False], [16, True], [65, False]]}
    assert [codec.step_at(choices[pointwise], rows) for rows in (1, 7, 8, 15, 16, 64, 65, 999)] == [
        1, 1, 0, 0, 1, 1, 0, 0]
    linears = {key for key in choices if key.startswith("linear ")}
    assert {str(choices[key]) for key in linears - set(losing)} == {"[[0, True], [65, False]]"}
    assert choices["snake"] is True and all(choices[key][0] == [0, True] for key in set(choices) - linears
                                            - {"snake"})
    assert all(getattr(m, "packed", None) is None for m in dac.modules())


def test_a_conv_runs_prepacked_at_the_sizes_its_steps_say_even_within_one_stream(one_shot, monkeypatch):
    """Every decoding conv and transposed conv prepacked below 3 frames' positions (the least of those of
    its shape) and eager from there: in a stream of 1, 4, 2, 9 and 24 frames each conv takes both sides (its
    past kept in one layout for both), a one-shot decode (40 frames) runs them all eager, and both equal
    eager's to 1e-5."""
    dac = codec.load(CKPT)
    frame = {}  # each decoding conv's positions for one frame of codes
    hooks = [m.register_forward_pre_hook(lambda m, args: frame.__setitem__(m, args[0].shape[-1]))
             for m in dac.modules() if isinstance(m, (codec.CausalConv, codec.CausalConvT))]
    codec.decode(dac, torch.zeros(10, 1, dtype=torch.long))
    for hook in hooks:
        hook.remove()
    convs = list(frame)
    choices = {codec.op_key(m): False if isinstance(m, codec.Snake) else [[0, False]] for m in dac.modules()
               if codec.op_key(m)}
    limit = {}  # convs of one shape share a choice: the smallest of their 3 frames' positions
    for m in convs:
        limit[codec.op_key(m)] = min(limit.get(codec.op_key(m), 3 * frame[m]), 3 * frame[m])
    choices.update({key: [[0, True], [n, False]] for key, n in limit.items()})
    codec.fast_path(dac, choices=choices)  # the linear layers and Snakes eager
    calls = []  # (conv, positions, prepacked)
    conv_pointwise, matmul = torch.ops.mkldnn._convolution_pointwise, codec.packed_matmul
    for m in convs:
        m.register_forward_pre_hook(lambda m, args: calls.append((m, args[0].shape[-1], [])))
    monkeypatch.setattr(torch.ops.mkldnn, "_convolution_pointwise",
                        lambda *args: calls[-1][2].append(1) or conv_pointwise(*args), raising=False)
    monkeypatch.setattr(codec, "packed_matmul", lambda *args: calls[-1][2].append(1) or matmul(*args))
    codes, waves = one_shot
    stream = torch.cat(list(codec.decode_stream(dac, codes[:1].split([1, 4, 2, 9, 24], -1))), -1)
    assert max_diff(stream, waves[1]) <= 1e-5
    assert {(n < limit[codec.op_key(m)]) == bool(packed) for m, n, packed in calls} == {True}
    assert {bool(packed) for _, _, packed in calls} == {True, False}
    prepacked, eager = ({m for m, _, packed in calls if bool(packed) == side} for side in (True, False))
    assert prepacked == eager == set(convs)
    calls.clear()
    assert max_diff(codec.decode(dac, codes[:1], chunk_frames=None), waves[1]) <= 1e-5
    assert calls and not any(packed for _, _, packed in calls)


def test_timing_both_sides_makes_each_prepacked_weight_once_and_frees_the_unused_after():
    """Inside keeping_copies (the choices' timing, the benchmark) an op turned fast, eager and fast again
    gets the same prepacked weight back: no hundreds of MB made and freed between timed calls. Outside it,
    each turn makes its own, and a copy no op holds is not kept."""
    dac = codec.load(CKPT)
    conv, linear = dac.decoder.model[0], dac.quantizer.post_module.layers[0].attention.wqkv
    with codec.keeping_copies():
        firsts = []
        for module in (conv, linear):
            codec.use_fast(module, True)
            firsts.append(module.packed)
            codec.use_fast(module, False)
            assert module.packed is None
            codec.use_fast(module, [[0, True], [8, False]])
            assert module.packed is firsts[-1]
        with codec.keeping_copies():  # nested: the same copies
            codec.use_fast(conv, True)
            assert conv.packed is firsts[0]
        codec.use_fast(linear, False)
    assert codec.KEPT_COPIES is None and conv.packed is firsts[0]  # in use: kept by the op
    codec.use_fast(conv, False)
    codec.use_fast(conv, True)
    assert conv.packed is not None and conv.packed is not firsts[0]
    assert torch.equal(conv.packed.to_dense(), firsts[0].to_dense())


def test_only_weights_onednn_can_reorder_on_this_cpu_are_prepacked():
    """fp32 always; bf16 only where the CPU converts it in hardware (AVX-512 BW/VL/DQ or AVX-NE-CONVERT):
    elsewhere oneDNN's reorder raises, and the benchmark's matmul peak in bf16 crashed on an AVX2 EPYC."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        weight = torch.rand(16, 8).to(dtype)
        try:
            common.prepack(weight)
            reorders = True
        except RuntimeError:
            reorders = False
        assert codec.can_prepack(weight) == (reorders and dtype != torch.float16), dtype
    assert not codec.can_prepack(torch.rand(16, 8, dtype=torch.float64))


def test_a_linear_layer_runs_prepacked_at_the_row_counts_its_steps_say(one_shot, tmp_path, monkeypatch):
    """A decision file's step between a stream's rows and an encode's: each linear layer's call takes the
    prepacked weight below it and nn.Linear's matmul from it on; the stream and the encode stay as eager's."""
    monkeypatch.setattr(codec, "choices_folder", lambda: tmp_path)
    monkeypatch.setattr(codec, "timed_choices", lambda model: pytest.fail("timed although the file decides"))
    dac = codec.load(CKPT)
    keys = {codec.op_key(m): m for m in dac.modules()}
    choices = {key: [[0, True], [8, False]] if isinstance(m, torch.nn.Linear) else False if key == "snake"
               else [[0, False]] for key, m in keys.items() if key}
    (tmp_path / codec.CHOICES_FILE).write_text(json.dumps({codec.machine_key(dac): choices}))
    codec.fast_path(dac)
    packed, eager = [], []  # rows of each linear layer's call (every other op is eager: no packed_matmul)
    packed_matmul, linear = codec.packed_matmul, torch.nn.Linear.forward
    monkeypatch.setattr(codec, "packed_matmul", lambda x, *args: packed.append(codec.linear_rows(x.shape))
                        or packed_matmul(x, *args))
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: eager.append(codec.linear_rows(x.shape))
                        or linear(self, x))
    codes, waves = one_shot
    stream = torch.cat(list(codec.decode_stream(dac, codes[:1].split(chunk_sizes([1, 4], 40), -1))), -1)
    assert max_diff(stream, waves[1]) <= 1e-5
    assert (set(packed), set(eager)) == ({1, 2, 4}, {8, 16})  # the upsampling ConvNeXts' 2 and 4 a frame
    audio = codec.load_audio(GOLDEN / "audio_in.wav")
    np.testing.assert_array_equal(codec.encode(dac, audio)[0].numpy(), gold("codec_codes.npy"))
    assert max(packed) < 8 <= min(eager) and max(eager) == 64  # the encode: 6 to 64 rows


def test_encode_and_decode_from_several_threads_match_sequential(model):
    audio = codec.load_audio(GOLDEN / "audio_in.wav")
    codes = torch.from_numpy(gold("codes_random.npy"))
    jobs = [lambda: codec.encode(model, audio),
            lambda: codec.decode(model, codes, chunk_frames=3),
            lambda: codec.decode(model, gold("codec_codes.npy"), chunk_frames=None),
            lambda: torch.cat(list(codec.decode_stream(model, codes.split(2, -1))), -1)]
    sequential = [job() for job in jobs]
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(lambda job: job(), jobs * 2))
    for i, got in enumerate(parallel):
        assert got.shape == sequential[i % 4].shape
        assert max_diff(got, sequential[i % 4]) <= (0 if i % 4 == 0 else 1e-6)  # codes exact, waves ~fp noise
    assert not any(parametrize.is_parametrized(m) for m in model.modules())  # weight norms folded at load


def full_size_upstream_config():
    """The tiny codec_config.json with modded_dac_vq.yaml's full-size numbers (like it, no window_size)."""
    cfg = json.loads((CKPT / "codec_config.json").read_text())
    cfg.update(encoder_dim=64, decoder_dim=1536, encoder_transformer_layers=[0, 0, 0, 4],
               decoder_transformer_layers=[4, 0, 0, 0])
    cfg["quantizer"]["input_dim"] = 1024
    for name in "pre_module", "post_module":
        cfg["quantizer"][name].update(window_size=128, input_dim=1024)
        cfg["quantizer"][name]["config"].update(n_layer=8, n_head=16, dim=1024, intermediate_size=3072)
    return cfg


def test_real_config_keeps_encoder_window_512(tmp_path):
    assert codec.CONFIG["encoder_window"] == 512
    upstream = full_size_upstream_config()
    assert "window_size" not in upstream["transformer_general_config"]
    (tmp_path / "codec_config.json").write_text(json.dumps(upstream))
    assert codec.read_config(tmp_path / "codec_config.json") == codec.CONFIG
    with torch.device("meta"):
        model = codec.DAC(codec.CONFIG)
    encoder = [m for m in model.encoder.modules() if isinstance(m, codec.Transformer)]
    assert [(t.window, len(t.layers), t.layers[0].attention.n_head) for t in encoder] == [(512, 4, 16)]
    assert model.quantizer.pre_module.window == model.quantizer.post_module.window == 128


def test_real_config_on_meta_has_exact_s2_pro_tensor_names_and_shapes():
    with torch.device("meta"):
        state = codec.DAC(codec.CONFIG).state_dict()
    assert len(state) == 535
    assert {k: list(v.shape) for k, v in state.items()} == REAL["codec"]
    assert list(state) == list(REAL["codec"])
    assert sum(v.numel() for v in state.values()) == REAL["codec_param_count"] == 391430530


def test_tiny_codec_config_json_overrides_config():
    cfg = codec.read_config(CKPT / "codec_config.json")
    dims = cfg["encoder_dim"], cfg["latent_dim"], cfg["decoder_dim"], cfg["quantizer_window"]
    assert dims == (4, 64, 64, 16)
    assert cfg["encoder_window"] == 512 and codec.read_config(CKPT / "absent.json") == codec.CONFIG


def swapped_weight_norm_checkpoint(tmp_path):
    """codec.pth with both weight-norm formats swapped, plus stale buffers older saves carry."""
    state = torch.load(CKPT / "codec.pth", weights_only=True)
    swap = {".parametrizations.weight.original0": ".weight_g",
            ".parametrizations.weight.original1": ".weight_v"}
    swap.update({v: k for k, v in swap.items()})
    out = {}
    for key, value in state.items():
        for a, b in swap.items():
            if key.endswith(a):
                key = key[: -len(a)] + b
                break
        out[key] = value
    out["quantizer.pre_module.freqs_cis"] = torch.zeros(4, 32, 2)
    out["quantizer.post_module.causal_mask"] = torch.ones(4, 4, dtype=torch.bool)
    torch.save(out, tmp_path / "codec.pth")
    (tmp_path / "codec_config.json").write_text((CKPT / "codec_config.json").read_text())
    return out


def test_both_weight_norm_key_formats_load_and_stale_buffers_are_ignored(model, tmp_path):
    state = swapped_weight_norm_checkpoint(tmp_path)
    assert "encoder.block.0.conv.weight_g" in state
    assert "quantizer.quantizer.quantizers.0.in_proj.parametrizations.weight.original1" in state
    other = codec.load(tmp_path)
    codes = gold("codes_random.npy")
    assert torch.equal(codec.decode(other, codes), codec.decode(model, codes))


def test_an_upstream_training_checkpoint_loads_its_generator(model, tmp_path):
    """As upstream's loader: a {"state_dict": ...} whose generator's keys carry a `generator.` prefix."""
    state = torch.load(CKPT / "codec.pth", weights_only=True)
    training = {f"generator.{k}": v for k, v in state.items()} | {"discriminator.w": torch.zeros(2)}
    torch.save({"state_dict": training}, tmp_path / "codec.pth")
    (tmp_path / "codec_config.json").write_text((CKPT / "codec_config.json").read_text())
    codes = gold("codes_random.npy")
    assert torch.equal(codec.decode(codec.load(tmp_path), codes), codec.decode(model, codes))


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("decoder.model.0.conv.bias"), "lacks 1 tensors (first: decoder.model.0.conv.bias)"),
    (lambda s: s.update({"decoder.extra.weight": torch.zeros(1)}), "unexpected tensors (first: decoder.ex"),
    (lambda s: s.update({"decoder.model.0.conv.bias": torch.zeros(3)}), "has shape [3], expected [64]"),
])
def test_checkpoint_with_wrong_tensors_fails_with_one_line_error(tmp_path, edit, message):
    state = torch.load(CKPT / "codec.pth", weights_only=True)
    edit(state)
    torch.save(state, tmp_path / "codec.pth")
    (tmp_path / "codec_config.json").write_text((CKPT / "codec_config.json").read_text())
    with pytest.raises(common.UserError) as err:
        codec.load(tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_checkpoint_and_bad_codes_raise_clear_errors(model, tmp_path):
    with pytest.raises(common.UserError, match="not found"):
        codec.load(tmp_path / "nope")
    with pytest.raises(common.UserError, match="has no codec.pth"):
        codec.load(tmp_path)
    (tmp_path / "codec.pth").write_text("not a torch file")
    with pytest.raises(common.UserError, match="cannot read"):
        codec.load(tmp_path)
    (tmp_path / "codec_config.json").write_text('{"_target_": "modded_dac.DAC"}')
    with pytest.raises(common.UserError, match="codec_config.json: no key 'quantizer'"):
        codec.load(tmp_path)
    with pytest.raises(common.UserError, match=r"shape \[10, T\]"):
        codec.decode(model, torch.zeros(9, 4, dtype=torch.long))
    with pytest.raises(common.UserError, match=">= 0"):
        codec.decode(model, -torch.ones(10, 4, dtype=torch.long))
    with pytest.raises(common.UserError, match="empty audio"):
        codec.encode(model, torch.zeros(0))


# ----------------------------------------------------------------------------- CLI
def run_cli(*args, cwd=ROOT):  # `python codec.py args` in cwd, in this process
    return run_main(codec.main, args, cwd)


def test_cli_encode_and_decode_reproduce_goldens(tmp_path, fast_path_calls):
    res = run_cli("encode", GOLDEN / "audio_in.wav", "--checkpoint", CKPT, "--out", tmp_path / "a.npy",
                  "--chunk-frames", 5)
    assert res.returncode == 0, res.stderr
    assert "RTF" in res.stdout.splitlines()[-1]
    codes = np.load(tmp_path / "a.npy")
    assert codes.dtype == np.int64 and codes.shape == (10, 54)
    np.testing.assert_array_equal(codes, gold("codec_codes.npy"))
    res = run_cli("decode", tmp_path / "a.npy", "--checkpoint", CKPT, "--chunk-frames", 7)
    assert res.returncode == 0, res.stderr
    wave, rate = sf.read(tmp_path / "a.wav", dtype="float32")
    assert rate == 44100 and sf.info(tmp_path / "a.wav").subtype == "PCM_16"
    assert max_diff(wave, gold("codec_decoded.npy")) <= 1 / 32768 + WAVE_ATOL  # PCM-16 rounding
    assert fast_path_calls == []
    res = run_cli("decode", tmp_path / "a.npy", "--checkpoint", CKPT, "--fast", "--out", tmp_path / "b.wav")
    assert res.returncode == 0, res.stderr
    assert fast_path_calls == [True]  # decode --fast: on the fast path, the same wav up to PCM-16 rounding
    assert max_diff(sf.read(tmp_path / "b.wav", dtype="float32")[0], wave) <= 1 / 32768


def test_cli_defaults_read_prompt_and_generate_folders_and_any_audio(model, tmp_path):
    # a stereo 22.05 kHz FLAC in prompt/: channels averaged, soxr-resampled to 44.1 kHz
    (tmp_path / "prompt").mkdir()
    stereo = np.stack([np.sin(np.arange(22050) * 0.05), np.cos(np.arange(22050) * 0.03)], 1) * 0.5
    sf.write(tmp_path / "prompt" / "ref.flac", stereo, 22050)
    (tmp_path / "generate").mkdir()
    np.save(tmp_path / "generate" / "out.npy", gold("codes_random.npy"))
    assert run_cli("encode", "--checkpoint", CKPT, cwd=tmp_path).returncode == 0
    assert run_cli("decode", "--checkpoint", CKPT, cwd=tmp_path).returncode == 0
    expected = codec.encode(model, codec.load_audio(tmp_path / "prompt" / "ref.flac"))[0]
    assert expected.shape == (10, 22)  # 44100 samples -> ceil(44100 / 2048) frames
    np.testing.assert_array_equal(np.load(tmp_path / "prompt" / "ref.npy"), expected.numpy())
    wave, rate = sf.read(tmp_path / "generate" / "out.wav")
    assert rate == 44100 and wave.shape == (40 * 2048,)


def test_cli_bench_prints_eager_and_fast_lines_with_plausible_figures(capsys):
    codec.main(["bench", "--device", "cpu", "--compile", "--seconds", "0.2", "--repeats", "1",
                "--stream-frames", "1", "--stream-chunks", "2", "--config", str(CKPT / "codec_config.json")])
    out = capsys.readouterr().out
    capability = torch.backends.cpu.get_cpu_capability()
    assert out.startswith(f"machine: cpu capability {capability} (") and " cores, " in out.splitlines()[0]
    peak = float(re.search(r"matmul peak (\d+) GFLOP/s", out)[1])
    lines = [line.split() for line in out.splitlines() if line.startswith("codec_bench ")]
    rows = {(f["path"], f["chunk"], f["compile"]): f for f in (dict(w.split("=") for w in line[1:])
                                                               for line in lines)}
    assert set(rows) == {(p, c, m) for p, c in [("encode", "16"), ("decode", "16"), ("decode", "0"),
                                                ("stream", "1")] for m in "01"}
    for (path, chunk, _), f in rows.items():
        rtf, fps = float(f["rtf"]), float(f["frames_per_s"])
        assert 1e-4 < rtf < 1e3 and abs(rtf * fps * 2048 / 44100 - 1) < 1e-3  # rtf = seconds per 21.5 frames
        # the RTF this path's FLOPs would take at the 2048 x 2048 matmul's speed (what the CPU allows)
        at_peak = rtf * float(f["gflops"]) / peak  # the peak printed in whole GFLOP/s, the rest to 4 digits
        assert float(f["rtf_at_peak"]) == pytest.approx(at_peak, rel=0.5 / peak + 2e-3)
        if path == "stream":
            assert abs(float(f["ms_per_chunk"]) - 1000 / fps) < 0.01 * 1000 / fps
    def flops_per_frame(f):
        return float(f["gflops"]) / float(f["frames_per_s"])
    for path, chunk in {(path, chunk) for path, chunk, _ in rows}:  # both paths do the same FLOPs per frame
        eager, fast = rows[path, chunk, "0"], rows[path, chunk, "1"]
        per_frame = [flops_per_frame(eager), flops_per_frame(fast)]
        assert per_frame[0] > 0 and per_frame[0] == pytest.approx(per_frame[1], rel=1e-3)
        assert float(eager["gflops"]) < peak and float(fast["gflops"]) < peak  # tiny layers: far below
    decodes = [flops_per_frame(rows[run]) for run in [("decode", "16", "0"), ("decode", "0", "0"),
                                                      ("stream", "1", "0")]]
    assert decodes == pytest.approx([decodes[0]] * 3, rel=1e-3)  # each counted in its own run: chunks or not


def test_bench_counts_the_flops_of_convolutions_and_linear_layers():
    conv, convt = codec.CausalConv(4, 6, 3, wn=False), codec.CausalConvT(4, 6, 4, 2)
    linear = torch.nn.Linear(4, 6)
    x = torch.rand(2, 4, 10)
    assert bench.counted_flops(conv, lambda: conv(x)) == 2 * (2 * 6 * 10) * 4 * 3  # outputs x inputs reached
    depthwise = codec.CausalConv(4, 4, 7, groups=4, wn=False)  # ConvNeXt's: each channel reads only itself
    assert bench.counted_flops(depthwise, lambda: depthwise(x)) == 2 * (2 * 4 * 10) * 1 * 7
    assert bench.counted_flops(convt, lambda: convt(x)) == 2 * (2 * 10) * 4 * 6 * 4  # inputs x whole kernel
    assert bench.counted_flops(linear, lambda: linear(x.mT)) == 2 * (2 * 10) * 4 * 6
    both = torch.nn.ModuleList([conv, linear])  # 1440 and 480 multiply-adds
    assert bench.counted_flops(both, lambda: linear(conv(x).mT[..., :4])) == 2 * 1440 + 2 * 480


def test_cli_decodes_raw_int16_code_files(tmp_path):
    gold("codes_random.npy").astype("<i2").tofile(tmp_path / "x.code")
    np.save(tmp_path / "y.npy", gold("codes_random.npy"))
    res = run_cli("decode", tmp_path / "x.code", tmp_path / "y.npy", "--checkpoint", CKPT,
                  "--out", tmp_path / "o")
    assert res.returncode == 0, res.stderr
    assert np.array_equal(sf.read(tmp_path / "o" / "x.wav")[0], sf.read(tmp_path / "o" / "y.wav")[0])


MISSING_DEVICE = "cuda" if not torch.cuda.is_available() else "mps"


def bad_inputs(tmp_path):
    (tmp_path / "noise.wav").write_text("this is not audio")
    sf.write(tmp_path / "empty.wav", np.zeros(0, dtype=np.float32), 44100)
    np.save(tmp_path / "rows9.npy", gold("codes_random.npy")[:9])
    high = gold("codes_random.npy").copy()
    high[3, 5] = 4096
    np.save(tmp_path / "high.npy", high)
    np.save(tmp_path / "negative.npy", -gold("codes_random.npy"))
    (tmp_path / "afile").write_text("")
    wav, codes = GOLDEN / "audio_in.wav", GOLDEN / "codes_random.npy"
    return {
        "no checkpoint dir": (["encode", wav, "--checkpoint", tmp_path / "nope", "--out", tmp_path / "o.npy"],
                              "not found"),
        "no codec.pth": (["decode", codes, "--checkpoint", tmp_path, "--out", tmp_path / "o.wav"],
                         "has no codec.pth"),
        "not audio": (["encode", tmp_path / "noise.wav"], "not a readable audio file"),
        "empty audio": (["encode", tmp_path / "empty.wav"], "contains no audio samples"),
        "wrong codebooks": (["decode", tmp_path / "rows9.npy"], "expected [10, T]"),
        "code too high": (["decode", tmp_path / "high.npy"], "must lie in 0..4095"),
        "negative code": (["decode", tmp_path / "negative.npy"], "must lie in 0..4095"),
        "unwritable out": (["decode", codes, "--out", tmp_path / "afile" / "x.wav"], "cannot write"),
        "two outputs collide": (["decode", codes, GOLDEN / "codec_codes.npy", GOLDEN / "codes_random.npy",
                                 "--out", tmp_path / "new"], "would write the same .wav"),
        "negative chunk": (["decode", codes, "--chunk-frames", "-5"], "--chunk-frames must be >= 0"),
        "bad flag value": (["decode", codes, "--chunk-frames", "many"], "invalid int value"),
        "unavailable device": (["decode", codes, "--device", MISSING_DEVICE], f"no {MISSING_DEVICE} device"),
        "unknown device": (["decode", codes, "--device", "tpu"], "use cpu, mps, cuda or cuda:N"),
        "a CUDA device past the last": (["decode", codes, "--device", f"cuda:{torch.cuda.device_count()}"],
                                        "CUDA devices" if torch.cuda.is_available() else "no cuda device"),
    }


@pytest.mark.parametrize("case", ["no checkpoint dir", "no codec.pth", "not audio", "empty audio",
                                  "wrong codebooks", "code too high", "negative code", "unwritable out",
                                  "two outputs collide", "negative chunk", "bad flag value",
                                  "unavailable device", "unknown device", "a CUDA device past the last"])
def test_cli_bad_input_gives_one_line_error_and_no_output(tmp_path, capsys, case):
    args, message = bad_inputs(tmp_path)[case]
    if "--checkpoint" not in args:
        args += ["--checkpoint", CKPT]
    before = set(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit:  # in-process: a subprocess per case would cost ~2 s of imports
        common.cli(codec.main, [str(a) for a in args])
    stderr = capsys.readouterr().err
    assert exit.value.code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr
    assert set(tmp_path.rglob("*")) == before
