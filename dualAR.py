"""Fish Audio S2-Pro text-to-speech: the Dual-AR (RQ-Transformer) model and generation, one file.

The slow transformer (Qwen3-shaped) reads the conversation and emits one semantic token per audio
frame. The fast transformer then emits the other codebooks of that frame, one after another.
Everything is written to give upstream fish-speech's codes for upstream's seed on CPU fp32.

    python dualAR.py --text "Hello!" --prompt-audio voice.wav --prompt-text "what voice.wav says"

How the file reads (sections, top to bottom):
    config          CONFIG (the real S2-Pro), config.json of either layout -> one flat dict
    building blocks RMSNorm, FeedForward, RoPE (codec.py's transformers have the same), KVCache, Attention
                    and Block (3 ways each), flex-decoding
    model           DualAR: embeddings, slow and fast transformers, the head; prefill, forward_slow/fast
    loading         the checkpoint's tensors (HF names, common's reader) -> the model, ids from the tokenizer
    compilation     compile_model (which layers get which bits, and how: quantize.py's, applied at `load`)
    prompt          upstream's chat template: system + references, user/assistant turns, dialogues
    sampling        upstream's top-k/top-p filter and exponential race, its random numbers
    one frame       sample_frame (slow token with repetition-aware sampling, then the codebooks), decode_step
    requests        Request: checks, text batches, frames -> codes chunks
    engine          Scheduler (rows, admit -> one batched frame -> hand out; common.EngineThread steps it)
    generation      generate, generate_many, stream
    demo            a tiny random model and codec, built in memory
    CLI             flags, references, `python dualAR.py` (devices, errors, atomic writes: common.py)
"""
import argparse
import collections
import functools
import json
import math
import os
import re
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from tqdm import tqdm

from common import (DTYPES, ArgumentParser, EngineClosed, Job, UserError, add_device_arg, byte_tokenizer,
                    check_plain_text, check_seed, cli, compiled, default_compile_cache, load_tokenizer,
                    new_voice, next_job, peak_memory_gb, pick_device, pick_dtype, queue_job, read_tensors,
                    unreadable, use_compile_cache, voice_files, weight_files, write_growing_wav)

# The real fishaudio/s2-pro dimensions, with upstream's flat `dual_ar` key names.
CONFIG = dict(
    vocab_size=155776, n_layer=36, n_head=32, n_local_heads=8, head_dim=128, dim=2560,
    intermediate_size=9728, rope_base=1e6, norm_eps=1e-6, max_seq_len=32768,
    tie_word_embeddings=True, attention_qkv_bias=False, attention_o_bias=False, attention_qk_norm=True,
    codebook_size=4096, num_codebooks=10, n_fast_layer=4, fast_dim=2560, fast_n_head=32,
    fast_n_local_heads=8, fast_head_dim=128, fast_intermediate_size=9728, fast_attention_qkv_bias=False,
    fast_attention_o_bias=False, fast_attention_qk_norm=True,
    scale_codebook_embeddings=True, norm_fastlayer_input=True,
)
# upstream's BaseModelArgs defaults, used for keys a flat `dual_ar` config.json leaves out
FLAT_DEFAULTS = dict(
    vocab_size=32000, n_layer=32, n_head=32, n_local_heads=-1, head_dim=64, dim=4096,
    intermediate_size=None, rope_base=10000, norm_eps=1e-5, max_seq_len=2048, tie_word_embeddings=True,
    attention_qkv_bias=False, attention_o_bias=False, attention_qk_norm=False, codebook_size=160,
    num_codebooks=4, n_fast_layer=4, scale_codebook_embeddings=False, norm_fastlayer_input=False,
)
FAST_KEYS = ["dim", "n_head", "n_local_heads", "head_dim", "intermediate_size",
             "attention_qkv_bias", "attention_o_bias", "attention_qk_norm"]
MAX_REFERENCES = 4
RAS_WINDOW, RAS_TEMPERATURE, RAS_TOP_P = 10, 1.0, 0.9  # repetition-aware sampling, as upstream
CONTEXT_RESERVE = 2048  # upstream refuses prompts longer than max_seq_len - 2048
DEFAULT_CONTEXT = 4096  # KV cache positions a request may use unless told otherwise (32k is 4.8 GB a row)
CHUNK_FRAMES = 8  # frames per streamed codes chunk
DEFAULT_CHECKPOINT = "./s2-pro"
VOICES = Path("prompt")  # the CLI's voices: its default references, where --save-voice writes
SEMANTIC_TOKEN = re.compile(r"<\|semantic:\d+\|>")  # codebook-0 code k is token <|semantic:0|> + k


# ----------------------------------------------------------------------------- config
def config_from_flat(flat: dict) -> dict:
    """Upstream's flat `dual_ar` dict (defaults and fast-model fallbacks applied) -> our CONFIG shape."""
    cfg = {k: flat.get(k, v) for k, v in FLAT_DEFAULTS.items()}
    if cfg["n_local_heads"] == -1:
        cfg["n_local_heads"] = cfg["n_head"]
    if cfg["head_dim"] is None:
        cfg["head_dim"] = cfg["dim"] // cfg["n_head"]
    if cfg["intermediate_size"] is None:
        hidden = int(2 * 4 * cfg["dim"] / 3)
        cfg["intermediate_size"] = -(-hidden // 256) * 256
    for key in FAST_KEYS:  # the fast transformer inherits every dimension it does not set
        value = flat.get("fast_" + key)
        cfg["fast_" + key] = cfg[key] if value is None else value
    return cfg


def flatten_omni(data: dict) -> dict:
    """The HF layout (`fish_qwen3_omni`: text_config + audio_decoder_config) -> upstream's flat dict."""
    text, audio = data["text_config"], data["audio_decoder_config"]
    flat = {k: v for k, v in text.items() if k in FLAT_DEFAULTS and v is not None}  # as upstream
    flat.update({"fast_" + k: audio.get(k) for k in FAST_KEYS})
    flat.update(codebook_size=audio["vocab_size"], num_codebooks=audio["num_codebooks"],
                n_fast_layer=audio["n_layer"], scale_codebook_embeddings=True, norm_fastlayer_input=True)
    return flat


def read_config(path: Path) -> dict:
    """config.json of the HF layout (`fish_qwen3_omni`) or upstream's flat `dual_ar` layout."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        kind = data.get("model_type")
        if kind == "omnivoice":
            raise UserError(f"{Path(path).parent} is an OmniVoice checkpoint: run it with omnivoice.py")
        if kind not in ("dual_ar", "fish_qwen3_omni"):
            raise UserError(f"{path}: model_type {kind!r} is not fish_qwen3_omni or dual_ar")
        return config_from_flat(data if kind == "dual_ar" else flatten_omni(data))
    except UserError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise unreadable(path, e) from None


def block_config(cfg: dict, fast: bool) -> dict:
    p = "fast_" if fast else ""
    return dict({k: cfg[p + k] for k in FAST_KEYS}, norm_eps=cfg["norm_eps"])


def is_semantic(ids: Tensor, cfg: dict) -> Tensor:
    return (ids >= cfg["semantic_begin_id"]) & (ids <= cfg["semantic_end_id"])


# ----------------------------------------------------------------------------- building blocks
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


class KVCache(nn.Module):
    """Static K/V buffers (rows, kv heads, positions, head_dim). Row b of the batch belongs to one request."""

    def __init__(self, batch: int, seq_len: int, n_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, n_heads, seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def fill(self, row: int, k: Tensor, v: Tensor):
        """A prefill: k, v (1, KV, S, D) at positions 0..S-1 of one row."""
        self.k_cache[row, :, : k.size(2)] = k[0]
        self.v_cache[row, :, : v.size(2)] = v[0]

    def update(self, pos: Tensor, k: Tensor, v: Tensor) -> tuple:
        """k, v (B, KV, 1, D) of rows 0..B-1, row b at position pos[b] -> those rows' keys and values."""
        rows = torch.arange(k.size(0), device=k.device)
        self.k_cache[rows, :, pos] = k[:, :, 0]
        self.v_cache[rows, :, pos] = v[:, :, 0]
        return self.k_cache[: k.size(0)], self.v_cache[: k.size(0)]

    def update_all(self, i: int, k: Tensor, v: Tensor) -> tuple:
        """k, v (B, KV, S, D) of rows 0..B-1, all at positions i-S+1..i -> their keys and values at 0..i."""
        self.k_cache[: k.size(0), :, i + 1 - k.size(2): i + 1] = k
        self.v_cache[: k.size(0), :, i + 1 - v.size(2): i + 1] = v
        return self.k_cache[: k.size(0), :, : i + 1], self.v_cache[: k.size(0), :, : i + 1]


class Attention(nn.Module):
    """Grouped-query attention, three ways: `forward` (causal within x: training, or a prefill that keeps k
    and v in cache row `row`), `decode` (one step per row at its own position: the slow model's frames),
    `codebook` (every row at the same positions: the fast model's codebooks)."""

    def __init__(self, c: dict):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = c["n_head"], c["n_local_heads"], c["head_dim"]
        qkv_dim = (self.n_head + 2 * self.n_kv) * self.head_dim
        self.wqkv = nn.Linear(c["dim"], qkv_dim, bias=c["attention_qkv_bias"])
        self.wo = nn.Linear(self.n_head * self.head_dim, c["dim"], bias=c["attention_o_bias"])
        self.qk_norm = c["attention_qk_norm"]
        if self.qk_norm:  # torch's own RMSNorm, per head, before RoPE (as upstream)
            self.q_norm = nn.RMSNorm(self.head_dim, c["norm_eps"])
            self.k_norm = nn.RMSNorm(self.head_dim, c["norm_eps"])
        self.gqa = self.n_head != self.n_kv  # query head h uses kv head h // (n_head // n_kv), as upstream
        self.kv_cache = None

    def project(self, x: Tensor, rope: Tensor) -> tuple:
        """x (B, S, dim) -> q (B, H, S, D), k and v (B, KV, S, D), normed and rotated."""
        B, S, _ = x.shape
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.wqkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(B, S, self.n_head, self.head_dim)
        k = k.view(B, S, self.n_kv, self.head_dim)
        v = v.view(B, S, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def out(self, y: Tensor) -> Tensor:  # (B, H, S, D) -> (B, S, dim)
        return self.wo(y.transpose(1, 2).flatten(2))

    def forward(self, x: Tensor, rope: Tensor, row: int = None) -> Tensor:
        q, k, v = self.project(x, rope)
        if row is not None:
            self.kv_cache.fill(row, k, v)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa))

    def decode(self, x: Tensor, rope: Tensor, pos: Tensor) -> Tensor:
        q, k, v = self.project(x, rope)
        return self.out(decode_attention(q, *self.kv_cache.update(pos, k, v), pos))

    def codebook(self, x: Tensor, rope: Tensor, i: int) -> Tensor:
        """x (B, S, dim) at positions i-S+1..i; S > 1 only from position 0 (SDPA's causal mask is
        top-left: query s sees keys 0..s)."""
        q, k, v = self.project(x, rope)
        keys, values = self.kv_cache.update_all(i, k, v)
        return self.out(F.scaled_dot_product_attention(q, keys, values, is_causal=x.size(1) > 1,
                                                        enable_gqa=self.gqa))


FLEX_BLOCK = 128  # cache positions per flex-attention block


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, pos: Tensor) -> Tensor:
    """q (B, H, 1, D) of row b at position pos[b] over keys/values (B, KV, S, D) at positions <= pos[b].
    Flex-decoding inside a compiled step (eager flex_attention is slow), SDPA with a mask elsewhere."""
    B, S = q.size(0), keys.size(2)
    if not torch.compiler.is_compiling():
        mask = torch.arange(S, device=q.device) <= pos[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None],
                                              enable_gqa=q.size(1) != keys.size(1))
    # flex-decoding: a block mask built from the positions, so a row reads only the blocks it has filled:
    # the blocks before its position's block in full, that one block through the mask
    n_blocks = S // FLEX_BLOCK
    block = (pos // FLEX_BLOCK).to(torch.int32)
    order = torch.arange(n_blocks, device=q.device, dtype=torch.int32).repeat(B, 1, 1, 1)
    one = torch.ones(B, 1, 1, dtype=torch.int32, device=q.device)

    def up_to_pos(b, h, q_idx, kv_idx):
        return kv_idx <= pos[b]

    partial = block.view(B, 1, 1, 1).repeat(1, 1, 1, n_blocks)
    mask = BlockMask.from_kv_blocks(one, partial, block.view(B, 1, 1), order, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=up_to_pos, seq_lengths=(1, S))
    # q scaled here with scale=1: flex compiles on CPU only if q is not a view of the RoPE output
    scale = q.size(-1) ** -0.5
    return flex_attention(q * scale, keys, values, block_mask=mask, scale=1.0,
                          enable_gqa=q.size(1) != keys.size(1))


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.attention = Attention(c)
        self.feed_forward = FeedForward(c["dim"], c["intermediate_size"])
        self.attention_norm = RMSNorm(c["dim"], c["norm_eps"])
        self.ffn_norm = RMSNorm(c["dim"], c["norm_eps"])

    def forward(self, x: Tensor, rope: Tensor, row: int = None) -> Tensor:  # training, or a prefill
        return self.mlp(x + self.attention(self.attention_norm(x), rope, row))

    def decode(self, x: Tensor, rope: Tensor, pos: Tensor) -> Tensor:  # the slow model's frames
        return self.mlp(x + self.attention.decode(self.attention_norm(x), rope, pos))

    def codebook(self, x: Tensor, rope: Tensor, i: int) -> Tensor:  # the fast model's codebooks
        return self.mlp(x + self.attention.codebook(self.attention_norm(x), rope, i))

    def mlp(self, h: Tensor) -> Tensor:
        return h + self.feed_forward(self.ffn_norm(h))


def grown(cache, batch: int, seq_len: int, n_heads: int, head_dim: int, like: Tensor) -> KVCache:
    """`cache` if it holds `batch` rows of `seq_len` positions in like's dtype and device, else a bigger one
    that keeps its contents. Caches never shrink: a compiled step guards on the cache tensors themselves,
    so every new cache costs a compile (and on CUDA new graphs)."""
    if cache is None or (cache.k_cache.dtype, cache.k_cache.device) != (like.dtype, like.device):
        return KVCache(batch, seq_len, n_heads, head_dim, like.dtype, like.device)
    rows, length = cache.k_cache.size(0), cache.k_cache.size(2)
    if batch <= rows and seq_len <= length:
        return cache
    new = KVCache(max(batch, rows), max(seq_len, length), n_heads, head_dim, like.dtype, like.device)
    new.k_cache[:rows, :, :length] = cache.k_cache
    new.v_cache[:rows, :, :length] = cache.v_cache
    return new


# ----------------------------------------------------------------------------- model
class DualAR(nn.Module):
    """Slow transformer over frames + fast transformer over the codebooks of one frame. Parameter names
    are upstream's internal ones (`hf_name` gives the HF release's keys)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg
        slow, fast = block_config(cfg, fast=False), block_config(cfg, fast=True)
        self.embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.codebook_embeddings = nn.Embedding(cfg["codebook_size"] * cfg["num_codebooks"], cfg["dim"])
        self.layers = nn.ModuleList(Block(slow) for _ in range(cfg["n_layer"]))
        self.norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        if not cfg["tie_word_embeddings"]:
            self.output = nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False)
        same = cfg["fast_dim"] == cfg["dim"]
        self.fast_project_in = nn.Identity() if same else nn.Linear(cfg["dim"], cfg["fast_dim"])
        self.fast_embeddings = nn.Embedding(cfg["codebook_size"], cfg["fast_dim"])
        self.fast_layers = nn.ModuleList(Block(fast) for _ in range(cfg["n_fast_layer"]))
        self.fast_norm = RMSNorm(cfg["fast_dim"], cfg["norm_eps"])
        self.fast_output = nn.Linear(cfg["fast_dim"], cfg["codebook_size"], bias=False)
        # the vocabulary rows sampling can pick (needs the tokenizer's ids: None for a bare config)
        self.sampling_rows = sampling_rows(cfg) if "semantic_begin_id" in cfg else None
        self.register_buffer("head_rows", None, persistent=False)  # those rows apart: `compile_model`
        self.tokenizer = None  # set by `load` (and `random_model`)
        self.compiled_step = None  # the frame step as one graph, set by `compile_model`
        self.quant = None  # the quantization scheme, set by quantize.py
        # 9 fast passes a frame (`sample_frame`); off: fp32 rounds codebook 1's logits otherwise (speed.md)
        self.fast_prefill = False
        self.top_filter = TopFilter()  # the sampler's top-k/top-p filter (cpu_fast.tune: candidates=True)
        self.engine = None  # a weak reference to the Scheduler that owns the KV caches
        self.make_rope()

    def make_rope(self):
        """RoPE tables as buffers (they follow .to()). `load` rebuilds them on the meta-built model."""
        cfg, device = self.config, self.embeddings.weight.device
        self.register_buffer("rope", rope_table(cfg["max_seq_len"], cfg["head_dim"], cfg["rope_base"])
                             .to(device), persistent=False)
        self.register_buffer("fast_rope", rope_table(cfg["num_codebooks"], cfg["fast_head_dim"],
                                                     cfg["rope_base"]).to(device), persistent=False)

    def setup_caches(self, batch: int, seq_len: int):
        """Static KV caches of at least `batch` rows and `seq_len` slow positions (rounded up to whole
        flex-attention blocks). Caches only grow, keeping their contents (see `grown`)."""
        cfg, weight = self.config, self.embeddings.weight
        seq_len = -(-seq_len // FLEX_BLOCK) * FLEX_BLOCK  # the block mask covers whole blocks
        for layer in self.layers:
            layer.attention.kv_cache = grown(layer.attention.kv_cache, batch, seq_len, cfg["n_local_heads"],
                                             cfg["head_dim"], weight)
        for layer in self.fast_layers:  # scratch: rewritten from position 0 every frame
            layer.attention.kv_cache = grown(layer.attention.kv_cache, batch, cfg["num_codebooks"],
                                             cfg["fast_n_local_heads"], cfg["fast_head_dim"], weight)

    @property
    def cache_len(self) -> int:
        cache = self.layers[0].attention.kv_cache
        return 0 if cache is None else cache.k_cache.size(2)

    @property
    def head_weight(self) -> Tensor:
        return (self.embeddings if self.config["tie_word_embeddings"] else self.output).weight

    def embed(self, tokens: Tensor, scale: bool = True) -> Tensor:
        """tokens (B, 1 + num_codebooks, S): row 0 token ids, rows 1.. codes at semantic positions.
        scale=False: without the 1 / sqrt(num_codebooks + 1) (upstream's training embedding lacks it)."""
        cfg = self.config
        offsets = torch.arange(cfg["num_codebooks"], device=tokens.device) * cfg["codebook_size"]
        codes = self.codebook_embeddings(tokens[:, 1:] + offsets[None, :, None]).sum(dim=1)
        ids = tokens[:, 0]
        semantic = is_semantic(ids, cfg)[..., None]
        x = self.embeddings(ids) + torch.where(semantic, codes, 0.0)
        if scale and cfg["scale_codebook_embeddings"]:
            x = torch.where(semantic, x / math.sqrt(cfg["num_codebooks"] + 1), x)
        return x

    def fast_input(self, x: Tensor, h: Tensor = None) -> Tensor:
        """Slow hidden states x (before the final norm; h: after it, if already computed) -> the fast
        transformer's input."""
        if self.config["norm_fastlayer_input"]:
            x = self.norm(x) if h is None else h
        return self.fast_project_in(x)

    def slow_states(self, tokens: Tensor, call=None) -> Tensor:
        """Training: tokens (B, 1 + num_codebooks, S) -> slow hidden states (B, S, dim) before the final
        norm, causal attention within the sequence, no KV cache, the training embedding. call(layer, x,
        rope) runs each block (e.g. with activation checkpointing)."""
        x, rope = self.embed(tokens, scale=False), self.rope[: tokens.size(-1)]
        for layer in self.layers:
            x = call(layer, x, rope) if call else layer(x, rope)
        return x

    def fast_states(self, x: Tensor, call=None) -> Tensor:
        """Training: fast inputs (N, num_codebooks, fast_dim) -> fast hidden states before fast_norm."""
        for layer in self.fast_layers:
            x = call(layer, x, self.fast_rope) if call else layer(x, self.fast_rope)
        return x

    def vocab_logits(self, x: Tensor) -> Tensor:
        """Training: slow states x (N, dim) -> logits over the whole vocabulary. Tied: the raw table (an
        embeddings LoRA does not reach the head, as upstream); untied: the output module (with its LoRA)."""
        h = self.norm(x)
        return F.linear(h, self.embeddings.weight) if self.config["tie_word_embeddings"] else self.output(h)

    def fast_logits(self, y: Tensor) -> Tensor:
        """Fast states (..., fast_dim) -> codebook logits (..., codebook_size)."""
        return self.fast_output(self.fast_norm(y))

    def head(self, x: Tensor, full: bool = False):
        """Last slow hidden state x (B, dim) -> (logits, fast-model input). The logits cover only the
        rows sampling can pick (`sampling_rows`) unless `full`."""
        weight, h = self.head_weight, self.norm(x)
        if not full:  # a compiled model keeps these rows apart (see compile_model)
            weight = self.head_rows if self.head_rows is not None else weight[slice(*self.sampling_rows)]
        return F.linear(h, weight), self.fast_input(x, h)

    def prefill(self, tokens: Tensor, row: int = 0, full: bool = False):
        """A whole prompt (1 + num_codebooks, T) into cache row `row` -> (logits, fast input) of its last
        position, each with a batch dimension of 1."""
        x = self.embed(tokens[None])
        rope = self.rope[: tokens.size(1)]
        for layer in self.layers:
            x = layer(x, rope, row)
        return self.head(x[:, -1], full)

    def forward_slow(self, frames: Tensor, pos: Tensor, full: bool = False):
        """One frame per row, frames (B, 1 + num_codebooks) at positions pos (B,) -> (logits, fast input)."""
        x = self.embed(frames[:, :, None])
        rope = self.rope[pos][:, None]  # (B, 1, head_dim / 2, 2): each row at its own position
        for layer in self.layers:
            x = layer.decode(x, rope, pos)
        return self.head(x[:, -1], full)

    def forward_fast(self, x: Tensor, i: int, logits: bool = True):
        """Fast positions i-S+1..i for every row: x (B, S, fast_dim) -> the logits of position i
        (B, codebook_size). S is 1, or 2 at i = 1: positions 0 and 1 in one pass (`fast_prefill`)."""
        rope = self.fast_rope[i + 1 - x.size(1): i + 1]
        for layer in self.fast_layers:
            x = layer.codebook(x, rope, i)
        return self.fast_logits(x[:, -1]) if logits else None


HF_PREFIXES = [("codebook_embeddings.", "audio_decoder.codebook_embeddings."), ("fast_", "audio_decoder."),
               ("", "text_model.model.")]  # our (upstream-internal) parameter names -> the HF release's


def hf_name(name: str) -> str:
    ours, theirs = next((o, t) for o, t in HF_PREFIXES if name.startswith(o))
    return theirs + name[len(ours):]


def internal_name(key: str) -> str:
    """Inverse of `hf_name`. Keys already in upstream's internal form pass through."""
    ours, theirs = next(((o, t) for o, t in HF_PREFIXES if key.startswith(t)), ("", ""))
    return ours + key[len(theirs):]


# ----------------------------------------------------------------------------- loading
def load_weights(model: DualAR, ckpt: Path, device, dtype, as_read=None):
    """The checkpoint's tensors into the meta-built model. as_read(block, fast): called on each transformer
    block as soon as its last tensor is read (quantize.s2_blocks_as_read: CPU int8wo/int4wo quantize each
    block so, and the unquantized model never exists whole)."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    blocks = {}  # "layers.3." -> the names of its tensors, for the blocks handed over as they are read
    if as_read:
        for name in expected:
            if block_prefix(name) != name:
                blocks.setdefault(block_prefix(name), set()).add(name)
    state, seen = {}, set()
    for key, tensor in read_tensors(weight_files(ckpt, "fishaudio/s2-pro", pth=True)):
        name = internal_name(key)
        if name not in expected:
            raise UserError(f"{ckpt}: unexpected tensor {hf_name(name)!r} — not an S2-Pro checkpoint"
                            " of this config.json?")
        if name in seen:  # two shards holding one tensor: which copy a user gets must not be an accident
            raise UserError(f"{ckpt}: tensor {hf_name(name)!r} is stored twice")
        if tensor.shape != expected[name]:
            raise UserError(f"{ckpt}: tensor {hf_name(name)!r} has shape {list(tensor.shape)},"
                            f" config.json implies {list(expected[name])}")
        state[name] = tensor.to(device=device, dtype=dtype)
        seen.add(name)
        prefix = block_prefix(name)
        if prefix in blocks and not blocks[prefix] - seen:
            model.load_state_dict({k: state.pop(k) for k in blocks.pop(prefix)}, strict=False, assign=True)
            as_read(model.get_submodule(prefix[:-1]), prefix.startswith("fast_"))
    missing = [k for k in expected if k not in seen]
    if missing:
        raise UserError(f"{ckpt}: missing tensor {hf_name(missing[0])!r} ({len(missing)} missing)")
    model.load_state_dict(state, strict=False, assign=True)


def block_prefix(name: str) -> str:
    """"layers.3.attention.wqkv.weight" -> "layers.3." (names outside the transformer blocks: themselves)."""
    parts = name.split(".")
    return ".".join(parts[:2]) + "." if parts[0] in ("layers", "fast_layers") else name


def special_ids(tokenizer) -> dict:
    """Ids the model needs, looked up by name in the tokenizer (never hard-coded)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    semantic = sorted(i for t, i in vocab.items() if SEMANTIC_TOKEN.fullmatch(t))
    if not semantic:
        raise UserError("tokenizer.json has no <|semantic:i|> tokens — not an S2-Pro tokenizer")
    begin, end = semantic[0], semantic[-1]
    if any(vocab.get(f"<|semantic:{k}|>") != begin + k for k in range(len(semantic))):
        raise UserError("tokenizer.json: <|semantic:k|> is not token <|semantic:0|> + k for every k")
    for name in ("<|im_start|>", "<|im_end|>", "<|voice|>"):
        if name not in vocab:
            raise UserError(f"tokenizer.json has no {name} token — not an S2-Pro tokenizer")
    return dict(semantic_begin_id=begin, semantic_end_id=end, im_end_id=vocab["<|im_end|>"])


def load(checkpoint, device="cpu", dtype=torch.float32, quant=None, compile=False,
         compile_cache=None, fast_prefill=False) -> DualAR:
    """Load config.json, tokenizer.json and the weights of an S2-Pro checkpoint directory.
    quant: one of quantize.S2_SCHEMES (quantize.py), compile: the frame step as one compiled graph,
    compile_cache: the folder where compiled kernels are kept for the next process (default
    `common.default_compile_cache()`), fast_prefill: 9 fast passes a frame instead of upstream's 10
    (`sample_frame`)."""
    device, quantizing = torch.device(device), quant not in (None, "none")
    if quantizing:
        import quantize  # only here: this file copied with common.py alone runs unquantized
        quantize.check_s2(quant, device, dtype)
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint dir {ckpt} does not exist — download fishaudio/s2-pro (see README)")
    for name in ("config.json", "tokenizer.json"):
        if not (ckpt / name).is_file():
            raise UserError(f"checkpoint dir {ckpt} has no {name} — download fishaudio/s2-pro (see README)")
    cfg = read_config(ckpt / "config.json")
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    cfg.update(special_ids(tokenizer))
    with torch.device("meta"):
        model = DualAR(cfg)
    as_read = quantize.s2_blocks_as_read(quant, device) if quantizing else None
    load_weights(model, ckpt, device, dtype, as_read)
    model.make_rope()
    model.tokenizer = tokenizer
    return optimize(model.requires_grad_(False).eval(), quant, compile, compile_cache, fast_prefill)


def optimize(model: DualAR, quant=None, compile=False, compile_cache=None, fast_prefill=False) -> DualAR:
    """Quantize and/or compile a loaded (or demo) model, and choose its frame step's fast passes (this CPU's
    faster matmuls are cpu_fast.tune's, applied after this)."""
    model.fast_prefill = fast_prefill
    if quant not in (None, "none"):
        import quantize  # as in `load`
        quantize.quantize(model, quant)
    if compile:
        compile_model(model, compile_cache)
    return model


# ----------------------------------------------------------------------------- compilation
RECOMPILE_GUARD = 64  # graphs of decode_step per process (dynamo's default, 8, is hit by a few cache sizes)


def compile_model(model: DualAR, cache=None, backend="inductor", step=None):
    """The frame step as one graph per (rows, cache) shape (see `batch_bucket`, `cache_bucket`), with
    flex-decoding inside; on CUDA replayed as CUDA graphs. Inductor keeps what it compiles in `cache`
    (`common.use_compile_cache`): the next process with the same shapes loads it instead of compiling
    again: process-wide, it sets $TORCHINDUCTOR_CACHE_DIR (unless the user did: inductor has no other
    setting for it). Up to RECOMPILE_GUARD graphs. backend="eager": the same graph capture, no codegen
    (smoke runs). step: another function of (model, ...) compiled the same way (tests)."""
    use_compile_cache(cache)
    # the head's rows as a tensor of their own (a slice of the embedding table is a view into it)
    model.register_buffer("head_rows", model.head_weight[slice(*model.sampling_rows)].clone(),
                          persistent=False)
    step = functools.partial(step or decode_step, model)
    cuda = model.embeddings.weight.device.type == "cuda"
    mode = "reduce-overhead" if cuda and backend == "inductor" else None
    options = None
    if not cuda and backend == "inductor" and model.quant not in (None, "none"):
        import quantize  # (loaded already: it set model.quant)
        # QuantLinear's cast to bf16 would become an epilogue of CPU flex-attention, which cannot take one
        options = dict(quantize.CPU_COMPILE_OPTIONS, epilogue_fusion=False)
    model.compiled_step = compiled(step, RECOMPILE_GUARD, fullgraph=True, dynamic=False, backend=backend,
                                   mode=mode, options=options)


# ----------------------------------------------------------------------------- prompt
SYSTEM_WITH_REFERENCES = "convert the provided text to speech reference to the following:\n\nText:\n"
SYSTEM_PLAIN = "convert the provided text to speech"
SPEAKER_TAG = re.compile(r"(<\|speaker:\d+\|>)")


def split_turns(text: str) -> list:
    """Split at <|speaker:N|> tags. Like upstream, text before the first tag is dropped."""
    parts = SPEAKER_TAG.split(text)
    return [(parts[i].strip() + parts[i + 1]).strip() for i in range(1, len(parts), 2)]


def text_batches(text: str, max_bytes: int, max_speakers: int = 5) -> list:
    """Group turns greedily into batches of <= max_speakers turns and ~max_bytes UTF-8 bytes."""
    turns = split_turns(text)
    if not turns:
        return [text]
    batches, current, size = [], [], 0
    for turn in turns:
        n = len(turn.encode("utf-8"))
        if current and (len(current) >= max_speakers or size + n > max_bytes):
            batches.append("\n".join(current))
            current, size = [], 0
        current.append(turn)
        size += n
    return batches + ["\n".join(current)]


def encode_pieces(model: DualAR, pieces: list) -> Tensor:
    """Each str piece is tokenised on its own, each code matrix (num_codebooks, n) becomes a
    semantic run. -> (1 + num_codebooks, T): row 0 token ids, rows 1.. codes (0 off semantic runs)."""
    cfg, columns = model.config, []
    for piece in pieces:
        if isinstance(piece, str):
            ids = torch.tensor(model.tokenizer.encode(piece, add_special_tokens=False).ids, dtype=torch.long)
            column = torch.zeros(1 + cfg["num_codebooks"], len(ids), dtype=torch.long)
            column[0] = ids
        else:
            codes = piece.long().cpu()
            column = torch.cat([codes[:1] + cfg["semantic_begin_id"], codes])
        columns.append(column)
    return torch.cat(columns, dim=1)


def build_prompt(model: DualAR, references: list, history: list, text: str) -> Tensor:
    """references: [(codes, transcript)], history: [(text, codes)] of the batches already spoken."""
    pieces = ["<|im_start|>system\n"]
    if references:
        texts = [t for _, t in references]
        tagged = [t if SPEAKER_TAG.search(t) else f"<|speaker:{i}|>{t}" for i, t in enumerate(texts)]
        codes = torch.cat([c for c, _ in references], dim=1)
        pieces += [SYSTEM_WITH_REFERENCES, "\n".join(tagged), "\n\nSpeech:\n", codes]
    else:
        pieces.append(SYSTEM_PLAIN)
    pieces.append("<|im_end|>\n")
    for turn_text, codes in history + [(text, None)]:
        pieces += ["<|im_start|>user\n", turn_text, "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"]
        if codes is not None:
            pieces += [codes, "<|im_end|>\n"]
    return encode_pieces(model, pieces)


# ----------------------------------------------------------------------------- sampling
def sampling_rows(cfg: dict) -> tuple:
    """The vocabulary rows the slow sampler can pick (semantic tokens and <|im_end|>, widened to whole
    64-row blocks): the head reads ~4 k rows instead of 155,776, and the draw is bit for bit the full
    head's, since every other row is -inf after the bias (the tests check it)."""
    first = min(cfg["semantic_begin_id"], cfg["im_end_id"])
    last = max(cfg["semantic_end_id"], cfg["im_end_id"])
    return first // 64 * 64, min(-(-(last + 1) // 64) * 64, cfg["vocab_size"])


def logits_to_probs(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                    removal=None) -> Tensor:
    """Upstream's filter, one row per request: top-k and top-p on the UNSCALED logits (the token that
    crosses top_p is dropped too, unlike HF), the best token always kept, then the temperature.
    removal(logits, top_p, top_k): which tokens the filter removes (default `sorted_removal`; one that finds
    the same faster: the model's `TopFilter.narrowed`)."""
    remove = (removal or sorted_removal)(logits, top_p, top_k)
    logits = torch.where(remove, float("-inf"), logits)
    return F.softmax(logits / torch.clip(temperature, min=1e-5)[:, None], dim=-1)


def sorted_removal(logits: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """Upstream's order: the whole row sorted -> which tokens top-k/top-p remove, in vocabulary order."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cum_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    ranks = torch.arange(logits.size(-1), device=logits.device)
    remove = (cum_probs > top_p[:, None]) | (ranks >= top_k[:, None])
    remove[:, 0] = False
    return remove.scatter(-1, order, remove)  # back to vocabulary order


class TopFilter(nn.Module):
    """The sampler's top-k/top-p filter as the model's module: upstream's `sorted_removal`, or with
    candidates=True (cpu_fast.tune's, on CPU) the same tokens removed, bit for bit, from an order of only the
    best candidates (`candidate_removal`): on a GPU its check of the candidates would cost a sync per draw."""

    def __init__(self, candidates: bool = False):
        super().__init__()
        self.candidates = candidates

    def extra_repr(self):
        return f"candidates={self.candidates}"

    def forward(self, logits: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
        return self.narrowed(int(top_k.max()))(logits, top_p, top_k)

    def narrowed(self, top_k: int):
        """The removal for rows of top_k at most."""
        return candidate_removal(top_k) if self.candidates else sorted_removal


CUMULATIVE_SLACK = 1e-4  # far above the rounding of a cumulative probability summed in another order


@functools.lru_cache(maxsize=None)  # one object per count: a compiled step's guard sees the same removal
def candidate_removal(top_k: int):
    """S2's removal for rows of top_k at most: `top_candidates` over a power of two of candidates (one
    compiled graph per count)."""
    candidates = max(32, 1 << max(int(top_k) - 1, 0).bit_length())
    return functools.partial(top_candidates, candidates=candidates)


def top_candidates(logits: Tensor, top_p: Tensor, top_k: Tensor, candidates: int) -> Tensor:
    """`sorted_removal` from the best candidates + 1 tokens alone: top-k drops every later rank, and what
    is kept is a prefix of the order. Two things depend on more than the candidates, and for them the row
    is sorted whole, as upstream: a tie across the kept prefix's end (which of the tied tokens upstream's
    unstable sort puts first), and a cumulative probability within CUMULATIVE_SLACK of top_p (its softmax
    sums the row in sorted order, rounding otherwise than in vocabulary order)."""
    if candidates >= logits.size(-1):
        return sorted_removal(logits, top_p, top_k)
    values, ids = torch.topk(logits, candidates + 1, dim=-1)  # (B, candidates + 1), best first
    # softmax, not exp of the whole row: on CPU that one is split across threads, 100x slower for 4k values
    cum_probs = torch.cumsum(F.softmax(logits, dim=-1).gather(-1, ids), dim=-1)
    ranks = torch.arange(candidates + 1, device=logits.device)
    remove = (cum_probs > top_p[:, None]) | (ranks >= top_k[:, None])
    remove[:, 0] = False
    kept = (~remove).sum(-1, keepdim=True)  # 1 .. candidates: rank `candidates` is past every top_k
    last, first_out = values.gather(-1, kept - 1), values.gather(-1, kept)
    tie = (last == first_out) & (last > float("-inf"))
    near = (cum_probs - top_p[:, None]).abs() < CUMULATIVE_SLACK
    args = logits, ids, remove, tie.any() | near.any(), top_p, top_k
    if torch.compiler.is_compiling():
        return candidates_or_sorted(*args)
    return removal_in_vocabulary_order(*args)  # the op's body: the op's dispatch costs ~60 us a draw eager


def removal_in_vocabulary_order(logits, ids, remove, unsure, top_p, top_k) -> Tensor:
    """`top_candidates`' removal (B, vocabulary): from the candidates' `remove`, or upstream's
    `sorted_removal` of the whole row where `unsure`."""
    if unsure:
        return sorted_removal(logits, top_p, top_k)
    return torch.ones_like(logits, dtype=torch.bool).scatter(-1, ids, remove)


# One opaque op, so that a compiled step branches on the host: torch.cond here made inductor compile two
# subgraphs per draw (22 a frame) and refuse to cache the graph ("Can't cache HigherOrderOperator: cond").
@torch.library.custom_op("fishfast::candidates_or_sorted", mutates_args=())
def candidates_or_sorted(logits: Tensor, ids: Tensor, remove: Tensor, unsure: Tensor, top_p: Tensor,
                         top_k: Tensor) -> Tensor:
    return removal_in_vocabulary_order(logits, ids, remove, unsure, top_p, top_k)


@candidates_or_sorted.register_fake
def _(logits, ids, remove, unsure, top_p, top_k):
    return torch.empty_like(logits, dtype=torch.bool)


def sample(logits: Tensor, noise: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
           removal=None) -> Tensor:
    """One draw per row: argmax(p / noise), noise = -log(u), u ~ U(0,1) in vocabulary order (upstream's
    exponential race). Always in fp32: bf16 probabilities tie and the lowest id would win."""
    probs = logits_to_probs(logits.float(), temperature, top_p, top_k, removal)
    return torch.argmax(probs / noise, dim=-1)


def draw_noise(model: DualAR, generators: list, uniform: Tensor = None) -> tuple:
    """The random numbers of one frame for each row, drawn as upstream draws them (rand_like over the whole
    vocabulary for the main and the repetition-aware sample, then over the codebook for codebooks 1..)
    from the row's own generator (None: an idle row) -> -log u over the sampling rows (B, 2, rows)
    and over the codebooks (B, n - 1, size). One call per row gives the numbers of upstream's 11 calls."""
    cfg = model.config
    vocab, size, (start, stop) = cfg["vocab_size"], cfg["codebook_size"], model.sampling_rows
    if uniform is None:
        uniform = torch.empty(len(generators), 2 * vocab + (cfg["num_codebooks"] - 1) * size,
                              device=model.embeddings.weight.device)
    for row, generator in enumerate(generators):
        if generator is None:
            uniform[row] = 0.5
        else:
            torch.rand(uniform.size(1), generator=generator, out=uniform[row])
    slow = uniform[:, : 2 * vocab].view(-1, 2, vocab)[:, :, start:stop]
    return -torch.log(slow), -torch.log(uniform[:, 2 * vocab:].view(-1, cfg["num_codebooks"] - 1, size))


# ----------------------------------------------------------------------------- one frame
def sample_frame(model: DualAR, logits: Tensor, hidden: Tensor, recent: Tensor, sampling: dict,
                 slow_noise: Tensor, fast_noise: Tensor) -> Tensor:
    """Slow logits (B, sampling rows) and fast input (B, fast_dim) -> the frames (B, 1 + num_codebooks):
    the main token (repetition-aware), then codebook 0 from it and codebooks 1.. from the fast model."""
    cfg = model.config
    start = model.sampling_rows[0]
    logits = logits.float() + sampling["bias"]
    temperature, top_p, top_k, removal = (sampling[k] for k in ("temperature", "top_p", "top_k", "removal"))
    main = start + sample(logits, slow_noise[:, 0], temperature, top_p, top_k, removal)
    high = start + sample(logits, slow_noise[:, 1], sampling["ras_temperature"], sampling["ras_top_p"], top_k,
                          removal)
    # repetition-aware sampling: a semantic token among the recent ones is replaced by the hotter draw
    main = torch.where((recent == main[:, None]).any(-1) & is_semantic(main, cfg), high, main)
    code = torch.clamp(main - cfg["semantic_begin_id"], 0, cfg["codebook_size"] - 1)
    codes, x = [main, code], model.fast_embeddings(code)[:, None]  # (B, 1, fast_dim): fast position 1
    if model.fast_prefill:  # codebook 0 is known already: positions 0 and 1 in one pass (s2.cpp, tuna-fish)
        x = torch.cat([hidden[:, None], x], dim=1)
    else:
        model.forward_fast(hidden[:, None], 0, logits=False)  # fills the fast cache, output unused (upstream)
    for i in range(1, cfg["num_codebooks"]):
        fast_logits = model.forward_fast(x, i)
        code = sample(fast_logits, fast_noise[:, i - 1], temperature, top_p, top_k, removal)
        codes.append(code)
        x = model.fast_embeddings(code)[:, None]
    return torch.stack(codes, dim=1)


def decode_step(model: DualAR, frames: Tensor, pos: Tensor, recent: Tensor, sampling: dict,
                slow_noise: Tensor, fast_noise: Tensor) -> Tensor:
    """One frame for every row: the last frames (B, 1 + num_codebooks) at positions pos (B,) -> the next.
    Static shapes, no host sync: this is the function `compile_model` compiles."""
    logits, hidden = model.forward_slow(frames, pos)
    return sample_frame(model, logits, hidden, recent, sampling, slow_noise, fast_noise)


def sampling_params(model: DualAR, sampling: list) -> dict:
    """Per-row [(temperature, top_p, top_k)] -> fp32 device tensors (B,), the bias that lets the slow
    model say only a semantic token or <|im_end|> (over the sampling rows), and the sampler's removal
    (`TopFilter.narrowed`)."""
    cfg, device = model.config, model.embeddings.weight.device
    ids = torch.arange(*model.sampling_rows)
    allowed = is_semantic(ids, cfg) | (ids == cfg["im_end_id"])
    temperature, top_p, top_k = zip(*sampling)
    rows = len(sampling)

    def floats(values):
        return torch.tensor(values, dtype=torch.float32, device=device)

    return dict(bias=torch.where(allowed, 0.0, float("-inf")).to(device), temperature=floats(temperature),
                top_p=floats(top_p), top_k=torch.tensor(top_k, device=device),
                ras_temperature=floats([RAS_TEMPERATURE] * rows), ras_top_p=floats([RAS_TOP_P] * rows),
                removal=model.top_filter.narrowed(max(top_k)))


# ----------------------------------------------------------------------------- requests
def check_reference_count(n: int):
    if n > MAX_REFERENCES:
        raise UserError(f"{n} references given, but at most {MAX_REFERENCES} are supported")


def check_sampling(temperature, top_p, top_k, max_new_tokens, chunk_length, chunk_frames=1):
    """Upstream's ranges, one message for the CLI and the API alike."""
    numbers = (temperature, top_p, top_k, max_new_tokens, chunk_length, chunk_frames)
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers):
        raise UserError("temperature, top_p, top_k, max_new_tokens, chunk_length must be numbers")
    if not (0 < top_p <= 1 and 0 < temperature < 2 and 0 <= top_k < 2**31 and int(top_k) == top_k):
        raise UserError("need 0 < top_p <= 1, 0 < temperature < 2 and an integer 0 <= top_k < 2**31"
                        " (upstream's ranges)")
    if max_new_tokens == 1 or max_new_tokens < 0 or int(max_new_tokens) != max_new_tokens:
        raise UserError("max_new_tokens must be 0 (no cap) or at least 2")  # 1 frame is dropped: none left
    if chunk_length < 1 or chunk_frames < 1:
        raise UserError("chunk_length and chunk_frames must be >= 1")


def check_request(model: DualAR, text: str, references) -> list:
    """-> the references [(codes, transcript)] with integer codes (num_codebooks, frames)."""
    cfg = model.config
    n_semantic = cfg["semantic_end_id"] - cfg["semantic_begin_id"] + 1
    if not isinstance(text, str) or not text.strip():
        raise UserError("the text to speak is empty")
    check_plain_text(model.tokenizer, text, "the text to speak", SPEAKER_TAG)
    references, checked = [(torch.as_tensor(c), t) for c, t in references], []
    check_reference_count(len(references))
    for i, (codes, transcript) in enumerate(references, 1):
        if not isinstance(transcript, str) or not transcript.strip():
            raise UserError(f"reference {i} has no transcript (give --prompt-text for every reference)")
        check_plain_text(model.tokenizer, transcript, f"reference {i} transcript", SPEAKER_TAG)
        if codes.dim() != 2 or codes.size(0) != cfg["num_codebooks"] or codes.size(1) == 0:
            raise UserError(f"reference {i} codes have shape {list(codes.shape)},"
                            f" expected [{cfg['num_codebooks']}, frames]")
        if codes.is_floating_point():
            raise UserError(f"reference {i} codes are floats, not integer codes")
        codes = codes.long()
        if codes.min() < 0 or codes.max() >= cfg["codebook_size"] or codes[0].max() >= n_semantic:
            raise UserError(f"reference {i} codes are not integer codes in [0, {cfg['codebook_size']})")
        checked.append((codes, transcript))
    return checked


class Request(Job):
    """One request: its text batches, sampling parameters, random stream, row, and what it has made:
    `chunks`, codes (num_codebooks, n) each, grows as the engine works (the one record of its codes).
    Iterating it yields them as they come, waiting while an engine thread works; `codes()` joins them.
    max_frames: the most frames all its text batches may make together (a server's cap; 0: the context's)."""

    def __init__(self, model: DualAR, text: str, references=(), seed=None, temperature=0.7, top_p=0.7,
                 top_k=30, max_new_tokens=0, chunk_length=300, chunk_frames=CHUNK_FRAMES, max_context=None,
                 max_frames=0):
        super().__init__()
        check_sampling(temperature, top_p, top_k, max_new_tokens, chunk_length, chunk_frames)
        self.max_frames = max_frames
        self.model, self.references = model, check_request(model, text, references)
        self.texts, self.history = text_batches(text, chunk_length), []
        self.sampling = (temperature, top_p, top_k)
        self.max_new_tokens, self.chunk_frames = max_new_tokens, chunk_frames
        self.max_context = min(max_context or DEFAULT_CONTEXT, model.config["max_seq_len"])
        if seed is None:  # no seed: one from the global generator, so torch.manual_seed still decides
            seed = int(torch.randint(2**62, ()))
        if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64:
            raise UserError(f"seed must be an integer in [-2**63, 2**64), got {seed!r:.40}")
        device = model.embeddings.weight.device
        self.generator = torch.Generator(device).manual_seed(seed)
        self.prompt = self.next_prompt()  # a prompt that cannot fit fails here, before any work
        self.batch_frames, self.raw_frames, self.pending, self.chunks, self.row = [], [], [], [], None
        self.submitted, self.first_audio = time.perf_counter(), None
        self.prefill_tokens, self.prefill_seconds = 0, 0.0

    def next_prompt(self) -> Tensor:
        prompt = build_prompt(self.model, self.references, self.history, self.texts[len(self.history)])
        limit = min(self.model.config["max_seq_len"] - CONTEXT_RESERVE, self.max_context - 1)
        if prompt.size(1) > limit:
            raise UserError(f"the prompt is {prompt.size(1)} tokens, the context allows {limit}"
                            f" ({CONTEXT_RESERVE} are kept for speech) — use shorter references or text")
        return prompt

    def frame_budget(self) -> int:
        """Frames this text batch may make: max_new_tokens, or up to the end of the context, and no more than
        max_frames leaves (+1: a batch's last frame is dropped)."""
        room = self.max_context - self.prompt.size(1)
        if self.max_frames:
            room = min(room, self.max_frames - self.spoken() + 1)
        return min(self.max_new_tokens, room) if self.max_new_tokens else room

    def spoken(self) -> int:
        """Frames of speech its finished text batches made."""
        return sum(codes.size(1) for _, codes in self.history)

    def add_frame(self, frame: Tensor) -> bool:
        """Record one frame (1 + num_codebooks,) -> whether this text batch is over. Every frame but the
        last of each batch is speech (upstream drops the last): hold one back, hand out the rest."""
        frames = self.batch_frames
        frames.append(frame)
        over = frame[0] == self.model.config["im_end_id"] and len(frames) > 1  # not the prefill frame
        over = over or len(frames) >= self.frame_budget()
        if len(frames) > 1:
            self.pending.append(frames[-2][1:])
        size = self.chunk_frames if self.chunks else 1  # the first chunk at once: time to first audio
        if len(self.pending) >= size or (over and self.pending):
            with self.changed:
                self.chunks.append(torch.stack(self.pending, dim=1))
                self.changed.notify_all()
            self.pending = []
        return over

    def end_batch(self) -> bool:
        """Close the current text batch -> whether the request has another one to speak."""
        frames = torch.stack(self.batch_frames, dim=1)
        self.raw_frames.append(frames)  # kept for inspection: upstream's generate() output per batch
        self.history.append((self.texts[len(self.history)], frames[1:, :-1]))
        self.batch_frames = []
        if len(self.history) < len(self.texts) and not (self.max_frames and self.spoken() >= self.max_frames):
            self.prompt = self.next_prompt()
            return True
        return False

    def __iter__(self):
        """Codes chunks as they are made (waits while an engine thread works)."""
        n = 0
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.done or len(self.chunks) > n)
                new, done = self.chunks[n:], self.done
            yield from new
            n += len(new)
            if done:
                if self.error:
                    raise self.error
                return

    def codes(self) -> Tensor:
        """Every chunk, joined (waits for the end): (num_codebooks, frames)."""
        chunks = list(self)
        return torch.cat(chunks, 1) if chunks else torch.zeros(self.model.config["num_codebooks"], 0,
                                                                 dtype=torch.long)


# ----------------------------------------------------------------------------- engine
class Scheduler:
    """`slots` rows of KV cache and one (compiled) frame step for all of them, run synchronously: `submit`
    requests, then `step()` until `busy` is false (nano-vllm's shape: step = admit -> run -> hand out).
    Requests are admitted into free rows between two frames, prefilled alone, then join the batched step;
    they leave when they end. Each row samples with its own parameters and random stream, so its codes do
    not depend on the others. A frame runs only the first `batch_bucket` rows that hold every busy row; a
    free row stays at position 0 (its attention reads one cache block). One scheduler owns a model's KV
    caches at a time: another one is refused while this one is live. common.EngineThread steps it from a
    thread of its own (a server's engine)."""

    def __init__(self, model: DualAR, slots: int = 1, context: int = None, sync_every: int = None):
        cfg, device = model.config, model.embeddings.weight.device
        self.model, self.slots, self.fixed_context = model, slots, context
        # frames made on the device before the host reads them: on CUDA the GPU then never waits for Python
        self.sync_every = sync_every or (4 if device.type == "cuda" else 1)
        self.rows, self.waiting, self.closed = [None] * slots, collections.deque(), False
        self.lock = threading.Lock()  # `waiting` is shared with the threads that submit (common.EngineThread)
        self.thread = None  # the engine thread that steps it, if any
        self.claim()
        # inference tensors, as the caches: made outside inference mode, the compiled step would see
        # tensors of another kind (another dispatch key) and compile again
        with torch.inference_mode():
            self.frames = torch.zeros(slots, 1 + cfg["num_codebooks"], dtype=torch.long, device=device)
            self.pos = torch.zeros(slots, dtype=torch.long, device=device)
            self.live = torch.zeros(slots, dtype=torch.long, device=device)  # 1: the row holds a request
            self.recent = torch.zeros(slots, RAS_WINDOW, dtype=torch.long, device=device)  # RAS: last tokens
            self.params = sampling_params(model, [(0.7, 0.7, 30)] * slots)
            self.outputs = torch.zeros(self.sync_every, *self.frames.shape, dtype=torch.long, device=device)
            self.uniform = torch.empty(slots, 2 * cfg["vocab_size"] + (cfg["num_codebooks"] - 1)
                                       * cfg["codebook_size"], device=device)
        self.decode = model.compiled_step or functools.partial(decode_step, model)

    @property
    def busy(self) -> bool:
        return any(self.rows) or bool(self.waiting)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    def live_engine(self) -> bool:
        """Whether its rows' KV cache must stay as it is: it has work, or a thread that may take some at any
        moment (idle is not free)."""
        return self.busy or (self.thread is not None and self.thread.is_alive())

    @torch.inference_mode()
    def claim(self):
        """Take the model's KV caches (sized for these rows), unless another live engine has them."""
        owner = self.model.engine and self.model.engine()
        if owner is not None and owner is not self and owner.live_engine():
            raise RuntimeError("this model's KV caches belong to another live engine: close it (or let it"
                               " finish) first, or submit to it")
        self.model.engine = weakref.ref(self)
        self.model.setup_caches(self.slots, self.fixed_context or cache_bucket(1, self.model.config))

    def submit(self, request: Request) -> Request:
        if self.closed:
            raise EngineClosed("the engine was closed")
        if not self.busy and not (self.model.engine and self.model.engine() is self):
            self.claim()
        with self.lock:
            queue_job(self.waiting, request)
        return request

    @torch.inference_mode()
    def step(self):
        """Admit waiting requests, then `sync_every` frames for every busy row, then hand them out."""
        for row, request in enumerate(self.rows):
            if request is not None and request.cancelled:
                self.free(row)
                request.finish()
        self.admit()
        active = [r for r, request in enumerate(self.rows) if request is not None]
        if not active:
            return
        n = min(batch_bucket(active[-1] + 1), self.slots)
        frames, states = self.run_frames(n, [request and request.generator for request in self.rows[:n]])
        for row in active:
            for i in range(self.sync_every):
                rewind = states[i + 1][row] if i + 1 < len(states) else None
                if self.collect(row, frames[i, row], rewind):
                    break

    def run(self):
        while self.busy:
            self.step()

    def admit(self):
        for row in range(self.slots):
            if self.rows[row] is None:
                request = next_job(self.waiting, self.lock)
                if request is None:
                    return
                try:
                    self.prefill(row, request)
                except Exception as e:
                    self.drop(row, request, e)

    def prefill(self, row: int, request: Request):
        """Prompt of the request's current text batch into `row`, and its first frame (no recent tokens,
        as upstream: the RAS window starts empty after the prefill frame)."""
        model, prompt = self.model, request.prompt
        self.ensure_context(prompt.size(1) + request.frame_budget())
        start = time.perf_counter()
        logits, hidden = model.prefill(prompt.to(self.pos.device), row)
        params = sampling_params(model, [request.sampling])
        slow_noise, fast_noise = draw_noise(model, [request.generator])
        none_yet = torch.full_like(self.recent[:1], -1)
        frame = sample_frame(model, logits, hidden, none_yet, params, slow_noise, fast_noise)
        for key in ("temperature", "top_p", "top_k"):
            self.params[key][row] = params[key][0]
        # every row runs the sampler, a free one with its last request's top_k
        self.params["removal"] = model.top_filter.narrowed(int(self.params["top_k"].max()))
        self.frames[row], self.pos[row], self.live[row] = frame[0], prompt.size(1), 1
        self.recent[row] = 0
        self.rows[row], request.row = request, row
        request.prefill_tokens += prompt.size(1)
        request.prefill_seconds += time.perf_counter() - start
        self.collect(row, frame[0].cpu())

    def ensure_context(self, needed: int):
        """Grow the KV caches (keeping their contents) when a row needs more positions than they hold."""
        if needed <= self.model.cache_len:
            return
        if self.fixed_context:
            raise UserError(f"this request needs {needed} positions, the engine's context is"
                            f" {self.fixed_context}: use shorter text, references or max_new_tokens")
        self.model.setup_caches(self.slots, cache_bucket(needed, self.model.config))

    @torch.inference_mode()
    def run_frames(self, n: int, generators: list) -> tuple:
        """`sync_every` frames for rows 0..n-1 (generators: each row's, None for a free row) -> the frames
        (sync_every, slots, 1 + num_codebooks) on the host (one sync), and each row's generator state
        before each frame (a text batch that ends early rewinds to it)."""
        states = []
        rows = {k: v if k in ("bias", "removal") else v[:n] for k, v in self.params.items()}
        for i in range(self.sync_every):
            if self.sync_every > 1:
                states.append([g and g.get_state() for g in generators])
            slow_noise, fast_noise = draw_noise(self.model, generators, self.uniform[:n])
            frames = self.decode(self.frames[:n], self.pos[:n], self.recent[:n], rows, slow_noise, fast_noise)
            self.frames[:n] = frames
            self.outputs[i, :n] = frames  # a CUDA graph overwrites its output at the next replay
            self.pos[:n] += self.live[:n]
            self.pos.clamp_(max=self.model.cache_len - 1)  # a row that ended within these frames runs on
            self.recent[:n] = torch.cat([self.recent[:n, 1:], frames[:, :1]], dim=1)
        return self.outputs.to("cpu", copy=True), states

    def collect(self, row: int, frame: Tensor, rewind=None) -> bool:
        """Hand a new frame to the row's request -> whether its text batch ended, then start its next
        batch (after rewinding its generator to `rewind`, the state before the frames it will not use)
        or retire it."""
        request = self.rows[row]
        if not request.add_frame(frame):
            return False
        self.free(row)
        if rewind is not None:
            request.generator.set_state(rewind)
        try:
            if request.end_batch():
                self.prefill(row, request)
                return True
        except Exception as e:
            self.drop(row, request, e)
            return True
        request.finish()
        return True

    def free(self, row: int):
        """The row holds no request: back to position 0, where its frames read one cache block."""
        self.rows[row] = None
        self.pos[row], self.live[row] = 0, 0

    def drop(self, row: int, request: Request, error: Exception):
        """End a request whose prefill failed, on bad input or a bug: the other rows go on."""
        self.free(row)
        if not isinstance(error, UserError):
            traceback.print_exc()
            error = RuntimeError(f"generation failed: {type(error).__name__}: {error}")
        request.finish(error)

    def fail(self, error: Exception):
        """End the requests in the rows (a step failed): the waiting ones run next."""
        for row, request in enumerate(self.rows):
            if request is not None:
                self.free(row)
                request.finish(error)

    def warm_up(self, report=None):
        """Compile (on CUDA also record) the frame step for every row count this engine runs, before the
        first request pays for it. report(rows, seconds) after each."""
        calls = 2 if self.pos.device.type == "cuda" else 1  # CUDA graphs: one warm-up run, then recorded
        for n in sorted({min(batch_bucket(r), self.slots) for r in range(1, self.slots + 1)}):
            start = time.perf_counter()
            for _ in range(calls):
                self.run_frames(n, [None] * n)  # free rows: position 0, nothing kept
            if report:
                report(n, time.perf_counter() - start)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.closed = True
        for request in [*self.rows, *self.waiting]:
            if request is not None and not request.done:
                request.finish(EngineClosed("the engine was closed"))
        self.rows, self.waiting = [None] * self.slots, collections.deque()


def batch_bucket(rows: int) -> int:
    """Rows a frame step runs when the busy rows are among the first `rows`: 1, 4, 8, 16, ... (capped
    at the engine's slots): a partly filled engine runs a smaller graph, and there are few graphs."""
    return 1 if rows <= 1 else max(4, 1 << (rows - 1).bit_length())


def cache_bucket(needed: int, cfg: dict) -> int:
    """KV cache length for `needed` positions: a power of two >= 256 (few compiled shapes), at most the
    model's context."""
    return min(max(256, 1 << (needed - 1).bit_length()), cfg["max_seq_len"])


# ----------------------------------------------------------------------------- generation
def chunks_until_done(scheduler: Scheduler, request: Request):
    """Run `scheduler` until `request` ends, yielding its codes chunks as they come."""
    n = 0
    while not request.done:
        scheduler.step()
        yield from request.chunks[n:]
        n = len(request.chunks)
    if request.error:
        raise request.error


@torch.inference_mode()
def stream(model: DualAR, text: str, **kwargs):
    """Speak `text` (same arguments as `generate`), yielding codes chunks (num_codebooks, n) as they are
    made: the first as soon as one frame of speech exists, then every `chunk_frames` frames."""
    with Scheduler(model) as scheduler:  # closed also when the reader stops early: the model is free
        yield from chunks_until_done(scheduler, scheduler.submit(Request(model, text, **kwargs)))


@torch.inference_mode()
def generate_many(model: DualAR, requests: list, slots: int = None, context: int = None) -> list:
    """Several requests (dicts of `generate`'s keyword arguments), batched -> their codes, in order.
    Each request's codes are the ones it gets alone. context: a fixed KV cache length (one compiled
    shape) instead of one that grows with the longest request."""
    batch = [Request(model, **r) for r in requests]  # every request is checked before any work
    with Scheduler(model, slots=slots or len(batch), context=context) as scheduler:
        for request in batch:
            scheduler.submit(request)
        scheduler.run()
    return [request.codes() for request in batch]


def generate(model: DualAR, text: str, references=(), **options) -> Tensor:
    """Speak `text` (optionally in the voice of references [(codes (10, n), transcript)]); options: Request's
    (seed, temperature, top_p, top_k, max_new_tokens=0: up to the context, chunk_length, max_context).
    Text with <|speaker:N|> tags is split into turns and spoken batch by batch, each batch seeing the
    codes of the ones before. -> codes (num_codebooks, frames)."""
    return generate_many(model, [dict(options, text=text, references=references)])[0]


# ----------------------------------------------------------------------------- demo checkpoint
DEMO_DIMS = dict(dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=128)


def demo_tokenizer(n_semantic: int):
    """Byte-level tokenizer (no merges) with the S2-Pro special tokens and <|semantic:i|> range."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|text|>", "<|voice|>"]
    return byte_tokenizer(specials + [f"<|semantic:{i}|>" for i in range(n_semantic)])


def demo_models(device, dtype) -> tuple:
    """A tiny random S2-Pro in the real layout (tokenizer, config, both transformers) and its codec, built
    in memory -> (model, codec model). Its 'speech' is noise: it only exercises the pipeline."""
    import codec  # the audio (codec.py): the CLI and the demo need it, the model does not
    tokenizer = demo_tokenizer(CONFIG["codebook_size"])
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64  # padded like the real vocabulary
    flat = dict(DEMO_DIMS, n_layer=2, vocab_size=vocab_size, rope_base=1e6, norm_eps=1e-6, max_seq_len=4096,
                attention_qk_norm=True, codebook_size=CONFIG["codebook_size"],
                num_codebooks=CONFIG["num_codebooks"], n_fast_layer=1, scale_codebook_embeddings=True,
                norm_fastlayer_input=True)
    torch.manual_seed(0)
    model = DualAR(dict(config_from_flat(flat), **special_ids(tokenizer)))
    for name, param in model.named_parameters():
        if not name.endswith("norm.weight"):
            nn.init.normal_(param, std=0.2)
    model.tokenizer = tokenizer
    model = model.to(device, torch.bfloat16).to(dtype).requires_grad_(False).eval()  # bf16, as released
    return model, codec.demo_model(device)


def demo_reference(args, device):
    """One second of a gliding tone, encoded by the demo codec, as the voice to 'clone'."""
    import codec
    t = torch.arange(codec.CONFIG["sample_rate"]) / codec.CONFIG["sample_rate"]
    wave = 0.3 * torch.sin(2 * math.pi * (220 + 80 * t) * t)
    return [(codec.encode(codec_model(args, device), wave)[0].cpu(), "A one second test tone.")]


# ----------------------------------------------------------------------------- CLI
def add_model_args(ap: argparse.ArgumentParser, more_quant: tuple = (), more_quant_help: str = ""):
    """The flags of every CLI that runs the model (this one, bench.py, app.py, tools/); more_quant: schemes
    of another model the CLI also serves (app.py: OmniVoice's)."""
    add_device_arg(ap)
    ap.add_argument("--dtype", choices=list(DTYPES), help="default bf16 on CUDA, fp32 elsewhere")
    import quantize  # the CLIs' choices (a model copied with common.py alone: call `load` without quant)
    ap.add_argument("--quant", choices=list(dict.fromkeys(quantize.S2_SCHEMES + tuple(more_quant))),
                    help="weight quantization of both transformers (int8wo, int4wo on CPU: torch's own"
                    " kernels, any dtype; on GPU torchao: int4wo bf16 and compute capability >= 8.0, fp8 >="
                    " 8.9, nvfp4 >= 10.0)" + more_quant_help)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, help="one compiled graph per frame"
                    " (default: on for CUDA, off on CPU where compiling takes minutes, see README)")
    ap.add_argument("--compile-cache", help="folder that keeps compiled kernels for the next run"
                    f" (default $TORCHINDUCTOR_CACHE_DIR, else {default_compile_cache()})")
    ap.add_argument("--fast-prefill", action="store_true", help="the fast transformer's first two positions"
                    " (slow state, codebook 0) in one pass: 9 passes a frame instead of upstream's 10; its"
                    " logits round otherwise than upstream's (off by default, docs/speed.md)")
    ap.add_argument("--no-tune", action="store_true", help="CPU: the plain model, without cpu_fast.tune's"
                    " faster matmuls (timed once per machine and kept beside the compile cache)")


def model_settings(args) -> tuple:
    """The shared flags -> (device, dtype, compile): bf16 and compiled on CUDA, fp32 and eager elsewhere."""
    device = pick_device(args.device)
    compiled = device.type == "cuda" if args.compile is None else args.compile  # CPU: minutes (README)
    return device, pick_dtype(args.dtype, device), compiled


def load_references(args, model: DualAR, device) -> list:
    """-> [(codes, transcript)] from --prompt-codes/--prompt-audio paired in order with --prompt-text,
    or else from prompt/ (unless --no-prompt)."""
    import codec
    given, texts = args.references or [], args.prompt_text or []
    if not given and not texts and not args.no_prompt:
        given = codec.default_references(VOICES)
        texts = [codec.read_transcript(path.with_suffix(".txt")) for _, path in given]
        if given:
            print("references from prompt/: " + ", ".join(p.name for _, p in given), file=sys.stderr)
    if len(texts) != len(given):
        raise UserError(f"{len(given)} reference clip(s) but {len(texts)} --prompt-text: give one transcript"
                        " per --prompt-audio/--prompt-codes, in the same order")
    check_reference_count(len(given))  # before any clip is encoded
    return [(codec.reference_codes(kind, path, model.config, lambda: codec_model(args, device)), text)
            for (kind, path), text in zip(given, texts)]


def codec_model(args, device):
    """The codec, in fp32 on every device: reference clips encode to the same codes everywhere."""
    import codec
    if getattr(args, "codec", None) is None:
        args.codec = codec.load(args.checkpoint, device, torch.float32)
    return args.codec


def output_files(args):
    """-> (codes path, wav path or None), checked writable before any work is done."""
    out = Path(args.out) if args.out else None
    if out is None:
        n = 0
        while Path(f"generate/{n}.wav").exists() or Path(f"generate/{n}.npy").exists():
            n += 1
        out = Path(f"generate/{n}.wav")
    if out.is_dir():
        raise UserError(f"--out {out} is a folder: give a file name such as {out / 'speech.wav'}")
    folder = out.parent if out.parent.exists() or args.out else Path(".")  # generate/ is made on writing
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist or is not writable")
    return out.with_suffix(".npy"), None if args.codes_only else out.with_suffix(".wav")


def parse_args(argv=None):
    ap = ArgumentParser(description="S2-Pro text-to-speech (Dual-AR): text -> codes -> wav.")
    ap.add_argument("--checkpoint", help="dir with config.json, weights, tokenizer.json and codec.pth"
                    " (default ./s2-pro, or the demo if that is absent)")
    ap.add_argument("--text", help="the text to speak (<|speaker:N|> tags make a dialogue)")
    ap.add_argument("--text-file", help="read the text from this UTF-8 file instead")
    ap.add_argument("--prompt-audio", dest="references", action="append", type=lambda p: ("audio", Path(p)),
                    help="reference clip to clone (repeatable, encoded with codec.py)")
    ap.add_argument("--prompt-codes", dest="references", action="append", type=lambda p: ("codes", Path(p)),
                    help="reference codes .npy [10, T] from `codec.py encode` (repeatable)")
    ap.add_argument("--prompt-text", action="append", help="transcript of each reference, in order"
                    " (repeatable). Default references: prompt/<stem>.npy or audio + prompt/<stem>.txt")
    ap.add_argument("--no-prompt", action="store_true", help="ignore prompt/: plain TTS, no voice cloning")
    ap.add_argument("--save-voice", metavar="NAME", help="keep the voice this run makes without a reference"
                    " as prompt/NAME.npy + .txt (its codes and text; a dialogue's first text batch): later"
                    " runs clone it")
    ap.add_argument("--force", action="store_true", help="--save-voice may replace a voice of that name")
    ap.add_argument("--out", help="output .wav/.npy path (default generate/<n>.wav and .npy)")
    ap.add_argument("--codes-only", action="store_true", help="write only the codes, skip the codec")
    ap.add_argument("--stream", action="store_true", help="write the wav while it is generated (a player"
                    " can open it as it grows) and report the time to first audio")
    ap.add_argument("--seed", type=int, default=42, help="random seed of the request (default 42)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    ap.add_argument("--top-p", type=float, default=0.7, help="nucleus sampling threshold (default 0.7)")
    ap.add_argument("--top-k", type=int, default=30, help="keep the k most likely tokens (default 30, 0 or 1:"
                    " greedy, as upstream)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="frames per text batch at most, >= 2"
                    " (default 0: until <|im_end|> or the end of --max-context)")
    ap.add_argument("--max-context", type=int, default=DEFAULT_CONTEXT, help="positions (prompt + frames)"
                    f" the KV cache holds at most (default {DEFAULT_CONTEXT}, at most the model's 32768)")
    ap.add_argument("--chunk-length", type=int, default=300, help="UTF-8 bytes of dialogue turns per batch"
                    " (default 300, as upstream)")
    add_model_args(ap)
    ap.add_argument("--demo", action="store_true", help="a tiny random checkpoint built on the fly (noise)")
    return ap.parse_args(argv)


def check_args(args):
    if args.text_file:
        try:
            args.text = Path(args.text_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise unreadable(args.text_file, e) from None
    if args.demo and not args.text:
        args.text = "Hello from fishfast! This is the demo."
    if not args.text or not args.text.strip():
        raise UserError("no text to speak: give --text or --text-file")
    check_sampling(args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.chunk_length)
    check_seed(args.seed)  # the server's range
    if args.stream and args.codes_only:
        raise UserError("--stream writes audio: drop --codes-only")
    if args.save_voice:
        check_save_voice(args)


def check_save_voice(args):
    """--save-voice keeps a voice the model made up: a run with references would copy theirs."""
    new_voice(VOICES, args.save_voice, args.force)
    if args.references or args.prompt_text:
        raise UserError("--save-voice keeps the voice of a run without a reference: leave out --prompt-audio,"
                        " --prompt-codes and --prompt-text")
    import codec
    found = [] if args.no_prompt else [path.name for _, path in codec.default_references(VOICES)]
    if found:
        raise UserError(f"--save-voice keeps the voice of a run without a reference, and {VOICES}/ holds"
                        f" {', '.join(found[:3])}: give --no-prompt")


def speak_cli(args):
    import codec
    check_args(args)
    device, dtype, compiled = model_settings(args)
    codes_path, wav_path = output_files(args)
    if args.demo:
        model, args.codec = demo_models(device, dtype)
        optimize(model, args.quant, compiled, args.compile_cache, args.fast_prefill)
    else:
        model = load(args.checkpoint, device, dtype, args.quant, compiled, args.compile_cache,
                     args.fast_prefill)
    if wav_path is not None and not args.demo and not (Path(args.checkpoint) / "codec.pth").is_file():
        if args.stream:
            raise UserError(f"--stream needs {args.checkpoint}/codec.pth")
        print(f"note: {args.checkpoint} has no codec.pth, so only the codes are written", file=sys.stderr)
        wav_path = None
    if wav_path is not None:
        codec_model(args, device)  # a broken codec.pth fails now, not after the generation
    references = load_references(args, model, device)
    if args.demo and not references and not args.save_voice:
        references = demo_reference(args, device)
    if not args.no_tune:  # the input is good: this CPU's faster matmuls (timed once per machine, kept)
        import cpu_fast
        cpu_fast.tune(model, rows=1)
        if wav_path is not None:  # decode only: reference codes stay eager, upstream's
            cpu_fast.keep_freed_memory()  # this process's allocator: the CLI's to set
            cpu_fast.tune(codec_model(args, device))
    request = Request(model, args.text, references, seed=args.seed, temperature=args.temperature,
                      top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                      chunk_length=args.chunk_length, max_context=args.max_context,
                      chunk_frames=CHUNK_FRAMES if args.stream else 1 << 30)
    codes_path.parent.mkdir(exist_ok=True)
    codes = speak(model, request, wav_path if args.stream else None, args)
    if wav_path is not None and not args.stream:
        codec.save_wav(wav_path, codec.decode(codec_model(args, device), codes.to(device))[0])
    codec.save_codes(codes_path, codes)
    print(f"wrote {codes_path}" + (f" and {wav_path}" if wav_path else ""))
    if args.save_voice:
        keep_voice(args.save_voice, request)
    print(request_figures(request, codes.size(1), device))


def keep_voice(name: str, request: Request):
    """--save-voice: the request's first text batch (its codes and text: all of it but for a long
    dialogue) as a reference in prompt/, replacing a voice of that name (--force)."""
    import codec
    text, codes = request.history[0]
    if codes.size(1) == 0:
        raise UserError("the model said nothing (it stopped at once): no voice to save, try another --seed")
    VOICES.mkdir(exist_ok=True)
    for path in voice_files(VOICES, name):
        path.unlink()
    codec.write_reference(VOICES, name, codes, text)
    print(f"saved voice {name} -> {VOICES / name}.npy + .txt ({codes.size(1)} frames)")


def speak(model: DualAR, request: Request, wav_path, args) -> Tensor:
    """Run one request with a progress bar. With a wav path, decode and write each chunk as it comes."""
    import codec
    with Scheduler(model) as scheduler, torch.inference_mode(), tqdm(unit="frame", leave=False) as bar:
        chunks = shown(chunks_until_done(scheduler, scheduler.submit(request)), bar)
        if wav_path is None:
            collections.deque(chunks, maxlen=0)  # run to the end
            return request.codes()
        device = scheduler.pos.device
        waves = codec.decode_stream(codec_model(args, device), (c.to(device) for c in chunks))  # (1, samples)
        for _ in write_growing_wav(wav_path, waves, codec.CONFIG["sample_rate"]):
            request.first_audio = request.first_audio or time.perf_counter()
    return request.codes()


def shown(chunks, bar):
    """The codes chunks, each counted on the progress bar as it passes."""
    for chunk in chunks:
        bar.update(chunk.size(1))
        yield chunk


def request_figures(request: Request, frames: int, device) -> str:
    """The final line: audio made, prefill tokens/s, frames/s, RTF, time to first audio, peak memory."""
    import codec
    wall = time.perf_counter() - request.submitted
    seconds = frames * codec.hop_length() / codec.CONFIG["sample_rate"]
    line = (f"{frames} frames, {seconds:.2f} s of audio in {wall:.2f} s: prefill"
            f" {request.prefill_tokens / max(request.prefill_seconds, 1e-9):.0f} tokens/s,"
            f" {frames / wall:.1f} frames/s, RTF {wall / max(seconds, 1e-9):.3f}")
    if request.first_audio:
        line += f", time to first audio {1000 * (request.first_audio - request.submitted):.0f} ms"
    return line + f", peak memory {peak_memory_gb(device):.2f} GB"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.demo and args.checkpoint:
        raise UserError("--demo builds its own tiny checkpoint: drop --checkpoint")
    args.demo = args.demo or (args.checkpoint is None and not Path(DEFAULT_CHECKPOINT).exists())
    args.checkpoint = args.checkpoint or DEFAULT_CHECKPOINT
    if not args.demo:
        return speak_cli(args)
    print(f"DEMO: no real checkpoint used — a tiny RANDOM model is built, so the audio is NOISE.\n"
          f"For speech, download fishaudio/s2-pro into {DEFAULT_CHECKPOINT} (see README).", file=sys.stderr)
    args.max_new_tokens = args.max_new_tokens or 64
    speak_cli(args)


if __name__ == "__main__":
    cli(main)
