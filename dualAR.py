"""Fish Audio S2-Pro text-to-speech: the Dual-AR (RQ-Transformer) model and generation, one file.

The slow transformer (Qwen3-shaped) reads the conversation and emits one semantic token per audio
frame. The fast transformer then emits the other codebooks of that frame, one after another.
Everything is written to give upstream fish-speech's codes for upstream's seed on CPU fp32.

    python dualAR.py --text "Hello!" --prompt-audio voice.wav --prompt-text "what voice.wav says"
"""
import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

import codec
from codec import FeedForward, RMSNorm, apply_rope, rope_table  # the same upstream arithmetic as the LM

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
DEFAULT_CHECKPOINT = "./s2-pro"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SEMANTIC_TOKEN = re.compile(r"<\|semantic:\d+\|>")  # codebook-0 code k is token <|semantic:0|> + k


class UserError(ValueError):
    """Bad input: the CLI prints the message as one line and writes nothing."""


def unreadable(path, error: Exception) -> UserError:
    """One line for a file that exists but cannot be parsed."""
    lines = str(error).strip().splitlines()
    detail = f"no key {error}" if isinstance(error, KeyError) else lines[0] if lines else type(error).__name__
    return UserError(f"cannot read {path}: {detail}")


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


# ----------------------------------------------------------------------------- building blocks
class KVCache(nn.Module):
    def __init__(self, batch: int, seq_len: int, n_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, n_heads, seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: Tensor, k: Tensor, v: Tensor):
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
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
        self.kv_cache = None

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
        B, S, _ = x.shape
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.wqkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(B, S, self.n_head, self.head_dim)
        k = k.view(B, S, self.n_kv, self.head_dim)
        v = v.view(B, S, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(pos, k, v)
        # query head h uses kv head h // (n_head // n_kv), as upstream's repeat_interleave
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_head != self.n_kv)
        return self.wo(y.transpose(1, 2).reshape(B, S, q_dim))


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.attention = Attention(c)
        self.feed_forward = FeedForward(c["dim"], c["intermediate_size"])
        self.attention_norm = RMSNorm(c["dim"], c["norm_eps"])
        self.ffn_norm = RMSNorm(c["dim"], c["norm_eps"])

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask, pos)
        return h + self.feed_forward(self.ffn_norm(h))


# ----------------------------------------------------------------------------- model
class DualAR(nn.Module):
    """Slow transformer over frames + fast transformer over the codebooks of one frame.

    Parameter names are upstream's internal ones. `hf_name` maps them to the HF release's keys.
    """

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
        if cfg["fast_dim"] != cfg["dim"]:
            self.fast_project_in = nn.Linear(cfg["dim"], cfg["fast_dim"])
        self.fast_embeddings = nn.Embedding(cfg["codebook_size"], cfg["fast_dim"])
        self.fast_layers = nn.ModuleList(Block(fast) for _ in range(cfg["n_fast_layer"]))
        self.fast_norm = RMSNorm(cfg["fast_dim"], cfg["norm_eps"])
        self.fast_output = nn.Linear(cfg["fast_dim"], cfg["codebook_size"], bias=False)
        self.cache_len = 0

    def setup_caches(self, batch: int, seq_len: int):
        """Allocate the static KV caches and RoPE tables (once, reused while big enough)."""
        cfg, weight = self.config, self.embeddings.weight
        seq_len = min(-(-seq_len // 256) * 256, cfg["max_seq_len"])
        if self.cache_len >= seq_len and self.layers[0].attention.kv_cache.k_cache.size(0) == batch:
            return
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, seq_len, cfg["n_local_heads"], cfg["head_dim"],
                                               weight.dtype, weight.device)
        for layer in self.fast_layers:
            layer.attention.kv_cache = KVCache(batch, cfg["num_codebooks"], cfg["fast_n_local_heads"],
                                               cfg["fast_head_dim"], weight.dtype, weight.device)
        self.rope = rope_table(seq_len, cfg["head_dim"], cfg["rope_base"]).to(weight.device)
        self.fast_rope = rope_table(cfg["num_codebooks"], cfg["fast_head_dim"], cfg["rope_base"])
        self.fast_rope = self.fast_rope.to(weight.device)
        self.cache_len = seq_len

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens (B, 1 + num_codebooks, S): row 0 token ids, rows 1.. codes at semantic positions."""
        cfg = self.config
        offsets = torch.arange(cfg["num_codebooks"], device=tokens.device) * cfg["codebook_size"]
        codes = self.codebook_embeddings(tokens[:, 1:] + offsets[None, :, None]).sum(dim=1)
        ids = tokens[:, 0]
        semantic = ((ids >= cfg["semantic_begin_id"]) & (ids <= cfg["semantic_end_id"]))[..., None]
        x = self.embeddings(ids) + torch.where(semantic, codes, 0.0)
        if cfg["scale_codebook_embeddings"]:
            x = torch.where(semantic, x / math.sqrt(cfg["num_codebooks"] + 1), x)
        return x

    def forward_slow(self, tokens: Tensor, pos: Tensor):
        """Cached slow forward of positions `pos` -> (logits, fast-model input) of the last one."""
        x = self.embed(tokens)
        mask = pos[:, None] >= torch.arange(self.cache_len, device=pos.device)  # causal over the cache
        rope = self.rope[pos]
        for layer in self.layers:
            x = layer(x, rope, mask, pos)
        x = x[:, -1]
        h = self.norm(x)
        head = self.embeddings if self.config["tie_word_embeddings"] else self.output
        logits = F.linear(h, head.weight)
        hidden = h if self.config["norm_fastlayer_input"] else x
        if hasattr(self, "fast_project_in"):
            hidden = self.fast_project_in(hidden)
        return logits, hidden

    def forward_fast(self, x: Tensor, pos: Tensor) -> Tensor:
        """Cached fast forward of one codebook position: x (B, fast_dim) -> logits (B, codebook_size)."""
        x = x.view(x.size(0), 1, -1)
        mask = pos[:, None] >= torch.arange(self.config["num_codebooks"], device=pos.device)
        rope = self.fast_rope[pos]
        for layer in self.fast_layers:
            x = layer(x, rope, mask, pos)
        return self.fast_output(self.fast_norm(x))[:, -1]


def hf_name(name: str) -> str:
    """Our (upstream-internal) parameter name -> the key in the HF safetensors release."""
    if name.startswith("codebook_embeddings."):
        return "audio_decoder." + name
    if name.startswith("fast_"):
        return "audio_decoder." + name[len("fast_"):]
    return "text_model.model." + name


def internal_name(key: str) -> str:
    """Inverse of `hf_name`. Keys already in upstream's internal form pass through."""
    if key.startswith("text_model.model."):
        return key[len("text_model.model."):]
    if key.startswith("audio_decoder.codebook_embeddings."):
        return key[len("audio_decoder."):]
    if key.startswith("audio_decoder."):
        return "fast_" + key[len("audio_decoder."):]
    return key


# ----------------------------------------------------------------------------- loading
def weight_files(ckpt: Path) -> list:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise unreadable(index, e) from None
        files = [ckpt / f for f in sorted(set(shards))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise UserError(f"{index} names shard {missing[0]}, which is not in {ckpt}")
        return files
    for name in ("model.safetensors", "model.pth"):
        if (ckpt / name).exists():
            return [ckpt / name]
    raise UserError(f"checkpoint dir {ckpt} has no model.safetensors(.index.json) or model.pth"
                    " — download fishaudio/s2-pro (see README)")


def read_weights(files: list):
    """Yield (name, tensor) one at a time from memory-mapped files, so that only one tensor is
    ever held twice while it is cast to the target dtype and device."""
    from safetensors import safe_open
    for f in files:
        try:
            if f.suffix == ".pth":
                state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
                state = state.get("state_dict", state)
                yield from ((k.removeprefix("model."), v) for k, v in state.items())
                continue
            with safe_open(f, framework="pt", device="cpu") as st:
                for key in st.keys():
                    yield internal_name(key), st.get_tensor(key)
        except Exception as e:  # a truncated or foreign file: say which one
            raise unreadable(f, e) from None


def load_weights(model: DualAR, ckpt: Path, device, dtype):
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = {}
    for name, tensor in read_weights(weight_files(ckpt)):
        if name not in expected:
            raise UserError(f"{ckpt}: unexpected tensor {hf_name(name)!r} — not an S2-Pro checkpoint"
                            " of this config.json?")
        if tensor.shape != expected[name]:
            raise UserError(f"{ckpt}: tensor {hf_name(name)!r} has shape {list(tensor.shape)},"
                            f" config.json implies {list(expected[name])}")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = [k for k in expected if k not in state]
    if missing:
        raise UserError(f"{ckpt}: missing tensor {hf_name(missing[0])!r} ({len(missing)} missing)")
    model.load_state_dict(state, assign=True)


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


def load(checkpoint, device="cpu", dtype=torch.float32) -> DualAR:
    """Load config.json, tokenizer.json and the weights of an S2-Pro checkpoint directory."""
    from tokenizers import Tokenizer
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint dir {ckpt} does not exist — download fishaudio/s2-pro (see README)")
    for name in ("config.json", "tokenizer.json"):
        if not (ckpt / name).is_file():
            raise UserError(f"checkpoint dir {ckpt} has no {name} — download fishaudio/s2-pro (see README)")
    cfg = read_config(ckpt / "config.json")
    try:
        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    except Exception as e:
        raise unreadable(ckpt / "tokenizer.json", e) from None
    cfg.update(special_ids(tokenizer))
    with torch.device("meta"):
        model = DualAR(cfg)
    load_weights(model, ckpt, device, dtype)
    model.tokenizer = tokenizer
    return model.requires_grad_(False).eval()


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
def logits_to_probs(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: int) -> Tensor:
    """Upstream's filter: top-k and top-p on the UNSCALED logits (the token that crosses top_p is
    dropped too, unlike HF), the best token always kept, then the temperature."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cum_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    ranks = torch.arange(logits.size(-1), device=logits.device)
    remove = (cum_probs > top_p) | (ranks >= top_k)
    remove[0] = False
    remove = remove.scatter(-1, order, remove)  # back to vocabulary order
    logits = torch.where(remove, float("-inf"), logits)
    return F.softmax(logits / torch.clip(temperature, min=1e-5), dim=-1)


def sample(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: int) -> Tensor:
    """One draw from a 1-D logit vector: argmax(p / -log u), u ~ U(0,1) in vocabulary order."""
    probs = logits_to_probs(logits, temperature, top_p, top_k)
    q = -torch.log(torch.rand_like(probs))
    return torch.argmax(probs / q, dim=-1, keepdim=True)


def sampling_params(model: DualAR, temperature: float, top_p: float, top_k: int) -> dict:
    """0-d tensors in the model's dtype, as upstream (so bf16 runs round 0.7 like upstream does)."""
    cfg, w = model.config, model.embeddings.weight
    bias = torch.full((cfg["vocab_size"],), float("-inf"), device=w.device, dtype=w.dtype)
    bias[cfg["semantic_begin_id"]: cfg["semantic_end_id"] + 1] = 0.0
    bias[cfg["im_end_id"]] = 0.0  # the slow model may only say a semantic token or <|im_end|>
    scalars = dict(temperature=temperature, top_p=top_p, ras_temperature=RAS_TEMPERATURE, ras_top_p=RAS_TOP_P)
    p = {k: torch.tensor(v, device=w.device, dtype=w.dtype) for k, v in scalars.items()}
    return dict(p, top_k=top_k, bias=bias)


# ----------------------------------------------------------------------------- one frame
def fast_codes(model: DualAR, hidden: Tensor, main: Tensor, p: dict) -> Tensor:
    """Codebook 0 follows from the main token. The fast model samples codebooks 1.. in turn."""
    cfg, device = model.config, hidden.device
    model.forward_fast(hidden, torch.tensor([0], device=device))  # fills the cache, output unused
    code = torch.clamp(main - cfg["semantic_begin_id"], 0, cfg["codebook_size"] - 1)
    codes = [code]
    for i in range(1, cfg["num_codebooks"]):
        logits = model.forward_fast(model.fast_embeddings(code), torch.tensor([i], device=device))
        code = sample(logits[0], p["temperature"], p["top_p"], p["top_k"])
        codes.append(code)
    return torch.cat(codes)


def decode_frame(model: DualAR, tokens: Tensor, pos: Tensor, window, p: dict) -> Tensor:
    """tokens (1, 1 + num_codebooks, S) at positions pos -> the next frame (1 + num_codebooks,)."""
    cfg = model.config
    logits, hidden = model.forward_slow(tokens, pos)
    logits = logits[0] + p["bias"]
    main = sample(logits, p["temperature"], p["top_p"], p["top_k"])
    high = sample(logits, p["ras_temperature"], p["ras_top_p"], p["top_k"])  # always drawn
    if window is not None:  # repetition-aware sampling: a repeated semantic token is redrawn hotter
        semantic = (main >= cfg["semantic_begin_id"]) & (main <= cfg["semantic_end_id"])
        main = torch.where((window == main).any() & semantic, high, main)
    return torch.cat([main, fast_codes(model, hidden, main, p)])


# ----------------------------------------------------------------------------- generation
@torch.inference_mode()
def generate_frames(model: DualAR, prompt: Tensor, max_new_tokens: int, p: dict, progress=False) -> Tensor:
    """Continue one prompt -> every frame generated (1 + num_codebooks, N), <|im_end|> frame included."""
    cfg, device = model.config, model.embeddings.weight.device
    T = prompt.size(1)
    budget = cfg["max_seq_len"] - T
    n = min(max_new_tokens, budget) if max_new_tokens else budget
    model.setup_caches(1, T + n)
    bar = tqdm(total=n, unit="frame", disable=not progress, leave=False)
    frame = decode_frame(model, prompt[None].to(device), torch.arange(T, device=device), None, p)
    frames = [frame]
    bar.update()
    window = torch.zeros(RAS_WINDOW, dtype=torch.long, device=device)  # excludes the prefill frame
    for i in range(1, n):
        pos = torch.tensor([T + i - 1], device=device)
        frame = decode_frame(model, frame.view(1, -1, 1), pos, window, p)
        window = torch.cat([window[1:], frame[:1]])
        frames.append(frame)
        bar.update()
        if frame[0] == cfg["im_end_id"]:  # upstream tests this in the decode loop only
            break
    bar.close()
    return torch.stack(frames, dim=1)


def check_reference_count(n: int):
    if n > MAX_REFERENCES:
        raise UserError(f"{n} references given, but at most {MAX_REFERENCES} are supported")


def check_request(model: DualAR, text: str, references: list, max_new_tokens: int):
    cfg = model.config
    n_semantic = cfg["semantic_end_id"] - cfg["semantic_begin_id"] + 1
    if not isinstance(text, str) or not text.strip():
        raise UserError("the text to speak is empty")
    if max_new_tokens == 1 or max_new_tokens < 0:  # 1 frame would leave none: the last one is dropped
        raise UserError("max_new_tokens must be 0 (no cap) or at least 2")
    check_reference_count(len(references))
    for i, (codes, transcript) in enumerate(references, 1):
        if not isinstance(transcript, str) or not transcript.strip():
            raise UserError(f"reference {i} has no transcript (give --prompt-text for every reference)")
        if codes.dim() != 2 or codes.size(0) != cfg["num_codebooks"] or codes.size(1) == 0:
            raise UserError(f"reference {i} codes have shape {list(codes.shape)},"
                            f" expected [{cfg['num_codebooks']}, frames]")
        if codes.is_floating_point():
            raise UserError(f"reference {i} codes are floats, not integer codes")
        codes = codes.long()
        if codes.min() < 0 or codes.max() >= cfg["codebook_size"] or codes[0].max() >= n_semantic:
            raise UserError(f"reference {i} codes are not integer codes in [0, {cfg['codebook_size']})")


@torch.inference_mode()
def generate(model: DualAR, text: str, references=(), seed=None, temperature=0.7, top_p=0.7, top_k=30,
             max_new_tokens=0, chunk_length=300, progress=False) -> Tensor:
    """Speak `text` (optionally in the voice of references [(codes (10, n), transcript)]).

    Text with <|speaker:N|> tags is split into turns and spoken batch by batch, each batch seeing the
    codes of the ones before. -> codes (num_codebooks, frames). max_new_tokens=0: up to the context.
    """
    references = [(torch.as_tensor(c), t) for c, t in references]
    check_request(model, text, references, max_new_tokens)
    references = [(c.long(), t) for c, t in references]
    if seed is not None:
        torch.manual_seed(seed)
    p = sampling_params(model, temperature, top_p, top_k)
    limit = model.config["max_seq_len"] - CONTEXT_RESERVE
    history = []
    for batch_text in text_batches(text, chunk_length):
        prompt = build_prompt(model, references, history, batch_text)
        if prompt.size(1) > limit:
            raise UserError(f"the prompt is {prompt.size(1)} tokens, the context allows {limit}"
                            f" ({CONTEXT_RESERVE} are kept for speech) — use shorter references or text")
        frames = generate_frames(model, prompt, max_new_tokens, p, progress)
        history.append((batch_text, frames[1:, :-1].cpu()))  # upstream always drops the last frame
    return torch.cat([codes for _, codes in history], dim=1)


# ----------------------------------------------------------------------------- demo checkpoint
DEMO_DIMS = dict(dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=128)
DEMO_CODEC = dict(encoder_dim=4, encoder_transformer_layers=[0, 0, 0, 1], latent_dim=64, decoder_dim=64,
                  quantizer_layers=1, quantizer_heads=1, quantizer_ffn=192, quantizer_window=16)


def demo_tokenizer(n_semantic: int):
    """Byte-level tokenizer (no merges) with the S2-Pro special tokens and <|semantic:i|> range."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|text|>", "<|voice|>"]
    tokenizer.add_special_tokens(specials + [f"<|semantic:{i}|>" for i in range(n_semantic)])
    return tokenizer


def make_demo_checkpoint(folder: Path, seed: int = 0):
    """A tiny random checkpoint in the real layout (config.json, tokenizer.json, model.safetensors,
    codec.pth + codec_config.json). Its 'speech' is noise: it only exercises the pipeline."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = demo_tokenizer(CONFIG["codebook_size"])
    tokenizer.save(str(folder / "tokenizer.json"))
    semantic0 = tokenizer.token_to_id("<|semantic:0|>")
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64  # padded like the real vocabulary
    text = dict(DEMO_DIMS, model_type="fish_qwen3", n_layer=2, vocab_size=vocab_size, rope_base=1e6,
                norm_eps=1e-6, max_seq_len=4096, attention_qk_norm=True)
    audio = dict(DEMO_DIMS, model_type="fish_qwen3_audio_decoder", n_layer=1,
                 vocab_size=CONFIG["codebook_size"], num_codebooks=CONFIG["num_codebooks"])
    config = dict(model_type="fish_qwen3_omni", semantic_start_token_id=semantic0,
                  semantic_end_token_id=semantic0 + CONFIG["codebook_size"] - 1,
                  text_config=text, audio_decoder_config=audio)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    cfg = read_config(folder / "config.json")
    cfg.update(special_ids(tokenizer))
    torch.manual_seed(seed)
    model = DualAR(cfg)
    for name, param in model.named_parameters():
        if not name.endswith("norm.weight"):
            nn.init.normal_(param, std=0.2)
    save_file({hf_name(k): v.to(torch.bfloat16) for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    codec_cfg = dict(codec.CONFIG, **DEMO_CODEC)
    torch.save(codec.DAC(codec_cfg).state_dict(), folder / "codec.pth")
    (folder / "codec_config.json").write_text(json.dumps(DEMO_CODEC, indent=2))


def demo_reference(args, device):
    """One second of a gliding tone, encoded by the demo codec, as the voice to 'clone'."""
    t = torch.arange(codec.CONFIG["sample_rate"]) / codec.CONFIG["sample_rate"]
    wave = 0.3 * torch.sin(2 * math.pi * (220 + 80 * t) * t)
    return [(codec.encode(codec_model(args, device), wave)[0].cpu(), "A one second test tone.")]


# ----------------------------------------------------------------------------- benchmark
def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def copy_bandwidth(device, gib=1, repeats=5) -> float:
    """Measured memory bandwidth in GB/s (read + write of a big copy): the ceiling for decoding."""
    src = torch.ones(gib * 2**28, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(device)
    return 2 * src.nbytes * repeats / (time.perf_counter() - start) / 1e9


def weight_bytes(*modules) -> int:
    return sum(p.nbytes for m in modules for p in m.parameters())


def timed_frames(model, frames, device):
    """(raw frames made, seconds) of one generation capped at `frames`."""
    synchronize(device)
    start = time.perf_counter()
    codes = generate(model, "The quick brown fox jumps over the lazy dog.", [], seed=0, max_new_tokens=frames)
    synchronize(device)
    return codes.size(1) + 1, time.perf_counter() - start


def bench(args):
    """Decode speed at the real S2-Pro size with random (torch.rand) weights."""
    device = codec.pick_device(args.device)
    dtype = DTYPES[args.dtype or "bf16"]
    tokenizer = demo_tokenizer(CONFIG["codebook_size"])
    with torch.device("meta"):
        model = DualAR(dict(CONFIG, **special_ids(tokenizer)))
    torch.manual_seed(0)
    model.load_state_dict({k: (torch.rand(v.shape, dtype=dtype, device=device) - 0.5) * 0.1
                           for k, v in model.state_dict().items()}, assign=True)
    model.tokenizer = tokenizer
    model.requires_grad_(False)
    # weights read per frame: the slow model (its tied head reads the whole embedding table) once,
    # the fast model once per codebook
    per_frame = weight_bytes(model.layers, model.norm, model.embeddings) \
        + CONFIG["num_codebooks"] * weight_bytes(model.fast_layers, model.fast_norm, model.fast_output)
    timed_frames(model, 2, device)  # warm-up
    n = args.max_new_tokens or 8
    short, t_short = timed_frames(model, 2, device)
    long, t_long = timed_frames(model, 2 + n, device)
    fps = (long - short) / (t_long - t_short)  # decode only: the prefill cancels out
    gbs, peak = per_frame * fps / 1e9, copy_bandwidth(device)
    seconds_per_frame = codec.hop_length() / codec.CONFIG["sample_rate"]
    print(f"S2-Pro size ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} G params), {dtype}, {device}:"
          f" prefill {t_short - (short - 1) / fps:.2f} s, decode {fps:.2f} frames/s,"
          f" {gbs:.1f} GB/s = {100 * gbs / peak:.0f}% of the measured {peak:.1f} GB/s,"
          f" RTF {1 / fps / seconds_per_frame:.2f}")


# ----------------------------------------------------------------------------- CLI
def read_transcript(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise unreadable(path, e) from None
    if not text:
        raise UserError(f"transcript {path} is empty")
    return text


def default_references(folder=Path("prompt")) -> list:
    """Every prompt/<stem>.npy (or audio file) that has a prompt/<stem>.txt transcript."""
    refs = {}
    for path in sorted(folder.glob("*")) if folder.is_dir() else []:
        kind = "audio" if path.suffix.lower() in codec.AUDIO_EXTENSIONS else None
        kind = "codes" if path.suffix == ".npy" else kind
        if kind and path.with_suffix(".txt").is_file() and (path.stem not in refs or kind == "codes"):
            refs[path.stem] = (kind, path)
    return list(refs.values())


def load_references(args, model: DualAR, device) -> list:
    """-> [(codes, transcript)] from --prompt-codes/--prompt-audio paired in order with --prompt-text,
    or else from prompt/ (unless --no-prompt)."""
    given, texts = args.references or [], args.prompt_text or []
    if not given and not texts and not args.no_prompt:
        given = default_references()
        texts = [read_transcript(path.with_suffix(".txt")) for _, path in given]
        if given:
            print("references from prompt/: " + ", ".join(p.name for _, p in given), file=sys.stderr)
    if len(texts) != len(given):
        raise UserError(f"{len(given)} reference clip(s) but {len(texts)} --prompt-text: give one transcript"
                        " per --prompt-audio/--prompt-codes, in the same order")
    check_reference_count(len(given))  # before any clip is encoded
    cfg, refs = model.config, []
    for (kind, path), text in zip(given, texts):
        if kind == "codes":
            codes = codec.read_codes(path, rows=cfg["num_codebooks"], vocab=cfg["codebook_size"])
        else:
            codes = codec.encode(codec_model(args, device), codec.load_audio(path))[0].cpu()
        refs.append((codes, text))
    return refs


def codec_model(args, device):
    if getattr(args, "codec", None) is None:
        args.codec = codec.load(args.checkpoint, device, codec.pick_dtype(None, device))
    return args.codec


def output_paths(args):
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
    ap = codec.ArgumentParser(description="S2-Pro text-to-speech (Dual-AR): text -> codes -> wav.")
    ap.add_argument("--checkpoint", help="dir with config.json, model weights,"
                    " tokenizer.json and codec.pth (default ./s2-pro, or the demo if that is absent)")
    ap.add_argument("--text", help="the text to speak (<|speaker:N|> tags make a dialogue)")
    ap.add_argument("--text-file", help="read the text from this UTF-8 file instead")
    ap.add_argument("--prompt-audio", dest="references", action="append", type=lambda p: ("audio", Path(p)),
                    help="reference clip to clone (repeatable, encoded with codec.py)")
    ap.add_argument("--prompt-codes", dest="references", action="append", type=lambda p: ("codes", Path(p)),
                    help="reference codes .npy [10, T] from `codec.py encode` (repeatable)")
    ap.add_argument("--prompt-text", action="append", help="transcript of each reference, in order"
                    " (repeatable). Default references: prompt/<stem>.npy or audio + prompt/<stem>.txt")
    ap.add_argument("--no-prompt", action="store_true", help="ignore prompt/: plain TTS, no voice cloning")
    ap.add_argument("--out", help="output .wav/.npy path (default generate/<n>.wav and .npy)")
    ap.add_argument("--codes-only", action="store_true", help="write only the codes, skip the codec")
    ap.add_argument("--seed", type=int, default=42, help="torch.manual_seed before generating (default 42)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    ap.add_argument("--top-p", type=float, default=0.7, help="nucleus sampling threshold (default 0.7)")
    ap.add_argument("--top-k", type=int, default=30,
                    help="keep the k most likely tokens (default 30, 0 or 1: greedy, as upstream)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="frames per text batch at most, >= 2"
                    " (default 0: until <|im_end|> or the context)")
    ap.add_argument("--chunk-length", type=int, default=300,
                    help="UTF-8 bytes of dialogue turns per batch (default 300, as upstream)")
    ap.add_argument("--device", choices=["cpu", "cuda", "mps"], help="default: cuda > mps > cpu")
    ap.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="default bf16 on CUDA, fp32 elsewhere")
    ap.add_argument("--demo", action="store_true",
                    help="run on a tiny random checkpoint built on the fly (the audio is noise)")
    ap.add_argument("--bench", action="store_true", help="time decoding at the real S2-Pro size with random"
                    " weights (default bf16, --max-new-tokens frames, default 8): frames/s, GB/s, RTF")
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
    if not 0 < args.top_p <= 1 or not 0 < args.temperature < 2 or args.top_k < 0:
        raise UserError("need 0 < --top-p <= 1, 0 < --temperature < 2 and --top-k >= 0 (upstream's ranges)")
    if args.chunk_length < 1:
        raise UserError("--chunk-length must be >= 1")


def run(args):
    check_args(args)
    device = codec.pick_device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    codes_path, wav_path = output_paths(args)
    model = load(args.checkpoint, device, dtype)
    if wav_path is not None and not (Path(args.checkpoint) / "codec.pth").is_file():
        print(f"note: {args.checkpoint} has no codec.pth, so only the codes are written", file=sys.stderr)
        wav_path = None
    if wav_path is not None:
        codec_model(args, device)  # a broken codec.pth fails now, not after the generation
    references = load_references(args, model, device)
    if args.demo and not references:
        references = demo_reference(args, device)
    start = time.perf_counter()
    codes = generate(model, args.text, references, seed=args.seed, temperature=args.temperature,
                     top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                     chunk_length=args.chunk_length, progress=True)
    wall = time.perf_counter() - start
    codes_path.parent.mkdir(exist_ok=True)
    if wav_path is not None:
        codec.save_wav(wav_path, codec.decode(codec_model(args, device), codes.to(device))[0])
    codec.save_codes(codes_path, codes)
    frames, seconds = codes.size(1), codes.size(1) * codec.hop_length() / codec.CONFIG["sample_rate"]
    print(f"wrote {codes_path}" + (f" and {wav_path}" if wav_path else ""))
    print(f"{frames} frames, {seconds:.2f} s of audio in {wall:.2f} s: {frames / wall:.1f} frames/s,"
          f" RTF {wall / max(seconds, 1e-9):.3f}")


def main(argv=None):
    args = parse_args(argv)
    if args.bench:
        return bench(args)
    if args.demo and args.checkpoint:
        raise UserError("--demo builds its own tiny checkpoint: drop --checkpoint")
    args.demo = args.demo or (args.checkpoint is None and not Path(DEFAULT_CHECKPOINT).exists())
    args.checkpoint = args.checkpoint or DEFAULT_CHECKPOINT
    if not args.demo:
        return run(args)
    print(f"DEMO: no real checkpoint used — a tiny RANDOM model is built, so the audio is NOISE.\n"
          f"For speech, download fishaudio/s2-pro into {DEFAULT_CHECKPOINT} (see README).", file=sys.stderr)
    args.max_new_tokens = args.max_new_tokens or 64
    with tempfile.TemporaryDirectory() as folder:
        make_demo_checkpoint(Path(folder))
        args.checkpoint = folder
        run(args)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:  # UserError and the codec's one-line errors
        sys.exit(f"error: {e}")
