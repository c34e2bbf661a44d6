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
import bisect
import io
import itertools
import json
import math
import os
import random
import shutil
import tarfile
import time
from contextlib import suppress
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

import common
import omnivoice
import omnivoice_codec
from common import UserError

# ----------------------------------------------------------------------------- tokens
AUDIO_EXTENSIONS = {".wav", ".flac", ".ogg", ".mp3", ".opus", ".aiff", ".aif"}  # what soundfile reads
TRANSCRIPT_SUFFIXES = (".lab", ".txt")
CODES_CACHE = ".omnivoice-codes"  # <clip stem> + this: the folder form's codes (np.save bytes), not a .npy
SHARD = "shard-%06d"
MAX_SAMPLE_TOKENS = 2000  # upstream's default max_sample_tokens: longer samples are skipped at training


def short_list(items: list, n=5) -> str:
    return ", ".join(map(str, items[:n])) + (f" and {len(items) - n} more" if len(items) > n else "")


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
    if args.folder is not None:
        folder = Path(args.folder)
        records, base, where = folder_records(folder), folder, str(folder)
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


# ----------------------------------------------------------------------------- optimizer


# ----------------------------------------------------------------------------- run


# ----------------------------------------------------------------------------- export


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
    p.add_argument("--device", type=common.device_name, help="cpu, cuda, cuda:N or mps (default: the best)")
    p.set_defaults(run=make_tokens)
