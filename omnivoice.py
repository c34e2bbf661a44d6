"""OmniVoice (k2-fsa) text-to-speech in one file: a bidirectional Qwen3 that unmasks audio codes.

The LM reads style tokens, text, the reference's audio codes and a fully masked target, all at once (no causal
mask), and predicts every codebook at every target position; over `num_step` steps the most confident
predictions are revealed, classifier-free guided by a second row that holds only the target. Its audio
tokenizer (HiggsAudio v2: DAC + HuBERT + residual quantizer, 24 kHz) lives in omnivoice_codec.py; its text
front end (non-verbal tags, languages, voice design attributes, chunks, sentences, length) and pydub's silence
arithmetic in omnivoice_text.py. Everything is written to give upstream omnivoice's audio for upstream's seed
on CPU fp32.

    python omnivoice.py --text "Hello!" --ref-audio me.wav --ref-text "what me.wav says"
    python omnivoice.py --text "Hello!" --instruct "female, low pitch, british accent"

How the file reads (sections, top to bottom):
    config           CONFIG (the real OmniVoice), GENERATION (upstream's defaults), config.json -> a flat dict
    building blocks  RMSNorm, RoPE, span attention (a flat row's, one op), Attention (GQA, q/k norm), Block
    model            OmniVoice: text + summed audio embeddings, the Qwen3 stack, one head per codebook
    loading          the checkpoint folder -> model, tokenizer and audio tokenizer
    compilation      the compiled forward (CPU: the flat row, any length; else static buckets); int8/int4
                     weights: quantize.py's, at `load`
    voices           a clone prompt from a clip (voice_prompt) or a generation's codes and text
                     (generation_voice, voice_of), saved and read back
    requests         the limits of a request (the CLI's and the server's), generate()'s arguments -> one
                     item per text (target length, style, reference; user text without control tokens)
    unmasking        the schedule (time_steps, count_schedule), the batch's rows (upstream's, packed,
                     flat), CFG in log-prob space, layer penalty, Gumbel reveal; the engine: Unmasking (one
                     text), Scheduler.step() (texts batched, each its own stream; common.EngineThread steps
                     it for a server), unmask (generate()'s batch)
    generation       encode, decode, generate (short and chunked), post-processing; Speech (a text sentence
                     by sentence, the server's streaming unit), CrossFade (the join, streamed), stream
    demo             a tiny random model and tokenizer, built in memory
    CLI              `python omnivoice.py` (voice names: common.voice_name, the server's)
"""
import argparse
import collections
import contextlib
import functools
import json
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

import common
import omnivoice_codec
from common import UserError
from omnivoice_text import (NONVERBAL_TAGS, add_punctuation, chunk_text_punctuation, combine_text,
                            cross_fade_chunks, cut_runs, estimate_target_tokens, fade_and_pad, has_cjk,
                            normalize_reference, output_gain, remove_silence, resolve_instruct,
                            resolve_language, rms, split_sentences, style_prefix, tokenize,
                            tokenize_with_nonverbal_tags)

# The real k2-fsa/OmniVoice LM (Qwen3-0.6B shape), in our flat key names.
CONFIG = dict(vocab_size=151676, dim=1024, n_layer=28, n_head=16, n_local_heads=8, head_dim=128,
              intermediate_size=3072, rope_base=1e6, norm_eps=1e-6, max_seq_len=40960, audio_vocab_size=1025,
              audio_mask_id=1024,
              num_codebooks=8)
# upstream's OmniVoiceGenerationConfig defaults: generate(**config) takes these names
GENERATION = dict(num_step=32, guidance_scale=2.0, t_shift=0.1, layer_penalty_factor=5.0,
                  position_temperature=5.0, class_temperature=0.0, denoise=True, preprocess_prompt=True,
                  postprocess_output=True, audio_chunk_duration=15.0, audio_chunk_threshold=30.0,
                  pad_duration=0.1, fade_duration=0.1)
DEFAULT_CHECKPOINT = "./OmniVoice"
VOICE_SUFFIX = ".omnivoice.safetensors"  # a saved voice: codes + transcript + level, beside S2's in prompt/


# ----------------------------------------------------------------------------- config
def config_from_json(data: dict) -> dict:
    """OmniVoiceConfig (model_type omnivoice, nested qwen3 llm_config) -> our flat dict."""
    llm = data["llm_config"]
    rope = llm.get("rope_parameters") or {}
    return dict(vocab_size=llm["vocab_size"], dim=llm["hidden_size"], n_layer=llm["num_hidden_layers"],
                n_head=llm["num_attention_heads"], n_local_heads=llm["num_key_value_heads"],
                head_dim=llm.get("head_dim") or llm["hidden_size"] // llm["num_attention_heads"],
                intermediate_size=llm["intermediate_size"],
                rope_base=float(rope.get("rope_theta", llm.get("rope_theta", 1e6))),
                norm_eps=llm["rms_norm_eps"], max_seq_len=llm.get("max_position_embeddings", 40960),
                audio_vocab_size=data["audio_vocab_size"],
                audio_mask_id=data["audio_mask_id"], num_codebooks=data["num_audio_codebook"])


def read_config(path: Path, s2_use="run it with dualAR.py") -> dict:  # s2_use: what an S2-Pro one is for
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        kind = data.get("model_type")
        if kind in ("fish_qwen3_omni", "dual_ar"):
            raise UserError(f"{path.parent} is an S2-Pro checkpoint ({kind}): {s2_use}")
        if kind != "omnivoice":
            raise UserError(f"{path}: model_type {kind!r} is not omnivoice — download k2-fsa/OmniVoice")
        if data["llm_config"].get("model_type", "qwen3") != "qwen3":
            raise UserError(f"{path}: llm_config is {data['llm_config']['model_type']!r}, not qwen3")
        return config_from_json(data)
    except UserError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise common.unreadable(path, e) from None


# ----------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()  # computed in fp32, as transformers' Qwen3RMSNorm
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_tables(length: int, head_dim: int, base: float, device) -> tuple:
    """cos, sin (length, head_dim) in fp32, each half duplicated (the rotate-half form)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / base ** exponents
    angles = torch.arange(length, device=device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).to(x.dtype)


@torch.library.custom_op("fishfast::span_attention", mutates_args=())
def span_attention(q: Tensor, k: Tensor, v: Tensor, spans: Tensor) -> Tensor:
    """A flat row's attention: q (B, h, L, d), k and v (B, kv heads, L, d), spans (n, 2) int64 (start, end):
    each sequence attends to itself alone, so nothing is masked and no pair of sequences costs a score ->
    (B, h, L, d) contiguous. One op, so that a compiled graph takes any spans without a guard on them."""
    attend = functools.partial(F.scaled_dot_product_attention, enable_gqa=True)
    return torch.cat([attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in spans.tolist()], 2)


@span_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, spans: Tensor) -> Tensor:
    return q.new_empty(q.shape)  # contiguous, as torch.cat's


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        dim, self.n_head, self.n_local_heads = cfg["dim"], cfg["n_head"], cfg["n_local_heads"]
        self.head_dim = cfg["head_dim"]
        self.q_proj = nn.Linear(dim, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_local_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_local_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg["norm_eps"])  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, cfg["norm_eps"])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.n_head, self.head_dim)).transpose(1, 2)  # (B, h, L, d)
        k = self.k_norm(self.k_proj(x).view(B, L, self.n_local_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_local_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask.dtype == torch.bool:  # (B, 1, L, L): who sees whom, bidirectional
            repeat = self.n_head // self.n_local_heads  # kv head j serves query heads j*r .. j*r+r-1
            k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # a flat row's (start, end) spans
            y = span_attention(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))


class Block(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.input_layernorm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        self.gate_proj = nn.Linear(cfg["dim"], cfg["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(cfg["dim"], cfg["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(cfg["intermediate_size"], cfg["dim"], bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


# ----------------------------------------------------------------------------- model
class OmniVoice(nn.Module):
    """The LM: ids (B, C, L) -> logits (B, C, L, V), every position attending to every other in its row."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg
        C, V = cfg["num_codebooks"], cfg["audio_vocab_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg["n_layer"]))
        self.norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
        self.audio_embeddings = nn.Embedding(C * V, cfg["dim"])  # codebook c: rows c*V .. c*V+V-1
        self.audio_heads = nn.Linear(cfg["dim"], C * V, bias=False)
        self.register_buffer("codebook_offsets", torch.arange(C) * V, persistent=False)
        self.tokenizer = self.audio_tokenizer = None  # set by load()
        self.compiled_hidden = None  # set by compile_forward()

    def embed(self, ids: Tensor, audio_mask: Tensor) -> Tensor:
        """Text rows embed codebook 0's id; audio positions sum the codebooks' embeddings."""
        # upstream looks every position up in both tables (audio ids as text ids, zeroed ids as audio ids)
        text = self.embed_tokens(ids[:, 0])
        audio = self.audio_embeddings(ids * audio_mask[:, None] + self.codebook_offsets[:, None]).sum(1)
        return torch.where(audio_mask[..., None], audio, text)

    def hidden(self, ids: Tensor, audio_mask: Tensor, mask: Tensor, positions: Tensor = None) -> Tensor:
        """(B, C, L) ids -> (B, L, dim) hidden states after the final norm; mask: (B, 1, L, L) bool, or the
        (start, end) spans of a flat row's sequences, (n, 2) int64; positions (B, L): each token's RoPE
        position (default 0..L-1 in every row)."""
        return self.stack(ids, audio_mask, mask, *self.rope(ids.shape[2], positions, ids.device))

    def rope(self, length: int, positions: Tensor, device) -> tuple:
        """fp32 cos, sin: (length, head_dim), or (B, 1, L, head_dim) at positions (B, L)."""
        cos, sin = rope_tables(length, self.config["head_dim"], self.config["rope_base"], device)
        if positions is not None:
            cos, sin = cos[positions][:, None], sin[positions][:, None]
        return cos, sin

    def stack(self, ids: Tensor, audio_mask: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """hidden() given RoPE's tables: the embeddings, the layers and the final norm (what compile_forward
        compiles: inductor would recompute the tables' cos and sin inside every layer's kernels)."""
        x = self.embed(ids, audio_mask)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def heads(self, hidden: Tensor) -> Tensor:
        """(..., dim) -> (..., C, V) fp32 logits."""
        return self.audio_heads(hidden).unflatten(-1, (self.config["num_codebooks"], -1)).float()

    def forward(self, ids: Tensor, audio_mask: Tensor, mask: Tensor) -> Tensor:
        return self.heads(self.hidden(ids, audio_mask, mask)).permute(0, 2, 1, 3)  # (B, C, L, V)

    @property
    def sample_rate(self) -> int:
        return self.audio_tokenizer.sample_rate

    @property
    def frame_rate(self) -> int:
        return self.audio_tokenizer.frame_rate


# ----------------------------------------------------------------------------- loading
def internal_name(key: str) -> str:
    """upstream's state_dict name -> ours (the Qwen3 stack sits under `llm.`, its MLP under `mlp.`)."""
    return key.removeprefix("llm.").replace(".mlp.", ".")


def load_weights(model: OmniVoice, ckpt: Path, device, dtype):
    expected = {name: p.shape for name, p in model.named_parameters()}
    state = {}
    for key, tensor in common.read_tensors(common.weight_files(ckpt, "k2-fsa/OmniVoice")):
        name = internal_name(key)
        if name in expected:  # codebook_layer_offsets is recomputed, not read
            state[name] = tensor.to(device, dtype)
    missing = [name for name in expected if name not in state]
    if missing:
        raise UserError(f"{ckpt} lacks {len(missing)} tensors (first: {missing[0]}): not OmniVoice's")
    wrong = [f"{n} is {list(t.shape)}, config.json says {list(expected[n])}" for n, t in state.items()
             if t.shape != expected[n]]
    if wrong:
        raise UserError(f"{ckpt}: {wrong[0]}")
    model.load_state_dict(state, assign=True, strict=False)
    C, V = model.config["num_codebooks"], model.config["audio_vocab_size"]
    model.codebook_offsets = torch.arange(C, device=device) * V


def load(checkpoint=DEFAULT_CHECKPOINT, device="cpu", dtype=torch.float32, quant=None) -> OmniVoice:
    """The k2-fsa/OmniVoice folder (config.json, model.safetensors, tokenizer.json, audio_tokenizer/) -> the
    model with .tokenizer and .audio_tokenizer (which always runs in fp32, as upstream's); quant: one of
    quantize.OMNIVOICE_SCHEMES (quantize.py)."""
    ckpt, device, quantizing = Path(checkpoint), torch.device(device), quant not in (None, "none")
    if quantizing:
        import quantize  # only here: this file copied without quantize.py runs unquantized
        quantize.check_omnivoice(quant, device)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint dir {ckpt} does not exist — download k2-fsa/OmniVoice (see README)")
    for name in ("config.json", "tokenizer.json"):
        if not (ckpt / name).is_file():
            raise UserError(f"checkpoint dir {ckpt} has no {name} — download k2-fsa/OmniVoice (see README)")
    cfg = read_config(ckpt / "config.json")
    if cfg["vocab_size"] <= cfg["audio_mask_id"]:  # upstream looks audio ids up in the text table
        raise UserError(f"{ckpt}: LM vocab {cfg['vocab_size']} <= audio_mask_id {cfg['audio_mask_id']}")
    tokenizer = common.load_tokenizer(ckpt / "tokenizer.json")
    with torch.device("meta"):
        model = OmniVoice(cfg)
    load_weights(model, ckpt, device, dtype)
    model.tokenizer = tokenizer
    model.audio_tokenizer = omnivoice_codec.load(ckpt / "audio_tokenizer", device)
    model.requires_grad_(False).eval()
    return quantize.quantize(model, quant) if quantizing else model


# ----------------------------------------------------------------------------- compilation
LENGTH_BUCKET = 128  # a compiled forward's rows are padded to a multiple of this: a graph per bucket
RECOMPILE_GUARD = 64  # graphs of the forward per process (dynamo's default, 8: 8 buckets of one batch size)


def compile_forward(model: OmniVoice, backend="inductor", cache=None) -> OmniVoice:
    """The LM's forward (hidden) compiled. On CPU unmask then lays every batch out as the flat row, whose
    length and span count the graph leaves symbolic: one graph for every batch (see flat_row). Elsewhere one
    graph per (rows, bucket) shape: packed_rows padded to a multiple of LENGTH_BUCKET positions, the padding
    attending to itself, so requests of different lengths within a bucket reuse the graph (static shapes
    for the GPU). backend="eager": the same capture, no codegen (tests). cache: where inductor keeps its
    kernels for the next process (use_compile_cache). Process-wide, it sets $TORCHINDUCTOR_CACHE_DIR
    (unless the user did: inductor has no other setting for it). Up to RECOMPILE_GUARD graphs."""
    common.use_compile_cache(cache)
    stack = common.compiled(model.stack, RECOMPILE_GUARD, fullgraph=True, dynamic=False, backend=backend)

    def hidden(ids: Tensor, audio_mask: Tensor, mask: Tensor, positions: Tensor = None) -> Tensor:
        cos, sin = model.rope(ids.shape[2], positions, ids.device)  # eagerly: see OmniVoice.stack
        if mask.dtype != torch.bool:  # a flat row: the tables' length is its length, symbolic
            for table in (cos, sin):
                torch._dynamo.maybe_mark_dynamic(table, 2)
        return stack(ids, audio_mask, mask, cos, sin)

    model.compiled_hidden = hidden
    return model


# ----------------------------------------------------------------------------- voices
def read_clip(ref_audio, sample_rate: int) -> np.ndarray:
    """A path or (wave, rate) -> float32 (1, N) at sample_rate: channels averaged, upstream's resampling."""
    if isinstance(ref_audio, (str, Path)):
        data, rate = common.read_audio(ref_audio)
        wave = data.T  # (channels, N)
    else:
        try:
            wave, rate = ref_audio
        except (TypeError, ValueError):
            raise UserError("ref_audio must be a path or a (wave, sample_rate) pair") from None
        wave = wave.detach().cpu().numpy() if isinstance(wave, Tensor) else np.asarray(wave)
        wave = wave.astype(np.float32)
        wave = wave[None] if wave.ndim == 1 else wave
        if wave.ndim != 2 or wave.shape[1] == 0 or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise UserError(f"ref_audio: a (channels, samples) wave and a positive integer rate, got "
                            f"{list(wave.shape)} at {rate!r}")
        if not np.isfinite(wave).all():
            raise UserError("ref_audio has NaN or infinite samples")
    if wave.shape[0] > 1:
        wave = np.mean(wave, axis=0, keepdims=True)
    if rate != sample_rate:
        wave = omnivoice_codec.resample(torch.from_numpy(np.ascontiguousarray(wave)), rate, sample_rate)
        wave = wave.numpy()
    return wave


class SilentClip(UserError):
    """A reference clip with no frame left once its silences are trimmed (a caller says how to keep them)."""


def voice_prompt(model: OmniVoice, ref_audio, ref_text: str, preprocess_prompt: bool = True) -> dict:
    """A clip and its transcript -> dict(codes (C, T) int64, text, rms): upstream's voice-clone prompt (level
    to RMS 0.1, silences trimmed, cut to whole frames, encoded; the transcript ends in punctuation)."""
    if ref_text is None or not str(ref_text).strip():
        raise UserError("ref_text is missing: give the transcript of the reference clip (fishfast ships no"
                        " speech recogniser)")
    common.check_plain_text(model.tokenizer, ref_text, "ref_text")
    wave = read_clip(ref_audio, model.sample_rate)
    level = rms(wave)  # of the whole clip, silences included
    wave = normalize_reference(wave, level)
    if preprocess_prompt:
        wave = remove_silence(wave, model.sample_rate, mid_sil=200, lead_sil=100, trail_sil=200)
    hop = model.audio_tokenizer.hop_length
    wave = wave[:, :wave.shape[-1] // hop * hop]
    if wave.shape[-1] == 0:
        raise SilentClip("the reference clip is silent or shorter than a frame (try preprocess_prompt=False)")
    codes = encode(model, wave[0], model.sample_rate)
    return dict(codes=codes, text=add_punctuation(ref_text) if preprocess_prompt else ref_text, rms=level)


def generation_voice(model: OmniVoice, codes, text: str, preprocess_prompt: bool = True) -> dict:
    """The codes a generation made without a reference and the text they say -> a voice (voice_prompt's
    dict): the codes themselves (not their audio encoded again), the text punctuated as voice_prompt
    punctuates a transcript, and rms measured as voice_prompt measures a clip, on those codes decoded."""
    codes = torch.as_tensor(codes).long().cpu()
    level = rms(decode(model, codes)[None])  # the whole wave, silences included
    return dict(codes=codes, text=add_punctuation(text) if preprocess_prompt else text, rms=level)


def voice_of(model: OmniVoice, text: str, tokens, speed=None, duration=None, **config) -> dict:
    """generate()'s one text, made without a reference, and its tokens (return_tokens) -> the voice of that
    generation: all its codes and its text if it was made in one piece, else its first chunk's (the
    reference upstream gives the other chunks, so the voice of the whole). speed, duration, **config: the
    generation's own (they set where a long text is cut)."""
    gen = generation_config(config)
    if isinstance(tokens, Tensor):
        return generation_voice(model, tokens, text, gen["preprocess_prompt"])
    [item] = plan(model, [text], None, None, None, None, None, speed, duration, gen)
    return generation_voice(model, tokens[0], chunk_texts(model, item, gen)[0], gen["preprocess_prompt"])


def save_voice(path, voice: dict):
    """A voice -> one safetensors file (codes; transcript, level and model kind in its metadata)."""
    from safetensors.torch import save_file
    meta = dict(model="omnivoice", format="1", text=voice["text"], rms=repr(float(voice["rms"])))
    common.write_atomic(path, lambda tmp: save_file({"codes": voice["codes"].cpu().contiguous()}, tmp, meta))


def load_voice(path, model: OmniVoice = None) -> dict:
    """A voice saved by save_voice, or upstream's VoiceClonePrompt.save() .pt file -> the voice dict."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"voice file {path} not found")
    try:
        if path.suffix == ".pt":
            data = torch.load(path, map_location="cpu", weights_only=True)
            voice = dict(codes=data["ref_audio_tokens"], text=data["ref_text"], rms=float(data["ref_rms"]))
        else:
            from safetensors import safe_open
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("model") != "omnivoice":
                    raise UserError(f"{path} is not an OmniVoice voice (model: {meta.get('model')!r})")
                voice = dict(codes=f.get_tensor("codes"), text=meta["text"], rms=float(meta["rms"]))
    except UserError:
        raise
    except Exception as e:
        raise common.unreadable(path, e) from None
    check_voice(voice, model)
    return voice


def check_voice(voice, model: OmniVoice = None):
    if not isinstance(voice, dict) or not {"codes", "text", "rms"} <= voice.keys():
        raise UserError("voice must be a dict(codes=, text=, rms=) as voice_prompt returns")
    codes = torch.as_tensor(voice["codes"])
    if codes.ndim != 2 or codes.shape[1] == 0 or codes.is_floating_point():
        raise UserError(f"voice codes must be integers of shape (codebooks, frames), got {list(codes.shape)}")
    if model is not None:
        C, size = model.config["num_codebooks"], model.audio_tokenizer.codebook_size
        if codes.shape[0] != C or codes.min() < 0 or codes.max() >= size:
            raise UserError(f"voice codes {list(codes.shape)} in {codes.min()}..{codes.max()} do not fit this"
                            f" model ({C} codebooks of {size})")


# ----------------------------------------------------------------------------- requests
# what one request may ask, the server's and the CLI's limits
MAX_STEPS = 64  # num_step (32 by default): a step re-reads the whole sequence
SPEEDS = (0.25, 4.0)  # speed: OpenAI's range
MAX_DURATION = 300  # seconds of audio `duration` may ask for


def check_limits(num_step=None, guidance_scale=None, speed=None, duration=None):
    """A request's numbers (their types are the caller's to check) within the limits: one message for the
    CLI and the server."""
    if num_step is not None and not 1 <= num_step <= MAX_STEPS:
        raise UserError(f"num_step must be 1 to {MAX_STEPS}, got {num_step}")
    if guidance_scale is not None and not guidance_scale >= 0:
        raise UserError(f"guidance_scale must be >= 0, got {guidance_scale:g}")
    if speed is not None and not SPEEDS[0] <= speed <= SPEEDS[1]:
        raise UserError(f"speed must be {SPEEDS[0]} to {SPEEDS[1]}, got {speed:g}")
    if duration is not None and not 0 < duration <= MAX_DURATION:
        raise UserError(f"duration must be more than 0 and at most {MAX_DURATION} seconds, got {duration:g}")


def per_item(name: str, value, n: int) -> list:
    """A value for every text, or a list with one value per text (or one for all)."""
    many = isinstance(value, list) or isinstance(value, tuple) and name != "ref_audio"  # (wave, rate) is one
    values = list(value) if many else [value]
    if len(values) not in (1, n):
        raise UserError(f"{name}: {len(values)} values for {n} texts (give one, or one per text)")
    return list(values) * n if len(values) == 1 else list(values)


def check_number(name: str, value, low=0.0):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= low):
        raise UserError(f"{name} must be a number > {low:g}, got {value!r}")


def plan(model: OmniVoice, texts: list, language, ref_audio, ref_text, voice, instruct, speed, duration,
         gen: dict) -> list:
    """generate()'s arguments -> one item per text: text, language, instruct, reference (codes, text, level),
    target length in frames, speed (upstream's _preprocess_all)."""
    n = len(texts)
    if any(not isinstance(text, str) or not text.strip() for text in texts):
        raise UserError("text is empty: give the words to speak")
    for text in texts:  # the non-verbal tags are text (tokenized alone), the tokenizer's own tokens are not
        common.check_plain_text(model.tokenizer, text, "text", NONVERBAL_TAGS)
    columns = [per_item(name, value, n) for name, value in
               (("language", language), ("instruct", instruct), ("speed", speed), ("duration", duration))]
    for s, d in zip(columns[2], columns[3]):  # before any clip is encoded
        check_number("speed", s)
        check_number("duration", d)
    if voice is not None and ref_audio is not None:
        raise UserError("give voice or ref_audio, not both")
    if ref_text is not None and ref_audio is None:
        raise UserError("ref_text is given without ref_audio")
    voices = per_item("voice", voice, n)
    if ref_audio is not None:
        clips, transcripts = per_item("ref_audio", ref_audio, n), per_item("ref_text", ref_text, n)
        made = [voice_prompt(model, a, t, gen["preprocess_prompt"]) for a, t in zip(clips, transcripts)]
        voices = made * n if len(made) == 1 else made
    for v in voices:  # a generation's voice says its tags, as upstream's chunk references do
        if v is not None:
            check_voice(v, model)
            common.check_plain_text(model.tokenizer, v["text"], "the voice's transcript (ref_text)",
                                    NONVERBAL_TAGS)
    items = []
    for text, v, lang, inst, s, d in zip(texts, voices, *columns):
        codes = None if v is None else torch.as_tensor(v["codes"]).long()
        item = dict(text=text, language=resolve_language(lang), ref_codes=codes,
                    ref_text=None if v is None else v["text"], ref_rms=None if v is None else float(v["rms"]),
                    instruct=None if inst is None else resolve_instruct(inst, use_zh=has_cjk(text)))
        ref_frames = None if codes is None else codes.shape[1]
        speed_for_estimate = 1.0 if d is not None else s or 1.0
        estimate = estimate_target_tokens(text, item["ref_text"], ref_frames, speed_for_estimate)
        if d is not None:  # a duration sets the length; speed becomes what the estimate implies (for chunks)
            item["target_len"] = max(1, int(d * model.frame_rate))
            item["speed"] = estimate / item["target_len"]
        else:
            item["target_len"], item["speed"] = estimate, s or 1.0
        limit = model.config["max_seq_len"]
        if item["target_len"] > limit:
            seconds = item["target_len"] / model.frame_rate
            raise UserError(f"{item['target_len']} frames ({seconds:.0f} s) is too long for the model"
                            f" ({limit} positions)")
        items.append(item)
    return items


# ----------------------------------------------------------------------------- unmasking
def time_steps(t_start: float, t_end: float, num_step: int, t_shift: float) -> torch.Tensor:
    """The num_step + 1 unmasking times, float32: linspace, then shifted t -> s*t / (1 + (s-1)*t)."""
    # torch's CPU linspace fills its second half backwards from t_end (end - step*(n-1-i)): keep torch's
    ts = torch.linspace(t_start, t_end, num_step + 1, dtype=torch.float32, device="cpu")
    return t_shift * ts / (1 + (t_shift - 1) * ts)


def count_schedule(total: int, ts) -> list[int]:
    """How many of the total masked positions each step reveals: ceil(total * dt) (in float64 on the float32
    times), the last step whatever is left."""
    ts = [float(t) for t in ts]
    counts, left = [], total
    for step in range(len(ts) - 1):
        n = left if step == len(ts) - 2 else min(math.ceil(total * (ts[step + 1] - ts[step])), left)
        counts.append(n)
        left -= n
    return counts


def item_ids(model: OmniVoice, item: dict, denoise: bool) -> Tensor:
    """One request's conditional sequence (C, L): style, text, reference codes, then the masked target."""
    C, has_ref = model.config["num_codebooks"], item["ref_codes"] is not None
    style = tokenize(model.tokenizer, style_prefix(denoise, has_ref, item["language"], item["instruct"]))
    text = f"<|text_start|>{combine_text(item['ref_text'], item['text'])}<|text_end|>"
    words = tokenize_with_nonverbal_tags(model.tokenizer, text)
    parts = [torch.tensor(style + words).expand(C, -1)]
    if has_ref:
        parts.append(item["ref_codes"])
    parts.append(torch.full((C, item["target_len"]), model.config["audio_mask_id"]))
    return torch.cat(parts, 1)


def batch_rows(model: OmniVoice, items: list, denoise: bool, seqs: list = None) -> dict:
    """B requests -> 2B rows (upstream's _generate_iterative): row i is request i's whole sequence, row B+i
    only its target (the unconditional input), each right-padded with the mask id -> dict(ids (2B, C, L),
    audio_mask (2B, L), mask (2B, 1, L, L), positions None (0..L-1), cond / uncond: each request's (row,
    first target position)). seqs: the requests' sequences as they are now (default: item_ids')."""
    seqs = seqs or [item_ids(model, item, denoise) for item in items]
    B, C, mask_id = len(items), model.config["num_codebooks"], model.config["audio_mask_id"]
    L = max(s.shape[1] for s in seqs)
    rows = dict(ids=torch.full((2 * B, C, L), mask_id), audio_mask=torch.zeros(2 * B, L, dtype=torch.bool),
                mask=torch.zeros(2 * B, 1, L, L, dtype=torch.bool), positions=None, cond=[], uncond=[])
    for i, (seq, item) in enumerate(zip(seqs, items)):
        c_len, T = seq.shape[1], item["target_len"]
        rows["ids"][i, :, :c_len], rows["ids"][B + i, :, :T] = seq, seq[:, -T:]
        rows["audio_mask"][i, audio_start(item, c_len):c_len], rows["audio_mask"][B + i, :T] = True, True
        rows["mask"][i, :, :c_len, :c_len] = rows["mask"][B + i, :, :T, :T] = True
        pad = torch.arange(T, L)
        rows["mask"][B + i, :, pad, pad] = True  # an unconditional pad position sees itself
        rows["cond"].append((i, c_len - T))
        rows["uncond"].append((B + i, 0))
    return rows


def packed_rows(model: OmniVoice, items: list, denoise: bool, seqs: list = None, bucket: int = 1) -> dict:
    """B requests -> B rows, each [its whole sequence | its target again], the two blocks attending only
    within themselves and each with positions from 0: batch_rows' values, up to rounding (the unconditional
    part no longer pays for the prompt's length, nor the rows for the longest request's). One masked
    attention call a layer for the whole batch: the layout for GPUs and the compiled forward, whose rows are
    padded to a multiple of `bucket` positions (see row_layout)."""
    seqs = seqs or [item_ids(model, item, denoise) for item in items]
    B, C, mask_id = len(items), model.config["num_codebooks"], model.config["audio_mask_id"]
    L = max(s.shape[1] + item["target_len"] for s, item in zip(seqs, items))
    L = -(-L // bucket) * bucket
    rows = dict(ids=torch.full((B, C, L), mask_id), audio_mask=torch.zeros(B, L, dtype=torch.bool),
                mask=torch.zeros(B, 1, L, L, dtype=torch.bool), positions=torch.zeros(B, L, dtype=torch.long),
                cond=[], uncond=[])
    for i, (seq, item) in enumerate(zip(seqs, items)):
        c_len, T = seq.shape[1], item["target_len"]
        rows["ids"][i, :, :c_len], rows["ids"][i, :, c_len:c_len + T] = seq, seq[:, -T:]
        rows["audio_mask"][i, audio_start(item, c_len):c_len + T] = True
        rows["mask"][i, :, :c_len, :c_len] = rows["mask"][i, :, c_len:c_len + T, c_len:c_len + T] = True
        pad = torch.arange(c_len + T, L)
        rows["mask"][i, :, pad, pad] = True
        rows["positions"][i, :c_len + T] = torch.cat([torch.arange(c_len), torch.arange(T)])
        rows["cond"].append((i, c_len - T))
        rows["uncond"].append((i, c_len))
    return rows


def flat_row(model: OmniVoice, items: list, denoise: bool, seqs: list = None) -> dict:
    """B requests -> ONE row: each request's whole sequence, then its target again, back to back with no
    padding, each sequence with positions from 0 and attending only to itself: mask = their (start, end)
    spans, (n, 2) int64, attended one by one (span_attention). Its length and span count are marked dynamic,
    so that a compiled forward takes every flat row in one graph."""
    seqs = seqs or [item_ids(model, item, denoise) for item in items]
    ids, audio_mask, positions, rows = [], [], [], dict(mask=[], cond=[], uncond=[])
    start = 0
    for seq, item in zip(seqs, items):
        c_len, T = seq.shape[1], item["target_len"]
        ids += [seq, seq[:, -T:]]
        audio_mask += [torch.arange(c_len) >= audio_start(item, c_len), torch.ones(T, dtype=torch.bool)]
        positions += [torch.arange(c_len), torch.arange(T)]
        rows["mask"] += [[start, start + c_len], [start + c_len, start + c_len + T]]
        rows["cond"].append((0, start + c_len - T))
        rows["uncond"].append((0, start + c_len))
        start += c_len + T
    rows = dict(rows, ids=torch.cat(ids, 1)[None], audio_mask=torch.cat(audio_mask)[None],
                positions=torch.cat(positions)[None], mask=torch.tensor(rows["mask"]))
    for name, dim in (("ids", 2), ("audio_mask", 1), ("positions", 1), ("mask", 0)):
        torch._dynamo.maybe_mark_dynamic(rows[name], dim)
    return rows


def audio_start(item: dict, c_len: int) -> int:
    """The first audio position of a conditional sequence: the reference's, else the target's."""
    return c_len - item["target_len"] - (0 if item["ref_codes"] is None else item["ref_codes"].shape[1])


def gumbel(logits: Tensor, temperature: float, generator) -> Tensor:
    """logits / temperature + Gumbel noise, the uniforms drawn on the CPU from `generator` as upstream's
    torch.rand_like draws them from the global one."""
    u = torch.rand(logits.shape, generator=generator).to(logits.device)
    return logits / temperature - torch.log(-torch.log(u + 1e-10) + 1e-10)


def predict(c_logits: Tensor, u_logits: Tensor, gen: dict, mask_id: int, generator) -> tuple:
    """Guided log-probs -> (tokens, confidence) per position (upstream's _predict_tokens_with_scoring)."""
    s = gen["guidance_scale"]
    if s != 0:
        c, u = F.log_softmax(c_logits, -1), F.log_softmax(u_logits, -1)
        log_probs = F.log_softmax(c + s * (c - u), -1)
    else:
        log_probs = F.log_softmax(c_logits, -1)
    log_probs[..., mask_id] = -math.inf  # after the renormalisation, as upstream: not renormalised again
    if gen["class_temperature"] > 0:
        k = math.ceil(0.1 * log_probs.shape[-1])
        top, where = log_probs.topk(k, -1)
        kept = torch.full_like(log_probs, -math.inf).scatter_(-1, where, top)
        tokens = gumbel(kept, gen["class_temperature"], generator).argmax(-1)
    else:
        tokens = log_probs.argmax(-1)
    return tokens, log_probs.max(-1).values  # the max log-prob, not the drawn token's: upstream's confidence


def reveal(tokens: Tensor, pred: Tensor, conf: Tensor, k: int, gen: dict, mask_id: int, generator):
    """Write the k most confident still-masked predictions into tokens (C, T), in place."""
    layers = torch.arange(conf.shape[1], device=conf.device).view(1, -1, 1)
    scores = conf - layers * gen["layer_penalty_factor"]  # earlier codebooks first
    if gen["position_temperature"] > 0:
        scores = gumbel(scores, gen["position_temperature"], generator)
    scores = scores.masked_fill(tokens[None] != mask_id, -math.inf)
    chosen = torch.topk(scores.flatten(), k).indices
    flat = tokens.view(-1)
    flat[chosen] = pred.flatten()[chosen]


def row_layout(packed: bool, model: OmniVoice):
    """generate()'s `packed` -> the function that lays the batch out in rows. False (the default): upstream's
    rows, bit for bit upstream's hidden states on CPU fp32. True: packed guidance, on CPU the flat row (each
    sequence attended alone), elsewhere a row per request (packed_rows: one masked attention call a layer);
    both round otherwise than upstream's rows (~1e-6: every golden's codes and audio unchanged, but a rare
    near-tie could draw another code, so it is not the default). A compiled forward always runs packed
    guidance: on CPU the flat row, elsewhere packed_rows, LENGTH_BUCKET at a time (static shapes)."""
    cpu = model.audio_heads.weight.device.type == "cpu"
    if model.compiled_hidden is not None:
        return flat_row if cpu else functools.partial(packed_rows, bucket=LENGTH_BUCKET)
    if not packed:
        return batch_rows
    return flat_row if cpu else packed_rows


class Unmasking(common.Job):
    """One text's unmasking (a text of generate()'s batch, a sentence of a Speech): its item (plan's), its
    options (generation_config's), its random stream, its codes so far and its step. Made in the caller's
    thread, stepped by a Scheduler's; codes() waits for the end."""

    def __init__(self, model: OmniVoice, item: dict, gen: dict, generator):
        super().__init__()
        C, T = model.config["num_codebooks"], item["target_len"]
        self.item, self.gen, self.generator = item, gen, generator
        self.seq = item_ids(model, item, gen["denoise"])  # style, text, reference, the masked target
        ts = time_steps(0.0, 1.0, gen["num_step"], gen["t_shift"]).tolist()
        self.schedule = count_schedule(T * C, ts)  # codes revealed at each of its steps
        self.tokens = torch.full((C, T), model.config["audio_mask_id"])  # moved to the device when admitted
        self.step = 0

    def codes(self) -> Tensor:
        """(C, T) int64 on the CPU, once every step has run (waits while an engine thread works)."""
        with self.changed:
            self.changed.wait_for(lambda: self.done)
        if self.error:
            raise self.error
        return self.tokens.cpu()


class Scheduler:
    """Texts unmasked together, run synchronously: submit() them, then step() until none is busy (nano-vllm's
    shape). step(): admit waiting texts (up to max_batch), run ONE forward over every active text's rows,
    let each reveal its own step's codes with its own options and random stream, retire those that ran all
    their steps. Each step reads the whole sequence again (nothing is cached), so a text joins at any step
    and leaves after its own num_step, and what it gets does not depend on what else runs (but for the
    rounding of a batched forward: none on the goldens). Texts that share one generator draw from it in
    batch order, as upstream's batch draws from its global one."""

    def __init__(self, model: OmniVoice, max_batch: int = 8, packed: bool = False):
        self.model, self.slots, self.packed = model, max_batch, packed
        # (ids, audio_mask, mask, positions) -> hidden states
        self.forward = model.compiled_hidden or model.hidden
        self.device, self.mask_id = model.audio_heads.weight.device, model.config["audio_mask_id"]
        self.active, self.waiting, self.rows, self.closed = [], collections.deque(), None, False
        self.lock = threading.Lock()  # `waiting` is shared with the threads that submit (common.EngineThread)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    @property
    def running(self) -> int:
        return len(self.active)

    def submit(self, job: Unmasking, new_request: bool = True) -> Unmasking:
        """Queue a text (new_request: common.EngineThread's room check; a Speech submits to either)."""
        if self.closed:
            raise common.EngineClosed("the engine was closed")
        with self.lock:
            common.queue_job(self.waiting, job)
        return job

    def wait(self, job: Unmasking) -> Tensor:
        """Step until `job` is done -> its codes."""
        while not job.done:
            self.step()
        return job.codes()

    @torch.inference_mode()
    def step(self):
        gone = [job for job in self.active if job.cancelled]
        self.active = [job for job in self.active if not job.cancelled]
        for job in gone:
            job.finish()
        if self.admit() or gone:
            self.rows = None
        if not self.active:
            return
        if self.rows is None:
            self.rows = self.build_rows()
        rows, model = self.rows, self.model
        # the flat row (packed guidance) does not round as upstream's rows anyway: its linears may take
        # another matmul (cpu_fast.tune's); upstream's rows keep F.linear, upstream's bits
        flat = rows["mask"].dtype != torch.bool
        with common.loose_matmuls() if flat else contextlib.nullcontext():
            hidden = self.forward(rows["ids"], rows["audio_mask"], rows["mask"], rows["positions"])
            for job, (c_row, c_at), (u_row, u_at) in zip(self.active, rows["cond"], rows["uncond"]):
                k, T = job.schedule[job.step], job.item["target_len"]
                job.step += 1
                if k <= 0:
                    continue
                cond = model.heads(hidden[c_row, c_at:c_at + T]).transpose(0, 1)[None]  # (1, C, T, V)
                uncond = model.heads(hidden[u_row, u_at:u_at + T]).transpose(0, 1)[None]
                pred, conf = predict(cond, uncond, job.gen, self.mask_id, job.generator)
                reveal(job.tokens, pred, conf, k, job.gen, self.mask_id, job.generator)
                rows["ids"][c_row, :, c_at:c_at + T] = rows["ids"][u_row, :, u_at:u_at + T] = job.tokens
        done = [job for job in self.active if job.step == len(job.schedule)]
        if done:
            self.active, self.rows = [job for job in self.active if job not in done], None
            for job in done:
                job.finish()

    def admit(self) -> bool:
        """Waiting texts into the batch while it has room -> whether any joined."""
        joined = False
        while len(self.active) < self.slots:
            job = common.next_job(self.waiting, self.lock)
            if job is None:
                break
            job.tokens = job.tokens.to(self.device)
            self.active.append(job)
            joined = True
        return joined

    def build_rows(self) -> dict:
        """The active texts' rows, each sequence with its codes so far (rebuilt when the batch changes)."""
        seqs = []
        for job in self.active:
            seq = job.seq.clone()
            seq[:, seq.shape[1] - job.item["target_len"]:] = job.tokens.cpu()
            seqs.append(seq)
        rows = row_layout(self.packed, self.model)(self.model, [job.item for job in self.active], None, seqs)
        return {key: value.to(self.device) if isinstance(value, Tensor) else value
                for key, value in rows.items()}

    def close(self):
        self.closed = True
        with self.lock:
            jobs, self.waiting = [*self.active, *self.waiting], collections.deque()
        self.active, self.rows = [], None
        for job in jobs:
            if not job.done:
                job.finish(common.EngineClosed("the engine was closed"))

    def fail(self, error: Exception):
        """End the texts in flight (a step failed): the waiting ones run next."""
        jobs, self.active, self.rows = self.active, [], None
        for job in jobs:
            job.finish(error)


def unmask(model: OmniVoice, items: list, gen: dict, generator, progress=False, packed=False) -> list:
    """num_step passes over the batch, each revealing its scheduled count of codes per request -> (C, T_i)
    codes per item. generator: one for all (upstream's draws: per request in batch order, the class draw,
    then the position) or a list, one per item. packed: see row_layout."""
    generators = generator if isinstance(generator, list) else [generator] * len(items)
    scheduler = Scheduler(model, max_batch=len(items), packed=packed)
    jobs = [scheduler.submit(Unmasking(model, item, gen, g)) for item, g in zip(items, generators)]
    for _ in tqdm(range(gen["num_step"]), desc=f"unmasking {len(items)} text(s)", disable=not progress,
                  leave=False):
        scheduler.step()
    return [job.codes() for job in jobs]


# ----------------------------------------------------------------------------- generation
def encode(model: OmniVoice, wave, sample_rate: int) -> Tensor:
    """A mono wave (N,) at any rate -> codes (C, T) int64 (no level change, no trimming: see voice_prompt)."""
    wave = wave.float() if isinstance(wave, Tensor) else torch.from_numpy(np.asarray(wave, dtype=np.float32))
    if wave.ndim != 1 or wave.numel() == 0:
        raise UserError(f"encode takes a non-empty mono wave (N,), got shape {list(wave.shape)}")
    if sample_rate != model.sample_rate:
        wave = omnivoice_codec.resample(wave, sample_rate, model.sample_rate)
    tok = model.audio_tokenizer
    with torch.inference_mode():
        return tok.encode(wave[None, None])[0].cpu()  # the tokenizer moves it to its device


def decode(model: OmniVoice, codes) -> np.ndarray:
    """Codes (C, T) -> a 1-D float32 wave at model.sample_rate (upstream's decoder output, unclipped)."""
    codes = torch.as_tensor(codes)
    tok, C = model.audio_tokenizer, model.config["num_codebooks"]
    if codes.ndim != 2 or codes.shape[0] != C or codes.shape[1] == 0 or codes.is_floating_point():
        raise UserError(f"codes must be integers of shape ({C}, T), got {list(codes.shape)}")
    if codes.min() < 0 or codes.max() >= tok.codebook_size:
        raise UserError(f"codes must lie in 0..{tok.codebook_size - 1}: {codes.min()}..{codes.max()}")
    with torch.inference_mode():
        return tok.decode(codes[None])[0, 0].cpu().numpy()


def chunk_chars(model: OmniVoice, item: dict, gen: dict) -> int:
    """Characters of the item's text that make audio_chunk_duration of audio (upstream's chunk length)."""
    frames_per_char = item["target_len"] / len(item["text"])
    return int(gen["audio_chunk_duration"] * model.frame_rate / frames_per_char)


def chunk_texts(model: OmniVoice, item: dict, gen: dict) -> list:
    """A long text's chunks: cut at punctuation into audio_chunk_duration's characters, a long run without
    it cut too (cut_runs)."""
    n = chunk_chars(model, item, gen)
    return cut_runs(chunk_text_punctuation(item["text"], n, min_chunk_len=3), n)


def chunk_item(item: dict, text: str, ref, ref_text) -> dict:
    """A long text's chunk as an item of its own: its text, its reference and its length estimated again."""
    ref_len = None if ref is None else ref.shape[1]
    return dict(item, text=text, ref_codes=ref, ref_text=ref_text,
                target_len=estimate_target_tokens(text, ref_text, ref_len, item["speed"]))


def chunked(model: OmniVoice, items: list, gen: dict, generator, progress=False, packed=False) -> list:
    """Long texts, split at punctuation into chunks of audio_chunk_duration (a long run without it cut too:
    cut_runs), each chunk generated with the request's reference (or, with none, with chunk 0's own codes
    and text) -> a list of chunk codes per item. Chunk i of every request runs in one batch (upstream's
    _generate_chunked)."""
    has_ref = [item["ref_codes"] is not None for item in items]
    if any(has_ref) and not all(has_ref):  # upstream asserts
        raise UserError("long texts with and without a reference cannot be generated in one batch")
    pieces = [chunk_texts(model, item, gen) for item in items]
    results = [[] for _ in items]

    def run(indices, texts, refs, ref_texts):
        batch = [chunk_item(items[i], text, ref, ref_text)
                 for i, text, ref, ref_text in zip(indices, texts, refs, ref_texts)]
        for i, codes in zip(indices, unmask(model, batch, gen, generator, progress, packed)):
            results[i].append(codes)

    for n in range(max(len(p) for p in pieces)):
        indices = [i for i, p in enumerate(pieces) if n < len(p)]
        if all(has_ref):
            run(indices, [pieces[i][n] for i in indices], [items[i]["ref_codes"] for i in indices],
                [items[i]["ref_text"] for i in indices])
        elif n == 0:
            run(indices, [pieces[i][0] for i in indices], [None] * len(indices), [None] * len(indices))
        else:
            run(indices, [pieces[i][n] for i in indices], [results[i][0] for i in indices],
                [pieces[i][0] for i in indices])
    return results


def finish(model: OmniVoice, tokens, ref_rms, gen: dict) -> np.ndarray:
    """Codes (or a long text's chunks, cross-faded) -> the output wave: silences trimmed, level back to the
    reference's (or peak 0.5 without one), faded and padded (upstream's _decode_and_post_process)."""
    sr = model.sample_rate
    if isinstance(tokens, list):
        wave = cross_fade_chunks([decode(model, t)[None] for t in tokens], sr)
    else:
        wave = decode(model, tokens)[None]
    wave = post_process(wave, sr, ref_rms, gen)
    return fade_and_pad(wave, gen["pad_duration"], gen["fade_duration"], sr)[0]


def post_process(wave: np.ndarray, sample_rate: int, ref_rms, gen: dict) -> np.ndarray:
    """(1, N) decoded audio -> silences trimmed (postprocess_output), the level of the reference (or peak
    0.5 without one): what finish does before the fades and pads."""
    if gen["postprocess_output"]:
        wave = remove_silence(wave, sample_rate, mid_sil=500, lead_sil=100, trail_sil=100)
    return output_gain(wave, ref_rms)


class CrossFade:
    """cross_fade_chunks, then fade_and_pad, computed as the chunks come: push(chunk) -> the samples that
    are final now, end() -> the rest; joined, they are fade_and_pad(cross_fade_chunks(chunks)) exactly (the
    same products in the same order). What waits: the last max(fade, third of the silence) samples (the
    next chunk fades them out, or the end does), and everything while the audio is shorter than two fades
    (fade_and_pad's fade is shorter for such audio)."""

    def __init__(self, sample_rate: int, pad_duration: float, fade_duration: float, silence_duration=0.3):
        self.sample_rate, self.pad_duration, self.fade_duration = sample_rate, pad_duration, fade_duration
        self.gap = int(silence_duration * sample_rate) // 3  # cross_fade_chunks' fades and its silence
        self.fade, self.pad = int(fade_duration * sample_rate), int(pad_duration * sample_rate)
        self.fade_in = np.linspace(0, 1, self.fade, dtype=np.float32)
        self.held = np.zeros(0, np.float32)  # the merged audio not sent yet
        self.sent, self.chunks = 0, 0  # samples of the merged audio sent, chunks pushed

    def push(self, chunk: np.ndarray) -> np.ndarray:
        chunk = np.array(chunk, dtype=np.float32).reshape(-1)  # a copy: the fades work in place
        if self.chunks:
            out_n, in_n = min(self.gap, self.sent + len(self.held)), min(self.gap, len(chunk))
            if out_n > 0:  # those samples are held: fewer than gap are sent only while none is
                self.held[-out_n:] *= np.linspace(1, 0, out_n, dtype=np.float32)
            if in_n > 0:
                chunk[:in_n] *= np.linspace(0, 1, in_n, dtype=np.float32)
            chunk = np.concatenate([np.zeros(self.gap, np.float32), chunk])
        self.held, self.chunks = np.concatenate([self.held, chunk]), self.chunks + 1
        return self.release(len(self.held) - max(self.gap, self.fade))

    def release(self, n: int) -> np.ndarray:
        """The first n held samples, faded in where they are the audio's first `fade`, with the leading pad
        before the first of them; nothing while the whole is shorter than two fades."""
        total = self.sent + len(self.held)
        if n <= 0 or total < 2 * self.fade:
            return np.zeros(0, np.float32)
        out, self.held = self.held[:n], self.held[n:]
        if self.sent < self.fade:
            k = min(self.fade - self.sent, n)
            out[:k] *= self.fade_in[self.sent:self.sent + k]
        pad = np.zeros(self.pad if not self.sent else 0, np.float32)
        self.sent += n
        return np.concatenate([pad, out])

    def end(self) -> np.ndarray:
        if not self.sent:  # short audio (or none): fade_and_pad's own arithmetic on the whole
            return fade_and_pad(self.held[None], self.pad_duration, self.fade_duration, self.sample_rate)[0]
        held = self.release(len(self.held) - self.fade)  # the fade-in, if it reaches so far
        tail = self.held
        if self.fade > 0:
            tail[-self.fade:] *= np.linspace(1, 0, self.fade, dtype=np.float32)
        return np.concatenate([held, tail, np.zeros(self.pad, np.float32)])


def generation_config(config: dict) -> dict:
    unknown = sorted(set(config) - set(GENERATION))
    if unknown:
        raise UserError(f"unknown generation option {unknown[0]!r}: use {', '.join(GENERATION)}")
    gen = dict(GENERATION, **config)
    if isinstance(gen["num_step"], bool) or not isinstance(gen["num_step"], int) or gen["num_step"] < 1:
        raise UserError(f"num_step must be an integer >= 1, got {gen['num_step']!r}")
    for name in ("guidance_scale", "t_shift", "layer_penalty_factor", "position_temperature",
                 "class_temperature", "audio_chunk_duration", "audio_chunk_threshold", "pad_duration",
                 "fade_duration"):
        value = gen[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{name} must be a number, got {value!r}")
        positive = name in ("t_shift", "audio_chunk_duration")
        if value < 0 or (value == 0 and positive):
            raise UserError(f"{name} must be {'>' if positive else '>='} 0, got {value!r}")
    return gen


def generate(model: OmniVoice, text, language=None, ref_audio=None, ref_text=None, voice=None, instruct=None,
             speed=None, duration=None, seed=None, return_tokens=False, progress=False, packed=False,
             **config):
    """Text (or a list: a batch) -> a list of 1-D float32 waves at model.sample_rate (and the codes of each:
    (C, T), or a long text's list of chunk codes, with return_tokens=True).

    Clone with voice= (voice_prompt's dict) or ref_audio= + ref_text=; design with instruct=; neither: auto.
    seed=S gives what upstream gives right after torch.manual_seed(S), from a generator of its own; with no
    seed the draws come from torch's global generator, as upstream's do. packed: each request's conditional
    and unconditional sequences side by side, faster, not bit for bit (see row_layout); False: upstream's
    two rows. **config: GENERATION's names."""
    gen = generation_config(config)
    texts = [text] if isinstance(text, str) else list(text) if isinstance(text, (list, tuple)) else None
    if not texts:
        raise UserError("text is empty: give the words to speak (a string or a list of strings)")
    generator = torch.default_generator if seed is None else torch.Generator().manual_seed(int(seed))
    with torch.inference_mode():
        items = plan(model, texts, language, ref_audio, ref_text, voice, instruct, speed, duration, gen)
        threshold = int(gen["audio_chunk_threshold"] * model.frame_rate)
        short = [i for i, item in enumerate(items) if item["target_len"] <= threshold]
        long = [i for i, item in enumerate(items) if item["target_len"] > threshold]
        tokens = [None] * len(items)
        for indices, run in ((short, unmask), (long, chunked)):  # each list in one batch, short first
            if indices:
                for i, codes in zip(indices, run(model, [items[i] for i in indices], gen, generator, progress,
                                                 packed)):
                    tokens[i] = codes
        audios = [finish(model, t, item["ref_rms"], gen) for t, item in zip(tokens, items)]
    return (audios, tokens) if return_tokens else audios


class Speech:
    """One text spoken sentence by sentence on a Scheduler or an EngineThread (the server's streaming unit).
    Made in the caller's thread: every argument checked (generate()'s, one text), a clip encoded, the text
    split at sentence ends (split_sentences, upstream's chunk length for very long ones) and the first
    sentence submitted. Iterated: 1-D float32 pieces at model.sample_rate, each sentence's as soon as it is
    decoded (the next one is unmasked meanwhile), joined with upstream's cross-fade (CrossFade). Each
    sentence is generated as upstream generates a long text's chunk: with the request's voice, or without
    one, the later sentences with the first one's codes and text as their reference. A text of one sentence
    is generate()'s item itself: the same codes and audio. seed=None: one drawn from torch's global
    generator; each Speech draws from its own stream, so what it says does not depend on what else runs.
    max_frames, max_sentence_frames: the most its sentences may make together and each (a server's caps);
    more is a UserError, before any work."""

    def __init__(self, model: OmniVoice, engine: Scheduler, text: str, language=None, ref_audio=None,
                 ref_text=None, voice=None, instruct=None, speed=None, duration=None, seed=None,
                 max_frames=None, max_sentence_frames=None, **config):
        if not isinstance(text, str):
            raise UserError("text must be a string")
        self.model, self.engine, self.gen = model, engine, generation_config(config)
        with torch.inference_mode():
            [self.item] = plan(model, [text], language, ref_audio, ref_text, voice, instruct, speed, duration,
                               self.gen)
        self.texts = split_sentences(text, chunk_chars(model, self.item, self.gen)) or [text.strip()]
        if max_frames is not None or max_sentence_frames is not None:
            self.check_length(max_frames, max_sentence_frames)
        if seed is None:
            seed = int(torch.randint(2**62, ()))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UserError(f"seed must be an integer, got {seed!r:.40}")
        self.generator = torch.Generator().manual_seed(seed)
        self.done, self.cancelled, self.error = False, False, None
        self.input_tokens, self.tokens = 0, []  # positions read a step, and each sentence's codes so far
        self.job = self.submit(0, None, new_request=True)  # a full engine refuses it here

    def sentence(self, n: int, first_codes) -> dict:
        """Sentence n's item: upstream's chunk n of a long text (see `chunked`); one sentence: plan's item
        (its length estimated again from plan's speed may miss a frame)."""
        item = self.item
        if len(self.texts) == 1:
            return item
        ref, ref_text = (item["ref_codes"], item["ref_text"]) if item["ref_codes"] is not None else \
            (None, None) if n == 0 else (first_codes, self.texts[0])
        return chunk_item(item, self.texts[n], ref, ref_text)

    def check_length(self, max_frames=None, max_sentence_frames=None):
        """Every sentence's length is known before any is made (without a voice, a later sentence's
        reference is the first one's codes, as long as its estimate): their sum, not the whole text's
        estimate, is the work (a short sentence is lengthened, a short transcript of a long clip stretches
        every estimate), and the longest one the memory (a short text stretched by `duration` has nothing
        to cut at)."""
        first = torch.zeros(0, self.sentence(0, None)["target_len"])  # only its length is read
        frames = [self.sentence(n, first)["target_len"] for n in range(len(self.texts))]
        rate = self.model.frame_rate
        why = "" if self.item["ref_codes"] is None else \
            " (a reference transcript shorter than what its clip says stretches every sentence)"
        if max_frames is not None and sum(frames) > max_frames:
            raise UserError(f"this request would make {sum(frames) / rate:.0f} s of audio, at most"
                            f" {max_frames / rate:g} s are allowed: send less text, a higher speed or a"
                            " shorter duration" + why)
        if max_sentence_frames is not None and max(frames) > max_sentence_frames:
            raise UserError(f"a sentence of this request would last {max(frames) / rate:.0f} s, at most"
                            f" {max_sentence_frames / rate:g} s are allowed: send more text for this duration"
                            " or a higher speed" + why)

    def submit(self, n: int, first_codes, new_request=False) -> Unmasking:
        job = Unmasking(self.model, self.sentence(n, first_codes), self.gen, self.generator)
        self.input_tokens += job.seq.shape[1] - job.item["target_len"]
        return self.engine.submit(job, new_request)

    def __iter__(self):
        sr = self.model.sample_rate
        join = CrossFade(sr, self.gen["pad_duration"], self.gen["fade_duration"])
        try:
            for n in range(len(self.texts)):
                codes = self.engine.wait(self.job)
                if self.cancelled:
                    return
                self.tokens.append(codes)
                if n + 1 < len(self.texts):  # unmasked while this one is decoded and sent
                    self.job = self.submit(n + 1, self.tokens[0])
                wave = post_process(decode(self.model, codes)[None], sr, self.item["ref_rms"], self.gen)
                piece = join.push(wave[0])
                if piece.size:
                    yield piece
            piece = join.end()
            if piece.size:
                yield piece
        finally:
            self.done = True
            self.job.cancel()  # a no-op once it has finished

    def voice(self) -> dict:
        """The voice of this request, made without one, once its first sentence is made: that sentence's
        codes and text (the reference its other sentences were given), as generation_voice keeps them."""
        if self.item["ref_codes"] is not None:
            raise UserError("this request was given a voice: save that voice, not its copy")
        if not self.tokens:
            raise UserError("no sentence of this request was made: there is no voice to save")
        return generation_voice(self.model, self.tokens[0], self.texts[0], self.gen["preprocess_prompt"])

    def cancel(self):
        """Stop: the sentence being unmasked leaves the batch, nothing more is said."""
        self.cancelled = True
        self.job.cancel()

    def finish(self, error: Exception):
        """End it with an error (the engine died): the reader gets it."""
        self.error = error
        self.job.finish(error)


def stream(model: OmniVoice, text: str, packed=False, **kwargs):
    """Speak `text` (generate()'s arguments, one text) sentence by sentence, yielding 1-D float32 pieces at
    model.sample_rate as each sentence is decoded (Speech, on a Scheduler of its own)."""
    yield from Speech(model, Scheduler(model, max_batch=1, packed=packed), text, **kwargs)


# ----------------------------------------------------------------------------- demo
DEMO_DIMS = dict(CONFIG, vocab_size=1040, dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=32,
                 intermediate_size=96)  # the fixture's dims
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|denoise|>", "<|lang_start|>",
                  "<|lang_end|>", "<|instruct_start|>", "<|instruct_end|>", "<|text_start|>", "<|text_end|>"]


def demo_tokenizer():
    """Byte-level tokenizer (no merges) with the special tokens OmniVoice's prompt uses."""
    return common.byte_tokenizer(SPECIAL_TOKENS, use_regex=False)


def random_model(cfg: dict, tokenizer_cfg: dict, device="cpu", dtype=torch.float32, seed=0,
                 tokenizer=None) -> OmniVoice:
    """An OmniVoice of any dims with torch.rand weights (its own generator: the global RNG is untouched),
    unit variance / sqrt(fan in), norms near 1, so activations stay O(1) at any depth; a random audio
    tokenizer of tokenizer_cfg (fp32) and `tokenizer` (default: demo_tokenizer's bytes)."""
    with torch.device("meta"):  # no default init: slow at the real size, and it draws from the global RNG
        model = OmniVoice(cfg)
    model = model.to_empty(device="cpu")
    model.codebook_offsets = torch.arange(cfg["num_codebooks"]) * cfg["audio_vocab_size"]  # not a parameter
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = (torch.rand(p.shape, generator=generator) * 2 - 1) * math.sqrt(3)  # unit variance
            p.copy_(1 + 0.1 * u if name.endswith("norm.weight") else 0.5 * u if "embed" in name
                    else u / math.sqrt(p.shape[1]))
    model = model.to(device, dtype).requires_grad_(False).eval()
    model.tokenizer = tokenizer or demo_tokenizer()
    model.audio_tokenizer = omnivoice_codec.random_tokenizer(tokenizer_cfg).to(device)  # fp32
    return model


def demo_model(device="cpu", dtype=torch.float32) -> OmniVoice:
    """A tiny random OmniVoice and audio tokenizer, built in memory: its 'speech' is noise, it only runs the
    pipeline (what `python omnivoice.py` does without a checkpoint)."""
    return random_model(dict(DEMO_DIMS), omnivoice_codec.DEMO_CONFIG, device, dtype)


# ----------------------------------------------------------------------------- CLI
def voice_path(name: str, folder: Path) -> Path:
    """--voice NAME: a file, or NAME in the voices folder (the server's rule for names: common.voice_name)."""
    path = Path(name)
    if path.suffix in (".pt", ".safetensors") or path.is_file():
        return path
    return folder / f"{common.voice_name(name, '--voice')}{VOICE_SUFFIX}"


def new_voice_path(name: str, folder: Path, force: bool) -> Path:
    """--save-voice NAME -> its file; a name taken by a voice of either model is refused unless --force (the
    server answers 409)."""
    return folder / f"{common.new_voice(folder, name, force)}{VOICE_SUFFIX}"


def keep_voice(path: Path, name: str, voice: dict):
    """--save-voice: the voice written to its file (with --force, the old voice of that name goes first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in common.voice_files(path.parent, name):
        old.unlink()
    save_voice(path, voice)
    print(f"saved voice {name} -> {path} ({voice['codes'].shape[1]} frames: {voice['text'][:60]!r})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="OmniVoice text-to-speech: voice cloning, design, auto voices"
                                 " (its benchmark: `python bench.py omnivoice --help`)")
    ap.add_argument("--text", required=True, help="what to say ([laughter], [sigh]... are non-verbal tags)")
    ap.add_argument("--checkpoint", help=f"the k2-fsa/OmniVoice folder (default {DEFAULT_CHECKPOINT}; without"
                    " one: a tiny random demo model that makes noise)")
    ap.add_argument("--ref-audio", help="a clip of the voice to clone (any rate, any format soundfile reads)")
    ap.add_argument("--ref-text", help="what --ref-audio says (required with it: no speech recogniser)")
    ap.add_argument("--voice", help=f"a saved voice: NAME in --voices ({VOICE_SUFFIX}) or a .safetensors/.pt")
    ap.add_argument("--save-voice", metavar="NAME", help="save the --ref-audio clone prompt as voice NAME;"
                    " without a reference, the voice this run makes (designed or auto: its codes and text,"
                    " a long text's first chunk), so later runs with --voice NAME clone it")
    ap.add_argument("--voices", default="prompt", help="the voices folder (default prompt/)")
    ap.add_argument("--force", action="store_true", help="--save-voice may replace a voice of that name")
    ap.add_argument("--instruct", help="voice design: attributes such as 'female, low pitch, british accent'")
    ap.add_argument("--language", help="a language code (en, zh...) or name (English...); default: none")
    ap.add_argument("--speed", type=float, help="speaking rate factor (> 1 faster)")
    ap.add_argument("--duration", type=float, help="length of the audio in seconds (overrides --speed)")
    ap.add_argument("--num-step", type=int, default=GENERATION["num_step"], help="unmasking steps (32)")
    ap.add_argument("--guidance-scale", type=float, default=GENERATION["guidance_scale"], help="CFG (2.0)")
    ap.add_argument("--class-temperature", type=float, default=GENERATION["class_temperature"],
                    help="token sampling temperature (0: the most likely token)")
    ap.add_argument("--no-denoise", action="store_true", help="leave out the <|denoise|> token")
    ap.add_argument("--no-preprocess", action="store_true", help="keep the reference clip's silences")
    ap.add_argument("--no-postprocess", action="store_true", help="keep the output's silences")
    ap.add_argument("--seed", type=int, default=42, help="random seed (42)")
    ap.add_argument("--out", default="generate/omnivoice.wav", help="output wav; its codes beside it (.npy)")
    common.add_device_arg(ap)
    ap.add_argument("--dtype", choices=list(common.DTYPES), help="LM dtype (default bf16 on CUDA, else fp32;"
                    " bf16 on a CPU with AVX-512-BF16 or AMX is several times faster, see docs/omnivoice.md)")
    import quantize  # the CLI's choices
    ap.add_argument("--quant", choices=quantize.OMNIVOICE_SCHEMES, help="int8wo / int4wo: int8 / int4 weights"
                    " (CPU), half / a quarter of bf16's memory; w8a8: int8 weights and activations, int8"
                    " products (CPU: the fastest, a little less faithful, see docs/omnivoice.md)")
    ap.add_argument("--packed", action="store_true", help="packed guidance: faster, upstream's codes on every"
                    " golden but not its bits (see docs/omnivoice.md)")
    ap.add_argument("--compile", action="store_true", help="compile the LM's forward"
                    " (torch.compile: minutes the first time; on CPU one graph for every length, as fast as"
                    " --packed eager; on GPU one per bucket of lengths; see docs/omnivoice.md)")
    ap.add_argument("--no-tune", action="store_true", help="CPU: the plain model, without cpu_fast.tune's"
                    " faster matmuls for --packed (timed once per machine and kept beside the compile cache)")
    return ap.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = common.pick_device(args.device)
    dtype = common.pick_dtype(args.dtype, device)
    out = Path(args.out)
    if out.suffix != ".wav" or out.is_dir():
        raise UserError(f"--out {out}: give a .wav file path")
    if args.save_voice and args.voice:
        raise UserError("--save-voice saves a --ref-audio clip or the voice of a run without a reference, not"
                        " --voice (a saved voice already)")
    save_path = new_voice_path(args.save_voice, Path(args.voices), args.force) if args.save_voice else None
    check_limits(args.num_step, args.guidance_scale, args.speed, args.duration)  # the server's
    common.check_seed(args.seed)
    checkpoint = args.checkpoint or (DEFAULT_CHECKPOINT if Path(DEFAULT_CHECKPOINT).is_dir() else None)
    if checkpoint:
        model = load(checkpoint, device, dtype, args.quant)
    else:
        print("!" * 100 + f"\nNo checkpoint ({DEFAULT_CHECKPOINT} not found): DEMO on a tiny RANDOM model"
              " built in memory. The pipeline is real, the AUDIO IS NOISE.\n" + "!" * 100)
        import quantize
        model = quantize.quantize(demo_model(device, dtype), args.quant)
    if args.compile:
        compile_forward(model)
    if not args.no_tune:
        import cpu_fast  # this CPU's faster matmuls (the flat row's), timed once per machine
        cpu_fast.tune(model)
    voice = load_voice(voice_path(args.voice, Path(args.voices)), model) if args.voice else None
    gen = dict(num_step=args.num_step, guidance_scale=args.guidance_scale, denoise=not args.no_denoise,
               class_temperature=args.class_temperature, preprocess_prompt=not args.no_preprocess,
               postprocess_output=not args.no_postprocess)
    if args.ref_audio:
        try:
            voice = voice_prompt(model, args.ref_audio, args.ref_text, gen["preprocess_prompt"])
        except SilentClip:  # its hint is the library's keyword: the CLI's flag instead
            raise UserError(f"--ref-audio {args.ref_audio} is silent or shorter than a frame"
                            + (" once its silences are trimmed (keep them: --no-preprocess)"
                               if gen["preprocess_prompt"] else "")) from None
        if save_path:
            keep_voice(save_path, args.save_voice, voice)
    common.reset_peak_memory(device)
    start = time.perf_counter()
    [audio], [tokens] = generate(model, args.text, language=args.language, voice=voice,
                                 instruct=args.instruct, speed=args.speed, duration=args.duration,
                                 seed=args.seed, return_tokens=True, progress=True, packed=args.packed, **gen)
    wall = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    common.save_wav(out, audio, model.sample_rate)
    codes = torch.cat(tokens, 1) if isinstance(tokens, list) else tokens  # a long text's chunks, in a row
    common.save_npy(out.with_suffix(".npy"), codes)
    if save_path and voice is None:  # the voice this run made, to clone from now on
        keep_voice(save_path, args.save_voice, voice_of(model, args.text, tokens, args.speed, args.duration,
                                                        **gen))
    seconds = len(audio) / model.sample_rate
    print(f"{out} ({out.with_suffix('.npy').name}): {seconds:.2f} s of audio, {codes.shape[1]} frames,"
          f" wall {wall:.2f} s, RTF {wall / max(seconds, 1e-9):.3f}, peak memory"
          f" {common.peak_memory_gb(device):.2f} GB")


if __name__ == "__main__":
    common.cli(main)
