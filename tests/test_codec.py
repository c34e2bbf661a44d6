"""codec.py against the upstream goldens in tests/fixtures/s2-tiny (see its README) and the S2-Pro shapes."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf
import torch
from torch.nn.utils import parametrize

import bench
import codec
import common
import cpu_fast
from conftest import CKPT, GOLDEN, REAL, ROOT, chunk_sizes, max_diff, run_main

WAVE_ATOL = 1e-4  # fixture README: codec waveforms in fp32


@pytest.fixture
def model(dac):
    """The session's tiny codec (conftest's `dac`): in this file, the model."""
    return dac


def gold(name):
    return np.load(GOLDEN / name)


@pytest.mark.upstream
@pytest.mark.parametrize("chunk", [None, 1, 16])
def test_encode_matches_upstream_codes(model, chunk):
    codes = codec.encode(model, codec.load_audio(GOLDEN / "audio_in.wav"), chunk_frames=chunk)
    assert codes.shape == (1, 10, 54) and codes.dtype == torch.int64
    np.testing.assert_array_equal(codes[0].numpy(), gold("codec_codes.npy"))


@pytest.mark.upstream
def test_encode_of_long_clip_pins_encoder_window_512(model):
    wave = codec.load_audio(GOLDEN / "audio_in_long.wav")
    np.testing.assert_array_equal(codec.encode(model, wave)[0].numpy(), gold("codec_codes_long.npy"))
    attention = model.encoder.block[4].block[5]
    attention.window = 511  # README: 511 changes 6 codes of this clip
    try:
        assert (codec.encode(model, wave)[0].numpy() != gold("codec_codes_long.npy")).sum() == 6
    finally:
        attention.window = 512


@pytest.mark.upstream
def test_decode_matches_upstream_waveform(model):
    wave = codec.decode(model, gold("codec_codes.npy"))
    assert wave.shape == (1, 54 * 2048) and wave.dtype == torch.float32
    assert max_diff(wave[0], gold("codec_decoded.npy")) <= WAVE_ATOL


@pytest.mark.upstream
def test_decode_of_random_codes_matches_upstream(model):
    wave = codec.decode(model, torch.from_numpy(gold("codes_random.npy"))[None])
    assert max_diff(wave[0], gold("codec_decoded_from_given_codes.npy")) <= WAVE_ATOL


@pytest.mark.upstream
def test_decode_clamps_wide_codes_like_upstream_without_touching_caller(model):
    wide = torch.from_numpy(gold("codes_random_wide.npy"))
    before = wide.clone()
    wave = codec.decode(model, wide)
    assert max_diff(wave[0], gold("codec_decoded_wide.npy")) <= WAVE_ATOL
    clamped = before.clone()
    clamped[1:] = clamped[1:].clamp(max=1023)
    assert torch.equal(codec.decode(model, clamped), wave)  # upstream: bit-identical to pre-clamped codes
    assert torch.equal(wide, before)  # upstream clamps the caller's tensor in place; we do not


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_decode_equals_one_shot(model, one_shot, chunk):
    codes, waves = one_shot
    assert max_diff(codec.decode(model, codes[:1], chunk_frames=chunk), waves[1]) <= 1e-5


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


def test_cli_encode_and_decode_reproduce_goldens(tmp_path, monkeypatch):
    """encode runs eager (upstream's codes exactly); decode is tuned by default (cpu_fast.tune: this
    session's decisions take every op fast) and gives --no-tune's wav up to PCM-16 rounding."""
    tuned, tune = [], cpu_fast.tune
    monkeypatch.setattr(cpu_fast, "tune", lambda dac: tuned.append(dac) or tune(dac))
    res = run_cli("encode", GOLDEN / "audio_in.wav", "--checkpoint", CKPT, "--out", tmp_path / "a.npy",
                  "--chunk-frames", 5)
    assert res.returncode == 0, res.stderr
    assert "RTF" in res.stdout.splitlines()[-1]
    codes = np.load(tmp_path / "a.npy")
    assert codes.dtype == np.int64 and codes.shape == (10, 54)
    np.testing.assert_array_equal(codes, gold("codec_codes.npy"))
    res = run_cli("decode", tmp_path / "a.npy", "--checkpoint", CKPT, "--chunk-frames", 7, "--no-tune")
    assert res.returncode == 0, res.stderr
    wave, rate = sf.read(tmp_path / "a.wav", dtype="float32")
    assert rate == 44100 and sf.info(tmp_path / "a.wav").subtype == "PCM_16"
    assert max_diff(wave, gold("codec_decoded.npy")) <= 1 / 32768 + WAVE_ATOL  # PCM-16 rounding
    assert tuned == []  # encode and decode --no-tune: eager
    res = run_cli("decode", tmp_path / "a.npy", "--checkpoint", CKPT, "--out", tmp_path / "b.wav")
    assert res.returncode == 0, res.stderr
    assert len(tuned) == 1 and any(type(m) is cpu_fast.CompiledSnake for m in tuned[0].modules())
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
    bench.main(["codec", "--device", "cpu", "--compile", "--seconds", "0.2", "--repeats", "1",
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
        "unknown device": (["decode", codes, "--device", "tpu"],
                           "use auto, cuda, cuda:N, npu, xpu, mps or cpu"),
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
