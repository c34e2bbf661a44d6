"""omnivoice_codec against upstream's goldens (tests/fixtures/omnivoice-tiny, see its README): every
intermediate of encode and decode, the resampler, the loader's errors, the real dims, the demo model."""
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import omnivoice_codec as oc
from common import UserError
from conftest import CKPT as S2_CHECKPOINT
from conftest import OV_CKPT, ov_golden as golden

TOKENIZER = OV_CKPT / "audio_tokenizer"


def close(ours, name):
    """The README's tolerance for codec floats: atol 1e-4 with rtol 1e-4."""
    torch.testing.assert_close(ours, golden(name), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def tokenizer():
    return oc.load(TOKENIZER)


# ----------------------------------------------------------------------------- config and resampling
def test_config_from_json_derives_the_sizes_upstream_derives():
    cfg = oc.config_from_json(json.loads((TOKENIZER / "config.json").read_text()))
    assert cfg.keys() == oc.CONFIG.keys() == oc.DEMO_CONFIG.keys()
    assert (cfg["hop_length"], cfg["frame_rate"], cfg["num_quantizers"]) == (960, 25, 8)
    assert (cfg["semantic_downsample_factor"], cfg["codebook_dim"], cfg["conv_dim"]) == (2, 16, [16] * 7)
    assert cfg == oc.DEMO_CONFIG  # the demo model has the fixture's dims


@pytest.mark.upstream
def test_resample_matches_torchaudio():
    close(oc.resample(golden("clip_ref_alt.npy"), 16000, 24000), "resample_ref_alt_to_24k.npy")
    close(oc.resample(golden("clip_ref24.npy"), 24000, 16000), "resample_ref24_to_16k.npy")


def windowed_sinc(x, orig, new):
    """The definition in float64: output n at time n/new sums x[i] * hann(t) * sinc(t) * base/orig, with
    t = (i/orig - n/new) * base over |t| < 6 zero crossings, base = 0.99 * min(orig, new) (rates reduced)."""
    g = math.gcd(orig, new)
    orig, new, base = orig // g, new // g, 0.99 * min(orig // g, new // g)
    t = (np.arange(len(x))[None] / orig - np.arange(math.ceil(new * len(x) / orig))[:, None] / new) * base
    kernel = np.where(np.abs(t) < 6, np.cos(t * np.pi / 12) ** 2 * np.sinc(t) * base / orig, 0.0)
    return kernel @ x


@pytest.mark.upstream
@pytest.mark.parametrize("orig, new", [(44100, 24000), (48000, 16000), (8000, 24000), (24000, 22050)])
def test_resample_is_the_windowed_sinc_for_any_rate_pair(orig, new):
    """In float64, since the kernel is built in the wave's dtype: in float32 its taps carry up to ~5e-6 of
    rounding for large reduced rates (147/80 here), as torchaudio's do."""
    x = torch.rand(2, 1, 1201, generator=torch.Generator().manual_seed(orig), dtype=torch.float64) - 0.5
    ours = oc.resample(x, orig, new)
    assert ours.shape == (2, 1, math.ceil(new * 1201 / orig)) and ours.dtype == torch.float64
    want = torch.from_numpy(np.stack([windowed_sinc(row.numpy(), orig, new) for row in x[:, 0]]))
    torch.testing.assert_close(ours[:, 0], want, atol=1e-10, rtol=0)
    assert oc.resample(x, orig, orig) is x


# ----------------------------------------------------------------------------- encode and decode goldens
@pytest.mark.upstream
@pytest.mark.parametrize("clip", ["ref24", "odd24"])
def test_encode_matches_upstream_step_by_step(tokenizer, clip):
    x = golden(f"clip_{clip}.npy")[None, None]
    with torch.no_grad():
        wave16 = tokenizer.hubert_input(x)
        close(wave16[0], f"codec_{clip}_hubert_input.npy")
        hidden = tokenizer.semantic_model(wave16)
        close(torch.stack(hidden, dim=1)[0], f"codec_{clip}_hubert_hidden_states.npy")
        features = tokenizer.semantic_features(hidden)
        close(features[0], f"codec_{clip}_encoder_semantic_in.npy")
        semantic = tokenizer.encoder_semantic(features)
        close(semantic[0], f"codec_{clip}_encoder_semantic_out.npy")
        wave = tokenizer.acoustic_input(x, semantic.shape[-1])
        if clip == "odd24":  # 25557 samples: the DAC would give 26 frames, so it gets hop/2 on both sides
            close(wave[0, 0], "codec_odd24_acoustic_encoder_in.npy")
        else:
            assert wave is x
        acoustic = tokenizer.acoustic_encoder(wave)
        close(acoustic[0], f"codec_{clip}_acoustic_encoder_out.npy")
        embeddings = tokenizer.quantizer_input(acoustic, semantic)
        close(embeddings[0], f"codec_{clip}_quantizer_in.npy")
        assert torch.equal(tokenizer.quantize(embeddings)[0], golden(f"codec_{clip}_codes.npy"))
    codes = tokenizer.encode(x)
    assert codes.dtype == torch.int64 and torch.equal(codes[0], golden(f"codec_{clip}_codes.npy"))


@pytest.mark.upstream
@pytest.mark.parametrize("clip", ["ref24", "odd24"])
def test_decode_matches_upstream_step_by_step(tokenizer, clip):
    codes = golden(f"codec_{clip}_codes.npy")[None]
    with torch.no_grad():
        quantized = tokenizer.dequantize(codes)
        close(quantized[0], f"codec_{clip}_decode_quantized.npy")
        close(tokenizer.fc2(quantized).transpose(1, 2)[0], f"codec_{clip}_decode_fc2_out.npy")
    audio = tokenizer.decode(codes)
    assert audio.shape == (1, 1, codes.shape[-1] * 960) and audio.dtype == torch.float32
    close(audio[0, 0], f"codec_{clip}_decoded.npy")


@pytest.mark.upstream
def test_decode_of_arbitrary_codes_matches_upstream(tokenizer):
    codes = golden("codec_random_codes.npy")  # column 0 is 1023, column 1 is 0: both ends of the codebook
    close(tokenizer.decode(codes[None])[0, 0], "codec_random_codes_decoded.npy")


def test_encode_draws_no_random_numbers(tokenizer):
    state = torch.get_rng_state()
    tokenizer.encode(golden("clip_odd24.npy")[None, None])
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.upstream
def test_a_batch_of_two_clips_encodes_as_each_alone(tokenizer):
    x = torch.stack([golden("clip_ref24.npy")[:25557], golden("clip_odd24.npy")])[:, None]
    both = tokenizer.encode(x)
    assert torch.equal(both[0], tokenizer.encode(x[:1])[0])
    assert torch.equal(both[1], golden("codec_odd24_codes.npy"))


# ----------------------------------------------------------------------------- loading
def tokenizer_folder(tmp_path, config=None, drop=(), change=None):
    """A copy of the fixture's audio_tokenizer/, with its config and tensors edited."""
    folder = tmp_path / "audio_tokenizer"
    folder.mkdir(parents=True)
    config = config or json.loads((TOKENIZER / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v for k, v in load_file(TOKENIZER / "model.safetensors").items() if k not in drop}
    save_file({**state, **(change or {})}, folder / "model.safetensors")
    return folder


def test_load_names_what_is_missing_or_wrong(tmp_path):
    with pytest.raises(UserError, match="not found"):
        oc.load(tmp_path / "nowhere")
    with pytest.raises(UserError, match="has no config.json"):
        oc.load(tmp_path)
    with pytest.raises(UserError, match="model_type 'fish_qwen3_omni' is not higgs_audio_v2_tokenizer"):
        oc.load(S2_CHECKPOINT)
    dac = json.loads((TOKENIZER / "config.json").read_text())["acoustic_model_config"]
    with pytest.raises(UserError, match="model_type 'dac' is not"):
        oc.load(tokenizer_folder(tmp_path / "dac", config=dac))
    (tmp_path / "config.json").write_text((TOKENIZER / "config.json").read_text())
    with pytest.raises(UserError, match="has no model.safetensors"):
        oc.load(tmp_path)
    with pytest.raises(UserError, match="has no tensor quantizer.quantizers.7.codebook.embed$"):
        oc.load(tokenizer_folder(tmp_path / "a", drop=["quantizer.quantizers.7.codebook.embed"]))
    with pytest.raises(UserError, match=r"fc2.weight is \[16, 47\], but config.json makes it \[16, 48\]"):
        oc.load(tokenizer_folder(tmp_path / "b", change={"fc2.weight": torch.zeros(16, 47)}))


def test_load_folds_either_form_of_the_pos_conv_weight_norm(tmp_path, tokenizer):
    prefix = "semantic_model.encoder.pos_conv_embed.conv."
    g, v = f"{prefix}parametrizations.weight.original0", f"{prefix}parametrizations.weight.original1"
    state = load_file(TOKENIZER / "model.safetensors")
    older = oc.load(tokenizer_folder(tmp_path, drop=[g, v], change={f"{prefix}weight_g": state[g],
                                                                     f"{prefix}weight_v": state[v]}))
    assert torch.equal(older.state_dict()[prefix + "weight"], tokenizer.state_dict()[prefix + "weight"])
    unused = ("decoder_semantic", "fc1", "embed_avg", "cluster_size", "inited")
    assert not any(word in name for name in tokenizer.state_dict() for word in unused)


# ----------------------------------------------------------------------------- the real dims, other dims
def dac_parameters(encoder=64, latent=256, decoder=1024, ratios=(8, 5, 4, 2, 3)):
    """DAC's encoder + decoder, counted from its definition: a residual unit on C channels has two Snake
    alphas, a k7 conv and a 1x1 conv (with biases); each block adds a Snake and a k=2s (transposed) conv."""
    unit = lambda c: 2 * c + (7 * c * c + c) + (c * c + c)  # noqa: E731
    enc = 7 * encoder + encoder
    for i, s in enumerate(ratios):
        c = encoder * 2 ** i
        enc += 3 * unit(c) + c + (2 * s * c * 2 * c + 2 * c)
    top = encoder * 2 ** len(ratios)
    enc += top + 3 * top * latent + latent
    dec = 7 * latent * decoder + decoder
    for i, s in enumerate(ratios):
        c = decoder // 2 ** i
        dec += c + (2 * s * c * c // 2 + c // 2) + 3 * unit(c // 2)
    bottom = decoder // 2 ** len(ratios)
    return enc + dec + bottom + 7 * bottom + 1


def test_the_real_dims_build_the_real_shapes():
    with torch.device("meta"):
        model = oc.AudioTokenizer(oc.CONFIG)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert shapes["acoustic_encoder.block.4.conv1.weight"] == [2048, 1024, 6]
    assert shapes["acoustic_encoder.conv2.weight"] == [256, 2048, 3]
    assert shapes["acoustic_decoder.block.0.conv_t1.weight"] == [1024, 512, 16]
    assert shapes["acoustic_decoder.conv2.weight"] == [1, 32, 7]
    assert shapes["fc.weight"] == [1024, 1024] and shapes["fc2.weight"] == [256, 1024]
    assert shapes["quantizer.quantizers.7.codebook.embed"] == [1024, 64]
    assert shapes["quantizer.quantizers.0.project_in.weight"] == [64, 1024]
    assert shapes["semantic_model.encoder.pos_conv_embed.conv.weight"] == [768, 48, 128]
    assert shapes["semantic_model.encoder.layers.11.feed_forward.intermediate_dense.weight"] == [3072, 768]
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    # facebook/hubert-base-ls960 has 94,371,712, with masked_spec_embed (768) and weight_g (128) on top
    assert count(model.semantic_model) == 94_371_712 - 768 - 128
    assert count(model.acoustic_encoder) + count(model.acoustic_decoder) == dac_parameters()
    assert count(model.encoder_semantic) == 768 * 768 * 3 + 2 * (2 * (768 * 768 * 4) + 768 * 768 * 3 + 768)


def test_another_frame_rate_and_codebook_build_from_the_config_alone():
    data = json.loads((TOKENIZER / "config.json").read_text())
    data["acoustic_model_config"].update(downsampling_ratios=[8, 5, 4, 3], upsampling_ratios=[8, 5, 4, 3])
    data["semantic_model_config"].update(hidden_size=24, num_attention_heads=3, num_hidden_layers=3,
                                         conv_dim=[8] * 7, num_conv_pos_embeddings=15,
                                         num_conv_pos_embedding_groups=4)
    data.update(codebook_size=512, codebook_dim=8, target_bandwidths=[0.9, 1.8])
    cfg = oc.config_from_json(data)
    assert (cfg["hop_length"], cfg["frame_rate"], cfg["semantic_downsample_factor"]) == (480, 50, 1)
    assert cfg["num_quantizers"] == 4  # 1800 bits/s over 50 frames/s of 9 bits
    model = oc.random_tokenizer(cfg, seed=1)
    for samples in (480 * 20, 480 * 20 - 77):  # a whole number of frames, and the hop/2-padded route
        codes = model.encode(torch.rand(2, 1, samples, generator=torch.Generator().manual_seed(0)) - 0.5)
        assert codes.shape == (2, 4, 20) and 0 <= codes.min() and codes.max() < 512
        assert model.decode(codes).shape == (2, 1, 20 * 480)


def test_semantic_strides_and_channel_ratios_build_from_the_config_alone():
    """A stride s != 1 in encoder_semantic takes a k=2s conv (stride 1 keeps k3), channel_ratios widen the
    blocks: with downsample_factor 640, HuBERT's 50 frames/s are all kept, then halved to the DAC's 25."""
    data = json.loads((TOKENIZER / "config.json").read_text())
    data.update(strides=[1, 2], channel_ratios=[1.5, 1], downsample_factor=640)
    cfg = oc.config_from_json(data)
    assert cfg["semantic_downsample_factor"] == 1
    model = oc.random_tokenizer(cfg)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items() if k.startswith("encoder_semantic.")}
    assert shapes["encoder_semantic.conv_blocks.0.conv.weight"] == [48, 32, 3]
    assert shapes["encoder_semantic.conv_blocks.1.res_units.0.conv1.weight"] == [48, 48, 3]
    assert shapes["encoder_semantic.conv_blocks.1.conv.weight"] == [32, 48, 4]
    wave = torch.rand(1, 1, 960 * 10, generator=torch.Generator().manual_seed(0)) - 0.5
    assert model.encode(wave).shape == (1, 8, 10)


def test_random_tokenizer_is_seeded_and_decodes_moderate_audio():
    state = torch.get_rng_state()
    model, again = oc.random_tokenizer(oc.DEMO_CONFIG), oc.random_tokenizer(oc.DEMO_CONFIG)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    codes = torch.randint(0, 1024, (1, 8, 25), generator=torch.Generator().manual_seed(3))
    audio = model.decode(codes)
    assert audio.shape == (1, 1, 24000) and audio.isfinite().all() and 0.05 < audio.abs().max() < 5
    assert model.encode(audio).shape == (1, 8, 25)
