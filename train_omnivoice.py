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
import bisect
import io
import itertools
import json
import math
import os
import random
import re
import shutil
import sys
import tarfile
import time
from contextlib import suppress
from pathlib import Path

import numpy as np
import soundfile as sf
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
import omnivoice_codec
import training
from common import AUDIO_EXTENSIONS, UserError, write_atomic
from training import short_list


# ----------------------------------------------------------------------------- tokens
TRANSCRIPT_SUFFIXES = (".lab", ".txt")
CODES_CACHE = ".omnivoice-codes"  # <clip stem> + this: the folder form's codes (np.save bytes), not a .npy
SHARD = "shard-%06d"
MAX_SAMPLE_TOKENS = 2000  # upstream's default max_sample_tokens: longer samples are skipped at training
SHORT_CLIP = 0.5  # seconds: a clip this short is more likely a cut file than speech (said, not refused)


def jsonl_records(path: Path) -> list:
    """Upstream's JSONL input: one object per non-empty line, kept as written (extra fields pass through)."""
    if not path.is_file():
        raise UserError(f"--input-jsonl {path} not found")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 may sit in a text
    except (OSError, UnicodeDecodeError) as e:
        raise common.unreadable(path, e) from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{number} is not a JSON object ({e})") from None
            if not isinstance(record, dict):
                raise UserError(f"{path}:{number} is not a JSON object")
            records.append(record)
    return records


def count_lines(path: Path) -> int:
    """Upstream sizes its shards by the file's newline count, not by the records it reads."""
    return path.read_bytes().count(b"\n")


def read_transcript(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise common.unreadable(path, e) from None


def folder_records(folder: Path) -> list:
    """A folder of clips with same-stem .lab/.txt transcripts (any sub-folders) -> upstream's records
    {id: stem, audio_path, text}, sorted by path."""
    if not folder.is_dir():
        raise UserError(f"data folder {folder} does not exist")
    clips = [p for p in sorted(folder.rglob("*")) if p.suffix.lower() in AUDIO_EXTENSIONS and p.is_file()]
    if not clips:
        raise UserError(f"no audio files under {folder} (looked for {' '.join(sorted(AUDIO_EXTENSIONS))})")
    records, missing = [], []
    for clip in clips:
        transcript = next((t for s in TRANSCRIPT_SUFFIXES if (t := clip.with_suffix(s)).is_file()), None)
        if transcript is None:
            missing.append(clip)
            continue
        records.append(dict(id=clip.stem, audio_path=str(clip.resolve()), text=read_transcript(transcript)))
    if missing:
        raise UserError(f"{len(missing)} clip(s) have no .lab/.txt transcript: {short_list(missing)}")
    return records


def check_records(records: list, base: Path, where: str) -> list:
    """Every record's id, text and clip checked before anything is encoded -> the clips' paths."""
    if not records:
        raise UserError(f"{where} holds no records")
    seen, paths = set(), []
    for record in records:
        key = record.get("id")
        if not isinstance(key, str) or not key or "." in key or "/" in key:
            # the tar reader takes a member's key up to its first dot; ids join labels to codes
            raise UserError(f"{where}: id {key!r} must be a non-empty string without '.' or '/'")
        if key in seen:
            raise UserError(f"{where}: id {key!r} appears twice")
        seen.add(key)
        text = record.get("text")
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{where}: {key} has a missing or empty transcript (text)")
        if not isinstance(record.get("audio_path"), str):
            raise UserError(f"{where}: {key} has no audio_path")
        path = base / record["audio_path"]  # an absolute audio_path stays as it is
        try:
            info = sf.info(str(path))
        except Exception as e:
            detail = str(e).strip().splitlines()[-1]
            raise UserError(f"{where}: {key}: {path} is not a readable audio file ({detail})") from None
        if info.frames == 0:
            raise UserError(f"{where}: {key}: {path} contains no audio samples")
        paths.append(path)
    return paths


def audio_tokenizer(checkpoint: Path, device) -> omnivoice_codec.AudioTokenizer:
    """An OmniVoice checkpoint folder (or its audio_tokenizer/ itself) -> the codec, or one clear line."""
    if (checkpoint / "audio_tokenizer").is_dir():
        return omnivoice_codec.load(checkpoint / "audio_tokenizer", device)
    with suppress(OSError, ValueError, KeyError, TypeError):
        if json.loads((checkpoint / "config.json").read_text())["model_type"] == "higgs_audio_v2_tokenizer":
            return omnivoice_codec.load(checkpoint, device)
    raise UserError(f"{checkpoint} has no audio_tokenizer/: pass a k2-fsa/OmniVoice checkpoint (an S2-Pro"
                    " checkpoint trains with train_lora.py)")


def codec_input(path: Path, tokenizer) -> tuple:
    """Upstream's audio arithmetic -> (wave [1, 1, T * hop] zero-padded on the right, samples before padding):
    channels averaged, resampled to the codec's rate, peak at 0.9."""
    wave = torch.from_numpy(np.ascontiguousarray(omnivoice.read_clip(path, tokenizer.sample_rate)))
    if not torch.isfinite(wave).all():
        raise UserError(f"{path} has NaN or infinite samples")
    peak = wave.abs().max()
    if peak == 0:
        raise UserError(f"{path} is silent (every sample is 0)")
    wave = wave / (peak + 1e-7) * 0.9
    n = wave.shape[-1]
    # the feature extractor pads to whole hops, so the codec never takes its own padding route
    return F.pad(wave, (0, -n % tokenizer.hop_length))[None], n


def npy_bytes(codes: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, codes)
    return buffer.getvalue()


def encode_clip(path: Path, tokenizer, cache: Path = None) -> tuple:
    """A clip -> (its tar member's bytes: np.save of the int16 codes [C, T], seconds, encoded?); `cache`
    (the folder form's) is reused when it is newer than the clip."""
    wave, n = codec_input(path, tokenizer)
    if cache is not None and cache.is_file() and cache.stat().st_mtime >= path.stat().st_mtime:
        return cache.read_bytes(), n / tokenizer.sample_rate, False
    codes = tokenizer.encode(wave)[0].to(torch.int16).cpu().numpy()
    data = npy_bytes(codes)
    if cache is not None:
        common.write_atomic(cache, lambda tmp: tmp.write_bytes(data))
    return data, n / tokenizer.sample_rate, True


def shard_size(total: int, samples_per_shard: int, min_num_shards: int) -> int:
    """Upstream's rule: fewer shards than min_num_shards -> total // min_num_shards samples per shard."""
    if total > 0 and max(1, math.ceil(total / samples_per_shard)) < min_num_shards:
        return max(1, total // min_num_shards)
    return samples_per_shard


def write_tar(path: Path, members: list):
    """[(id, npy bytes)] -> a tar of <id>.npy members, in order (what webdataset's TarWriter writes)."""
    with tarfile.open(path, "w") as tar:
        for key, data in members:
            info = tarfile.TarInfo(f"{key}.npy")
            info.size, info.mode, info.mtime = len(data), 0o444, time.time()
            tar.addfile(info, io.BytesIO(data))


def write_tokens(folder: Path, final: Path, samples: list, per_shard: int) -> int:
    """[(label, npy bytes)] in order -> folder/audios/*.tar, txts/*.jsonl and data.lst (paths of `final`,
    absolute, as upstream writes them) -> shards written."""
    (folder / "audios").mkdir(parents=True)
    (folder / "txts").mkdir()
    lines = []
    for index, start in enumerate(range(0, len(samples), per_shard)):
        shard = samples[start:start + per_shard]
        write_tar(folder / "audios" / f"{SHARD % index}.tar", [(label["id"], data) for label, data in shard])
        # upstream drops None values and keeps non-ASCII text as it is
        kept = [{k: v for k, v in label.items() if v is not None} for label, _ in shard]
        text = "".join(json.dumps(label, ensure_ascii=False) + "\n" for label in kept)
        (folder / "txts" / f"{SHARD % index}.jsonl").write_text(text, encoding="utf-8")
        duration = 0.0
        for label, _ in shard:
            duration += label["audio_duration"]
        tar, jsonl = (os.path.abspath(final / sub / f"{SHARD % index}{ext}")
                      for sub, ext in (("audios", ".tar"), ("txts", ".jsonl")))
        lines.append(f"{tar} {jsonl} {len(shard)} {duration:.3f}\n")
    (folder / "data.lst").write_text("".join(lines), encoding="utf-8")
    return len(lines)


def replace_folder(tmp: Path, out: Path):
    """tmp becomes out; an earlier tokens folder at out is replaced only once tmp is complete."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def tokens_input(args) -> tuple:
    """-> (records in the reader's order, {id: clip path}, the count upstream sizes shards by)."""
    if (args.folder is None) == (args.input_jsonl is None):
        raise UserError("give either --input-jsonl DATA.jsonl or a FOLDER of clips with transcripts")
    if args.language_id is not None and args.folder is None:
        raise UserError("--language-id is for a FOLDER of clips: a JSONL's lines carry their own language_id")
    if args.folder is not None:
        folder = Path(args.folder)
        records, base, where = folder_records(folder), folder, str(folder)
        if args.language_id is not None:  # what a JSONL line's language_id says: <|lang_start|>ID<|lang_end|>
            records = [dict(r, language_id=args.language_id) for r in records]
        total = len(records)
        if not os.access(folder, os.W_OK):
            raise UserError(f"cannot cache codes in {folder}: the folder is not writable")
    else:
        path = Path(args.input_jsonl)
        records, base, where = jsonl_records(path), path.parent, str(path)
        total = count_lines(path)
    clips = dict(zip((r["id"] for r in records), check_records(records, base, where)))
    if not args.no_shuffle:
        random.Random(args.shuffle_seed).shuffle(records)  # upstream reseeds the global random: same order
    return records, clips, total


def encode_records(records: list, clips: dict, tokenizer, cached: bool) -> tuple:
    """-> ([(label: the record + audio_duration + num_tokens, npy bytes)], clips encoded)."""
    samples, encoded = [], 0
    for record in tqdm(records, desc="encode", unit="clip"):
        path = clips[record["id"]]
        data, seconds, fresh = encode_clip(path, tokenizer, path.with_name(path.stem + CODES_CACHE)
                                           if cached else None)
        encoded += fresh
        frames = np.load(io.BytesIO(data)).shape[1]
        samples.append((dict(record, audio_duration=seconds, num_tokens=frames), data))
    return samples, encoded


def make_tokens(args):
    """`tokens`: upstream's extract_audio_tokens on a JSONL (or a folder of clips) -> OUT/data.lst, audios/,
    txts/, in the reader's order (upstream's own with one encoding job at a time)."""
    if args.samples_per_shard < 1 or args.min_num_shards < 1:
        raise UserError("--samples-per-shard and --min-num-shards must be at least 1")
    out = Path(os.path.abspath(args.out))  # data.lst names it (as upstream: absolute, links kept)
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / "data.lst").is_file()):
        raise UserError(f"--out {out} exists and is not a tokens folder (no data.lst): choose a new folder")
    records, clips, total = tokens_input(args)
    tokenizer = audio_tokenizer(Path(args.checkpoint), common.pick_device(args.device))
    per_shard = shard_size(total, args.samples_per_shard, args.min_num_shards)
    start, tmp = time.perf_counter(), out.with_name(f".{out.name}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        samples, encoded = encode_records(records, clips, tokenizer, cached=args.folder is not None)
        shards = write_tokens(tmp, out, samples, per_shard)
        replace_folder(tmp, out)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.folder is not None:
        print(f"{len(samples) - encoded} clip(s) reused their cached codes (<clip>{CODES_CACHE}, newer than"
              " the clip)")
    if long := sum(label["num_tokens"] > MAX_SAMPLE_TOKENS for label, _ in samples):
        print(f"note: {long} clip(s) have more than {MAX_SAMPLE_TOKENS} frames: training skips them"
              " (upstream's max_sample_tokens)")
    if short := [label["id"] for label, _ in samples if label["audio_duration"] < SHORT_CLIP]:
        print(f"note: {len(short)} clip(s) last under {SHORT_CLIP} s ({short_list(short)}): check"
              " them (training takes them as they are)")
    hours = sum(label["audio_duration"] for label, _ in samples) / 3600
    print(f"tokens: {len(samples)} clips ({hours:.3f} h) in {shards} shard(s) of up to {per_shard} -> {out}"
          f" ({encoded} encoded in {time.perf_counter() - start:.1f} s)")


# ----------------------------------------------------------------------------- data
SHUFFLE_BUFFER, SHUFFLE_INITIAL = 20000, 100  # webdataset's sample shuffle as upstream configures it
NUM_BUCKETS = 20  # StreamLengthGroupDataset's length buckets
IGNORE = -100  # label of positions without loss
STYLE_TOKENS = ("<|denoise|>", "<|lang_start|>", "<|lang_end|>", "<|instruct_start|>", "<|instruct_end|>",
                "<|text_start|>", "<|text_end|>")
PAD_TOKEN = "<|endoftext|>"


def read_manifest(path: Path) -> list:
    """data.lst -> [(tar, label jsonl, count, seconds)]. Relative paths are taken from data.lst's folder
    (upstream reads them from the working folder, but writes absolute ones)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise common.unreadable(path, e) from None
    shards = []
    for number, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        try:
            tar, jsonl, count, seconds = parts
            shards.append((Path(path).parent / tar, Path(path).parent / jsonl, int(count), float(seconds)))
        except ValueError:
            raise UserError(f"{path}:{number}: expected 'tar_path label_jsonl_path num_items num_seconds'")\
                from None
    return shards


def train_shards(data_config: dict, base: Path, split="train") -> list:
    """Upstream's data config {"train": [{"manifest_path": [...], "repeat": n}], "dev": [...]} -> the shards
    of `split`, each manifest's repeated `repeat` times, in order; relative manifest paths from `base`."""
    if not isinstance(data_config, dict) or not isinstance(data_config.get(split, []), list):
        raise UserError(f"data config: '{split}' must be a list of {{\"manifest_path\": [...]}}")
    if split == "train" and not data_config.get("train"):
        raise UserError("data config has no 'train' entries")
    shards = []
    for item in data_config.get(split, []):
        paths = item.get("manifest_path") if isinstance(item, dict) else None
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise UserError(f"data config: each '{split}' entry needs \"manifest_path\": [list of data.lst]")
        if unknown := sorted(set(item) - {"manifest_path", "repeat", "language_id"}):  # language_id: a label
            raise UserError(f"data config: unknown field(s) {', '.join(unknown)} in a '{split}' entry")
        repeat = item.get("repeat", 1)
        if not isinstance(repeat, int) or repeat < 0:
            raise UserError(f"data config: repeat {repeat!r} is not a whole number")
        for manifest in paths:
            manifest = Path(base) / manifest
            if not manifest.is_file():
                raise UserError(f"data config: manifest {manifest} not found")
            shards.extend(read_manifest(manifest) * repeat)
    return shards


def draw_base_seed() -> int:
    """What creating a DataLoader iterator draws from the global torch generator: its workers' base seed."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def worker_seed(base_seed: int, worker: int, num_workers: int, rank: int) -> int:
    # torch seeds worker w with base + w; transformers' seed_worker reseeds it with that mod 2**32 plus
    # num_workers x rank (python random, numpy and torch)
    return (base_seed + worker) % 2 ** 32 + num_workers * rank


def worker_shards(shards: list, epoch: int, num_workers: int, rank: int, world: int,
                  evaluation=False) -> list:
    """Each loader worker's shards on this rank: the list shuffled by random.Random(epoch) (training), then
    split as upstream's WebDataset splits it (checked in webdataset 1.0.2): split_by_node first (every
    world-th from rank; it reads RANK and WORLD_SIZE, which torchrun sets, else torch.distributed), then
    split_by_worker (every num_workers-th of those); its shard shuffle after them is a no-op
    (shardshuffle=False). Upstream hands the loader to no accelerate wrapper: each rank runs its own, with the
    same base seed (set_seed is not per device) and worker seeds offset by rank (worker_seed)."""
    shards = list(shards)
    if not evaluation:
        random.Random(epoch).shuffle(shards)
    mine = shards[rank::world]
    split = [mine[w::num_workers] for w in range(num_workers)]
    if not all(split):
        raise UserError(f"{len(shards)} shard(s) for {num_workers} loader worker(s) x {world} process(es):"
                        " each worker needs one (upstream fails alike); lower --num-workers, or re-run tokens"
                        " with a larger --min-num-shards")
    return split


def read_labels(path: Path) -> dict:
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
        items = [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise common.unreadable(path, e) from None
    return {item["id"]: item for item in items if isinstance(item, dict) and "id" in item}


def read_shard(tar_path: Path, jsonl_path: Path):
    """A shard -> its samples {id, label, codes [C, T]} in member order (members <id>.npy; the key
    is the name up to its first dot, as webdataset's)."""
    labels = read_labels(jsonl_path)
    try:
        with tarfile.open(tar_path) as tar:
            for member in tar:
                if not member.isreg() or member.name.startswith("__"):
                    continue
                key, _, ext = member.name.partition(".")
                if ext.lower() != "npy":
                    raise UserError(f"{tar_path}: member {member.name} is not <id>.npy codes")
                if key not in labels:
                    raise UserError(f"{jsonl_path} has no label for id {key} of {tar_path}")
                codes = np.load(io.BytesIO(tar.extractfile(member).read()))
                if codes.ndim != 2 or codes.dtype.kind not in "iu":
                    raise UserError(f"{tar_path}: {member.name} is not integer codes [codebooks, frames]")
                yield dict(id=key, label=labels[key], codes=torch.from_numpy(codes))  # int16 while buffered
    except (OSError, tarfile.TarError, ValueError) as e:
        if isinstance(e, UserError):
            raise
        raise common.unreadable(tar_path, e) from None


def shuffled(samples, rng: random.Random, bufsize=SHUFFLE_BUFFER, initial=SHUFFLE_INITIAL):
    """webdataset's buffer shuffle: read one sample and one more while the buffer is short of bufsize; once it
    holds `initial`, emit a random one (its slot takes the last); at the end emit the rest the same way."""
    def pick(buffer):
        k = rng.randint(0, len(buffer) - 1)
        sample, buffer[k] = buffer[k], buffer[-1]
        buffer.pop()
        return sample
    samples, buffer, initial = iter(samples), [], min(initial, bufsize)
    for sample in samples:
        buffer.append(sample)
        if len(buffer) < bufsize:
            buffer.extend(itertools.islice(samples, 1))
        if len(buffer) >= initial:
            yield pick(buffer)
    while buffer:
        yield pick(buffer)


def text_ids(tokenizer, text: str, rows: int) -> Tensor:
    """The plain tokenizer call (Qwen's post-processor adds nothing), repeated on every codebook row."""
    return torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)[None].repeat(rows, 1)


def process_sample(sample: dict, settings: dict, tokenizer, rng: random.Random, generator) -> dict:
    """upstream's OmniVoiceSampleProcessor: condition dropout, prompt and mask ratios (python random, in this
    order), the mask from torch.rand -> {id, input_ids [C, L], labels [C, L], audio_mask [L], length}."""
    label, codes = sample["label"], sample["codes"].long()
    rows = settings["num_audio_codebook"]
    if codes.shape[0] != rows:  # upstream would skip every such sample with a warning
        raise UserError(f"sample {sample['id']} has {codes.shape[0]} codebooks, the train config's"
                        f" num_audio_codebook is {rows}")
    denoise = "clean_start_token_idx" in label
    drop_cond = False if denoise else rng.uniform(0, 1) < settings["drop_cond_ratio"]
    prompt_ratio, use_language, use_instruct = 0.0, False, False
    if not drop_cond:
        prompt_ratio = rng.uniform(*settings["prompt_ratio_range"])
        use_language = rng.uniform(0, 1) < settings["language_ratio"]
        use_instruct = rng.uniform(0, 1) < settings["instruct_ratio"]  # drawn even when the ratio is 0
        if use_instruct and rng.uniform(0, 1) < settings["only_instruct_ratio"]:
            prompt_ratio = 0.0
    mask_ratio = rng.uniform(*settings["mask_ratio_range"])
    language = label.get("language_id", "None") if use_language else "None"
    instruct = label.get("instruct", "None") if use_instruct else "None"
    # upstream's training f-string, not inference's style_prefix: an empty language_id stays empty here
    style = ("<|denoise|>" if denoise else "") + f"<|lang_start|>{language}<|lang_end|>"
    style += f"<|instruct_start|>{instruct}<|instruct_end|>"
    if "text_pinyin" in label and rng.uniform(0, 1) < settings["use_pinyin_ratio"]:
        text = label["text_pinyin"]
    elif isinstance(label.get("text"), str):
        text = label["text"]
    else:  # upstream would skip the sample with a warning
        raise UserError(f"sample {sample['id']} has no text in its label")
    prompt = label["clean_start_token_idx"] if denoise else int(codes.shape[1] * prompt_ratio)
    # torch compares its float32 draws with the ratio rounded to float32
    masked = torch.rand(codes[:, prompt:].shape, generator=generator) < mask_ratio
    inputs, labels = codes.clone(), codes.clone()
    inputs[:, prompt:][masked] = settings["audio_mask_id"]
    labels[:, prompt:][~masked] = IGNORE
    if not drop_cond:
        labels[:, :prompt] = IGNORE
    if drop_cond:
        audio_mask = torch.ones(codes.shape[1], dtype=torch.bool)
    else:
        context = torch.cat([text_ids(tokenizer, style, rows),
                             text_ids(tokenizer, f"<|text_start|>{text}<|text_end|>", rows)], dim=1)
        inputs = torch.cat([context, inputs], dim=1)
        labels = torch.cat([torch.full_like(context, IGNORE), labels], dim=1)
        audio_mask = torch.arange(inputs.shape[1]) >= context.shape[1]
    return dict(id=sample["id"], input_ids=inputs, labels=labels, audio_mask=audio_mask,
                length=inputs.shape[1])


def length_groups(samples, settings: dict, dropped: list = None):
    """StreamLengthGroupDataset: samples outside [min, max]_sample_tokens are skipped (after their draws);
    20 buckets up to linspace(min, max, 21)[1:]; a bucket is emitted once (its longest) x (count + 1) >=
    batch_tokens or count >= max_batch_size; at the end the rest, in bucket order."""
    low, high = settings["min_sample_tokens"], settings["max_sample_tokens"]
    bounds = np.linspace(low, high, NUM_BUCKETS + 1)[1:].tolist()
    buckets, longest = [[] for _ in range(NUM_BUCKETS)], [0.0] * NUM_BUCKETS
    for sample in samples:
        length = sample["length"]
        if length < low or length > high:
            if dropped is not None:
                dropped.append(sample["id"])
            continue
        b = bisect.bisect_left(bounds, length)
        buckets[b].append(sample)
        longest[b] = max(longest[b], length)
        if longest[b] * (len(buckets[b]) + 1) >= settings["batch_tokens"] or \
                len(buckets[b]) >= settings["max_batch_size"]:
            yield buckets[b]
            buckets[b], longest[b] = [], 0.0
    yield from (bucket for bucket in buckets if bucket)


def collate(samples: list, pad_id: int) -> dict:
    """PaddingDataCollator: right-padded to the longest; every query attends to the row's real keys."""
    n = max(s["length"] for s in samples)
    pad = [n - s["length"] for s in samples]
    valid = torch.stack([torch.arange(n) < s["length"] for s in samples])  # (B, L)
    return dict(
        input_ids=torch.stack([F.pad(s["input_ids"], (0, p), value=pad_id) for s, p in zip(samples, pad)]),
        labels=torch.stack([F.pad(s["labels"], (0, p), value=IGNORE) for s, p in zip(samples, pad)]),
        audio_mask=torch.stack([F.pad(s["audio_mask"], (0, p), value=False) for s, p in zip(samples, pad)]),
        position_ids=torch.where(valid, torch.arange(n), 0),
        attention_mask=valid[:, None, None, :].expand(len(samples), 1, n, n).contiguous(),  # (B, 1, L, L)
        ids=[s["id"] for s in samples])


def worker_batches(shards: list, settings: dict, tokenizer, epoch: int, seed: int, pad_id: int,
                   dropped: list = None, evaluation=False):
    """One loader worker's batches. Its python random and torch generator are seeded as upstream's worker
    seeds its global ones (torch.Generator().manual_seed(s) gives the same CPU stream as torch.manual_seed(s):
    checked); webdataset's constructor then spends one randint on a seed it never uses."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    rng.randint(0, 1000000)
    samples = itertools.chain.from_iterable(read_shard(tar, jsonl) for tar, jsonl, _, _ in shards)
    if not evaluation:
        samples = shuffled(samples, random.Random(epoch))
    processed = (process_sample(s, settings, tokenizer, rng, generator) for s in samples)
    for group in length_groups(processed, settings, dropped):
        yield collate(group, pad_id)


def epoch_batches(shards: list, settings: dict, tokenizer, epoch: int, base_seed: int, num_workers: int,
                  rank: int = 0, world: int = 1, dropped: list = None, evaluation=False):
    """One epoch of upstream's loader on this rank, its workers simulated in-process: batch dicts (input_ids,
    labels [B, C, L], audio_mask, position_ids [B, L], attention_mask [B, 1, L, L], ids, worker) from the
    workers in turn, an exhausted worker skipped. `dropped` collects the ids the length filter skips."""
    if num_workers < 1:
        raise UserError("num_workers must be at least 1 (upstream's loader always runs workers)")
    if missing := [t for t in (PAD_TOKEN, *STYLE_TOKENS) if tokenizer.token_to_id(t) is None]:
        raise UserError(f"the tokenizer has no {', '.join(missing)}: give an OmniVoice checkpoint's one")
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    streams = [worker_batches(part, settings, tokenizer, epoch, worker_seed(base_seed, w, num_workers, rank),
                              pad_id, dropped, evaluation)
               for w, part in enumerate(worker_shards(shards, epoch, num_workers, rank, world, evaluation))]
    active = list(range(num_workers))
    while active:
        for w in list(active):
            batch = next(streams[w], None)
            if batch is None:
                active.remove(w)
            else:
                yield dict(batch, worker=w)


# ----------------------------------------------------------------------------- model
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


OVERLAY_TOKEN = "<|ov_train_pad_{}|>"  # placeholders no text matches, up to the text embedding's rows


def tokenizer_overlay(args):
    """`overlay`: the checkpoint's tokenizer.json plus placeholder tokens up to its text embedding's rows, so
    that training keeps the whole table (upstream's builder would shrink it to the tokenizer and then fail
    on the audio ids it looks up there)."""
    from tokenizers import AddedToken
    ckpt, out = Path(args.checkpoint), Path(args.out)
    cfg = checkpoint_config(ckpt)
    if not (ckpt / "tokenizer.json").is_file():
        raise UserError(f"checkpoint dir {ckpt} has no tokenizer.json — give an OmniVoice checkpoint")
    tokenizer = common.load_tokenizer(ckpt / "tokenizer.json")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > cfg["vocab_size"]:
        raise UserError(f"{ckpt}: the tokenizer has {size} tokens, more than the {cfg['vocab_size']} rows"
                        " of the text embedding: no overlay can help")
    tokenizer.add_tokens([AddedToken(OVERLAY_TOKEN.format(i), normalized=False, special=False)
                          for i in range(cfg["vocab_size"] - size)])
    out.mkdir(parents=True, exist_ok=True)
    common.write_atomic(out / "tokenizer.json", lambda tmp: tmp.write_text(tokenizer.to_str(pretty=True)))
    print(f"wrote {out / 'tokenizer.json'}: {size} tokens + {cfg['vocab_size'] - size} placeholders;"
          f" train with --tokenizer {out}")


def checkpoint_config(ckpt: Path) -> dict:
    if not (ckpt / "config.json").is_file():
        raise UserError(f"checkpoint dir {ckpt} has no config.json — download k2-fsa/OmniVoice"
                        " (see README)")
    return omnivoice.read_config(ckpt / "config.json", s2_use="fine-tune it with train_lora.py")


def build_model(checkpoint, tokenizer_dir=None, device="cpu") -> omnivoice.OmniVoice:
    """The checkpoint's LM in fp32 for training (no audio tokenizer), .tokenizer from the checkpoint or the
    --tokenizer overlay, .codebook_weights upstream's normalized loss weights."""
    ckpt = Path(checkpoint)
    cfg = checkpoint_config(ckpt)
    source = Path(tokenizer_dir) if tokenizer_dir else ckpt
    if not (source / "tokenizer.json").is_file():
        raise UserError(f"{source} has no tokenizer.json")
    tokenizer = common.load_tokenizer(source / "tokenizer.json")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != cfg["vocab_size"]:  # upstream resizes the table and then fails on the audio ids it looks up
        raise UserError(f"{source / 'tokenizer.json'} has {size} tokens, {ckpt}'s text embedding"
                        f" {cfg['vocab_size']} rows: pass --tokenizer DIR, an overlay padded to"
                        f" {cfg['vocab_size']} (`train_omnivoice.py overlay --checkpoint {ckpt} --out DIR`)")
    if missing := [t for t in STYLE_TOKENS if tokenizer.token_to_id(t) is None]:
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
    cos, sin = (table.to(x.dtype) for table in model.rope(ids.shape[2], positions, x.device))
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
    audio_vocab_size=None, audio_mask_id=None, num_audio_codebook=None, drop_cond_ratio=0.1,
    prompt_ratio_range=[0.0, 0.3], mask_ratio_range=[0.0, 1.0], language_ratio=0.8,
    use_pinyin_ratio=0.0, instruct_ratio=0.0, only_instruct_ratio=0.0, resume_from_checkpoint=None,
    init_from_checkpoint=None, learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0, steps=5000, seed=42,
    lr_scheduler_type="cosine", warmup_type="ratio", warmup_ratio=0.01, warmup_steps=0, batch_tokens=8192,
    gradient_accumulation_steps=1, num_workers=2, mixed_precision="bf16", allow_tf32=True,
    max_sample_tokens=2000, min_sample_tokens=50, max_batch_size=64, save_steps=500,
    keep_last_n_checkpoints=3)  # upstream's -1 keeps all: 7.2 GB each at the real size, a disk in 5,000 steps
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
# settings a resumed run may change: they do not change the numbers
RESUMABLE = ("checkpointing", "device", "train_config.keep_last_n_checkpoints")


def read_json(path, what: str) -> dict:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} {path} does not exist")
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder, not a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # OSError: unreadable (permissions); ValueError: not JSON, not UTF-8
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


def checkpoint_codebooks(settings: dict):
    """The processor's codebook fields (upstream reads them from the train config alone): the checkpoint's
    where the config leaves them out; one that disagrees is refused (upstream skipped every sample)."""
    ckpt = Path(settings["init_from_checkpoint"])
    cfg = checkpoint_config(ckpt)
    for key, ours in (("audio_vocab_size", "audio_vocab_size"), ("audio_mask_id", "audio_mask_id"),
                      ("num_audio_codebook", "num_codebooks")):
        if settings[key] is None:
            settings[key] = cfg[ours]
        elif settings[key] != cfg[ours]:
            raise UserError(f"the train config's {key} is {settings[key]!r}, {ckpt}/config.json's"
                            f" {cfg[ours]!r}: leave it out or give the checkpoint's")


def absolute(path) -> str:  # what a run records: its paths then mean the same from any folder
    return os.path.abspath(os.path.expanduser(str(path)))


def run_config(args, stored: dict = None) -> dict:
    """What a run is: train settings (the config file, else the stored run's, then the flags), method,
    LoRA, tokenizer, data config; `stored`: the run being resumed, whose choices fill what is not given.
    Paths given are recorded absolute (a stored run's as stored)."""
    stored = stored or {}
    if args.train_config:
        settings = train_settings(read_json(args.train_config, "--train-config"), args.train_config)
    else:
        source = "the run's config" if stored else "the defaults"
        settings = train_settings(stored.get("train_config", {}), source)
    flags = dict(init_from_checkpoint=args.checkpoint, num_workers=args.num_workers, steps=args.max_steps,
                 gradient_accumulation_steps=args.grad_accum, batch_tokens=args.batch_tokens,
                 learning_rate=args.lr, save_steps=args.save_steps, keep_last_n_checkpoints=args.keep_last)
    settings.update({k: v for k, v in flags.items() if v is not None})
    if not settings["init_from_checkpoint"]:
        raise UserError("no checkpoint: give --checkpoint DIR or init_from_checkpoint in --train-config")
    if settings["init_from_checkpoint"] != stored.get("train_config", {}).get("init_from_checkpoint"):
        settings["init_from_checkpoint"] = absolute(settings["init_from_checkpoint"])
    checkpoint_codebooks(settings)
    for key in ("steps", "gradient_accumulation_steps", "batch_tokens", "num_workers", "save_steps"):
        if not isinstance(settings[key], int) or settings[key] < 1:
            raise UserError(f"{key} must be an integer >= 1 (it is {settings[key]!r})")
    keep = settings["keep_last_n_checkpoints"]
    if not isinstance(keep, int) or isinstance(keep, bool) or not (keep == -1 or keep >= 1):
        raise UserError(f"keep_last_n_checkpoints must be -1 (all) or an integer >= 1 (it is {keep!r})")
    lr = settings["learning_rate"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise UserError(f"learning_rate must be a number > 0 (it is {lr!r})")  # torch's own: a traceback
    data_config = absolute(args.data_config) if args.data_config else stored.get("data_config")
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
                tokenizer=absolute(args.tokenizer) if args.tokenizer else stored.get("tokenizer"),
                data_config=str(data_config), data=read_json(data_config, "--data-config"),
                checkpointing=args.checkpointing, device=args.device)


def resumed_config(args, out: Path) -> dict:
    """--resume: the stored run's config; what the command line gives must not change it."""
    stored = read_json(out / RUN_CONFIG, "run config")
    config = run_config(args, stored)
    changes = []  # (key, stored, given)
    for key in list(config) + [k for k in stored if k not in config]:
        old, new = stored.get(key), config.get(key)
        if key == "train_config" and isinstance(old, dict):
            changes += [(f"train_config.{k}", old.get(k), new.get(k)) for k in sorted(set(old) | set(new))]
        else:
            changes.append((key, old, new))
    for key, old, new in changes:
        if key not in RESUMABLE and old != new:
            raise UserError(f"--resume: {out} was started with {key}={old!r}, this command gives {new!r}:"
                            " resume with the same settings, or start a new run")
    return config


def seed_everything(seed: int):
    """accelerate's set_seed: Python's random, numpy and torch (every device) from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
    C, V = model.config["num_codebooks"], model.config["audio_vocab_size"]
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
    need = sum(p.numel() * 4 * 3 for _, p in run["trainable"])  # fp32 weights (adapters), AdamW's 2 moments
    free = shutil.disk_usage(out).free
    if free < need:
        raise UserError(f"step {state['step']}: {out} has {free / 1e9:.2f} GB free, a checkpoint needs"
                        f" {need / 1e9:.2f} GB: free some space (--keep-last N keeps fewer), then --resume")
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
    over = stopped_early(out)
    if args.resume:
        if over:
            raise UserError(f"--resume: {out}'s run stopped before its first checkpoint: run the same command"
                            " without --resume to start it over")
        if not (out / RUN_CONFIG).is_file() or not checkpoints(out):
            raise UserError(f"--resume: {out} holds no run with a checkpoint ({RUN_CONFIG} + checkpoint-N/)")
        config = resumed_config(args, out)
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not over:
            raise UserError(f"--out {out} is not empty: pass --resume to continue its run, or another --out")
        config = run_config(args)
    settings = config["train_config"]
    model = build_model(settings["init_from_checkpoint"], config["tokenizer"], device)
    if settings["num_audio_codebook"] != model.config["num_codebooks"] or \
            settings["audio_mask_id"] != model.config["audio_mask_id"]:  # upstream would skip every sample
        raise UserError(f"train config: num_audio_codebook {settings['num_audio_codebook']} / audio_mask_id"
                        f" {settings['audio_mask_id']}, the checkpoint's {model.config['num_codebooks']} /"
                        f" {model.config['audio_mask_id']}: make them equal")
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
        run["resumed"] = checkpoints(out)[-1]
        run["state"] = load_checkpoint(run, run["resumed"])
        if rank == 0:
            keep_metrics_up_to(out / METRICS, run["state"])
    else:
        run["state"] = dict(step=0, micro_step=0, epoch=0, position=0, base_seed=None)
        if world > 1:
            dist.barrier()  # every process has seen --out empty before rank 0 writes in it
        if rank == 0:
            if over:
                print(f"{out}: its run stopped before its first checkpoint: starting over", file=sys.stderr)
                (out / METRICS).unlink(missing_ok=True)
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / RUN_CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=1)))
    return run


def stopped_early(out: Path) -> bool:
    """Whether `out` holds only a run that stopped before its first checkpoint (its config and metrics):
    nothing to resume from, nothing lost by starting it over."""
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    return RUN_CONFIG in names and names <= {RUN_CONFIG, METRICS} and not checkpoints(out)


def epoch_iterator(run: dict, batches_for_epoch):
    """This epoch's batches from the loop's position: a new epoch draws its base seed first (as upstream's
    DataLoader does when its iterator is made); a resumed one skips what was trained."""
    state = run["state"]
    if state["base_seed"] is None:
        state["base_seed"] = draw_base_seed()
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
            if "ids" in batch:  # the loader's sample ids: which clips this micro-batch holds, every process's
                record["ids"] = [i for ids in from_every_process(list(batch["ids"]), run) for i in ids]
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


def from_every_process(value, run: dict) -> list:  # [rank 0's value, rank 1's, ...]
    if run["world"] == 1:
        return [value]
    values = [None] * run["world"]
    dist.all_gather_object(values, value)
    return values


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
    tokenizer, workers, run["dropped"] = run["model"].tokenizer, settings["num_workers"], []
    return lambda epoch, base_seed: epoch_batches(shards, settings, tokenizer, epoch, base_seed, workers,
                                                  run["rank"], run["world"], dropped=run["dropped"])


def run_notes(run: dict) -> list:
    """What a user should know of the run before it starts: where a resumed one continues from, what of the
    configs does not apply here."""
    notes, config, settings = [], run["config"], run["settings"]
    if "resumed" in run:
        notes.append(f"resumed from {run['resumed']} (step {run['state']['step']} of {settings['steps']})")
    if isinstance(config.get("data"), dict) and config["data"].get("dev"):
        notes.append("the data config's 'dev' entries are not read (no dev-set evaluation)")
    if settings["mixed_precision"] == "bf16" and run["device"].type != "cuda":
        notes.append(f"mixed_precision bf16 applies on CUDA: this {run['device'].type} run trains in fp32")
    return notes


def train(args, batches_for_epoch=None):
    """`train`: a run folder with config.json, metrics.jsonl and checkpoint-N/ (batches_for_epoch(epoch,
    base_seed) -> batches: the data config's loader by default)."""
    rank, world, device = training.join_processes(common.pick_device(args.device))
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
        for note in run_notes(run):
            print(f"note: {note}", file=sys.stderr)
    start = time.perf_counter()
    try:
        train_loop(run, batches_for_epoch or data_batches(run), out, log)
    except KeyboardInterrupt:
        last = checkpoints(out)
        if not last:
            raise UserError(f"interrupted at step {run['state']['step']}, before the first checkpoint: run"
                            " the same command again to start over") from None
        raise UserError(f"interrupted at step {run['state']['step']}: continue from {last[-1]} with"
                        " --resume") from None
    steps = run["state"]["step"] - started
    dropped = sorted(set().union(*from_every_process(sorted(run.get("dropped", ())), run)))  # every process's
    if rank == 0 and dropped:  # upstream's length filter, said and logged rather than silent
        log(dict(skipped=dropped))
        low, high = run["settings"]["min_sample_tokens"], run["settings"]["max_sample_tokens"]
        print(f"{len(dropped)} samples skipped by the length filter ({short_list(dropped)}):"
              f" outside {low}-{high} tokens with their text (min_sample_tokens, max_sample_tokens)",
              file=sys.stderr)
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
    tokenizer_dir = Path(config["tokenizer"]) if config["tokenizer"] else ckpt
    if not (tokenizer_dir / "tokenizer.json").is_file():  # never another tokenizer than the run's
        raise UserError(f"the run's tokenizer {tokenizer_dir} has no tokenizer.json: the run was trained"
                        " with it, the export needs it")
    if config["method"] == "lora":
        model = build_model(ckpt, config["tokenizer"])
        add_lora(model, config["lora"])
        adapter = load_file(folder / ADAPTER_FILE)
        with torch.no_grad():
            for name, p in trainable_parameters(model):
                p.copy_(adapter[peft_name(name)])
        state = model_state(model)

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
def tokens_parser(subparsers):
    """The `tokens` command: upstream's extract_audio_tokens options, with dashes (underscores work too)."""
    p = subparsers.add_parser(
        "tokens", help="clips -> audio codes in upstream's tar shards (stage 0)",
        description="Encode clips with the checkpoint's audio tokenizer into upstream's layout: OUT/data.lst,"
                    " OUT/audios/shard-*.tar (<id>.npy int16 codes), OUT/txts/shard-*.jsonl (labels).")
    p.add_argument("folder", nargs="?", type=Path,
                   help="a folder of clips, each with a same-stem .lab or .txt transcript (id = stem; codes"
                        f" are cached next to each clip as <stem>{CODES_CACHE} and reused on the next run)")
    p.add_argument("--input-jsonl", "--input_jsonl", type=Path,
                   help="upstream's input: one {id, audio_path, text, language_id?, ...} per line; relative"
                        " audio paths are taken from the file's folder; extra fields pass through")
    p.add_argument("--checkpoint", type=Path, default=Path(omnivoice.DEFAULT_CHECKPOINT),
                   help="the OmniVoice checkpoint whose audio_tokenizer/ encodes (or that folder itself)")
    p.add_argument("--out", type=Path, required=True,
                   help="the tokens folder to write (an earlier one is replaced once this is complete)")
    p.add_argument("--samples-per-shard", "--samples_per_shard", type=int, default=1000,
                   help="most samples per tar shard (upstream's default 1000)")
    p.add_argument("--min-num-shards", "--min_num_shards", type=int, default=32,
                   help="fewer shards than this -> total // this samples per shard (upstream's default 32;"
                        " training needs a shard per loader worker and process)")
    p.add_argument("--shuffle-seed", type=int, default=42,
                   help="the seed of the list's shuffle (upstream's 42)")
    p.add_argument("--no-shuffle", action="store_true", help="keep the input's order")
    p.add_argument("--language-id", help="the folder form's language_id for every clip (e.g. en, or a new"
                   " language's own id; default none, as a JSONL line without one)")
    common.add_device_arg(p)


COMMANDS = dict(tokens=make_tokens, overlay=tokenizer_overlay, train=train, export=export)


def parse_args(argv=None):
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    tokens_parser(sub)
    o = sub.add_parser("overlay", help="a tokenizer overlay for --tokenizer: the checkpoint's tokenizer"
                       " padded to its text embedding's rows (where it has fewer tokens than rows)")
    o.add_argument("--checkpoint", required=True, help="the OmniVoice checkpoint to train")
    o.add_argument("--out", required=True, help="folder for the overlay's tokenizer.json")
    t = sub.add_parser("train", help="fine-tune (full or LoRA) on stage 0's tokens: a run folder")
    t.add_argument("--train-config", "--train_config", help="upstream's train config JSON (default: its"
                   " train_config_finetune_sdpa.json values); flags below override its fields")
    t.add_argument("--data-config", "--data_config",
                   help="upstream's data config JSON: {\"train\": [{\"manifest_path\":"
                   " [\"tokens/data.lst\"]}]} (relative paths: from its folder)")
    t.add_argument("--out", required=True, help="run folder: config.json, metrics.jsonl, checkpoint-N/")
    t.add_argument("--checkpoint", help="OmniVoice checkpoint to start from (init_from_checkpoint)")
    t.add_argument("--tokenizer", help="folder whose tokenizer.json replaces the checkpoint's (an overlay"
                   " whose size equals the text embedding's rows, where the checkpoint's has fewer tokens)")
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
    t.add_argument("--keep-last", type=int, help="checkpoints kept, the oldest removed"
                   " (keep_last_n_checkpoints; default 3, upstream's all: -1): a full one is 7.2 GB at the"
                   " real size")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last"
                   " checkpoint, bit for bit (only --checkpointing and --device may change)")
    t.add_argument("--checkpointing", action="store_true",
                   help="gradient checkpointing of the layers: less memory, one more forward per step")
    common.add_device_arg(t, "; several processes (torchrun): NCCL on CUDA, else gloo")
    e = sub.add_parser("export", help="a run's checkpoint -> a checkpoint folder (LoRA merged) + adapter/")
    e.add_argument("run", help="run folder of `train`")
    e.add_argument("--out", required=True, help="new folder for the checkpoint")
    e.add_argument("--step", type=int, help="which checkpoint-N (default: the last)")
    return ap.parse_args(argv)


def main(argv=None):
    training.run_command(COMMANDS, parse_args(argv))


if __name__ == "__main__":
    common.cli(main)
