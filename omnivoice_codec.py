"""OmniVoice's audio tokenizer: the HiggsAudio v2 tokenizer (transformers' HiggsAudioV2TokenizerModel, eval
mode) in plain PyTorch. 24 kHz audio <-> codes [B, num_quantizers, T], one frame per hop_length samples.

encode: resample to 16 kHz -> HuBERT -> mean of its L+1 hidden states, every factor-th frame
        -> encoder_semantic
        | the waveform (padded by hop/2 only when the lengths disagree) -> DAC encoder
        -> concat -> fc -> residual VQ (plain euclidean argmax)
decode: sum of project_out(embed[codes]) -> fc2 -> DAC decoder (no tanh)

Sections: config, resampling (torchaudio's sinc_interp_hann), DAC encoder and decoder, the semantic conv
encoder, HuBERT, residual VQ, the tokenizer, loading (and the random demo model).
Module and tensor names are upstream's, so a checkpoint loads with no renaming.
"""
import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import UserError, unreadable

# ----------------------------------------------------------------------------- config
CONFIG = dict(  # the real tokenizer of k2-fsa/OmniVoice
    sample_rate=24000, semantic_sample_rate=16000, downsample_factor=320,
    hop_length=960, frame_rate=25, semantic_downsample_factor=2,
    codebook_size=1024, codebook_dim=64, num_quantizers=8,
    # encoder_semantic: HiggsAudio's conv stack over the HuBERT features
    kernel_size=3, unit_kernel_size=3, strides=[1, 1], channel_ratios=[1, 1], block_dilations=[1, 1],
    # acoustic_model_config: the DAC encoder and decoder
    encoder_hidden_size=64, acoustic_hidden_size=256, decoder_hidden_size=1024,
    downsampling_ratios=[8, 5, 4, 2, 3], upsampling_ratios=[8, 5, 4, 2, 3],
    # semantic_model_config: HuBERT base
    semantic_hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    conv_dim=[512] * 7, conv_kernel=[10, 3, 3, 3, 3, 2, 2], conv_stride=[5, 2, 2, 2, 2, 2, 2],
    conv_bias=False, num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16, layer_norm_eps=1e-5,
)

DEMO_CONFIG = dict(  # the dims of tests/fixtures/omnivoice-tiny, for the in-memory demo model
    CONFIG, codebook_dim=16, encoder_hidden_size=4, acoustic_hidden_size=16, decoder_hidden_size=64,
    semantic_hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    conv_dim=[16] * 7,
)

# copied as they are from config.json, its acoustic_model_config (DAC) and its semantic_model_config (HuBERT)
TOKENIZER_KEYS = ("sample_rate", "semantic_sample_rate", "downsample_factor", "codebook_size", "codebook_dim",
                  "kernel_size", "unit_kernel_size", "strides", "channel_ratios", "block_dilations")
DAC_KEYS = ("encoder_hidden_size", "decoder_hidden_size", "downsampling_ratios", "upsampling_ratios")
HUBERT_KEYS = ("num_hidden_layers", "num_attention_heads", "intermediate_size", "conv_dim", "conv_kernel",
               "conv_stride", "num_conv_pos_embeddings", "num_conv_pos_embedding_groups", "layer_norm_eps")
HUBERT_FIXED = dict(  # HubertConfig options the HiggsAudio v2 tokenizer never changes (their defaults)
    feat_extract_norm="group", do_stable_layer_norm=False, feat_extract_activation="gelu", hidden_act="gelu",
    feat_proj_layer_norm=True, conv_pos_batch_norm=False,
)


def config_from_json(data: dict) -> dict:
    """audio_tokenizer/config.json (HiggsAudioV2TokenizerConfig) -> our flat dict, derived as upstream."""
    if data.get("model_type") != "higgs_audio_v2_tokenizer":
        raise UserError(f"model_type {data.get('model_type')!r} is not higgs_audio_v2_tokenizer: pass the "
                        "audio_tokenizer/ folder of a k2-fsa/OmniVoice checkpoint")
    acoustic, semantic = data["acoustic_model_config"], data["semantic_model_config"]
    if acoustic.get("model_type", "dac") != "dac" or semantic.get("model_type", "hubert") != "hubert":
        raise UserError("only a DAC acoustic model and a HuBERT semantic model are supported")
    for key, value in HUBERT_FIXED.items():
        if semantic.get(key, value) != value:
            raise UserError(f"semantic_model_config {key}={semantic[key]!r} is not supported ({value!r} is)")
    cfg = {key: data[key] for key in TOKENIZER_KEYS}
    cfg.update({key: acoustic[key] for key in DAC_KEYS}, acoustic_hidden_size=acoustic["hidden_size"])
    cfg.update({key: semantic[key] for key in HUBERT_KEYS}, semantic_hidden_size=semantic["hidden_size"],
               conv_bias=semantic.get("conv_bias", False))
    if cfg["codebook_dim"] is None:  # upstream's default: the width of fc
        cfg["codebook_dim"] = cfg["acoustic_hidden_size"] + cfg["semantic_hidden_size"]
    sr, hop, size = cfg["sample_rate"], math.prod(cfg["downsampling_ratios"]), cfg["codebook_size"]
    frame_rate, bandwidth = math.ceil(sr / hop), data["target_bandwidths"][-1]
    built = int(1000 * bandwidth // (frame_rate * math.ceil(math.log2(size))))  # quantizers upstream builds
    used = int(max(1, math.floor(bandwidth / (math.log2(size) * frame_rate / 1000))))  # ... and encode runs
    factor = int(hop / (sr / cfg["semantic_sample_rate"]) / cfg["downsample_factor"])
    return dict(cfg, hop_length=hop, frame_rate=frame_rate, semantic_downsample_factor=factor,
                num_quantizers=min(built, used))


# ----------------------------------------------------------------------------- resampling
def resample(wave: torch.Tensor, orig_freq: int, new_freq: int) -> torch.Tensor:
    """[..., N] -> [..., ceil(new*N/orig)]: torchaudio.functional.resample with its defaults
    (sinc_interp_hann, lowpass_filter_width 6, rolloff 0.99), kernel in the wave's dtype, op for op."""
    if orig_freq == new_freq:
        return wave
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    zeros, base = 6, min(orig, new) * 0.99  # lowpass_filter_width, the cutoff after the rolloff
    width = math.ceil(zeros * orig / base)
    kw = dict(dtype=wave.dtype, device=wave.device)
    idx = torch.arange(-width, width + orig, **kw)[None, None] / orig
    t = torch.arange(0, -new, -1, **kw)[:, None, None] / new + idx  # (new, 1, 2*width + orig)
    t = (t * base).clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t) * (window * (base / orig))
    flat = F.pad(wave.reshape(-1, wave.shape[-1]), (width, width + orig))
    out = F.conv1d(flat[:, None], kernel, stride=orig).transpose(1, 2).reshape(flat.shape[0], -1)
    length = int(torch.tensor(new * wave.shape[-1] / orig, dtype=torch.float32).ceil())  # as torchaudio: fp32
    return out[..., :length].reshape(*wave.shape[:-1], -1)


# ----------------------------------------------------------------------------- DAC encoder and decoder
class Snake1d(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, dim, 1))

    def forward(self, x):
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class DacResidualUnit(nn.Module):
    def __init__(self, dim, dilation):
        super().__init__()
        self.snake1, self.snake2 = Snake1d(dim), Snake1d(dim)
        self.conv1 = nn.Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation)
        self.conv2 = nn.Conv1d(dim, dim, 1)

    def forward(self, x):  # k7 with padding 3*dilation keeps the length: DAC's centre crop never cuts
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class DacEncoderBlock(nn.Module):
    def __init__(self, dim, stride):  # dim//2 channels in, dim out, time / stride
        super().__init__()
        self.res_unit1, self.res_unit2, self.res_unit3 = (DacResidualUnit(dim // 2, d) for d in (1, 3, 9))
        self.snake1 = Snake1d(dim // 2)
        self.conv1 = nn.Conv1d(dim // 2, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2))

    def forward(self, x):
        return self.conv1(self.snake1(self.res_unit3(self.res_unit2(self.res_unit1(x)))))


class DacEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim, ratios = cfg["encoder_hidden_size"], cfg["downsampling_ratios"]
        self.conv1 = nn.Conv1d(1, dim, 7, padding=3)
        self.block = nn.ModuleList(DacEncoderBlock(dim * 2 ** (i + 1), s) for i, s in enumerate(ratios))
        self.snake1 = Snake1d(dim * 2 ** len(ratios))
        self.conv2 = nn.Conv1d(dim * 2 ** len(ratios), cfg["acoustic_hidden_size"], 3, padding=1)

    def forward(self, x):  # [B, 1, N] -> [B, acoustic_hidden, frames]
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))

    def output_length(self, n: int) -> int:
        """Frames for n samples, as upstream counts them: every Conv1d in module order."""
        for conv in (m for m in self.modules() if isinstance(m, nn.Conv1d)):
            (k,), (s,), (p,), (d,) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
            n = int((n + 2 * p - d * (k - 1) - 1) / s + 1)
        return n


class DacDecoderBlock(nn.Module):
    def __init__(self, dim, stride):  # dim channels in, dim//2 out, time * stride
        super().__init__()
        self.snake1 = Snake1d(dim)
        # HiggsAudio sets output_padding = stride % 2 (DAC has 0), so that each block gives exactly T * stride
        self.conv_t1 = nn.ConvTranspose1d(dim, dim // 2, 2 * stride, stride=stride,
                                          padding=math.ceil(stride / 2), output_padding=stride % 2)
        self.res_unit1, self.res_unit2, self.res_unit3 = (DacResidualUnit(dim // 2, d) for d in (1, 3, 9))

    def forward(self, x):
        return self.res_unit3(self.res_unit2(self.res_unit1(self.conv_t1(self.snake1(x)))))


class DacDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim, ratios = cfg["decoder_hidden_size"], cfg["upsampling_ratios"]
        self.conv1 = nn.Conv1d(cfg["acoustic_hidden_size"], dim, 7, padding=3)
        self.block = nn.ModuleList(DacDecoderBlock(dim // 2 ** i, s) for i, s in enumerate(ratios))
        self.snake1 = Snake1d(dim // 2 ** len(ratios))
        self.conv2 = nn.Conv1d(dim // 2 ** len(ratios), 1, 7, padding=3)

    def forward(self, x):  # [B, acoustic_hidden, T] -> [B, 1, T * prod(upsampling_ratios)]
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))  # HiggsAudio replaces DAC's final tanh with identity


# ----------------------------------------------------------------------------- the semantic conv encoder
class SemanticResidualUnit(nn.Module):
    def __init__(self, dim, kernel, dilation):
        super().__init__()
        padding = (kernel - 1) // 2 * dilation
        self.conv1 = nn.Conv1d(dim, dim, kernel, dilation=dilation, padding=padding, bias=False)
        self.conv2 = nn.Conv1d(dim, dim, 1, bias=False)

    def forward(self, x):
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class SemanticEncoderBlock(nn.Module):
    def __init__(self, cfg, dim, out, stride):
        super().__init__()
        self.res_units = nn.ModuleList(SemanticResidualUnit(dim, cfg["unit_kernel_size"], d)
                                       for d in cfg["block_dilations"])
        kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(dim, out, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x):
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim, k = cfg["semantic_hidden_size"], cfg["kernel_size"]
        self.conv = nn.Conv1d(dim, dim, k, padding=k // 2, bias=False)
        widths = [dim] + [int(dim * r) for r in cfg["channel_ratios"]]
        self.conv_blocks = nn.ModuleList(SemanticEncoderBlock(cfg, widths[i], widths[i + 1], s)
                                         for i, s in enumerate(cfg["strides"]))

    def forward(self, x):  # [B, semantic_hidden, frames] -> [B, semantic_hidden, frames / prod(strides)]
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


# ----------------------------------------------------------------------------- HuBERT
class HubertLayer(nn.Module):
    """Post-LN layer: attention (biases, no mask), residual, LayerNorm, FFN, residual, LayerNorm."""

    def __init__(self, cfg):
        super().__init__()
        dim, eps, self.heads = cfg["semantic_hidden_size"], cfg["layer_norm_eps"], cfg["num_attention_heads"]
        projections = ("q_proj", "k_proj", "v_proj", "out_proj")
        self.attention = nn.ModuleDict({name: nn.Linear(dim, dim) for name in projections})
        self.layer_norm, self.final_layer_norm = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.feed_forward = nn.ModuleDict(dict(intermediate_dense=nn.Linear(dim, cfg["intermediate_size"]),
                                               output_dense=nn.Linear(cfg["intermediate_size"], dim)))

    def forward(self, x):  # [B, frames, H]
        B, T, H = x.shape
        a, ff = self.attention, self.feed_forward
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, scale=(H // self.heads) ** -0.5)  # (B, heads, T, hd)
        x = self.layer_norm(x + a.out_proj(y.transpose(1, 2).reshape(B, T, H)))
        return self.final_layer_norm(x + ff.output_dense(F.gelu(ff.intermediate_dense(x))))


class Hubert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dims, dim, eps = cfg["conv_dim"], cfg["semantic_hidden_size"], cfg["layer_norm_eps"]
        convs = [nn.ModuleDict(dict(conv=nn.Conv1d(c_in, c_out, k, stride=s, bias=cfg["conv_bias"])))
                 for c_in, c_out, k, s in zip([1] + dims, dims, cfg["conv_kernel"], cfg["conv_stride"])]
        convs[0].layer_norm = nn.GroupNorm(dims[0], dims[0])  # "group" norm: on the first conv only
        self.feature_extractor = nn.ModuleDict(dict(conv_layers=nn.ModuleList(convs)))
        self.feature_projection = nn.ModuleDict(dict(layer_norm=nn.LayerNorm(dims[-1], eps=eps),
                                                     projection=nn.Linear(dims[-1], dim)))
        K = cfg["num_conv_pos_embeddings"]
        pos_conv = nn.Conv1d(dim, dim, K, padding=K // 2, groups=cfg["num_conv_pos_embedding_groups"])
        self.encoder = nn.ModuleDict(dict(
            pos_conv_embed=nn.ModuleDict(dict(conv=pos_conv)), layer_norm=nn.LayerNorm(dim, eps=eps),
            layers=nn.ModuleList(HubertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))))

    def forward(self, wave) -> list:
        """[B, N] at 16 kHz -> the L+1 hidden states [B, frames, H]: layer 0's input, each layer's output."""
        x = wave[:, None]
        for i, layer in enumerate(self.feature_extractor.conv_layers):
            x = layer.conv(x)
            x = F.gelu(layer.layer_norm(x) if i == 0 else x)
        x = self.feature_projection.projection(self.feature_projection.layer_norm(x.transpose(1, 2)))
        pos = self.encoder.pos_conv_embed.conv(x.transpose(1, 2))
        pos = pos[..., :-1] if self.encoder.pos_conv_embed.conv.kernel_size[0] % 2 == 0 else pos  # even K
        hidden = [self.encoder.layer_norm(x + F.gelu(pos).transpose(1, 2))]
        for layer in self.encoder.layers:
            hidden.append(layer(hidden[-1]))
        return hidden


# ----------------------------------------------------------------------------- residual VQ
class EuclideanCodebook(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.register_buffer("embed", torch.zeros(cfg["codebook_size"], cfg["codebook_dim"]))

    def quantize(self, x):  # [..., dim] -> [...] indices: plain euclidean (no L2 normalisation, unlike DAC)
        flat, embed = x.reshape(-1, x.shape[-1]), self.embed.t()
        dist = -(flat.pow(2).sum(1, keepdim=True) - 2 * flat @ embed + embed.pow(2).sum(0, keepdim=True))
        return dist.max(dim=-1).indices.view(x.shape[:-1])


class VectorQuantization(nn.Module):
    def __init__(self, cfg, hidden):
        super().__init__()
        self.codebook = EuclideanCodebook(cfg)
        self.project_in = nn.Linear(hidden, cfg["codebook_dim"])
        self.project_out = nn.Linear(cfg["codebook_dim"], hidden)

    def decode(self, indices):  # [B, T] -> [B, T, hidden]
        return self.project_out(F.embedding(indices, self.codebook.embed))


# ----------------------------------------------------------------------------- the tokenizer
class AudioTokenizer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.sample_rate, self.hop_length = cfg["sample_rate"], cfg["hop_length"]
        self.frame_rate = cfg["frame_rate"]
        self.num_quantizers, self.codebook_size = cfg["num_quantizers"], cfg["codebook_size"]
        hidden = cfg["acoustic_hidden_size"] + cfg["semantic_hidden_size"]
        self.acoustic_encoder, self.acoustic_decoder = DacEncoder(cfg), DacDecoder(cfg)
        self.encoder_semantic = SemanticEncoder(cfg)
        self.semantic_model = Hubert(cfg)
        self.fc = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, cfg["acoustic_hidden_size"])
        self.quantizer = nn.ModuleDict(dict(quantizers=nn.ModuleList(
            VectorQuantization(cfg, hidden) for _ in range(self.num_quantizers))))

    # encode, step by step
    def hubert_input(self, x):
        """[B, 1, N] -> [B, N_16k + 320]: resampled, channel 0, zero-padded."""
        x = resample(x, self.sample_rate, self.config["semantic_sample_rate"])
        return F.pad(x[:, 0, :], (160, 160))  # upstream's fixed 160 (not hop/2, a TODO in transformers)

    def semantic_features(self, hidden_states):
        """HuBERT's L+1 hidden states -> encoder_semantic's input [B, H, T]: their mean, every factor-th."""
        features = torch.stack(hidden_states, dim=1).mean(dim=1)
        factor = self.config["semantic_downsample_factor"]
        return (features[:, ::factor] if factor > 1 else features).transpose(1, 2)

    def acoustic_input(self, x, frames: int):
        """The waveform the DAC encoder sees: padded by hop/2 on both sides only if its frames != `frames`."""
        if self.acoustic_encoder.output_length(x.shape[-1]) != frames:
            x = F.pad(x, (self.hop_length // 2, self.hop_length // 2))
        return x

    def quantizer_input(self, acoustic, semantic):
        """[B, acoustic_hidden, T] and [B, semantic_hidden, T] -> fc over their concat [B, hidden, T]."""
        return self.fc(torch.cat([acoustic, semantic], dim=1).transpose(1, 2)).transpose(1, 2)

    def quantize(self, embeddings):
        """[B, hidden, T] -> codes [B, num_quantizers, T]: each quantizer takes what the previous left."""
        residual, codes = embeddings, []
        for quantizer in self.quantizer.quantizers:
            indices = quantizer.codebook.quantize(quantizer.project_in(residual.transpose(1, 2)))
            residual = residual - quantizer.decode(indices).transpose(1, 2)
            codes.append(indices)
        return torch.stack(codes, dim=1)

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, 1, N] at sample_rate -> codes [B, num_quantizers, T] int64."""
        if x.dim() != 3 or x.shape[1] != 1:
            raise UserError(f"encode takes mono audio [batch, 1, samples], not {list(x.shape)}")
        x = x.to(self.fc.weight)  # its device and dtype
        semantic = self.encoder_semantic(self.semantic_features(self.semantic_model(self.hubert_input(x))))
        acoustic = self.acoustic_encoder(self.acoustic_input(x, semantic.shape[-1]))
        return self.quantize(self.quantizer_input(acoustic, semantic))

    # decode
    def dequantize(self, codes):
        """codes [B, C, T] -> [B, T, hidden], the sum over quantizers (from 0.0, as upstream), time-major."""
        per_quantizer = zip(self.quantizer.quantizers, codes.long().transpose(0, 1))
        return sum((quantizer.decode(indices) for quantizer, indices in per_quantizer), 0.0)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, C, T] -> audio [B, 1, T * hop] float32, neither clamped nor trimmed (as upstream)."""
        codes = codes.to(self.fc2.weight.device)
        latent = self.fc2(self.dequantize(codes)).transpose(1, 2)  # (B, acoustic_hidden, T)
        return self.acoustic_decoder(latent).float()


# ----------------------------------------------------------------------------- loading
POS_CONV = "semantic_model.encoder.pos_conv_embed.conv."
WEIGHT_NORM = [("parametrizations.weight.original0", "parametrizations.weight.original1"),  # (g, v)
               ("weight_g", "weight_v")]  # the older form, which transformers also reads


def read_weights(path: Path, names) -> dict:
    """The tensors `names` of model.safetensors, HuBERT's weight-normed pos conv folded into its weight.
    Nothing else is read: upstream ships decoder_semantic, fc1 and the codebooks' EMA state, all unused."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, "pt") as f:
            stored = set(f.keys())
            state = {name: f.get_tensor(name) for name in names if name in stored}
            for g, v in WEIGHT_NORM:
                if {POS_CONV + g, POS_CONV + v} <= stored:
                    g, v = f.get_tensor(POS_CONV + g).float(), f.get_tensor(POS_CONV + v).float()
                    state[POS_CONV + "weight"] = v * (g / v.norm(dim=(0, 1), keepdim=True))  # norm over dim 2
    except (OSError, SafetensorError) as e:
        raise unreadable(path, e) from None
    return state


def load(folder, device="cpu", dtype=torch.float32) -> AudioTokenizer:
    """An OmniVoice checkpoint's audio_tokenizer/ folder (config.json, model.safetensors) -> the model."""
    folder = Path(folder)
    hint = "pass the audio_tokenizer/ folder of a k2-fsa/OmniVoice checkpoint"
    if not folder.is_dir():
        raise UserError(f"audio tokenizer folder {folder} not found: {hint}")
    config_path, weights = folder / "config.json", folder / "model.safetensors"
    if not config_path.is_file():
        raise UserError(f"{folder} has no config.json: {hint}")
    try:
        cfg = config_from_json(json.loads(config_path.read_text()))
    except UserError as e:
        raise UserError(f"{config_path}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise unreadable(config_path, e) from None
    if not weights.is_file():
        raise UserError(f"{folder} has no model.safetensors: {hint}")
    with torch.device("meta"):
        model = AudioTokenizer(cfg)
    state = read_weights(weights, model.state_dict())
    for name, want in model.state_dict().items():
        if name not in state:
            raise UserError(f"{weights} has no tensor {name}")
        if state[name].shape != want.shape:
            got = list(state[name].shape)
            raise UserError(f"{weights}: {name} is {got}, but config.json makes it {list(want.shape)}")
    model.load_state_dict(state, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def random_tokenizer(cfg: dict, seed=0) -> AudioTokenizer:
    """Random weights from torch.rand (its own generator: the global RNG is untouched), scaled so that
    activations stay O(1) and decode gives audio peaking near 0.5."""
    with torch.device("meta"):  # no default init: it would draw from the global RNG
        model = AudioTokenizer(cfg)
    model = model.to_empty(device="cpu").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            u = torch.rand(tensor.shape, generator=generator) * 2 - 1  # U(-1, 1): variance 1/3
            if name.endswith("alpha"):
                tensor.copy_(1 + 0.5 * u)
            elif "layer_norm" in name:
                tensor.copy_(1 + 0.1 * u if name.endswith("weight") else 0.05 * u)
            elif name.endswith("bias"):
                tensor.copy_(0.05 * u)
            else:  # unit variance for the codebooks, 1/fan_in for the weights
                tensor.copy_(u * math.sqrt(3 / (1 if name.endswith("embed") else tensor[0].numel())))
        codes = torch.arange(cfg["num_quantizers"] * 8).reshape(1, -1, 8) * 37 % cfg["codebook_size"]
        peak = model.decode(codes).abs().max()
        model.acoustic_decoder.conv2.weight /= 2 * peak
        model.acoustic_decoder.conv2.bias /= 2 * peak
    return model
