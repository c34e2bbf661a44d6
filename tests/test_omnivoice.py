"""OmniVoice against what upstream (omnivoice 0.2.1, CPU fp32) computed on the tiny checkpoint: the LM
forward, the unmasking loop step by step, voice prompts and all 14 generate() cases, through the Python API
and the CLI.
The fixture's README (tests/fixtures/omnivoice-tiny/README.md) says what each golden is."""
import functools
import hashlib
import inspect
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch._inductor.compile_fx import compile_fx

import bench
import common
import cpu_fast
import dualAR
import omnivoice
import omnivoice_text
import quantize
from conftest import CKPT as S2_CKPT, OV_CASES as CASES, OV_CKPT as CKPT, OV_GOLDEN as GOLDEN, OV_TINY as TINY
from conftest import ROOT, ov_golden as golden, run_main

INT16_STEP = 1 / 32768


@pytest.fixture(scope="module")
def model():
    return omnivoice.load(CKPT)


def clip_by_sha(sha):
    """The clip a case's kwargs name by the sha256 of its samples."""
    for name in ("clip_ref24.npy", "clip_ref_alt.npy", "clip_odd24.npy"):
        clip = np.load(GOLDEN / name)
        if hashlib.sha256(clip.tobytes()).hexdigest() == sha:
            return clip
    raise KeyError(sha)


def voice_of(spec):
    """A case's VoiceClonePrompt, read from upstream's own saved file (prompt_<k>.pt) with the same codes."""
    for name in ("prompt_ref24.pt", "prompt_ref_alt.pt"):
        voice = omnivoice.load_voice(GOLDEN / name)
        if hashlib.sha256(voice["codes"].numpy().tobytes()).hexdigest() == spec["tokens"]["sha256"]:
            assert voice["text"] == spec["ref_text"] and voice["rms"] == spec["ref_rms"]
            return voice
    raise KeyError(spec["tokens"]["sha256"])


def api_kwargs(case):
    """cases.json's generate() kwargs in our API's words (voice_clone_prompt -> voice)."""
    kwargs = dict(CASES["generate"][case]["kwargs"])
    prompt = kwargs.pop("voice_clone_prompt", None)
    if prompt is not None:
        prompts = prompt if isinstance(prompt, list) else [prompt]
        voices = [voice_of(p["VoiceClonePrompt"]) for p in prompts]
        kwargs["voice"] = voices if isinstance(prompt, list) else voices[0]
    if "ref_audio" in kwargs:
        spec, rate = kwargs["ref_audio"]
        kwargs["ref_audio"] = (clip_by_sha(spec["tensor"]["sha256"]), rate)
    return kwargs


def reference_rms(case, i):
    """The level of request i's reference (None without one), from the goldens' own prompt records."""
    kwargs = CASES["generate"][case]["kwargs"]
    prompt = kwargs.get("voice_clone_prompt")
    if prompt is not None:
        return (prompt[i] if isinstance(prompt, list) else prompt)["VoiceClonePrompt"]["ref_rms"]
    if "ref_audio" in kwargs:
        sha = kwargs["ref_audio"][0]["tensor"]["sha256"]
        return next(p["ref_rms"] for p in CASES["voice_clone_prompt"].values()
                    if isinstance(p["kwargs"]["ref_audio"], list)
                    and p["kwargs"]["ref_audio"][0]["tensor"]["sha256"] == sha)
    return None


def audio_gain(case, i, tokens, model):
    """The gain upstream applies after its int16 silence trim: reference level / 0.1 (below 0.1), else 1,
    and without a reference 0.5 / the trimmed decode's peak."""
    rms = reference_rms(case, i)
    if rms is not None:
        return rms / 0.1 if rms < 0.1 else 1.0
    waves = [omnivoice.decode(model, t)[None] for t in (tokens if isinstance(tokens, list) else [tokens])]
    wave = omnivoice_text.cross_fade_chunks(waves, model.sample_rate) if len(waves) > 1 else waves[0]
    trimmed = omnivoice_text.remove_silence(wave, model.sample_rate, mid_sil=500, lead_sil=100, trail_sil=100)
    return 0.5 / np.abs(trimmed).max()


def assert_audio_close(audio, expected, case, i, tokens, model):
    """Untrimmed audio: within 1e-4. Trimmed audio went through int16 by truncation, then a gain: within 2
    int16 steps times the gain (the fixture README's tolerance), the product taken with float32's relative
    rounding (1e-4: an exact 2-step difference, scaled in float32, lands a hair above 2 steps)."""
    if CASES["generate"][case]["kwargs"].get("postprocess_output", True) is False:
        np.testing.assert_allclose(audio, expected, rtol=0, atol=1e-4)
        return
    tolerance = 2 * INT16_STEP * audio_gain(case, i, tokens, model) * (1 + 1e-4)
    np.testing.assert_allclose(audio, expected, rtol=0, atol=tolerance)


# ----------------------------------------------------------------------------- the LM forward
@pytest.mark.upstream
@pytest.mark.parametrize("case", ["clone", "design", "batch"])
def test_first_forward_gives_upstreams_logits(model, case):
    ids, audio_mask = golden(f"gen_{case}_fwd0_input_ids.npy"), golden(f"gen_{case}_fwd0_audio_mask.npy")
    logits = model(ids, audio_mask, golden(f"gen_{case}_fwd0_attention_mask.npy"))  # (2B, C, L, V)
    expected, fwd0 = golden(f"gen_{case}_fwd0_logits_target.npy"), CASES["generate"][case]["fwd0"]
    n, B = expected.shape[2], len(fwd0["c_lens"])
    for i, (c_len, T) in enumerate(zip(fwd0["c_lens"], fwd0["target_lens"])):
        cond = logits[i, :, c_len - T:c_len - T + n]  # the first n target positions
        torch.testing.assert_close(cond, expected[2 * i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[B + i, :, :n], expected[2 * i + 1], atol=1e-4, rtol=1e-4)


@pytest.mark.upstream
def test_embeddings_and_last_hidden_state_match_upstream(model):
    ids, audio_mask = golden("gen_clone_fwd0_input_ids.npy"), golden("gen_clone_fwd0_audio_mask.npy")
    torch.testing.assert_close(model.embed(ids, audio_mask), golden("gen_clone_fwd0_inputs_embeds.npy"),
                               atol=1e-4, rtol=1e-4)
    hidden = model.hidden(ids, audio_mask, golden("gen_clone_fwd0_attention_mask.npy"))
    torch.testing.assert_close(hidden, golden("gen_clone_fwd0_llm_last_hidden.npy"), atol=1e-4, rtol=1e-4)


@pytest.mark.upstream
@pytest.mark.parametrize("case", ["clone", "design", "batch"])
def test_the_batch_rows_are_upstreams(model, case):
    """ids, audio mask and the 4-D mask built from generate()'s arguments, as upstream built them."""
    gen = omnivoice.generation_config({})
    kwargs = api_kwargs(case)
    texts = kwargs.pop("text")
    texts = texts if isinstance(texts, list) else [texts]
    names = ("language", "ref_audio", "ref_text", "voice", "instruct", "speed", "duration")
    args = [kwargs.get(k) for k in names]
    items = omnivoice.plan(model, texts, *args, gen)
    rows = omnivoice.batch_rows(model, items, gen["denoise"])
    assert torch.equal(rows["ids"], golden(f"gen_{case}_fwd0_input_ids.npy"))
    assert torch.equal(rows["audio_mask"], golden(f"gen_{case}_fwd0_audio_mask.npy"))
    assert torch.equal(rows["mask"], golden(f"gen_{case}_fwd0_attention_mask.npy"))
    fwd0 = CASES["generate"][case]["fwd0"]
    assert rows["cond"] == [(i, c - T) for i, (c, T) in enumerate(zip(fwd0["c_lens"], fwd0["target_lens"]))]


@pytest.mark.upstream
@pytest.mark.parametrize("case", ["clone", "design", "batch"])
def test_step_zero_predictions_and_confidence(model, case):
    """The tokens and confidence of the first step, before the layer penalty and the position noise."""
    ids, audio_mask = golden(f"gen_{case}_fwd0_input_ids.npy"), golden(f"gen_{case}_fwd0_audio_mask.npy")
    logits = model(ids, audio_mask, golden(f"gen_{case}_fwd0_attention_mask.npy"))
    c_len, T = CASES["generate"][case]["fwd0"]["c_lens"][0], CASES["generate"][case]["fwd0"]["target_lens"][0]
    B = ids.shape[0] // 2
    pred, conf = omnivoice.predict(logits[:1, :, c_len - T:c_len], logits[B:B + 1, :, :T],
                                   omnivoice.GENERATION, model.config["audio_mask_id"], None)
    assert torch.equal(pred, golden(f"gen_{case}_step0_pred_tokens.npy"))
    torch.testing.assert_close(conf, golden(f"gen_{case}_step0_confidence.npy"), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("class_temperature", [0.0, 0.8])
def test_the_mask_token_is_never_predicted_and_set_after_the_guidance(class_temperature):
    """Even where the mask id has the largest logit; its -inf comes after CFG's log_softmax, so the other
    tokens keep the probabilities that included it (not renormalised again)."""
    c = torch.zeros(1, 1, 2, 4)
    c[..., 3] = 5.0  # the mask id, 3, is the likeliest
    u = c.clone()
    gen = dict(omnivoice.GENERATION, class_temperature=class_temperature)
    tokens, conf = omnivoice.predict(c, u, gen, mask_id=3, generator=torch.Generator().manual_seed(0))
    assert (tokens != 3).all()
    expected = torch.log_softmax(torch.tensor([0.0, 0, 0, 5]), -1)[0]  # CFG of equal rows changes nothing
    torch.testing.assert_close(conf, torch.full((1, 1, 2), expected.item()))


# ----------------------------------------------------------------------------- generate()
GENERATE_CASES = list(CASES["generate"])


def test_fourteen_cases_are_covered():
    assert len(GENERATE_CASES) == 14


@pytest.mark.upstream
@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_gives_upstreams_tokens_and_audio(model, case):
    spec = CASES["generate"][case]
    audios, tokens = omnivoice.generate(model, **api_kwargs(case), seed=spec["seed"], return_tokens=True)
    files = spec["token_files"]
    flat = [t for item in tokens for t in (item if isinstance(item, list) else [item])]
    assert len(flat) == len(files)
    for got, name in zip(order_tokens(tokens, files), files):
        assert torch.equal(got, golden(name)), name
    assert len(audios) == len(spec["audio_files"])
    for i, name in enumerate(spec["audio_files"].values()):
        expected = np.load(GOLDEN / name)
        assert audios[i].dtype == np.float32 and audios[i].shape == expected.shape
        assert_audio_close(audios[i], expected, case, i, tokens[i], model)


TUNED = {}  # matmul -> the tiny model tuned by cpu_fast as a machine whose timing took that matmul


MATMUL_FUNCTIONS = {"onednn": "packed_matmul", "mkl": "mkl_packed_matmul"}  # cpu_fast's, per matmul


def tuned_model(matmul: str, monkeypatch):
    if matmul not in TUNED:
        with monkeypatch.context() as patch:
            patch.setattr(cpu_fast, "many_rows_matmul", lambda again=False: matmul)
            TUNED[matmul] = cpu_fast.tune(omnivoice.load(CKPT))
    return TUNED[matmul]


@pytest.mark.parametrize("layout, matmul", [("flat_row", "onednn"), ("flat_row", "mkl"),
                                            ("flat_row", "torch"), ("packed_rows", "onednn")])
@pytest.mark.parametrize("case", GENERATE_CASES)
def test_packed_guidance_gives_upstreams_tokens(case, layout, matmul, monkeypatch):
    """generate() runs upstream's rows by default (test_generate_gives_upstreams_tokens_and_audio); packed
    guidance, as CPU's flat row (packed=True; tuned, its linears on oneDNN's, MKL's packed or torch's
    matmul, as this machine's timing decides) and as the GPU's packed rows (a row per request, a block
    mask), gives every golden's codes too. Its hidden states agree with upstream's to ~1e-6, not bit for bit
    (attention and matmuls sum in other orders over other shapes), and no golden's code moves."""
    spec, model = CASES["generate"][case], tuned_model(matmul, monkeypatch)
    rows = getattr(omnivoice, layout)
    monkeypatch.setattr(omnivoice, "row_layout", lambda packed, model: rows)
    _, tokens = omnivoice.generate(model, **api_kwargs(case), seed=spec["seed"], return_tokens=True,
                                   packed=True)
    for got, name in zip(order_tokens(tokens, spec["token_files"]), spec["token_files"]):
        assert torch.equal(got, golden(name)), name


def test_upstreams_rows_are_the_default_and_packed_is_the_flat_row_on_cpu_only():
    def on(kind):  # what row_layout reads of a model
        return SimpleNamespace(audio_heads=SimpleNamespace(weight=torch.empty(0, device=kind)),
                               compiled_hidden=None)
    cpu, cuda = on("cpu"), on("meta")  # any device but the CPU
    assert omnivoice.row_layout(False, cpu) is omnivoice.row_layout(False, cuda) is omnivoice.batch_rows
    assert omnivoice.row_layout(True, cpu) is omnivoice.flat_row
    assert omnivoice.row_layout(True, cuda) is omnivoice.packed_rows
    defaults = [inspect.signature(f).parameters["packed"].default
                for f in (omnivoice.generate, omnivoice.unmask, omnivoice.chunked)]
    assert defaults == [False, False, False]  # upstream's bits unless asked


@pytest.mark.parametrize("matmul", ["onednn", "mkl", "torch"])
def test_a_tuned_models_linears_run_the_machines_matmul_within_loose_matmuls_alone(matmul, monkeypatch):
    """cpu_fast.tune: the layers' and heads' linears run the matmul this machine's timing chose
    (`many_rows_matmul`: oneDNN's or MKL's on packed copies of the weights, or torch's) within
    `common.loose_matmuls` (the flat row), and torch's own F.linear outside it (upstream's rows, upstream's
    bits); `print(model)` names them."""
    calls = {"onednn": [], "mkl": []}
    for name, fn in MATMUL_FUNCTIONS.items():
        real = getattr(cpu_fast, fn)
        monkeypatch.setattr(cpu_fast, fn, lambda *a, real=real, name=name: calls[name].append(1) or real(*a))
    model = tuned_model(matmul, monkeypatch)
    voice = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")
    items = omnivoice.plan(model, ["Hello there."], "en", None, None, [voice], None, None, None,
                           omnivoice.generation_config({}))
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    kind = torch.nn.Linear if matmul == "torch" else cpu_fast.ManyRowsLinear
    assert {type(m) for m in [*linears, model.audio_heads]} == {kind}
    assert (f"ManyRowsLinear(in_features={model.config['dim']}" in repr(model)) == (matmul != "torch")
    assert (f"matmul={matmul})" in repr(model)) == (matmul != "torch")
    rows = omnivoice.flat_row(model, items, True)
    with torch.inference_mode():
        model.hidden(rows["ids"], rows["audio_mask"], rows["mask"], rows["positions"])
        assert calls == {"onednn": [], "mkl": []}  # outside loose_matmuls: F.linear
        with common.loose_matmuls():
            model.hidden(rows["ids"], rows["audio_mask"], rows["mask"], rows["positions"])
    assert {name: len(c) for name, c in calls.items()} == {
        name: len(linears) if name == matmul else 0 for name in calls}


@pytest.mark.parametrize("packed", [True, False])
def test_an_unmasking_step_runs_the_flat_row_within_loose_matmuls_and_upstreams_rows_without(model, packed):
    """Each step of the flat row runs the LM's layers (the forward) and its audio heads (the target rows'
    logits) within common.loose_matmuls (where cpu_fast.tune may give them another matmul); upstream's
    rows run without it (upstream's bits)."""
    entered = []  # per call of the first layer and the heads: within loose_matmuls
    hooks = [m.register_forward_pre_hook(lambda m, args: entered.append((m, common.LOOSE_MATMULS.get())))
             for m in (model.layers[0], model.audio_heads)]
    voice = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")
    gen = dict(omnivoice.generation_config({}), num_step=3)
    items = omnivoice.plan(model, ["Hello there."], "en", None, None, [voice], None, None, None, gen)
    try:
        omnivoice.unmask(model, items, gen, torch.Generator().manual_seed(0), packed=packed)
    finally:
        for hook in hooks:
            hook.remove()
    assert [loose for m, loose in entered if m is model.layers[0]] == [packed] * 3  # one forward a step
    assert [loose for m, loose in entered if m is model.audio_heads] == [packed] * 6  # cond and uncond


def test_the_flat_row_holds_every_sequence_once_as_a_span(model):
    voice = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")
    gen = omnivoice.generation_config({})
    items = omnivoice.plan(model, ["Hello there.", "A longer second text."], "en", None, None, [voice, None],
                           None, None, None, gen)
    plain, flat = omnivoice.batch_rows(model, items, True), omnivoice.flat_row(model, items, True)
    c0, c1 = (at + item["target_len"] for (_, at), item in zip(plain["cond"], items))  # cond lengths
    T0, T1 = items[0]["target_len"], items[1]["target_len"]
    s1 = c0 + T0  # where request 1 starts
    assert flat["mask"].tolist() == [[0, c0], [c0, s1], [s1, s1 + c1], [s1 + c1, s1 + c1 + T1]]
    assert flat["mask"].dtype == torch.int64 and flat["ids"].shape == (1, 8, s1 + c1 + T1)
    for i, (start, end) in enumerate(flat["mask"].tolist()):  # span 2r + u: request r's upstream row
        row = i // 2 + len(items) * (i % 2)
        assert torch.equal(flat["ids"][0, :, start:end], plain["ids"][row, :, :end - start])
        assert torch.equal(flat["audio_mask"][0, start:end], plain["audio_mask"][row, :end - start])
        assert flat["positions"][0, start:end].tolist() == list(range(end - start))
    assert flat["cond"] == [(0, c0 - T0), (0, s1 + c1 - T1)] and flat["uncond"] == [(0, c0), (0, s1 + c1)]


def test_packed_rows_hold_each_request_once_with_two_blocks(model):
    voice = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")
    gen = omnivoice.generation_config({})
    texts = ["Hello there.", "A longer second text, for the padding."]
    items = omnivoice.plan(model, texts, "en", None, None, voice, None, None, None, gen)
    plain, packed = omnivoice.batch_rows(model, items, True), omnivoice.packed_rows(model, items, True)
    assert packed["ids"].shape[0] == 2 and plain["ids"].shape[0] == 4
    for i, item in enumerate(items):
        (row, at), (urow, uat) = packed["cond"][i], packed["uncond"][i]
        T, c_len = item["target_len"], packed["uncond"][i][1]
        assert row == urow == i and uat == at + T
        assert torch.equal(packed["ids"][i, :, :c_len], plain["ids"][i, :, :c_len])
        assert packed["positions"][i, c_len:c_len + T].tolist() == list(range(T))
        block = packed["mask"][i, 0]
        assert block[:c_len, :c_len].all() and block[c_len:c_len + T, c_len:c_len + T].all()
        assert not block[:c_len, c_len:].any() and not block[c_len:c_len + T, :c_len].any()


def order_tokens(tokens, files):
    """Our tokens in the golden files' order: gen_<k>_tokens_call<c>_item<i>.npy, or one file per item."""
    out = []
    for name in files:
        if "_call" in name:
            call, item = (int(x) for x in name.removesuffix(".npy").split("_call")[1].split("_item"))
            t = tokens[item]
            out.append(t[call] if isinstance(t, list) else t)
        else:
            out.append(tokens[len(out)])
    return out


@pytest.mark.upstream
def test_tokens_after_every_step_are_upstreams(model, monkeypatch):
    seen = []
    reveal = omnivoice.reveal

    def spy(tokens, *args):
        reveal(tokens, *args)
        seen.append(tokens.clone())
    monkeypatch.setattr(omnivoice, "reveal", spy)
    omnivoice.generate(model, **api_kwargs("clone"), seed=CASES["generate"]["clone"]["seed"])
    assert torch.equal(torch.stack(seen), golden("gen_clone_tokens_per_step.npy"))


def test_seed_leaves_the_global_generator_alone_and_none_uses_it(model):
    torch.manual_seed(5)
    state = torch.get_rng_state()
    a = omnivoice.generate(model, "Good morning.", seed=1001, num_step=4)[0]
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(1001)
    b = omnivoice.generate(model, "Good morning.", num_step=4)[0]  # upstream's way: the global generator
    np.testing.assert_array_equal(a, b)
    assert not torch.equal(torch.get_rng_state(), state)


def test_a_batch_item_without_a_list_gets_the_same_value(model):
    voice = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")
    a = omnivoice.generate(model, ["Hi there.", "Hi again."], voice=voice, language="en", seed=3, num_step=4)
    b = omnivoice.generate(model, ["Hi there.", "Hi again."], voice=[voice, voice],
                           language=["en", "English"], seed=3, num_step=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- voices
PROMPTS = [k for k in CASES["voice_clone_prompt"]]


def prompt_call(name):
    kwargs = dict(CASES["voice_clone_prompt"][name]["kwargs"])
    audio = kwargs.pop("ref_audio")
    if isinstance(audio, str):
        audio = TINY / audio
    else:
        spec, rate = audio
        shape = spec["tensor"]["shape"]
        if len(shape) == 2:  # the stereo case: the clip and minus half of it reversed
            clip = np.load(GOLDEN / "clip_ref_alt.npy")
            wave = np.stack([clip, -0.5 * clip[::-1]]).astype(np.float32)
            assert hashlib.sha256(wave.tobytes()).hexdigest() == spec["tensor"]["sha256"]
        else:
            wave = clip_by_sha(spec["tensor"]["sha256"])
        audio = (wave, rate)
    return audio, kwargs


@pytest.mark.upstream
@pytest.mark.parametrize("name", PROMPTS)
def test_voice_prompt_is_upstreams(model, name):
    audio, kwargs = prompt_call(name)
    voice = omnivoice.voice_prompt(model, audio, kwargs["ref_text"], kwargs.get("preprocess_prompt", True))
    spec = CASES["voice_clone_prompt"][name]
    saved = torch.load(GOLDEN / spec["saved"], weights_only=True)
    assert torch.equal(voice["codes"], golden(spec["tokens"])) and torch.equal(voice["codes"],
                                                                               saved["ref_audio_tokens"])
    assert voice["text"] == spec["ref_text"] == saved["ref_text"]
    assert voice["rms"] == pytest.approx(saved["ref_rms"], rel=1e-6)


def test_a_saved_voice_reads_back_and_generates_the_same(model, tmp_path):
    voice = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")
    omnivoice.save_voice(tmp_path / "v.omnivoice.safetensors", voice)
    back = omnivoice.load_voice(tmp_path / "v.omnivoice.safetensors", model)
    assert torch.equal(back["codes"], voice["codes"]) and back["text"] == voice["text"]
    assert back["rms"] == voice["rms"]


# ----------------------------------------------------------------------------- a generation's voice kept
LONG = CASES["generate"]["long_chunked_noref"]  # upstream's own clone path from a generated voice


def test_a_long_texts_voice_is_its_first_chunk_and_clones_as_upstream_cloned_it(model, tmp_path):
    """Without a reference upstream speaks a long text's later chunks with its first chunk's codes and text
    as their reference: that is the voice kept, and cloning the saved voice gives upstream's next chunk."""
    kwargs = dict(LONG["kwargs"])
    text, gen = kwargs.pop("text"), omnivoice.generation_config(kwargs)
    first, second = "The first sentence is here.", "Is this the second one?"  # upstream's chunks 0 and 1
    generator = torch.Generator().manual_seed(LONG["seed"])
    with torch.inference_mode():
        items = omnivoice.plan(model, [first], None, None, None, None, None, None, None, gen)
        [codes] = omnivoice.unmask(model, items, gen, generator)
    assert torch.equal(codes, golden(LONG["token_files"][0]))
    voice = omnivoice.voice_of(model, text, [codes, "later chunks: not read"], **kwargs)
    assert voice["text"] == first and torch.equal(voice["codes"], codes)
    wave = omnivoice.decode(model, golden(LONG["token_files"][0])).astype(np.float64)
    assert voice["rms"] == pytest.approx(np.sqrt(np.mean(wave ** 2)), rel=1e-6)  # voice_prompt's measure
    omnivoice.save_voice(tmp_path / "kept.omnivoice.safetensors", voice)
    back = omnivoice.load_voice(tmp_path / "kept.omnivoice.safetensors", model)
    assert torch.equal(back["codes"], codes) and back["text"] == first and back["rms"] == voice["rms"]
    with torch.inference_mode():  # the draws go on from chunk 0's, as upstream's do
        items = omnivoice.plan(model, [second], None, None, None, back, None, None, None, gen)
        [codes] = omnivoice.unmask(model, items, gen, generator)
    assert torch.equal(codes, golden(LONG["token_files"][1]))


def test_a_golden_clone_prompt_saved_and_read_back_gives_upstreams_clone(model, tmp_path):
    spec = CASES["generate"]["clone"]
    prompt = torch.load(GOLDEN / "prompt_ref24.pt", weights_only=True)  # upstream's own saved prompt
    voice = dict(codes=prompt["ref_audio_tokens"], text=prompt["ref_text"], rms=float(prompt["ref_rms"]))
    omnivoice.save_voice(tmp_path / "v.omnivoice.safetensors", voice)
    back = omnivoice.load_voice(tmp_path / "v.omnivoice.safetensors", model)
    assert torch.equal(back["codes"], voice["codes"]) and back["text"] == voice["text"]
    assert back["rms"] == voice["rms"]
    kwargs = {k: v for k, v in spec["kwargs"].items() if k != "voice_clone_prompt"}
    [_], [tokens] = omnivoice.generate(model, voice=back, seed=spec["seed"], return_tokens=True, **kwargs)
    assert torch.equal(tokens, golden("gen_clone_tokens.npy"))


def test_a_voice_given_to_a_request_is_not_kept_as_its_copy(model):
    voice = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")
    speech = omnivoice.Speech(model, omnivoice.Scheduler(model, max_batch=1), "Hi.", voice=voice, num_step=2)
    speech.cancel()
    with pytest.raises(common.UserError, match="this request was given a voice: save that voice"):
        speech.voice()


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, message", [
    (dict(text=""), "text is empty"),
    (dict(text="   "), "text is empty"),
    (dict(text="Hi.", speed=0), "speed must be a number > 0"),
    (dict(text="Hi.", speed=-1.0), "speed must be a number > 0"),
    (dict(text="Hi.", duration=0), "duration must be a number > 0"),
    (dict(text="Hi.", duration=1e6), "too long for the model"),
    (dict(text="Hi.", language="xx-unknown"), "unknown language"),
    (dict(text="Hi.", instruct="a dragon"), "female"),
    (dict(text="Hi.", ref_audio=(np.zeros(24000, np.float32), 24000)), "ref_text is missing"),
    (dict(text="Hi.", ref_text="hello"), "without ref_audio"),
    (dict(text="Hi.", num_step=0), "num_step must be an integer >= 1"),
    (dict(text="Hi.", top_p=0.5), "unknown generation option 'top_p'"),
    (dict(text=["a", "b", "c"], speed=[1.0, 2.0]), "speed: 2 values for 3 texts"),
])
def test_bad_input_is_one_clear_error(model, kwargs, message):
    with pytest.raises(common.UserError, match=message):
        omnivoice.generate(model, **kwargs)


def test_a_clip_that_is_not_audio_is_refused(model, tmp_path):
    (tmp_path / "x.wav").write_text("not audio")
    with pytest.raises(common.UserError, match="not a readable audio file"):
        omnivoice.voice_prompt(model, tmp_path / "x.wav", "hello")


def test_a_voice_code_equal_to_the_codebook_size_is_refused_and_one_less_is_taken(model, tmp_path):
    """The tiny codec's codebooks hold 1024 codes, 0 to 1023: a saved voice read for the model is checked."""
    voice = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")  # codes (8, 57) in 2..1023
    path = tmp_path / f"edge{omnivoice.VOICE_SUFFIX}"
    omnivoice.save_voice(path, voice)
    assert torch.equal(omnivoice.load_voice(path, model)["codes"], voice["codes"])
    codes = voice["codes"].clone()
    codes[3, 10] = 1024
    omnivoice.save_voice(path, dict(voice, codes=codes))
    with pytest.raises(common.UserError) as refused:
        omnivoice.load_voice(path, model)
    assert str(refused.value) == "voice codes [8, 57] in 2..1024 do not fit this model (8 codebooks of 1024)"


def test_each_limit_takes_its_edge_and_refuses_one_past_it(tmp_path):
    """check_limits, the one check of the CLI and the server: num_step up to 64, speed 0.25 to 4, duration
    up to 300 s, guidance_scale from 0."""
    omnivoice.check_limits(num_step=64, guidance_scale=0.0, speed=4.0, duration=300)
    omnivoice.check_limits(num_step=1, speed=0.25, duration=0.01)
    for kwargs, message in ((dict(num_step=65), "num_step must be 1 to 64, got 65"),
                            (dict(num_step=0), "num_step must be 1 to 64, got 0"),
                            (dict(speed=4.01), "speed must be 0.25 to 4.0, got 4.01"),
                            (dict(speed=0.24), "speed must be 0.25 to 4.0, got 0.24"),
                            (dict(duration=300.5), "duration must be more than 0 and at most 300 seconds,"
                                                       " got 300.5"),
                            (dict(guidance_scale=-0.5), "guidance_scale must be >= 0, got -0.5")):
        with pytest.raises(common.UserError) as refused:
            omnivoice.check_limits(**kwargs)
        assert str(refused.value) == message
    r = run_main(omnivoice.main, ["--checkpoint", CKPT, "--text", "Hi.", "--out", tmp_path / "o.wav",
                                  "--num-step", "65"], tmp_path)
    assert (r.returncode, r.stderr) == (2, "error: num_step must be 1 to 64, got 65\n")


def test_checkpoints_of_the_other_model_say_so():
    with pytest.raises(common.UserError, match="S2-Pro checkpoint .* dualAR.py"):
        omnivoice.load(S2_CKPT)
    with pytest.raises(common.UserError, match="OmniVoice checkpoint: run it with omnivoice.py"):
        dualAR.load(CKPT)
    with pytest.raises(common.UserError, match="does not exist"):
        omnivoice.load(ROOT / "no-such-folder")


def test_a_checkpoint_without_its_weights_or_with_broken_ones_is_one_line_naming_the_file(tmp_path):
    import shutil
    folder = shutil.copytree(CKPT, tmp_path / "ov")
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()
    with pytest.raises(common.UserError, match="has no model.safetensors — download k2-fsa/OmniVoice"):
        omnivoice.load(folder)
    index = {"weight_map": {"x": "part-1.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(common.UserError, match="names shard part-1.safetensors, which is not in"):
        omnivoice.load(folder)
    (folder / "part-1.safetensors").write_bytes(weights[:100])  # truncated
    with pytest.raises(common.UserError, match="part-1.safetensors"):
        omnivoice.load(folder)
    (folder / "part-1.safetensors").write_bytes(weights)
    assert omnivoice.load(folder).config == omnivoice.load(CKPT).config  # one shard of the index: all of it


# ----------------------------------------------------------------------------- CLI
def test_cli_clones_a_voice_and_writes_upstreams_audio_and_codes(tmp_path):
    spec = CASES["generate"]["clone_from_ref_audio"]
    clip = tmp_path / "ref.npy"
    np.save(clip, clip_by_sha(spec["kwargs"]["ref_audio"][0]["tensor"]["sha256"]))
    import soundfile as sf
    sf.write(tmp_path / "ref.wav", np.load(clip), 16000, subtype="FLOAT")
    text, seed = spec["kwargs"]["text"], spec["seed"]
    args = ["--checkpoint", CKPT, "--text", text, "--language", "en", "--seed", seed]
    r = run_main(omnivoice.main, args + ["--ref-audio", tmp_path / "ref.wav", "--ref-text",
                                         spec["kwargs"]["ref_text"], "--out", tmp_path / "out.wav",
                                         "--save-voice", "fox", "--voices", tmp_path], tmp_path)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(tmp_path / "out.npy"), np.load(GOLDEN / "gen_clone_refaudio_tokens.npy"))
    wave, rate = sf.read(tmp_path / "out.wav", dtype="float32")
    assert rate == 24000
    expected = np.clip(np.load(GOLDEN / "gen_clone_refaudio_audio0.npy"), -1, 1)
    gain = reference_rms("clone_from_ref_audio", 0) / 0.1  # the API's bound, plus the wav's own PCM-16 step
    np.testing.assert_allclose(wave, expected, rtol=0, atol=2 * INT16_STEP * gain * (1 + 1e-4) + INT16_STEP)
    assert "RTF" in r.stdout.splitlines()[-1] and "peak memory" in r.stdout.splitlines()[-1]
    again = ["--voice", "fox", "--voices", tmp_path, "--out", tmp_path / "again.wav"]
    r = run_main(omnivoice.main, args + again, tmp_path)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(tmp_path / "again.npy"), np.load(tmp_path / "out.npy"))


def test_cli_keeps_a_designed_voice_and_clones_it_later(model, tmp_path):
    """--save-voice without a reference: the run's own codes (upstream's designed voice) and text; --voice
    then clones it as the library clones that voice."""
    spec = CASES["generate"]["design"]
    kw = spec["kwargs"]
    args = ["--checkpoint", CKPT, "--language", "en", "--voices", tmp_path]
    design = ["--text", kw["text"], "--instruct", kw["instruct"], "--seed", spec["seed"],
              "--save-voice", "her"]
    r = run_main(omnivoice.main, args + design + ["--out", tmp_path / "d.wav"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "saved voice her" in r.stdout
    voice = omnivoice.load_voice(tmp_path / "her.omnivoice.safetensors", model)
    assert np.array_equal(voice["codes"].numpy(), np.load(tmp_path / "d.npy"))
    assert np.array_equal(np.load(tmp_path / "d.npy"), np.load(GOLDEN / "gen_design_tokens.npy"))
    assert voice["text"] == kw["text"]
    r = run_main(omnivoice.main, args + design + ["--out", tmp_path / "e.wav"], tmp_path)
    assert r.returncode == 2 and "voice 'her' exists already" in r.stderr
    assert not (tmp_path / "e.wav").exists()
    r = run_main(omnivoice.main, args + ["--text", "Good morning everyone.", "--voice", "her", "--seed", "7",
                                         "--out", tmp_path / "c.wav"], tmp_path)
    assert r.returncode == 0, r.stderr
    [_], [tokens] = omnivoice.generate(model, "Good morning everyone.", language="en", voice=voice, seed=7,
                                       return_tokens=True)
    assert np.array_equal(np.load(tmp_path / "c.npy"), tokens.numpy())
    r = run_main(omnivoice.main, args + ["--text", "Hi.", "--voice", "her", "--save-voice", "him",
                                         "--out", tmp_path / "h.wav"], tmp_path)
    assert (r.returncode, r.stderr) == (2, "error: --save-voice saves a --ref-audio clip or the voice of a"
                                           " run without a reference, not --voice (a saved voice already)\n")


def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path):
    r = run_main(omnivoice.main, ["--checkpoint", CKPT, "--text", "Hi.", "--language", "klingon", "--out",
                                  tmp_path / "o.wav"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: unknown language")
    assert len(r.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_demo_without_a_checkpoint_says_it_makes_noise(tmp_path):
    r = run_main(omnivoice.main, ["--text", "Hello there.", "--num-step", "2", "--out", tmp_path / "d.wav"],
                 tmp_path)
    assert r.returncode == 0, r.stderr
    assert "DEMO" in r.stdout and "NOISE" in r.stdout
    assert (tmp_path / "d.wav").is_file() and np.load(tmp_path / "d.npy").shape[0] == 8


# ----------------------------------------------------------------------------- the real size
def test_the_real_dims_build_upstreams_tensors_on_meta():
    """Qwen3-0.6B's shape: 28 layers of 11 tensors + 4, upstream's names, 612.6 M parameters (the size
    third-party exports of the real file give)."""
    with torch.device("meta"):
        real = omnivoice.OmniVoice(omnivoice.CONFIG)
    names = {omnivoice.internal_name(f"llm.layers.{i}.{part}") for i in range(28) for part in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")}
    names |= {"embed_tokens.weight", "norm.weight", "audio_embeddings.weight", "audio_heads.weight"}
    params = dict(real.named_parameters())
    assert set(params) == names
    assert params["layers.0.self_attn.q_proj.weight"].shape == (16 * 128, 1024)
    assert params["audio_heads.weight"].shape == (8 * 1025, 1024)
    assert sum(p.numel() for p in params.values()) / 1e6 == pytest.approx(612.6, abs=0.05)


def test_a_speed_list_with_none_means_one_for_that_item(model):
    """upstream raises TypeError on [None, 1.2], though its docstring allows it: we read None as 1.0."""
    gen = omnivoice.generation_config({})

    def lengths(texts, speed):
        return [i["target_len"] for i in omnivoice.plan(model, texts, *[None] * 5, speed, None, gen)]
    texts = ["Hello there.", "Good day."]
    assert lengths(texts, [None, 1.2]) == lengths(texts, [1.0, 1.2])
    assert lengths(["Good day."], 1.2) < lengths(["Good day."], None)


# ----------------------------------------------------------------------------- half precision and int8
@pytest.mark.parametrize("units", [True, False], ids=["bf16-units", "no-bf16-units"])
@pytest.mark.parametrize("dtype, quant, share", [
    (torch.bfloat16, None, 0.95), (torch.float32, "int8wo", 0.95), (torch.bfloat16, "int8wo", 0.95),
    (torch.float32, "int4wo", 0.88), (torch.bfloat16, "int4wo", 0.88), (torch.float32, "w8a8", 0.95),
    (torch.bfloat16, "w8a8", 0.95)])
@pytest.mark.upstream
def test_bf16_int8_and_int4_keep_the_argmax_of_fp32_at_their_stated_share(model, dtype, quant, share, units,
                                                                          monkeypatch):
    """The share of (codebook, target position) whose most likely code is fp32's, on the three first
    forwards of the goldens, measured on the tiny checkpoint (docs/omnivoice.md): bf16 and int8wo 97-100 %
    (tested >= 95 %), w8a8 96-100 % (>= 95 %), int4wo 90-94 % (tested >= 88 %: it gives up what OpenVINO's
    W8A8 does). On a CPU with bf16 matrix units and on one without (whose bf16 linears and int8wo products
    then run in fp32)."""
    monkeypatch.setitem(quantize.HALF_UNITS, torch.bfloat16, units)
    low = cpu_fast.tune(omnivoice.load(CKPT, dtype=dtype, quant=quant))
    half = dtype == torch.bfloat16 and not units
    assert (type(low.audio_heads) is cpu_fast.HalfLinear) == half
    if quant:  # every linear layer of the transformer, and nothing else
        assert not any(isinstance(m, torch.nn.Linear) for m in low.layers.modules())
        gate = low.layers[0].gate_proj
        if quant == "w8a8":  # but the MLP's down projection, int8 weights only
            assert isinstance(gate, quantize.W8A8Linear) and gate.weight.dtype == torch.int8
            down = low.layers[0].down_proj
            assert isinstance(down, quantize.QuantLinear) and down.bits == 8
        else:
            assert isinstance(gate, quantize.QuantLinear) and gate.bits == dict(int8wo=8, int4wo=4)[quant]
    for case in ("clone", "design", "batch"):
        ids, audio_mask = golden(f"gen_{case}_fwd0_input_ids.npy"), golden(f"gen_{case}_fwd0_audio_mask.npy")
        mask = golden(f"gen_{case}_fwd0_attention_mask.npy")
        full, approx = model(ids, audio_mask, mask), low(ids, audio_mask, mask)
        fwd0 = CASES["generate"][case]["fwd0"]
        for i, (c_len, T) in enumerate(zip(fwd0["c_lens"], fwd0["target_lens"])):
            same = full[i, :, c_len - T:c_len].argmax(-1) == approx[i, :, c_len - T:c_len].argmax(-1)
            assert same.float().mean() >= share, (case, i)


def test_int8_generates_and_a_scheme_it_lacks_is_refused(model):
    for quant in ("int8wo", "w8a8"):
        low = omnivoice.load(CKPT, quant=quant)
        [audio] = omnivoice.generate(low, "Good morning.", seed=1, num_step=4)
        assert audio.dtype == np.float32 and np.isfinite(audio).all() and audio.size > 0
    with pytest.raises(common.UserError, match="quant 'int2wo': use one of none, int8wo, int4wo, w8a8$"):
        omnivoice.load(CKPT, quant="int2wo")


# ----------------------------------------------------------------------------- the compiled forward
class CountingBackend:
    """A torch.compile backend that records the input shapes of each graph dynamo hands it and runs it
    eagerly: compile_forward's tracing, guards and recompiles in seconds (as test_dualAR's); or compiles it
    with `compile` (inductor's compile_fx: its code too)."""

    def __init__(self, compile=None):
        self.graphs, self.compile = [], compile

    def __call__(self, graph, example_inputs):
        self.graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return self.compile(graph, example_inputs) if self.compile else graph.forward


def test_a_compiled_forward_on_cpu_runs_every_flat_row_in_one_graph_and_keeps_the_goldens_codes():
    """On CPU a compiled forward runs the flat row, its length and span count symbolic: texts of every
    length, alone or batched, share one graph (no recompile in a server), inductor's code for symbolic
    lengths. The goldens' codes come out."""
    backend = CountingBackend(compile=compile_fx)
    model = omnivoice.compile_forward(omnivoice.load(CKPT), backend=backend)
    assert omnivoice.row_layout(False, model) is omnivoice.row_layout(True, model) is omnivoice.flat_row
    texts = ["Hi.", "Hello there.", "Good morning, everyone.", "A somewhat longer sentence to say aloud."]
    lengths = [omnivoice.generate(model, text, seed=1, num_step=2, return_tokens=True)[1][0].shape[1]
               for text in texts]
    omnivoice.generate(model, texts[:3], seed=1, num_step=2)
    assert len(set(lengths)) == len(texts) and len(backend.graphs) == 1
    for case in ("clone", "batch", "design"):
        spec = CASES["generate"][case]
        _, tokens = omnivoice.generate(model, **api_kwargs(case), seed=spec["seed"], return_tokens=True)
        for got, name in zip(order_tokens(tokens, spec["token_files"]), spec["token_files"]):
            assert torch.equal(got, golden(name)), name
    assert len(backend.graphs) == 1


def test_a_compiled_forward_makes_ropes_tables_eagerly_outside_its_graph(monkeypatch):
    """Inside the graph inductor would recompute the tables' cos and sin in every layer's kernels (6 % of a
    4-layer forward at the real dims): they are made before it, and the graph takes them as inputs."""
    made, real = [], omnivoice.rope_tables
    monkeypatch.setattr(omnivoice, "rope_tables", lambda *a: made.append(torch.compiler.is_compiling())
                        or real(*a))
    backend = CountingBackend()
    model = omnivoice.compile_forward(omnivoice.load(CKPT), backend=backend)
    omnivoice.generate(model, "Hello there.", seed=1, num_step=2)
    assert made == [False, False]  # one forward a step, its tables made eagerly
    (ids, *inputs), = backend.graphs  # one graph; its inputs: ids first, cos and sin (1, 1, L, head_dim)
    tables = (1, 1, ids[2], model.config["head_dim"])
    assert inputs.count(tables) == 2


def test_a_compiled_forward_off_cpu_compiles_each_bucket_once_and_keeps_the_goldens_codes(monkeypatch):
    """Elsewhere (the GPU's layout, packed_rows, run here on CPU): requests of different lengths within one
    bucket of LENGTH_BUCKET positions share a graph; a longer one adds one; running them all again adds none.
    The goldens' codes come out of the padded, compiled rows."""
    backend = CountingBackend()
    model = omnivoice.compile_forward(omnivoice.load(CKPT), backend=backend)
    layout = functools.partial(omnivoice.packed_rows, bucket=omnivoice.LENGTH_BUCKET)
    monkeypatch.setattr(omnivoice, "row_layout", lambda packed, model: layout)
    texts = ["Hi.", "Hello there.", "Good morning, everyone.", "A somewhat longer sentence to say aloud."]

    def serve():  # three lengths within the first bucket, then one past it
        return [omnivoice.generate(model, text, seed=1, num_step=2, return_tokens=True)[1][0].shape[1]
                for text in texts]

    assert len(set(serve())) == len(texts) and len(backend.graphs) == 2
    assert [shapes[0] for shapes in backend.graphs] == [(1, 8, 128), (1, 8, 256)]  # (rows, codebooks, bucket)
    serve()
    assert len(backend.graphs) == 2
    for case in ("clone", "batch", "design"):
        spec = CASES["generate"][case]
        _, tokens = omnivoice.generate(model, **api_kwargs(case), seed=spec["seed"], return_tokens=True)
        for got, name in zip(order_tokens(tokens, spec["token_files"]), spec["token_files"]):
            assert torch.equal(got, golden(name)), name


@pytest.mark.parametrize("matmul", ["onednn", "mkl"])
def test_a_compiled_forward_of_a_tuned_model_runs_the_machines_matmul_as_one_op(matmul, monkeypatch):
    """cpu_fast.tune's packed matmuls in a compiled forward (packed guidance: loose by construction, and
    dynamo cannot read loose_matmuls' context variable): each linear one op on the packed copy, what
    app.py --compile serves after tuning; the goldens' codes come out."""
    calls = []
    real = getattr(cpu_fast, MATMUL_FUNCTIONS[matmul])
    monkeypatch.setattr(cpu_fast, MATMUL_FUNCTIONS[matmul], lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(cpu_fast, "many_rows_matmul", lambda again=False: matmul)
    model = cpu_fast.tune(omnivoice.load(CKPT))
    assert type(model.audio_heads) is cpu_fast.ManyRowsLinear
    backend = CountingBackend()
    omnivoice.compile_forward(model, backend=backend)
    spec = CASES["generate"]["clone"]
    _, tokens = omnivoice.generate(model, **api_kwargs("clone"), seed=spec["seed"], return_tokens=True)
    for got, name in zip(order_tokens(tokens, spec["token_files"]), spec["token_files"]):
        assert torch.equal(got, golden(name)), name
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.layers.modules())
    steps, heads = omnivoice.GENERATION["num_step"], 2  # the heads run eagerly: cond and uncond, each step
    assert len(backend.graphs) == 1 and len(calls) == steps * (linears + heads)


# ----------------------------------------------------------------------------- the benchmark
def test_the_benchmark_counts_an_unmasking_steps_flops_by_hand():
    cfg = dict(dim=4, n_head=2, n_local_heads=1, head_dim=3, intermediate_size=5, num_codebooks=2,
               audio_vocab_size=7)
    # per position and layer: q, o 2*4*6; k, v 2*4*3; gate, up, down 3*4*5; attention 2*10 positions*6
    per_position = 2 * 4 * 6 + 2 * 4 * 3 + 3 * 4 * 5 + 2 * 10 * 6
    heads = 2 * (3 + 4) * 4 * 2 * 7  # the cond and uncond logits of 3 + 4 target positions
    assert bench.ov_step_flops(cfg, 2, rows=3, length=10, targets=[3, 4]) == 2 * (2 * 3 * 10 * per_position
                                                                                   + heads)
    # a flat row of 10 positions: each of its spans (6 and 4 positions) attends to itself alone
    linear, attention = 2 * 4 * 6 + 2 * 4 * 3 + 3 * 4 * 5, 2 * (6 * 6 + 4 * 4) * 6
    flat = bench.ov_step_flops(cfg, 2, rows=1, length=10, targets=[3, 4], spans=[(0, 6), (6, 10)])
    assert flat == 2 * (2 * (10 * linear + attention) + heads)


def test_the_benchmark_runs_on_the_tiny_checkpoint(capsys):
    bench.main(["omnivoice", "--config", "tiny", "--rounds", "1", "--seconds", "1", "--num-step", "2",
                    "--packed", "--compare-packed", "--compare-quant", "w8a8"])
    out = capsys.readouterr().out
    assert out.startswith("machine: cpu capability ") and "matmul peak" in out.splitlines()[0]
    assert "1 rows x" in out and "(flat_row)" in out and "2 steps" in out  # packed on CPU: one flat row
    assert re.search(r"steps/s [\d.]+ / [\d.]+ / [\d.]+, RTF", out) and "% of the matmul peak" in out
    assert re.search(r"audio tokenizer encode 1 s: RTF [\d.]+", out) and "audio tokenizer decode 1 s" in out
    assert re.search(r"packed vs upstream's rows, interleaved: RTF [\d.]+ / .* speed-up [\d.]+x", out)
    assert re.search(r"w8a8 vs unquantized, interleaved: RTF [\d.]+ / .* speed-up [\d.]+x \(medians\); the"
                     r" first forward's most likely code kept at (9\d|100)\.\d% of the target positions", out)


def test_the_benchmark_times_the_compiled_forward_against_eager(capsys):
    bench.main(["omnivoice", "--config", "tiny", "--rounds", "2", "--seconds", "1", "--num-step", "2",
                "--compile", "--compare-compiled"])
    out = capsys.readouterr().out
    assert "(flat_row)" in out and "compiled forward: the first run" in out  # on CPU: the flat row
    spread = r"[\d.]+ / [\d.]+ / [\d.]+"  # min / median / max
    assert re.search(rf"compiled vs eager \(packed\), interleaved: RTF {spread} vs {spread}, speed-up [\d.]+x"
                     r" \(medians\)", out)
    with pytest.raises(common.UserError, match="--compare-compiled times the compiled forward against eager:"
                                               " add --compile$"):
        bench.main(["omnivoice", "--config", "tiny", "--compare-compiled"])


def test_the_benchmark_compares_a_quantized_copy_only_against_the_unquantized_model():
    with pytest.raises(common.UserError, match="--compare-quant times a quantized copy against the"
                                               " unquantized model: drop --quant"):
        bench.main(["omnivoice", "--config", "tiny", "--quant", "int8wo", "--compare-quant", "w8a8"])


# ----------------------------------------------------------------------------- other dims
def test_other_dims_codebooks_and_frame_rate_run_every_mode(tmp_path):
    """A model unlike the fixture (4 codebooks of 512 at 50 frames/s, 6 query heads on 2, 3 layers, another
    width) built from its config alone: every mode gives (4, T) codes, fully unmasked, and repeats per
    seed."""
    import omnivoice_codec
    data = json.loads((CKPT / "audio_tokenizer/config.json").read_text())
    data["acoustic_model_config"].update(downsampling_ratios=[8, 5, 4, 3], upsampling_ratios=[8, 5, 4, 3])
    data.update(codebook_size=512, codebook_dim=8, target_bandwidths=[0.9, 1.8])
    cfg = dict(omnivoice.DEMO_DIMS, dim=48, n_layer=3, n_head=6, n_local_heads=2, head_dim=16,
               intermediate_size=80, audio_vocab_size=513, audio_mask_id=512, num_codebooks=4)
    model = omnivoice.OmniVoice(cfg)
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data = (torch.rand(p.shape, generator=generator) - 0.5) / 4 + (1 if p.ndim == 1 else 0)
    model.tokenizer = common.load_tokenizer(CKPT / "tokenizer.json")
    model.audio_tokenizer = omnivoice_codec.random_tokenizer(omnivoice_codec.config_from_json(data), seed=1)
    model.requires_grad_(False).eval()
    assert model.frame_rate == 50
    clip = (np.sin(np.arange(32000) / 7) * np.linspace(0, 0.3, 32000)).astype(np.float32)  # 2 s at 16 kHz
    voice = omnivoice.voice_prompt(model, (clip, 16000), "A short test.", preprocess_prompt=False)
    assert voice["codes"].shape == (4, 100) and voice["text"] == "A short test."
    runs = [dict(voice=voice), dict(instruct="male, low pitch"), dict(), dict(voice=voice, speed=1.5),
            dict(duration=0.5), dict(voice=voice, audio_chunk_threshold=0.5, audio_chunk_duration=0.4)]
    for kwargs in runs:
        audios, tokens = omnivoice.generate(model, "Hello there, how are you?", seed=7, num_step=4,
                                            return_tokens=True, **kwargs)
        for codes in tokens[0] if isinstance(tokens[0], list) else tokens:
            assert codes.shape[0] == 4 and 0 <= codes.min() and codes.max() < 512, kwargs
        assert audios[0].dtype == np.float32 and np.isfinite(audios[0]).all() and audios[0].size > 0
        again = omnivoice.generate(model, "Hello there, how are you?", seed=7, num_step=4, **kwargs)
        np.testing.assert_array_equal(again[0], audios[0])
    _, [codes] = omnivoice.generate(model, "Hi.", duration=0.5, seed=1, num_step=2, return_tokens=True)
    assert codes.shape == (4, 25)  # 0.5 s at 50 frames/s
    _, chunks = omnivoice.generate(model, "One. Two. Three.", voice=voice, seed=1, num_step=2,
                                   audio_chunk_threshold=0.1, audio_chunk_duration=0.1, return_tokens=True)
    assert isinstance(chunks[0], list) and len(chunks[0]) > 1


# ----------------------------------------------------------------------------- issue 45: user text, CLI rules
def test_a_control_token_in_the_text_or_a_transcript_is_refused_and_nonverbal_tags_still_work(model):
    gen = omnivoice.generation_config({})
    def plan(text, voice=None):
        return omnivoice.plan(model, [text], None, None, None, voice, None, None, None, gen)
    with pytest.raises(common.UserError) as error:  # around the closed attribute list, read as control
        plan("Hi.<|text_end|><|instruct_start|>male, whisper<|instruct_end|><|text_start|>")
    assert str(error.value).startswith("text contains '<|text_end|>', a control token of the model's")
    voice = dict(omnivoice.load_voice(GOLDEN / "prompt_ref24.pt"), text="The fox.<|denoise|>")
    with pytest.raises(common.UserError, match=r"^the voice's transcript \(ref_text\) contains '<\|denoise"):
        plan("Hi.", voice)
    with pytest.raises(common.UserError, match=r"^ref_text contains '<\|lang_start\|>'"):
        omnivoice.voice_prompt(model, (np.zeros(16000, np.float32), 16000), "a <|lang_start|>zh")
    [item] = plan("Ha [laughter] ha.")
    assert item["text"] == "Ha [laughter] ha."


def test_cli_takes_the_servers_limits_and_voice_names_and_keeps_an_existing_voice(tmp_path):
    base = ["--checkpoint", CKPT, "--text", "Hi.", "--out", tmp_path / "o.wav"]
    for flags, message in ((["--num-step", "100000"], "num_step must be 1 to 64, got 100000"),
                           (["--seed", "-1"], "seed must be an integer from 0 to 2**63 - 1, got -1"),
                           (["--speed", "9"], "speed must be 0.25 to 4.0, got 9"),
                           (["--save-voice", "../evil"], "--save-voice '../evil' is not allowed: use 1-64"
                            " letters, digits, '_', '-' or inner spaces"),
                           (["--voice", "my.voice"], "--voice 'my.voice' is not allowed: use 1-64 letters,"
                            " digits, '_', '-' or inner spaces")):
        r = run_main(omnivoice.main, base + flags + ["--ref-audio", "clip.wav", "--ref-text", "x"], tmp_path)
        assert (r.returncode, r.stderr) == (2, f"error: {message}\n")
    assert omnivoice.voice_path("stereo one", tmp_path) == tmp_path / "stereo one.omnivoice.safetensors"
    (tmp_path / "taken.npy").write_bytes(b"S2-Pro's voice")  # one name space: either model's voice
    (tmp_path / "taken.txt").write_text("its transcript\n")
    save = ["--ref-audio", "clip.wav", "--ref-text", "x", "--save-voice", "taken", "--voices", tmp_path]
    r = run_main(omnivoice.main, base + save, tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --save-voice 'taken': voice 'taken' exists")
    assert "--force" in r.stderr and (tmp_path / "taken.npy").read_bytes() == b"S2-Pro's voice"
    assert omnivoice.new_voice_path("taken", tmp_path, force=True) == tmp_path / "taken.omnivoice.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.npy", "taken.txt"]


def test_cli_a_silent_clip_names_the_clis_flag_not_the_librarys_keyword(tmp_path):
    import soundfile as sf
    sf.write(tmp_path / "quiet.wav", np.zeros(16000, np.float32), 16000)
    args = ["--checkpoint", CKPT, "--text", "Hi.", "--ref-audio", "quiet.wav", "--ref-text", "Nothing."]
    r = run_main(omnivoice.main, args + ["--out", tmp_path / "o.wav"], tmp_path)
    assert (r.returncode, r.stderr) == (2, "error: --ref-audio quiet.wav is silent or shorter than a frame"
                                           " once its silences are trimmed (keep them: --no-preprocess)\n")
