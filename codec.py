"""The S2-Pro audio codec: Fish Audio's modified DAC (44.1 kHz, hop 2048, 10 codebooks) in plain PyTorch.

    model = codec.load("s2-pro")                       # folder with codec.pth, or the file itself
    codes = codec.encode(model, codec.load_audio("ref.wav"))   # (B, 10, T) int64, ~21.53 frames/s
    wave = codec.decode(model, codes)                  # (B, T * 2048) float32 in [-1, 1]

CLI: `python codec.py encode|decode --help`. Matches upstream fish-speech (3dd1f85) `modded_dac.DAC`
with `rvq.DownsampleResidualVectorQuantize` as it runs at inference: codes exactly, waveforms to fp32 noise.
Needs common.py alone. Also the reference files S2-Pro clones from (a clip or its codes + transcript).
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import soxr
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm
from tqdm import tqdm

import common  # the error users see, devices, atomic writes, audio files: no model

CONFIG = dict(  # the real S2-Pro codec (upstream fish_speech/configs/modded_dac_vq.yaml)
    sample_rate=44100, latent_dim=1024, head_dim=64, rope_base=10000, norm_eps=1e-5,
    encoder_dim=64, encoder_rates=[2, 4, 8, 8], encoder_transformer_layers=[0, 0, 0, 4],
    encoder_window=512,  # upstream asks a functools.partial for `window_size`: it has none, so 512
    decoder_dim=1536, decoder_rates=[8, 8, 4, 2],
    downsample_factor=[2, 2], semantic_codebook_size=4096, codebook_size=1024, codebook_dim=8,
    n_codebooks=9,  # residual codebooks after the semantic one
    quantizer_layers=8, quantizer_heads=16, quantizer_ffn=3072, quantizer_window=128,  # pre and post_module
)
CHUNK_FRAMES = 16  # frames per pass (0.74 s): memory stays flat, every tensor under 32 MB
ATTN_BLOCK = 2048  # queries per attention call (shorter inputs: upstream's one full-mask call)
STALE_BUFFERS = ("freqs_cis", "causal_mask")  # non-persistent buffers that older saves may still carry


# ----------------------------------------------------------------------------- building blocks
def with_past(cache, module, x, n, dim=-1, channels_last=False):  # (..., L, ...) -> (..., n + L, ...)
    """x after the n steps that came before it in this stream (along dim): zeros at its start, or with no
    stream. channels_last: x (B, C, L) comes out (B, L, C) in memory (cpu_fast's layout), the same past."""
    if n == 0:
        return x
    past = None if cache is None else cache.get(module)
    if past is None:
        past = x.new_zeros(x.shape[:dim] + (n,) + x.shape[dim:][1:])
    x = torch.cat([past.mT, x.mT], 1).mT if channels_last else torch.cat([past, x], dim)
    if cache is not None:
        cache[module] = x.narrow(dim, x.shape[dim] - n, n).clone()  # a view would keep all of x alive
    return x


class Snake(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    @staticmethod
    def snake(x, alpha):  # (B, C, L), (1, C, 1): five passes over x eager, one compiled (cpu_fast)
        return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)

    def forward(self, x, cache=None):
        return self.snake(x, self.alpha.view(1, -1, 1))


class CausalConv(nn.Module):
    """Conv1d padded with zeros on the left only (upstream `CausalConvNet`), weight-normed unless wn=False."""

    def __init__(self, cin, cout, kernel, stride=1, dilation=1, groups=1, wn=True):
        super().__init__()
        conv = nn.Conv1d(cin, cout, kernel, stride=stride, dilation=dilation, groups=groups)
        self.conv = weight_norm(conv) if wn else conv
        self.pad = (kernel - 1) * dilation + 1 - stride

    def forward(self, x, cache=None):  # (B, C, L) -> (B, C', L / stride); L is whole frames, so divisible
        return self.conv(self.padded(x, cache))

    def padded(self, x, cache, channels_last=False):  # (B, C, L) -> (B, C, pad + L): the kernel's reach
        return with_past(cache, self, x, self.pad, channels_last=channels_last)


class CausalConvT(nn.Module):
    """ConvTranspose1d (kernel = stride or 2 * stride) minus its last kernel - stride outputs: L * stride.
    One matmul and an overlap-add: CPU conv_transpose1d copies the whole weight on every call (72 MB in
    the first decoder stage) and is 1.8x (16-frame chunks) to 14x (1-frame chunks) slower."""

    def __init__(self, cin, cout, kernel, stride, wn=True):
        super().__init__()
        if kernel not in (stride, 2 * stride):  # forward adds the overlap of one block only
            raise common.UserError(f"codec config: an upsampling kernel of {kernel} for stride {stride}"
                                   " is not supported (kernel = stride or 2 * stride)")
        conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.conv = weight_norm(conv) if wn else conv
        self.stride, self.overlap = stride, kernel // stride - 1

    def forward(self, x, cache=None):  # (B, C, L) -> (B, C', L * stride)
        B, _, L = x.shape
        w = self.conv.weight  # (C, C', kernel)
        y = (x.mT @ w.flatten(1)).view(B, L, -1, w.shape[2]).mT  # (B, L, kernel, C')
        y = y.unflatten(2, (1 + self.overlap, self.stride))
        out = y[:, :, 0]  # (B, L, stride, C'): what each input sample writes into its own block
        if self.overlap:  # ... plus what the one before it writes into the next block
            out = out + self.overlap_from_before(y[:, :, 1], cache)
        return out.permute(0, 3, 1, 2).flatten(2) + self.conv.bias[:, None]

    def overlap_from_before(self, overlaps, cache):  # (B, L, stride, C'): each sample's, the one before's
        return with_past(cache, self, overlaps, 1, dim=1)[:, :overlaps.shape[1]]


class Sequential(nn.Sequential):
    """nn.Sequential (same module names) that hands a stream's cache to every layer."""

    def forward(self, x, cache=None):
        for layer in self:
            x = layer(x, cache)
        return x


class Stack(nn.Module):
    """Layers kept under `.block` (upstream's module names), residual=True adds the input back."""

    def __init__(self, *layers, residual=False):
        super().__init__()
        self.block = Sequential(*layers)
        self.residual = residual

    def forward(self, x, cache=None):
        y = self.block(x, cache)
        return x + y if self.residual else y


def residual_units(dim):  # upstream's three ResidualUnits of a stage
    return [Stack(Snake(dim), CausalConv(dim, dim, 7, dilation=dilation), Snake(dim), CausalConv(dim, dim, 1),
                  residual=True) for dilation in (1, 3, 9)]


class ConvNeXt(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.dwconv = CausalConv(dim, dim, 7, groups=dim, wn=False)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)

    def forward(self, x, cache=None):  # (B, C, L)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(self.dwconv(x, cache).transpose(1, 2)))))
        return x + (self.gamma * y).transpose(1, 2)


class LayerScale(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


# The transformer blocks (upstream's arithmetic), dualAR.py's as well: one home, and codec.py needs no LM
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()  # upstream normalises in fp32
        xf = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rope_table(length, head_dim, base, start=0):
    """Positions start.. -> (length, head_dim / 2, 2): cos, sin."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(start, start + length), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([rot.real, rot.imag], -1).to(torch.bfloat16).float()  # upstream rounds it to bf16


def apply_rope(x, rope):
    """x (B, T, H, hd), rope (T or B, T, ...): rotates the interleaved pairs (x[2j], x[2j+1])."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[..., None, :, 0], rope[..., None, :, 1]  # broadcast over heads
    out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], -1)
    return out.flatten(3).type_as(x)


def windowed_attention(q, k, v, window):  # q (B, H, T, hd), k/v (B, H, P + T, hd): P past keys first
    out = torch.empty_like(q)
    length, past = q.shape[2], k.shape[2] - q.shape[2]
    for s in range(past, past + length, ATTN_BLOCK):  # query t (key index t) sees keys t-window+1..t
        e = min(s + ATTN_BLOCK, past + length)
        k0 = max(0, s - window + 1)
        qpos = torch.arange(s, e, device=q.device)[:, None]
        kpos = torch.arange(k0, e, device=q.device)[None]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        out[:, :, s - past: e - past] = F.scaled_dot_product_attention(
            q[:, :, s - past: e - past], k[:, :, k0:e], v[:, :, k0:e], attn_mask=mask[None, None])
    return out


class Attention(nn.Module):
    def __init__(self, dim, n_head, head_dim):
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * n_head * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)
        self.n_head, self.head_dim = n_head, head_dim

    def forward(self, x, rope, window, cache=None):  # (B, T, D)
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.n_head, self.head_dim).unbind(2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        if cache is not None:  # a stream: its last window - 1 keys and values are all a new query can see
            if self in cache:
                k, v = torch.cat([cache[self][0], k], 2), torch.cat([cache[self][1], v], 2)
            keep = min(window - 1, k.shape[2])
            cache[self] = k[:, :, k.shape[2] - keep:].clone(), v[:, :, k.shape[2] - keep:].clone()
        y = windowed_attention(q, k, v, window)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, dim, n_head, ffn, cfg):
        super().__init__()
        self.attention = Attention(dim, n_head, cfg["head_dim"])
        self.feed_forward = FeedForward(dim, ffn)
        self.ffn_norm = RMSNorm(dim, cfg["norm_eps"])
        self.attention_norm = RMSNorm(dim, cfg["norm_eps"])
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def forward(self, x, rope, window, cache=None):
        h = x + self.attention_layer_scale(self.attention(self.attention_norm(x), rope, window, cache))
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    """Causal sliding-window transformer on (B, C, T) tensors (upstream `WindowLimitedTransformer`)."""

    def __init__(self, dim, n_layer, n_head, ffn, window, cfg):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, n_head, ffn, cfg) for _ in range(n_layer))
        self.norm = RMSNorm(dim, cfg["norm_eps"])
        self.window, self.head_dim, self.rope_base = window, cfg["head_dim"], cfg["rope_base"]

    def forward(self, x, cache=None):
        x = x.transpose(1, 2).contiguous()  # (B, T, C); a transposed view made each Linear a slower bmm
        start = 0 if cache is None else cache.get(self, 0)  # positions count from a stream's first frame
        if cache is not None:
            cache[self] = start + x.shape[1]
        rope = rope_table(x.shape[1], self.head_dim, self.rope_base, start).to(x.device)
        for layer in self.layers:
            x = layer(x, rope, self.window, cache)
        return self.norm(x).transpose(1, 2)


class WNProj(nn.Module):
    """1x1 conv with descript-audio-codec's legacy weight norm (the checkpoint's weight_g / weight_v)."""

    def __init__(self, cin, cout):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(cout))
        self.weight_g = nn.Parameter(torch.ones(cout, 1, 1))
        self.weight_v = nn.Parameter(torch.randn(cout, cin, 1))
        self.register_buffer("weight", None, persistent=False)  # fold_weight_norm computes it once

    def forward(self, x):
        w = self.weight if self.weight is not None else torch._weight_norm(self.weight_v, self.weight_g, 0)
        return F.conv1d(x, w, self.bias)


class VQ(nn.Module):
    """One codebook: project to 8 dims, nearest L2-normalised codebook row, project the raw row back."""

    def __init__(self, dim, size, codebook_dim):
        super().__init__()
        self.in_proj = WNProj(dim, codebook_dim)
        self.out_proj = WNProj(codebook_dim, dim)
        self.codebook = nn.Embedding(size, codebook_dim)

    def encode(self, residual):  # (B, D, T) -> codes (B, T), quantized (B, D, T)
        e = self.in_proj(residual)
        flat = F.normalize(e.transpose(1, 2).reshape(-1, e.shape[1]))
        book = F.normalize(self.codebook.weight)
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ book.t() + book.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].view(e.shape[0], -1)
        q = self.codebook(codes).transpose(1, 2)
        return codes, self.out_proj(e + (q - e))  # upstream's straight-through form, for bit-exact residuals

    def decode(self, codes):  # (B, T) -> (B, D, T)
        return self.out_proj(self.codebook(codes).transpose(1, 2))


def rvq(n, size, cfg):  # upstream ResidualVectorQuantize: at inference only its list of quantizers matters
    m = nn.Module()
    m.quantizers = nn.ModuleList(VQ(cfg["latent_dim"], size, cfg["codebook_dim"]) for _ in range(n))
    return m


# ----------------------------------------------------------------------------- model
class Quantizer(nn.Module):
    """2x stride-2 downsampling, pre transformer, 1 semantic + n residual codebooks, the reverse to decode."""

    def __init__(self, cfg):
        super().__init__()
        d, factors = cfg["latent_dim"], cfg["downsample_factor"]
        self.semantic_quantizer = rvq(1, cfg["semantic_codebook_size"], cfg)
        self.quantizer = rvq(cfg["n_codebooks"], cfg["codebook_size"], cfg)
        self.downsample = Sequential(
            *(Sequential(CausalConv(d, d, f, stride=f, wn=False), ConvNeXt(d)) for f in factors))
        self.upsample = Sequential(
            *(Sequential(CausalConvT(d, d, f, f, wn=False), ConvNeXt(d)) for f in reversed(factors)))
        dims = d, cfg["quantizer_layers"], cfg["quantizer_heads"], cfg["quantizer_ffn"]
        self.pre_module = Transformer(*dims, cfg["quantizer_window"], cfg)
        self.post_module = Transformer(*dims, cfg["quantizer_window"], cfg)

    def encode(self, z, cache=None):  # (B, D, 4T) latent -> codes (B, 1 + n_codebooks, T)
        residual = self.pre_module(self.downsample(z, cache), cache)
        codes = []
        for vq in [*self.semantic_quantizer.quantizers, *self.quantizer.quantizers]:
            c, q = vq.encode(residual)
            codes.append(c)
            residual = residual - q
        return torch.stack(codes, 1)

    def decode(self, codes, cache=None):  # (B, 1 + n_codebooks, T) -> (B, D, T), still at frame rate
        acoustic = sum(vq.decode(codes[:, i + 1]) for i, vq in enumerate(self.quantizer.quantizers))
        return self.post_module(self.semantic_quantizer.quantizers[0].decode(codes[:, 0]) + acoustic, cache)


def build_encoder(cfg):
    d = cfg["encoder_dim"]
    layers = [CausalConv(1, d, 7)]
    for stride, n_layer in zip(cfg["encoder_rates"], cfg["encoder_transformer_layers"]):
        d *= 2
        down = CausalConv(d // 2, d, 2 * stride, stride=stride)
        heads, window = d // 64, cfg["encoder_window"]  # upstream: n_head = dim // 64, ffn = 3 * dim
        attn = [Transformer(d, n_layer, heads, 3 * d, window, cfg)] if n_layer else []
        layers.append(Stack(*residual_units(d // 2), Snake(d // 2), down, *attn))
    return Stack(*layers, Snake(d), CausalConv(d, cfg["latent_dim"], 3))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["decoder_dim"]
        layers = [CausalConv(cfg["latent_dim"], d, 7)]
        for i, stride in enumerate(cfg["decoder_rates"]):
            cin, cout = d // 2**i, d // 2 ** (i + 1)
            up = CausalConvT(cin, cout, 2 * stride, stride)
            layers.append(Stack(Snake(cin), up, *residual_units(cout)))
        self.model = Sequential(*layers, Snake(cout), CausalConv(cout, 1, 7))

    def forward(self, x, cache=None):
        return torch.tanh(self.model(x, cache))


def hop_length(cfg=CONFIG):  # samples per frame: 2048 for S2-Pro
    return math.prod(cfg["encoder_rates"]) * math.prod(cfg["downsample_factor"])


class DAC(nn.Module):
    def __init__(self, cfg=CONFIG):
        super().__init__()
        self.config = dict(cfg)
        self.encoder = build_encoder(cfg)
        self.quantizer = Quantizer(cfg)
        self.decoder = Decoder(cfg)
        self.hop = hop_length(cfg)

    def encode_chunk(self, x, cache):  # (B, 1, n * hop) -> codes (B, 1 + n_codebooks, n), the cache updated
        return self.quantizer.encode(self.encoder(x, cache), cache)

    def decode_chunk(self, codes, cache):  # codes (B, 1 + n_codebooks, n) in range -> (B, 1, n * hop)
        return self.decoder(self.quantizer.upsample(self.quantizer.decode(codes, cache), cache), cache)


# ----------------------------------------------------------------------------- loading
def read_config(path):
    """CONFIG, overridden by codec_config.json if present (upstream's hydra yaml as json, or flat keys)."""
    path = Path(path)
    if not path.is_file():
        return dict(CONFIG)
    try:
        cfg = json.loads(path.read_text())
        if "_target_" not in cfg:  # flat keys (dualAR's demo checkpoint)
            return {**CONFIG, **cfg}
        q, general = cfg["quantizer"], cfg["transformer_general_config"]
        t = q["post_module"]["config"]
        top = "sample_rate encoder_dim encoder_rates encoder_transformer_layers decoder_dim decoder_rates"
        vq = "downsample_factor semantic_codebook_size n_codebooks codebook_size codebook_dim"
        return dict(CONFIG, **{k: cfg[k] for k in top.split()}, **{k: q[k] for k in vq.split()},
                    **{k: general[k] for k in ("head_dim", "rope_base", "norm_eps")},
                    encoder_window=general.get("window_size", 512), latent_dim=q["input_dim"],
                    quantizer_window=q["post_module"]["window_size"], quantizer_layers=t["n_layer"],
                    quantizer_heads=t["n_head"], quantizer_ffn=t["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:  # ValueError: not json
        raise common.unreadable(path, e) from None


def weight_norm_key(key, wanted):
    """key in the weight-norm format `wanted` holds: legacy weight_g/v or parametrizations' original0/1."""
    for old, new in ((".weight_g", ".parametrizations.weight.original0"),
                     (".weight_v", ".parametrizations.weight.original1")):
        for a, b in ((old, new), (new, old)):
            if key.endswith(a) and key[: -len(a)] + b in wanted:
                return key[: -len(a)] + b
    return key


def load(path="s2-pro", device="cpu", dtype=torch.float32):
    """Codec from a checkpoint folder (codec.pth + optional codec_config.json) or a codec.pth file."""
    path = Path(path)
    pth = path / "codec.pth" if path.is_dir() else path
    if not path.exists():
        raise common.UserError(f"checkpoint {path} not found — download fishaudio/s2-pro (see README)")
    if not pth.is_file():
        raise common.UserError(f"checkpoint dir {path} has no codec.pth — download fishaudio/s2-pro")
    with torch.device("meta"):
        model = DAC(read_config(pth.parent / "codec_config.json"))
    try:
        state = torch.load(pth, map_location="cpu", weights_only=True)
    except Exception as e:
        raise common.UserError(f"cannot read {pth} as a state_dict ({type(e).__name__})") from None
    state = state.get("state_dict", state)  # upstream's loader also takes its training checkpoints:
    if any(k.startswith("generator.") for k in state):  # the generator's weights, its prefix dropped
        state = {k.removeprefix("generator."): v for k, v in state.items() if k.startswith("generator.")}
    wanted = model.state_dict()
    tensors = {weight_norm_key(k, wanted): v for k, v in state.items()}
    missing = [k for k in wanted if k not in tensors]
    extra = [k for k in tensors if k not in wanted and k.rsplit(".", 1)[-1] not in STALE_BUFFERS]
    wrong = [f"{k} has shape {list(v.shape)}, expected {list(wanted[k].shape)}"
             for k, v in tensors.items() if k in wanted and v.shape != wanted[k].shape]
    hint = "codec_config.json does not match it, or it is not an S2-Pro codec"
    if missing:
        raise common.UserError(f"{pth} lacks {len(missing)} tensors (first: {missing[0]}) — {hint}")
    if extra:
        raise common.UserError(f"{pth} has {len(extra)} unexpected tensors (first: {extra[0]}) — {hint}")
    if wrong:
        raise common.UserError(f"{pth}: {wrong[0]} — {hint}")
    model.load_state_dict({k: v for k, v in tensors.items() if k in wanted}, assign=True)
    return fold_weight_norm(model).requires_grad_(False).eval().to(device=device, dtype=dtype)


def fold_weight_norm(model):
    """Conv weights g * v / ||v|| computed once for inference. Bit-identical to the parametrization, and
    thread-safe: parametrize.cached(), the other way to compute them once per call, is global state."""
    for module in model.modules():
        if parametrize.is_parametrized(module):
            parametrize.remove_parametrizations(module, "weight")
        if isinstance(module, WNProj):
            module.weight = torch._weight_norm(module.weight_v, module.weight_g, 0).detach()
    return model


DEMO = dict(encoder_dim=4, encoder_transformer_layers=[0, 0, 0, 1], latent_dim=64, decoder_dim=64,
            quantizer_layers=1, quantizer_heads=1, quantizer_ffn=192, quantizer_window=16)


def demo_model(device="cpu"):
    """A tiny codec of the real layout with torch's default (global RNG) init, fp32: dualAR's demo's."""
    model = fold_weight_norm(DAC(dict(CONFIG, **DEMO)))
    return model.requires_grad_(False).eval().to(device)


# ----------------------------------------------------------------------------- API
# Every part of the codec is causal, so it runs on chunks of whole frames as a stream: each conv keeps the
# last inputs its kernel reaches back to, each attention layer its last window - 1 keys and values, in a
# `cache` dict owned by the call. Re-decoding 16 frames of left context through the convs instead (attention
# needs keys ~1000 frames back anyway) took 7.8x the time per chunk at 1 frame, 1.6x at 16.
@torch.inference_mode()
def encode(model, wave, chunk_frames=CHUNK_FRAMES):
    """Waveform (N,), (B, N) or (B, 1, N) at 44.1 kHz -> codes (B, 10, ceil(N / 2048)) int64.
    chunk_frames=None: one pass; chunks give the same codes in flat memory."""
    p = next(model.parameters())
    wave = torch.as_tensor(wave)
    if wave.shape[-1] == 0:
        raise common.UserError("empty audio: nothing to encode")
    x = wave.to(p.device, p.dtype).reshape(-1, 1, wave.shape[-1])
    x = F.pad(x, (0, -x.shape[-1] % model.hop))  # upstream pads right with zeros to whole frames
    cache = {}
    chunks = x.split(chunk_frames * model.hop if chunk_frames else x.shape[-1], -1)
    return torch.cat([model.encode_chunk(c, cache) for c in chunks], -1)


@torch.inference_mode()
def decode(model, codes, chunk_frames=CHUNK_FRAMES):
    """Codes (10, T) or (B, 10, T) -> waveform (B, T * 2048) float32; chunk_frames=None: one pass.
    Codes above a codebook's size are clamped like upstream (row 0 to 4095, rows 1..9 to 1023), on a copy."""
    codes = clamped_codes(model, codes)
    return torch.cat(list(decode_stream(model, codes.split(chunk_frames or codes.shape[-1], -1))), -1)


@torch.inference_mode()
def decode_stream(model, chunks):
    """Codes chunks (B, 10, n) or (10, n) as they arrive -> each one's new samples (B, n * 2048) float32.
    The pieces joined equal decode() of all the codes (same clamping), to fp32 noise."""
    cache = {}
    for codes in chunks:
        yield model.decode_chunk(clamped_codes(model, codes), cache)[:, 0].float()


def clamped_codes(model, codes):
    """Codes checked and clamped to each codebook's size, a copy on the model's device: (B, 10, T) int64."""
    cfg, rows = model.config, model.config["n_codebooks"] + 1
    codes = torch.as_tensor(codes)
    codes = codes[None] if codes.dim() == 2 else codes
    if codes.dim() != 3 or codes.shape[1] != rows or codes.shape[2] == 0:
        raise common.UserError(f"codes must have shape [{rows}, T] or [B, {rows}, T]: {list(codes.shape)}")
    if codes.min() < 0:
        raise common.UserError(f"codes must be >= 0, found {codes.min().item()}")
    codes = codes.to(next(model.parameters()).device, torch.long, copy=True)
    codes[:, 0].clamp_(max=cfg["semantic_codebook_size"] - 1)
    codes[:, 1:].clamp_(max=cfg["codebook_size"] - 1)
    return codes


def load_audio(path, sample_rate=44100):
    """Any file soundfile reads -> float32 mono tensor (N,) at sample_rate (channels averaged, soxr)."""
    data, rate = common.read_audio(path)
    return mono_at(data.mean(1), rate, sample_rate)


def mono_at(mono, rate: int, sample_rate=44100):
    """A mono float32 array at `rate` -> a tensor (N,) at sample_rate (soxr), as every clip is read."""
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate)
    return torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32))


def read_codes(path, rows=10, vocab=4096):  # the LM samples every codebook from 4096 entries
    """Codes (rows, T) int64 from a .npy, or a raw little-endian int16 .code file laid out as [rows, T]."""
    path = Path(path)
    if not path.is_file():
        raise common.UserError(f"codes file {path} not found")
    if path.suffix == ".code":
        codes = np.fromfile(path, dtype="<i2")
        codes = codes.reshape(rows, -1) if codes.size % rows == 0 else codes
    else:
        try:
            codes = np.load(path, allow_pickle=False)
        except Exception as e:
            raise common.UserError(f"{path} is not a .npy array ({type(e).__name__})") from None
    codes = codes[0] if codes.ndim == 3 and codes.shape[0] == 1 else codes
    if codes.ndim != 2 or codes.shape[0] != rows or codes.shape[1] == 0:
        raise common.UserError(f"{path}: codes have shape {list(codes.shape)}, expected [{rows}, T], T > 0")
    if not np.issubdtype(codes.dtype, np.integer):
        raise common.UserError(f"{path}: codes must be integers, got {codes.dtype}")
    if codes.min() < 0 or codes.max() >= vocab:
        raise common.UserError(f"{path}: codes must lie in 0..{vocab - 1}: {codes.min()}..{codes.max()}")
    return torch.from_numpy(codes.astype(np.int64))


def save_wav(path, wave, sample_rate=44100):
    """Mono float waveform -> PCM-16 .wav, atomically."""
    common.save_wav(path, wave, sample_rate)


def save_codes(path, codes):
    """Codes -> int64 .npy, atomically."""
    common.save_npy(path, codes)


# ----------------------------------------------------------------------------- reference files
def read_transcript(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise common.unreadable(path, e) from None
    if not text:
        raise common.UserError(f"transcript {path} is empty")
    return text


def default_references(folder=Path("prompt")) -> list:
    """Every prompt/<stem>.npy (or audio file) that has a prompt/<stem>.txt transcript -> [(kind, path)]."""
    refs = {}
    for path in sorted(folder.glob("*")) if folder.is_dir() else []:
        kind = "audio" if path.suffix.lower() in common.AUDIO_EXTENSIONS else None
        kind = "codes" if path.suffix == ".npy" else kind
        if kind and path.with_suffix(".txt").is_file() and (path.stem not in refs or kind == "codes"):
            refs[path.stem] = (kind, path)
    return list(refs.values())


def reference_codes(kind: str, path: Path, cfg: dict, dac) -> torch.Tensor:
    """A reference file -> codes (num_codebooks, T) for the LM of config `cfg`: a codes file as it is, an
    audio file through the codec (`dac()` gives it: codes alone never load it). An unreadable file is a
    UserError."""
    if kind == "codes":
        return read_codes(path, rows=cfg["num_codebooks"], vocab=cfg["codebook_size"])
    return encode(dac(), load_audio(path))[0].cpu()


def write_reference(folder: Path, name: str, codes, text: str):
    """A voice -> <folder>/<name>.npy (its codes) + <name>.txt (its transcript), the layout default_references
    reads; the voice appears only once its transcript is written whole, and a failed write leaves no codes."""
    npy, txt = Path(folder) / f"{name}.npy", Path(folder) / f"{name}.txt"
    try:
        save_codes(npy, codes)
        common.write_atomic(txt, lambda tmp: tmp.write_text(text.strip() + "\n", encoding="utf-8"))
    except common.UserError:  # a full disk, a folder gone
        npy.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- CLI
def output_files(inputs, out, suffix):
    """One output per input: beside it, the --out file, or in the --out folder (made on writing)."""
    folder = out is not None and (len(inputs) > 1 or Path(out).is_dir())
    if folder:
        outputs = [Path(out) / p.with_suffix(suffix).name for p in inputs]
    else:
        outputs = [p.with_suffix(suffix) if out is None else Path(out) for p in inputs]
    if len(set(outputs)) < len(outputs):
        raise common.UserError(f"two inputs would write the same {suffix} file: rename one")
    for path in outputs:  # fail before any work is done
        parent = path.parent.parent if folder and not path.parent.exists() else path.parent  # made later
        if not (parent.is_dir() and os.access(parent, os.W_OK)) or path.is_dir():
            raise common.UserError(f"cannot write {path}: not a writable file location")
    return outputs


def run_files(args):
    encoding = args.command == "encode"
    folder, kinds = ("prompt", common.AUDIO_EXTENSIONS) if encoding else ("generate", {".npy"})
    inputs = [Path(p) for p in args.paths]
    inputs = inputs or sorted(p for p in Path(folder).glob("*") if p.suffix.lower() in kinds)
    if not inputs:
        raise common.UserError(f"no input files: pass paths, or put them in {folder}/")
    data = [load_audio(p) if encoding else read_codes(p) for p in inputs]  # check every input before writing
    outputs = output_files(inputs, args.out, ".npy" if encoding else ".wav")
    device = common.pick_device(args.device)
    model = load(args.checkpoint, device, common.pick_dtype(args.dtype, device, cuda="fp16"))
    if not encoding and not args.no_tune:  # encoding stays eager: reference codes exactly upstream's
        import cpu_fast
        cpu_fast.keep_freed_memory()  # this process's allocator: the CLI's to set
        cpu_fast.tune(model)
    start, rate, chunk = time.perf_counter(), model.config["sample_rate"], args.chunk_frames or None
    for x, out in tqdm(list(zip(data, outputs)), desc=args.command, unit="file"):
        out.parent.mkdir(exist_ok=True)
        if encoding:
            save_codes(out, encode(model, x, chunk)[0])
        else:
            save_wav(out, decode(model, x, chunk)[0], rate)
    wall = time.perf_counter() - start
    seconds = sum(x.shape[-1] * (1 if encoding else model.hop) for x in data) / rate
    print(f"{args.command}d {len(inputs)} file(s): {seconds:.2f} s of audio in {wall:.2f} s, "
          f"RTF {wall / seconds:.3f}")


def main(argv=None):
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    shared = argparse.ArgumentParser(add_help=False)
    common.add_device_arg(shared)
    shared.add_argument("--dtype", choices=["fp32", "fp16", "bf16"],
                        help="default: fp16 on CUDA, else fp32 (bf16 is audibly noisier in the decoder)")
    shared.add_argument("--chunk-frames", type=int, default=CHUNK_FRAMES,
                        help="frames per encode/decode pass: flat memory (default %(default)s; 0: one pass)")
    files = argparse.ArgumentParser(add_help=False, parents=[shared])
    files.add_argument("--checkpoint", default="./s2-pro", help="folder with codec.pth (+ optional "
                       "codec_config.json), or a codec.pth file (default: %(default)s)")
    files.add_argument("--out", help="output file for one input, or a folder for several "
                                     "(default: beside each input)")
    enc = sub.add_parser("encode", parents=[files], help="audio -> <stem>.npy codes [10, T] (int64)")
    enc.add_argument("paths", nargs="*", help="audio files soundfile reads (wav, flac, ogg, mp3 at any rate, "
                                              "channels averaged). Default: every audio file in prompt/")
    dec = sub.add_parser("decode", parents=[files], help="codes -> <stem>.wav (44.1 kHz PCM-16)")
    dec.add_argument("paths", nargs="*", help=".npy or raw int16 .code files of codes [10, T]. "
                                              "Default: every generate/*.npy")
    dec.add_argument("--no-tune", action="store_true", help="CPU: decode eager, without cpu_fast.tune's"
                     " compiled Snakes and prepacked weights (timed once per machine; within 1e-5 of eager)")
    args = parser.parse_args(argv)
    if args.chunk_frames < 0:
        raise common.UserError("--chunk-frames must be >= 0")
    try:
        run_files(args)
    except OSError as e:
        raise common.UserError(str(e)) from None


if __name__ == "__main__":
    common.cli(main)
