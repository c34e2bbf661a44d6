"""OmniVoice's text and audio front end (omnivoice_text.py) and its unmasking schedule (omnivoice.py)
against the upstream goldens in tests/fixtures/omnivoice-tiny."""
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import omnivoice as ov
import omnivoice_text as ot
from common import UserError
from conftest import OV_CASES as CASES
from conftest import OV_CKPT, ov_golden

TEXT, DURATION = CASES["text"], CASES["duration"]["rows"]
REF_TEXT, REF_TOKENS = "Hello world, nice to meet you.", 61  # cases.json duration: the English reference
# cases.json does not record the Chinese reference's text: only its weight matters, and 18.0 fits every row.
ZH_REF_TEXT, ZH_REF_TOKENS = "今天天气很好", 40


def gold(name):
    return ov_golden(name).numpy()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(OV_CKPT / "tokenizer.json"))


# ----------------------------------------------------------------------------- text
def test_nonverbal_tags_are_upstreams_13():
    assert ot.NONVERBAL_TAGS.pattern == CASES["defaults"]["nonverbal_tags_regex"]


@pytest.mark.parametrize("row", TEXT["tokenize"], ids=lambda row: repr(row["text"]))
def test_tokenize_matches_upstream(tokenizer, row):
    assert ot.tokenize(tokenizer, row["text"]) == row["tokenizer_ids"]
    assert tokenizer.encode(row["text"], add_special_tokens=False).ids == row["tokenizer_ids_no_special"]
    assert ot.tokenize_with_nonverbal_tags(tokenizer, row["text"]) == row["nonverbal_ids"]


@pytest.mark.parametrize("row", TEXT["combine_text"], ids=lambda row: repr(row["text"]))
def test_combine_text_matches_upstream(row):
    assert ot.combine_text(row["ref_text"], row["text"]) == row["combined"]


@pytest.mark.parametrize("row", TEXT["resolve_instruct"], ids=lambda row: repr(row["instruct"]))
def test_resolve_instruct_matches_upstream(row):
    assert ot.resolve_instruct(row["instruct"], use_zh=row["use_zh"]) == row["resolved"]


def test_instruct_of_generate_follows_the_text_language():
    for key, case in CASES["generate"].items():
        kwargs = case["kwargs"]
        if kwargs.get("instruct") is not None:
            resolved = ot.resolve_instruct(kwargs["instruct"], use_zh=ot.has_cjk(kwargs["text"]))
            assert resolved == case["iterative_calls"][0]["instructs"][0], key


def test_conflicting_instruct_items_raise_upstreams_message():
    with pytest.raises(UserError) as error:
        ot.resolve_instruct("female, male")
    assert f"ValueError: {error.value}" == TEXT["resolve_instruct_conflict"]


def test_attribute_outside_the_list_is_an_error_listing_the_valid_ones():
    with pytest.raises(UserError) as error:
        ot.resolve_instruct("femal, low pitch, loud")
    message = str(error.value)
    assert "\n" not in message and "'femal' (did you mean 'female'?)" in message and "'loud'" in message
    for attribute in [*ot.EN_TO_ZH, *ot.ZH_TO_EN, *ot.ACCENTS, *ot.DIALECTS]:
        assert attribute in message


def test_accent_forces_english_and_dialect_forces_chinese():
    assert ot.resolve_instruct("男, american accent", use_zh=True) == "male, american accent"
    assert ot.resolve_instruct("male, 四川话", use_zh=False) == "男，四川话"


def test_dialect_and_accent_cannot_mix():
    with pytest.raises(UserError, match="dialect and an English accent"):
        ot.resolve_instruct("四川话, british accent")


@pytest.mark.parametrize("language, code", TEXT["resolve_language"].items())
def test_resolve_language_matches_upstream(language, code):
    if code is None and language.lower() != "none":  # upstream warns and falls back to None; we refuse
        with pytest.raises(UserError, match=f"unknown language '{language}' — use a code such as en"):
            ot.resolve_language(language)
    else:
        assert ot.resolve_language(language) == code


def test_language_table_has_upstreams_646_languages():
    ids, names = ot.languages()
    assert len(ids) == len(names) == 646 and names["cantonese"] == "yue" and ot.resolve_language(None) is None


@pytest.mark.parametrize("text, expected", TEXT["add_punctuation"].items())
def test_add_punctuation_matches_upstream(text, expected):
    assert ot.add_punctuation(text) == expected


@pytest.mark.parametrize("row", TEXT["chunk_text_punctuation"], ids=lambda row: f"len{row['chunk_len']}")
def test_chunk_text_punctuation_matches_upstream(row):
    assert ot.chunk_text_punctuation(row["text"], row["chunk_len"], row["min_chunk_len"]) == row["chunks"]


@pytest.mark.parametrize("row", TEXT["style_prefix"], ids=lambda row: row["style_text"][:24])
def test_style_prefix_matches_upstream(tokenizer, row):
    text = ot.style_prefix(row["denoise"], row["has_ref"], row["lang"], row["instruct"])
    assert text == row["style_text"] and ot.tokenize(tokenizer, text) == row["ids"]


@pytest.mark.parametrize("row", DURATION, ids=lambda row: repr(row["text"][:16]))
def test_duration_estimate_matches_upstream(row):
    text = row["text"]
    assert ot.text_weight(text) == row["weight"]
    for speed, key in ((1.0, "est_no_ref"), (1.3, "est_no_ref_speed_1.3"), (0.7, "est_no_ref_speed_0.7")):
        assert ot.estimate_target_tokens(text, None, None, speed) == row[key]
    assert ot.estimate_target_tokens(text, REF_TEXT, REF_TOKENS) == row["est_ref"]
    assert ot.estimate_target_tokens(text, REF_TEXT, REF_TOKENS, speed=2) == row["est_ref_speed_2"]
    assert ot.estimate_target_tokens(text, ZH_REF_TEXT, ZH_REF_TOKENS) == row["est_ref_zh"]
    assert ot.estimate_duration(text, REF_TEXT, REF_TOKENS) == row["raw_estimate_duration_ref"]
    assert ot.estimate_duration(text, "Nice to meet you.", 25) == row["raw_estimate_duration_nice"]


# ----------------------------------------------------------------------------- audio utilities
@pytest.mark.parametrize("clip", ["ref24", "ref_alt", "odd24"])
def test_rms_is_upstreams_float32(clip):
    assert ot.rms(gold(f"clip_{clip}.npy")[None]) == CASES["clips"][clip]["rms"]


def test_remove_silence_of_the_prompt_matches_pydub():
    x = gold("clip_ref24.npy")[None]
    x = ot.normalize_reference(x, ot.rms(x))
    out = ot.remove_silence(x, 24000, mid_sil=200, lead_sil=100, trail_sil=200)
    # exact: the README's 2/32768 is for waves out of a model, these inputs are upstream's own
    np.testing.assert_array_equal(out, gold("util_remove_silence_prompt.npy"))


def test_remove_silence_of_the_output_matches_pydub():
    out = ot.remove_silence(gold("clip_ref24.npy")[None], 24000, mid_sil=500, lead_sil=100, trail_sil=100)
    np.testing.assert_array_equal(out, gold("util_remove_silence_output.npy"))


@pytest.mark.parametrize("key, preprocess", [("ref24", True), ("ref24_nopre", False)])
def test_prompt_wave_is_upstreams_encode_input(key, preprocess):
    x = gold("clip_ref24.npy")[None]
    x = ot.normalize_reference(x, ot.rms(x))
    if preprocess:
        x = ot.remove_silence(x, 24000, mid_sil=200, lead_sil=100, trail_sil=200)
    x = x[:, :x.shape[-1] // 960 * 960]
    np.testing.assert_array_equal(x[0], gold(f"prompt_{key}_encode_input.npy"))


def pcm(*runs):
    """(int16 value, samples) runs -> a (1, N) float32 wave at 24 kHz."""
    return np.concatenate([np.full(n, value / 32768, np.float32) for value, n in runs])[None]


LOUD = 8000  # one such sample makes any pydub window here louder than -50 dBFS


@pytest.mark.parametrize("lead_in", [
    [(103, 240), (104, 240)],  # rms 103 is under -50 dBFS (103.6), 104 is not
    [(104, 180), (103, 60), (104, 240)],  # rms 103.75 floors to 103
    [(103.9, 120), (-103.9, 120), (104, 240)],  # int16 conversion truncates toward zero: ±103
])
def test_edge_trim_cuts_10ms_chunks_under_minus_50_dbfs(lead_in):
    x = pcm(*lead_in, (LOUD, 480))
    np.testing.assert_array_equal(ot.remove_silence(x, 24000, 0, 0, 0), x[:, 240:])


@pytest.mark.parametrize("silence_ms", [700, 705])  # the last window starts on the 10 ms grid, or off it
def test_a_final_silence_is_cut_to_mid_sil(silence_ms):
    x = pcm((LOUD, 24000), (0, silence_ms * 24))
    out = ot.remove_silence(x, 24000, mid_sil=200, lead_sil=1000, trail_sil=1000)
    np.testing.assert_array_equal(out, x[:, :(1000 + 200) * 24])


def test_lengths_are_ms_rounded_half_even_and_slices_past_the_data_zero_filled():
    x = pcm((LOUD, 24012))  # 1000.5 ms -> 1000 ms
    np.testing.assert_array_equal(ot.remove_silence(x, 24000, 0, 0, 0), x[:, :24000])
    x = pcm((LOUD, 24036))  # 1001.5 ms -> 1002 ms, 12 samples more than there are
    np.testing.assert_array_equal(ot.remove_silence(x, 24000, 0, 0, 0), pcm((LOUD, 24036), (0, 12)))


def test_fade_and_pad_matches_upstream():
    out = ot.fade_and_pad(gold("clip_odd24.npy")[None], pad_duration=0.1, fade_duration=0.1,
                          sample_rate=24000)
    np.testing.assert_array_equal(out, gold("util_fade_and_pad.npy"))


def test_cross_fade_chunks_matches_upstream():
    odd, ref = gold("clip_odd24.npy")[None], gold("clip_ref24.npy")[None]
    out = ot.cross_fade_chunks([odd, ref[:, :5000], odd[:, :3000]], 24000)
    np.testing.assert_array_equal(out, gold("util_cross_fade.npy"))
    np.testing.assert_array_equal(odd[0], gold("clip_odd24.npy"))  # inputs untouched


def test_levels_round_twice_in_float32():
    x = (np.arange(1, 2001, dtype=np.float32) * np.float32(1.37e-4)).reshape(1, -1)
    ref_rms = 0.0132135571911931
    up = ot.normalize_reference(x, ref_rms)
    np.testing.assert_array_equal(up, (x * np.float32(0.1)) / np.float32(ref_rms))
    assert up.dtype == np.float32 and not np.array_equal(up, x * np.float32(0.1 / ref_rms))
    down = ot.output_gain(x, ref_rms)
    np.testing.assert_array_equal(down, (x * np.float32(ref_rms)) / np.float32(0.1))
    assert down.dtype == np.float32 and not np.array_equal(down, x * np.float32(ref_rms / 0.1))


def test_output_gain_without_reference_peaks_at_half_and_loud_references_are_untouched():
    x = np.array([[0.1, -0.4, 0.2]], dtype=np.float32)
    np.testing.assert_array_equal(ot.output_gain(x, None), x / np.float32(0.4) * np.float32(0.5))
    assert ot.output_gain(x, 0.1) is x and ot.output_gain(np.zeros((1, 3), np.float32), None).max() == 0


# ----------------------------------------------------------------------------- unmasking schedule
@pytest.mark.parametrize("num_step, t_shift", [(32, 0.1), (10, 0.5)])
def test_time_steps_match_torch_linspace(num_step, t_shift):
    ts = ov.time_steps(0.0, 1.0, num_step, t_shift)
    assert ts.dtype == torch.float32
    np.testing.assert_array_equal(ts.numpy(), gold(f"util_time_steps_{num_step}_{t_shift}.npy"))


@pytest.mark.parametrize("key", CASES["generate"])
def test_count_schedule_matches_every_generate_call(key):
    case, defaults = CASES["generate"][key], CASES["defaults"]["generation_config"]
    gen = dict(defaults, **case["kwargs"])
    ts = ov.time_steps(0.0, 1.0, gen["num_step"], gen["t_shift"])
    codebooks = CASES["dims"]["omni"]["num_audio_codebook"]
    for call in case["iterative_calls"]:
        for target_len, schedule in zip(call["target_lens"], call["count_schedule"]):
            assert ov.count_schedule(target_len * codebooks, ts) == schedule


# ----------------------------------------------------------------------------- issue 45: messages
def test_a_repeated_attribute_is_refused_as_upstream_does_but_named_a_repeat_not_a_conflict():
    for instruct, repeated in (("male, male", "male"), ("Male, low pitch, male", "male"),
                               ("女，female", "female")):
        with pytest.raises(UserError) as error:  # upstream: "Conflicting ... 'male' vs 'male'"
            ot.resolve_instruct(instruct)
        assert str(error.value) == f"instruct: '{repeated}' is given twice: give each attribute once"
