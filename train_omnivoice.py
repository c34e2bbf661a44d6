"""Fine-tuning OmniVoice, full or LoRA: audio tokens, training, export, one file.

Upstream k2-fsa/OmniVoice 0.2.1's pipeline, on our dependencies: its tar shards of codes, its batches,
losses and updates, bit for bit on CPU fp32 (tests/fixtures/omnivoice-tiny/train is the specification).

    python train_omnivoice.py tokens --input-jsonl data.jsonl --checkpoint CKPT --out tokens/
    python train_omnivoice.py train --train-config T.json --data-config D.json --out runs/me
    python train_omnivoice.py export runs/me --out my-omnivoice     # omnivoice.py --checkpoint my-omnivoice

How the file reads (sections, top to bottom):
    tokens          stage 0: clips -> codes in upstream's tar shards + label JSONL + data.lst
    data            stage 1's batches: shard and sample shuffles, the processor's draws, length buckets,
                    padding, loader workers in turn
    model           the trainable model: LoRA (peft's init and names), the loss per codebook
    optimizer       AdamW, global-norm clipping, the cosine schedule with warm-up, accumulation
    run             configs (upstream's JSON), the run folder, checkpoints, --resume, several processes
    export          merged checkpoint folder, peft-format adapter
    CLI             tokens / train / export
"""

import argparse
import importlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from contextlib import suppress
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import common
import omnivoice
from common import UserError, write_atomic

# ----------------------------------------------------------------------------- tokens


# ----------------------------------------------------------------------------- data


# ----------------------------------------------------------------------------- model
IGNORE = -100  # labels of positions without loss (text, prompt, unmasked audio, padding)
OMNIVOICE_TOKENS = ("<|denoise|>", "<|lang_start|>", "<|lang_end|>", "<|instruct_start|>", "<|instruct_end|>",
                    "<|text_start|>", "<|text_end|>")
# upstream's later LoRA recipe; lora_dropout as the goldens' peft setup
LORA_DEFAULTS = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], modules_to_save=None)
# peft LoraConfig keys that we accept only at the value we implement
LORA_FIXED = dict(bias="none", init_lora_weights=True, use_rslora=False, use_dora=False, fan_in_fan_out=False)
LORA_IGNORED = ("task_type", "peft_type", "base_model_name_or_path", "inference_mode", "revision")
# upstream's module order inside a decoder layer (its named_parameters order: clipping sums in it)
LAYER_ORDER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
               "input_layernorm", "post_attention_layernorm")
TOP_ORDER = ("llm.embed_tokens", "llm.layers", "llm.norm", "audio_embeddings", "audio_heads")


def upstream_name(name: str) -> str:
    """Our parameter name -> upstream's (omnivoice.internal_name's inverse): llm. prefix, mlp. modules."""
    if name.startswith(("embed_tokens.", "layers.", "norm.")):
        name = "llm." + name
    return re.sub(r"\.(gate_proj|up_proj|down_proj)(?=\.|$)", r".mlp.\1", name)


def upstream_position(name: str) -> tuple:
    """Sort key of an upstream name in upstream's named_parameters order (a LoRA's base, then A, then B)."""
    parts = name.split(".")
    if parts[:2] == ["llm", "layers"]:
        n = 2 if parts[3] in ("self_attn", "mlp") else 1
        return 1, int(parts[2]), LAYER_ORDER.index(".".join(parts[3:3 + n])), ".".join(parts[3 + n:])
    top = next(i for i, t in enumerate(TOP_ORDER) if name.startswith(t + "."))
    return top, 0, 0, name


def build_model(checkpoint, tokenizer_dir=None, device="cpu") -> omnivoice.OmniVoice:
    """The checkpoint's LM in fp32 for training (no audio tokenizer), .tokenizer from the checkpoint or the
    --tokenizer overlay, .codebook_weights upstream's normalized loss weights."""
    ckpt = Path(checkpoint)
    if not (ckpt / "config.json").is_file():
        raise UserError(f"checkpoint dir {ckpt} has no config.json — download k2-fsa/OmniVoice"
                        " (see README)")
    cfg = omnivoice.read_config(ckpt / "config.json")  # an S2-Pro checkpoint: its one-line error
    source = Path(tokenizer_dir) if tokenizer_dir else ckpt
    if not (source / "tokenizer.json").is_file():
        raise UserError(f"{source} has no tokenizer.json")
    tokenizer = omnivoice.load_tokenizer(source / "tokenizer.json")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != cfg["vocab_size"]:  # upstream resizes the table and then fails on the audio ids it looks up
        raise UserError(f"{source / 'tokenizer.json'} has {size} tokens, {ckpt}'s text embedding"
                        f" {cfg['vocab_size']} rows: pass --tokenizer DIR, an overlay whose tokenizer.json"
                        f" pads the vocabulary to {cfg['vocab_size']} (see docs/training.md)")
    if missing := [t for t in OMNIVOICE_TOKENS if tokenizer.token_to_id(t) is None]:
        raise UserError(f"{source / 'tokenizer.json'} lacks OmniVoice's token {missing[0]}:"
                        " not its tokenizer")
    weights = json.loads((ckpt / "config.json").read_text()).get("audio_codebook_weights",
                                                                  [8, 8, 6, 6, 4, 4, 2, 2])
    if len(weights) != cfg["num_codebooks"]:
        raise UserError(f"{ckpt}: audio_codebook_weights has {len(weights)} entries for"
                        f" {cfg['num_codebooks']} codebooks")
    with torch.device("meta"):
        model = omnivoice.OmniVoice(cfg)
    omnivoice.load_weights(model, ckpt, torch.device(device), torch.float32)
    model.tokenizer = tokenizer
    # upstream: w / sum(w) in Python floats, then a float32 tensor
    model.codebook_weights = torch.tensor([w / sum(weights) for w in weights], device=device)
    return model.train()


class LoRALinear(nn.Module):
    """peft's lora.Linear: base(x) + B(A(dropout(x))) * alpha / r; the base layer is shared, not copied."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # peft's draws, on the CPU generator: A and B made as nn.Linear (one init each), A drawn again,
        # B zeroed
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.to(base.weight.device)
        self.scaling = alpha / r

    def forward(self, x: Tensor) -> Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def lora_config(given: dict = None) -> dict:
    """peft LoraConfig keys (a JSON file's) over LORA_DEFAULTS; what we do not implement is one error."""
    lora = dict(LORA_DEFAULTS)
    for key, value in (given or {}).items():
        if key in LORA_DEFAULTS:
            lora[key] = value
        elif key in LORA_FIXED:
            if value != LORA_FIXED[key]:
                raise UserError(f"LoRA config: {key}={value!r} is not supported (only {LORA_FIXED[key]!r})")
        elif key not in LORA_IGNORED:
            raise UserError(f"LoRA config: unknown key {key!r} (known: {', '.join(LORA_DEFAULTS)},"
                            f" {', '.join(LORA_FIXED)}; ignored: {', '.join(LORA_IGNORED)})")
    if not (isinstance(lora["r"], int) and lora["r"] >= 1 and 0 <= lora["lora_dropout"] < 1):
        raise UserError("LoRA config: r must be an integer >= 1 and lora_dropout in [0, 1)")
    return lora


def targeted(name: str, targets) -> bool:
    """peft's match of target_modules: a regex string matches the whole name, a list any last part(s)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def add_lora(model: omnivoice.OmniVoice, lora: dict) -> list:
    """Swap each targeted nn.Linear (upstream names, module order) for a LoRALinear; freeze the rest but
    modules_to_save, which train fully -> the names of the wrapped modules (ours)."""
    model.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        if name and targeted(upstream_name(name), lora["target_modules"]):
            if not isinstance(module, nn.Linear):
                raise UserError(f"LoRA target {upstream_name(name)} is an nn.{type(module).__name__}, not"
                                " an nn.Linear: train it fully with modules_to_save instead")
            model.set_submodule(name, LoRALinear(module, lora["r"], lora["lora_alpha"], lora["lora_dropout"]))
            wrapped.append(name)
    if not wrapped:
        raise UserError(f"LoRA target_modules {lora['target_modules']} match no layer of the model")
    names = {upstream_name(n): n for n, _ in model.named_modules() if n}
    for saved in lora["modules_to_save"] or []:
        match = [ours for up, ours in names.items() if targeted(up, [saved])]
        if not match:
            raise UserError(f"LoRA modules_to_save: {saved!r} matches no module of the model")
        for ours in match:
            model.get_submodule(ours).requires_grad_(True)
    return wrapped


def trainable_parameters(model: nn.Module) -> list:
    """[(upstream name, parameter)] of what trains, in upstream's named_parameters order."""
    named = [(upstream_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    return sorted(named, key=lambda item: upstream_position(item[0]))


def peft_name(name: str, saved=True) -> str:
    """Upstream name of a LoRA tensor -> peft's: as saved (adapter_model.safetensors) or in memory."""
    name = "base_model.model." + name
    return name if saved else re.sub(r"\.(lora_[AB])\.", r".\1.default.", name)


def lm_hidden(model: omnivoice.OmniVoice, ids: Tensor, audio_mask: Tensor, mask: Tensor, positions: Tensor,
              checkpointing=False) -> Tensor:
    """omnivoice's hidden(), each layer optionally checkpointed (its activations recomputed in backward)."""
    x = model.embed(ids, audio_mask)
    cos, sin = omnivoice.rope_tables(x.shape[1], model.cfg["head_dim"], model.cfg["rope_base"], x.device)
    cos, sin = cos.to(x.dtype)[positions][:, None], sin.to(x.dtype)[positions][:, None]  # (B, 1, L, head_dim)
    for layer in model.layers:
        if checkpointing:  # the dropout draws are replayed from the saved RNG state in the recomputation
            x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
        else:
            x = layer(x, cos, sin, mask)
    return model.norm(x)


def training_loss(model: omnivoice.OmniVoice, batch: dict, checkpointing=False) -> Tensor:
    """Upstream's loss: cross-entropy at labelled positions, a mean per codebook, weighted sum."""
    hidden = lm_hidden(model, batch["input_ids"], batch["audio_mask"], batch["attention_mask"],
                       batch["position_ids"], checkpointing)
    logits = model.heads(hidden).permute(0, 2, 1, 3)  # (B, C, L, V)
    labels = batch["labels"]
    per_token = F.cross_entropy(logits.permute(0, 3, 1, 2), labels, reduction="none", ignore_index=IGNORE)
    valid = (labels != IGNORE).float()
    means = (per_token * valid).sum(dim=(0, 2)) / valid.sum(dim=(0, 2)).clamp(min=1.0)  # (C,)
    return (means * model.codebook_weights).sum()


# ----------------------------------------------------------------------------- optimizer
def lr_factor(k: int, settings: dict) -> float:
    """transformers' cosine (or constant) schedule with linear warm-up at scheduler step k (0-based)."""
    warmup = warmup_steps(settings)
    if k < warmup:
        return float(k) / float(max(1, warmup))
    if settings["lr_scheduler_type"] == "constant":
        return 1.0
    progress = float(k - warmup) / float(max(1, settings["steps"] - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def warmup_steps(settings: dict) -> int:
    if settings["warmup_type"] == "ratio":
        return math.ceil(settings["steps"] * settings["warmup_ratio"])
    return settings["warmup_steps"]


def make_optimizer(params: list, settings: dict) -> torch.optim.AdamW:
    """torch's AdamW as upstream makes it: one group, no exclusions from weight decay; torch's default
    implementation (single-tensor on CPU, as the goldens; foreach on CUDA)."""
    return torch.optim.AdamW(params, lr=settings["learning_rate"], weight_decay=settings["weight_decay"])


def clip_gradients(params: list, max_norm: float) -> tuple:
    """Global-norm clipping as accelerate calls it -> (norm before clipping, coefficient) as floats."""
    if max_norm <= 0:
        return 0.0, 1.0
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)  # per-tensor norms in the given order
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # what clip_grad_norm_ multiplied by
    return total.item(), coef.item()


def reduce_gradients(params: list, world: int):
    """Data parallel as DDP's default hook: every gradient divided by the processes, then summed."""
    grads = [p for p in params if p.grad is not None]
    flat = torch.cat([p.grad.flatten() for p in grads]).div_(world)
    dist.all_reduce(flat)
    for p, grad in zip(grads, flat.split([p.numel() for p in grads])):
        p.grad.copy_(grad.view_as(p))


def optimizer_step(run: dict, step: int) -> dict:
    """Optimizer step `step` (1-based) on the accumulated gradients -> its metrics line."""
    settings, params, optimizer = run["settings"], [p for _, p in run["trainable"]], run["optimizer"]
    if run["world"] > 1:
        reduce_gradients(params, run["world"])
    lr = settings["learning_rate"] * lr_factor(step - 1, settings)
    for group in optimizer.param_groups:
        group["lr"] = lr
    grad_norm, coef = clip_gradients(params, settings["max_grad_norm"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return dict(step=step, lr=lr, grad_norm=grad_norm, clip_coef=coef,
                lr_after=settings["learning_rate"] * lr_factor(step, settings))


# ----------------------------------------------------------------------------- run
# upstream's TrainingConfig fields with examples/config/train_config_finetune_sdpa.json's values
TRAIN_DEFAULTS = dict(
    audio_vocab_size=1025, audio_mask_id=1024, num_audio_codebook=8, drop_cond_ratio=0.1,
    prompt_ratio_range=[0.0, 0.3], mask_ratio_range=[0.0, 1.0], language_ratio=0.8,
    use_pinyin_ratio=0.0, instruct_ratio=0.0, only_instruct_ratio=0.0, resume_from_checkpoint=None,
    init_from_checkpoint=None, learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0, steps=5000, seed=42,
    lr_scheduler_type="cosine", warmup_type="ratio", warmup_ratio=0.01, warmup_steps=0, batch_tokens=8192,
    gradient_accumulation_steps=1, num_workers=2, mixed_precision="bf16", allow_tf32=True,
    max_sample_tokens=2000, min_sample_tokens=50, max_batch_size=64, save_steps=500,
    keep_last_n_checkpoints=-1)
# fields of upstream's config that do not apply here, and why (read, then left out)
IGNORED_FIELDS = dict(
    llm_name_or_path="training starts from init_from_checkpoint (or --checkpoint)",
    output_dir="the run folder is --out", data_config="the data config is --data-config",
    attn_implementation="always SDPA with length-grouped padded batches (upstream's sdpa path)",
    use_deepspeed="plain PyTorch (torchrun for several GPUs)", deepspeed_config="plain PyTorch",
    logging_steps="metrics.jsonl has every micro-step and step", eval_steps="no dev-set evaluation",
    audio_codebook_weights="the loss weights are the checkpoint's config.json's, as upstream's")
RUN_CONFIG, METRICS, STATE = "config.json", "metrics.jsonl", "state.pt"
CHECKPOINT_PREFIX = "checkpoint-"
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
RESUMABLE = ("checkpointing", "device")  # settings a resumed run may change: they do not change the numbers


def read_json(path, what: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise common.unreadable(path, e) from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} is not a JSON object")
    return data


def train_settings(given: dict, source: str) -> dict:
    """An upstream train config (dict) over TRAIN_DEFAULTS; an unknown field is one error."""
    settings = dict(TRAIN_DEFAULTS)
    if ignored := [k for k in given if k in IGNORED_FIELDS]:
        print(f"note: {source}: not read here: " + "; ".join(f"{k} ({IGNORED_FIELDS[k]})" for k in ignored),
              file=sys.stderr)
    for key, value in given.items():
        if key in IGNORED_FIELDS:
            continue
        if key not in TRAIN_DEFAULTS:
            raise UserError(f"{source}: unknown field {key!r} (not one of upstream's TrainingConfig fields)")
        settings[key] = value
    if settings["resume_from_checkpoint"]:
        raise UserError(f"{source}: resume_from_checkpoint is not read here: continue a run with --resume")
    if settings["mixed_precision"] not in ("no", "bf16"):
        raise UserError(f"{source}: mixed_precision {settings['mixed_precision']!r}: use \"bf16\" or \"no\"")
    if settings["lr_scheduler_type"] not in ("cosine", "constant"):
        raise UserError(f"{source}: lr_scheduler_type {settings['lr_scheduler_type']!r}: cosine or constant")
    if settings["warmup_type"] not in ("ratio", "steps"):
        raise UserError(f"{source}: warmup_type {settings['warmup_type']!r}: ratio or steps")
    return settings


def run_config(args, stored: dict = None) -> dict:
    """What a run is: train settings (the config file, else the stored run's, then the flags), method,
    LoRA, tokenizer, data config; `stored`: the run being resumed, whose choices fill what is not given."""
    stored = stored or {}
    if args.train_config:
        settings = train_settings(read_json(args.train_config, "--train-config"), args.train_config)
    else:
        source = "the run's config" if stored else "the defaults"
        settings = train_settings(stored.get("train_config", {}), source)
    flags = dict(init_from_checkpoint=args.checkpoint, num_workers=args.num_workers, steps=args.max_steps,
                 gradient_accumulation_steps=args.grad_accum, batch_tokens=args.batch_tokens,
                 learning_rate=args.lr, save_steps=args.save_steps)
    settings.update({k: v for k, v in flags.items() if v is not None})
    if not settings["init_from_checkpoint"]:
        raise UserError("no checkpoint: give --checkpoint DIR or init_from_checkpoint in --train-config")
    settings["init_from_checkpoint"] = str(settings["init_from_checkpoint"])
    for key in ("steps", "gradient_accumulation_steps", "batch_tokens", "num_workers", "save_steps"):
        if not isinstance(settings[key], int) or settings[key] < 1:
            raise UserError(f"{key} must be an integer >= 1 (it is {settings[key]!r})")
    data_config = args.data_config or stored.get("data_config")
    if data_config is None:
        raise UserError("train needs --data-config D.json (upstream's:"
                        " {\"train\": [{\"manifest_path\": [...]}]})")
    method = args.method or stored.get("method", "full")
    if method != "lora" and args.lora_config:
        raise UserError("--lora-config is for --method lora")
    lora = None
    if method == "lora":
        given = read_json(args.lora_config, "--lora-config") if args.lora_config else stored.get("lora")
        lora = lora_config(given)
    lora_seed = args.lora_seed if args.lora_seed is not None else stored.get("lora_seed", settings["seed"])
    return dict(train_config=settings, method=method, lora=lora, lora_seed=lora_seed,
                tokenizer=str(args.tokenizer) if args.tokenizer else stored.get("tokenizer"),
                data_config=str(data_config), data=read_json(data_config, "--data-config"),
                checkpointing=args.checkpointing, device=args.device)


def resumed_config(args, out: Path) -> dict:
    """--resume: the stored run's config; what the command line gives must not change it."""
    stored = read_json(out / RUN_CONFIG, "run config")
    config = run_config(args, stored)
    for key in list(config) + [k for k in stored if k not in config]:
        old, new = stored.get(key), config.get(key)
        if key == "train_config" and isinstance(old, dict):
            diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
            if diff:
                key, old, new = f"train_config.{diff[0]}", old.get(diff[0]), new.get(diff[0])
        if key not in RESUMABLE and old != new:
            raise UserError(f"--resume: {out} was started with {key}={old!r}, this command gives {new!r}:"
                            " resume with the same settings, or start a new run")
    return config


def join_processes(device: torch.device) -> tuple:
    """-> (rank, processes, device). Under torchrun (RANK set): NCCL on cuda:LOCAL_RANK, or gloo on CPU."""
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # as train_lora.py: dynamo imported before the group is made, so its defaults do not hold the group
        importlib.import_module("torch._dynamo")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def seed_everything(seed: int):
    """accelerate's set_seed: Python's random, numpy and torch (every device) from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _base_seed() -> int:
    """What a DataLoader's new iterator draws first: one int64 from the global torch generator."""
    return torch.empty((), dtype=torch.int64).random_().item()


def model_state(model: omnivoice.OmniVoice) -> dict:
    """The model as upstream's save_pretrained writes it: upstream names, its offsets buffer, LoRA merged
    (W + (B @ A) * scaling, the fp32 matmul then the multiply)."""
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            delta = (module.lora_B.weight @ module.lora_A.weight) * module.scaling
            state[upstream_name(name) + ".weight"] = module.base_layer.weight + delta
    for name, p in model.named_parameters():
        if ".lora_" not in name and ".base_layer." not in name:
            state[upstream_name(name)] = p
    C, V = model.cfg["num_codebooks"], model.cfg["audio_vocab_size"]
    state["codebook_layer_offsets"] = torch.arange(C) * V
    return {k: t.detach().float().cpu().contiguous() if t.is_floating_point() else t.cpu()
            for k, t in state.items()}


def adapter_state(run: dict) -> dict:
    """peft's saved adapter: LoRA A/B and modules_to_save, keys base_model.model.<upstream name>."""
    return {peft_name(name): p.detach().float().cpu().contiguous() for name, p in run["trainable"]}


def adapter_config(config: dict) -> dict:
    """peft 0.21's adapter_config.json for our LoRA (everything else at peft's defaults)."""
    lora = config["lora"]
    targets = sorted(lora["target_modules"]) if isinstance(lora["target_modules"], list) \
        else lora["target_modules"]
    return dict(
        alora_invocation_tokens=None, alpha_pattern={}, arrow_config=None,
        auto_mapping=dict(base_model_class="OmniVoice", parent_library="omnivoice.models.omnivoice"),
        base_model_name_or_path=config["train_config"]["init_from_checkpoint"], bias="none",
        corda_config=None,
        ensure_weight_tying=False, eva_config=None, exclude_modules=None, fan_in_fan_out=False,
        inference_mode=True, init_lora_weights=True, kasa_config=None, layer_replication=None,
        layers_pattern=None, layers_to_transform=None, loftq_config={}, lora_alpha=lora["lora_alpha"],
        lora_bias=False, lora_dropout=lora["lora_dropout"], lora_ga_config=None, megatron_config=None,
        megatron_core="megatron.core", modules_to_save=lora["modules_to_save"], monteclora_config=None,
        peft_type="LORA", peft_version="0.21.2", qalora_group_size=16, r=lora["r"], rank_pattern={},
        revision=None, target_modules=targets, target_parameters=None, task_type=None,
        trainable_token_indices=None, use_bdlora=None, use_dora=False, use_qalora=False, use_rslora=False,
        velora_config=None)


def save_checkpoint(run: dict, out: Path, state: dict):
    """checkpoint-N/: the weights (full: model.safetensors as upstream's; LoRA: peft's adapter files) and
    state.pt (AdamW, the position in the data, every process's random state), written whole or not at all."""
    rng = dict(torch=torch.get_rng_state())
    if run["device"].type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run["device"])
    rngs = [rng] * run["world"]
    if run["world"] > 1:
        dist.all_gather_object(rngs, rng)
    if run["rank"] > 0:
        return
    config = run["config"]

    def write(tmp: Path):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if config["method"] == "full":
            save_file(model_state(run["model"]), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            save_file(adapter_state(run), str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(config), indent=2, sort_keys=True))
        torch.save(dict(state, optimizer=run["optimizer"].state_dict(), rng=rngs), tmp / STATE)
    folder = out / f"{CHECKPOINT_PREFIX}{state['step']}"
    write_atomic(folder, write)
    keep = config["train_config"]["keep_last_n_checkpoints"]
    if keep > 0:
        for old in checkpoints(out)[:-keep]:
            shutil.rmtree(old)


def checkpoints(out: Path) -> list:
    """The run's checkpoint folders, oldest first."""
    steps = {int(p.name[len(CHECKPOINT_PREFIX):]): p for p in out.glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit()}
    return [steps[n] for n in sorted(steps)]


def load_checkpoint(run: dict, folder: Path) -> dict:
    """checkpoint-N/ back into the model, AdamW and this process's random state -> the loop's state."""
    full = run["config"]["method"] == "full"
    try:
        saved = torch.load(folder / STATE, map_location="cpu", weights_only=True)
        weights = load_file(folder / ("model.safetensors" if full else ADAPTER_FILE))
    except Exception as e:
        raise common.unreadable(folder, e) from None
    if len(saved["rng"]) != run["world"]:
        raise UserError(f"--resume: {folder} was saved by {len(saved['rng'])} process(es): resume on as many")
    names = {n if full else peft_name(n): p for n, p in run["trainable"]}
    if missing := sorted(set(names) - set(weights)):
        raise UserError(f"--resume: {folder} lacks {missing[0]}: not this run's checkpoint")
    with torch.no_grad():
        for name, p in names.items():
            p.copy_(weights[name])
    run["optimizer"].load_state_dict(saved["optimizer"])
    rng = saved["rng"][run["rank"]]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and run["device"].type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], run["device"])
    return {k: saved[k] for k in ("step", "micro_step", "epoch", "position", "base_seed")}


def keep_metrics_up_to(path: Path, state: dict):
    """On resume: drop the metrics logged after the checkpoint (they will be logged again)."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with suppress(ValueError, KeyError):  # a line cut short by a crash
            record = json.loads(line)
            if record.get("micro_step", -1) < state["micro_step"] and record.get("step", 0) <= state["step"]:
                kept.append(line + "\n")
    write_atomic(path, lambda tmp: tmp.write_text("".join(kept)))


def start_run(args, rank: int, world: int, device: torch.device) -> dict:
    """The run in --out, new or (--resume) read back -> model, trainable parameters, AdamW, loop state."""
    out = Path(args.out)
    if args.resume:
        if not (out / RUN_CONFIG).is_file() or not checkpoints(out):
            raise UserError(f"--resume: {out} holds no run with a checkpoint ({RUN_CONFIG} + checkpoint-N/)")
        config = resumed_config(args, out)
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"--out {out} is not empty: pass --resume to continue its run, or another --out")
        config = run_config(args)
    settings = config["train_config"]
    model = build_model(settings["init_from_checkpoint"], config["tokenizer"], device)
    if settings["num_audio_codebook"] != model.cfg["num_codebooks"] or \
            settings["audio_mask_id"] != model.cfg["audio_mask_id"]:  # upstream would skip every sample
        raise UserError(f"train config: num_audio_codebook {settings['num_audio_codebook']} / audio_mask_id"
                        f" {settings['audio_mask_id']}, the checkpoint's {model.cfg['num_codebooks']} /"
                        f" {model.cfg['audio_mask_id']}: make them equal")
    if config["method"] == "lora":
        torch.manual_seed(config["lora_seed"])  # the stage seed: peft's A draws
        add_lora(model, config["lora"])
    trainable = trainable_parameters(model)
    run = dict(config=config, settings=settings, model=model, trainable=trainable, rank=rank, world=world,
               device=device, optimizer=make_optimizer([p for _, p in trainable], settings))
    if settings["allow_tf32"] and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    seed_everything(settings["seed"])  # as upstream's trainer, after the model is built
    if args.resume:
        run["state"] = load_checkpoint(run, checkpoints(out)[-1])
        if rank == 0:
            keep_metrics_up_to(out / METRICS, run["state"])
    else:
        run["state"] = dict(step=0, micro_step=0, epoch=0, position=0, base_seed=None)
        if world > 1:
            dist.barrier()  # every process has seen --out empty before rank 0 writes in it
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / RUN_CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=1)))
    return run


def epoch_iterator(run: dict, batches_for_epoch):
    """This epoch's batches from the loop's position: a new epoch draws its base seed first (as upstream's
    DataLoader does when its iterator is made); a resumed one skips what was trained."""
    state = run["state"]
    if state["base_seed"] is None:
        state["base_seed"] = _base_seed()
    rng = torch.get_rng_state()
    batches = iter(batches_for_epoch(state["epoch"], state["base_seed"]))
    for _ in range(state["position"]):
        next(batches)
    torch.set_rng_state(rng)  # making the batches must not move the dropout draws
    return batches


def train_loop(run: dict, batches_for_epoch, out: Path, log):
    """Upstream's loop: micro-steps until `steps` optimizer steps; an exhausted epoch starts the next one
    within the same accumulation; loss / GA backward; sync every GA-th micro-step."""
    settings, state, model, device = run["settings"], run["state"], run["model"], run["device"]
    accum, steps = settings["gradient_accumulation_steps"], settings["steps"]
    bf16 = device.type == "cuda" and settings["mixed_precision"] == "bf16"
    batches = epoch_iterator(run, batches_for_epoch)
    bar = tqdm(total=steps, initial=state["step"], unit="step", desc="train", disable=run["rank"] > 0)
    try:
        while state["step"] < steps:
            batch = next(batches, None)
            if batch is None:
                state.update(epoch=state["epoch"] + 1, position=0, base_seed=None)
                batches = epoch_iterator(run, batches_for_epoch)
                batch = next(batches, None)
                if batch is None:
                    raise UserError(f"epoch {state['epoch']} has no batch: every sample was filtered out")
            state["position"] += 1
            record = dict(micro_step=state["micro_step"], epoch=state["epoch"])
            if "ids" in batch:  # the loader's sample ids: which clips this micro-batch holds
                record["ids"] = list(batch["ids"])
            batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, Tensor)}
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                loss = training_loss(model, batch, run["config"]["checkpointing"])
            (loss / accum).backward()  # accelerate's backward: the GA micro-batches' gradients add up
            log(dict(record, loss=mean_over_processes(loss.item(), run)))
            state["micro_step"] += 1
            if state["micro_step"] % accum:
                continue
            state["step"] += 1
            record = optimizer_step(run, state["step"])
            log(record)
            bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{record['lr']:.2e}")
            bar.update()
            if state["step"] % settings["save_steps"] == 0 or state["step"] == steps:
                save_checkpoint(run, out, state)
    finally:
        bar.close()


def mean_over_processes(value: float, run: dict) -> float:
    if run["world"] == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=run["device"])
    dist.all_reduce(total)
    return total.item() / run["world"]


def data_batches(run: dict):
    """The CLI's batch source: the data config's shards through the loader (several workers, this rank)."""
    config, settings = run["config"], run["settings"]
    shards = train_shards(config["data"], Path(config["data_config"]).parent)
    tokenizer, workers = run["model"].tokenizer, settings["num_workers"]
    return lambda epoch, base_seed: epoch_batches(shards, settings, tokenizer, epoch, base_seed, workers,
                                                  run["rank"], run["world"])


def train(args, batches_for_epoch=None):
    """`train`: a run folder with config.json, metrics.jsonl and checkpoint-N/ (batches_for_epoch(epoch,
    base_seed) -> batches: the data config's loader by default)."""
    rank, world, device = join_processes(common.pick_device(args.device))
    run = start_run(args, rank, world, device)
    out, started = Path(args.out), run["state"]["step"]

    def log(record: dict):
        if rank == 0:
            with open(out / METRICS, "a") as f:
                f.write(json.dumps(record) + "\n")

    n_params = sum(p.numel() for _, p in run["trainable"]) / 1e6
    if rank == 0:
        print(f"{run['config']['method']}: {n_params:.2f} M trained parameters, {world} x {device}",
              file=sys.stderr)
    start = time.perf_counter()
    try:
        train_loop(run, batches_for_epoch or data_batches(run), out, log)
    except KeyboardInterrupt:
        raise UserError(f"interrupted at step {run['state']['step']}: continue from the last checkpoint with"
                        " --resume") from None
    steps = run["state"]["step"] - started
    if rank == 0 and not steps:
        print(f"{out} is already at step {started} of {run['settings']['steps']}: nothing to do")
    elif rank == 0:
        wall = time.perf_counter() - start
        print(f"{steps} steps in {wall:.1f} s ({steps / max(wall, 1e-9):.2f} steps/s), epoch"
              f" {run['state']['epoch']}: wrote {out / (CHECKPOINT_PREFIX + str(run['state']['step']))}")
    return run


# ----------------------------------------------------------------------------- export
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def export(args):
    """`export`: a run's checkpoint -> a checkpoint folder omnivoice.load and upstream's from_pretrained
    read (config.json, model.safetensors, tokenizer, audio_tokenizer/), LoRA merged, + adapter/ (peft's)."""
    run_dir, out = Path(args.run), Path(args.out)
    config = read_json(run_dir / RUN_CONFIG, "run config")
    found = checkpoints(run_dir)
    if args.step is not None:
        found = [p for p in found if p.name == f"{CHECKPOINT_PREFIX}{args.step}"]
    if not found:
        what = f"no checkpoint-{args.step}" if args.step is not None else "no checkpoint yet"
        raise UserError(f"{run_dir} has {what}")
    folder, ckpt = found[-1], Path(config["train_config"]["init_from_checkpoint"])
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty: choose a new folder")
    if not (ckpt / "audio_tokenizer").is_dir():
        raise UserError(f"{ckpt} has no audio_tokenizer/: the exported folder could not speak")
    if config["method"] == "lora":
        model = build_model(ckpt, config["tokenizer"])
        add_lora(model, config["lora"])
        adapter = load_file(folder / ADAPTER_FILE)
        with torch.no_grad():
            for name, p in trainable_parameters(model):
                p.copy_(adapter[peft_name(name)])
        state = model_state(model)
    tokenizer_dir = Path(config["tokenizer"]) if config["tokenizer"] else ckpt

    def write(tmp: Path):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        shutil.copy(ckpt / "config.json", tmp / "config.json")
        if config["method"] == "full":  # already upstream's save_pretrained file
            shutil.copy(folder / "model.safetensors", tmp / "model.safetensors")
        else:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "adapter").mkdir()
            for name in (ADAPTER_FILE, ADAPTER_CONFIG):
                shutil.copy(folder / name, tmp / "adapter" / name)
        for name in TOKENIZER_FILES:  # the overlay's files over the checkpoint's
            source = tokenizer_dir / name if (tokenizer_dir / name).is_file() else ckpt / name
            if source.is_file():
                shutil.copy(source, tmp / name)
        shutil.copytree(ckpt / "audio_tokenizer", tmp / "audio_tokenizer")
    write_atomic(out, write)
    print(f"exported {folder} ({config['method']}) to {out}: python omnivoice.py --checkpoint {out} ...")


# ----------------------------------------------------------------------------- CLI
COMMANDS = dict(train=train, export=export)


def parse_args(argv=None):
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    tokens_parser(sub)
    t = sub.add_parser("train", help="fine-tune (full or LoRA) on stage 0's tokens: a run folder")
    t.add_argument("--train-config", help="upstream's train config JSON (default: its"
                   " train_config_finetune_sdpa.json values); flags below override its fields")
    t.add_argument("--data-config", help="upstream's data config JSON: {\"train\": [{\"manifest_path\":"
                   " [\"tokens/data.lst\"]}]} (relative paths: from its folder)")
    t.add_argument("--out", required=True, help="run folder: config.json, metrics.jsonl, checkpoint-N/")
    t.add_argument("--checkpoint", help="OmniVoice checkpoint to start from (init_from_checkpoint)")
    t.add_argument("--tokenizer", help="folder whose tokenizer.json replaces the checkpoint's (an overlay"
                   " whose size equals the text embedding's rows: the public checkpoint needs one)")
    t.add_argument("--method", choices=["full", "lora"], help="full fine-tuning (default) or LoRA")
    t.add_argument("--lora-config", help="peft LoraConfig keys as JSON: r, lora_alpha, lora_dropout,"
                   " target_modules, modules_to_save (default r 16, alpha 32, dropout 0.05, the seven"
                   " projections)")
    t.add_argument("--lora-seed", type=int, help="torch seed before the adapters are made (default: seed)")
    t.add_argument("--num-workers", type=int, help="loader workers (num_workers; at most the shards)")
    t.add_argument("--max-steps", type=int, help="optimizer steps (steps: also the schedule's length)")
    t.add_argument("--grad-accum", type=int, help="micro-batches per step (gradient_accumulation_steps)")
    t.add_argument("--batch-tokens", type=int, help="tokens per padded micro-batch (batch_tokens)")
    t.add_argument("--lr", type=float, help="peak learning rate (learning_rate)")
    t.add_argument("--save-steps", type=int, help="a checkpoint every N steps (save_steps), and the last")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last"
                   " checkpoint, bit for bit (only --checkpointing and --device may change)")
    t.add_argument("--checkpointing", action="store_true",
                   help="gradient checkpointing of the layers: less memory, one more forward per step")
    t.add_argument("--device", choices=["cpu", "cuda", "mps"], help="default: cuda > mps > cpu")
    e = sub.add_parser("export", help="a run's checkpoint -> a checkpoint folder (LoRA merged) + adapter/")
    e.add_argument("run", help="run folder of `train`")
    e.add_argument("--out", required=True, help="new folder for the checkpoint")
    e.add_argument("--step", type=int, help="which checkpoint-N (default: the last)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        COMMANDS[args.command](args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    common.cli(main)
