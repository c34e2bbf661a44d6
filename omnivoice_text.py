"""OmniVoice's front end without the model: upstream omnivoice's text handling, its languages, its
length estimate, and pydub's silence arithmetic as upstream uses it. Strings and numpy arrays in and out:
omnivoice.py feeds what comes out to the LM and trims what the codec decodes.

How the file reads (sections, top to bottom):
    tokens        non-verbal tags tokenized alone, the reference transcript + text as one line, CJK detection
    languages     omnivoice_languages.tsv: an id or a name -> upstream's language id
    voice design  the closed list of instruct attributes, English <-> Chinese, the style prefix
    sentences     end punctuation, long texts cut into chunks, a text cut into sentences (streaming)
    length        characters weighted by script -> the number of audio frames to generate
    silence       pydub 0.25.1's split_on_silence / detect_leading_silence on int16, in numpy
    levels        fades and padding, cross-fades between chunks, the reference's level and the output gain
"""
import bisect
import difflib
import functools
import math
import re
import unicodedata
from pathlib import Path

import numpy as np

from common import UserError, shorten

# ----------------------------------------------------------------------------- tokens
NONVERBAL_TAGS = re.compile(r"\[(laughter|sigh|confirmation-en|question-en|question-ah|question-oh|"
                            r"question-ei|question-yi|surprise-ah|surprise-oh|surprise-wa|surprise-yo|"
                            r"dissatisfaction-hnn)\]")
CJK = re.compile(r"[\u4e00-\u9fff]")  # upstream's "Chinese" everywhere: the CJK Unified Ideographs block only


def tokenize(tokenizer, text: str) -> list[int]:
    """Upstream's default tokenizer call (style prefix, fallback): with the post-processor, which adds
    nothing in OmniVoice's tokenizer."""
    return tokenizer.encode(text).ids


def tokenize_with_nonverbal_tags(tokenizer, text: str) -> list[int]:
    """Text ids with each non-verbal tag tokenized on its own, so "[laughter]" gets the same ids whatever
    surrounds it; the pieces between the tags without special tokens."""
    ids, start = [], 0
    for tag in NONVERBAL_TAGS.finditer(text):
        for piece in (text[start:tag.start()], tag.group()):
            if piece:
                ids += tokenizer.encode(piece, add_special_tokens=False).ids
        start = tag.end()
    if text[start:]:
        ids += tokenizer.encode(text[start:], add_special_tokens=False).ids
    return ids or tokenize(tokenizer, text)


def combine_text(ref_text: str | None, text: str) -> str:
    """The reference transcript and the text as the LM reads them: one line, single spaces, ASCII
    parentheses, no whitespace next to a Chinese character."""
    full = f"{ref_text.strip()} {text.strip()}" if ref_text else text.strip()
    full = re.sub(r"[\r\n]+", "", full)
    full = full.replace("（", "(").replace("）", ")")
    full = re.sub(r"[ \t]+", " ", full)
    return re.sub(r"(?<=[\u4e00-\u9fff])\s+|\s+(?=[\u4e00-\u9fff])", "", full)


def has_cjk(text: str | None) -> bool:
    """Whether upstream treats the text as Chinese (voice design attributes, end punctuation)."""
    return bool(text and CJK.search(text))


# ----------------------------------------------------------------------------- languages
LANGUAGES_TSV = Path(__file__).with_name("omnivoice_languages.tsv")


@functools.lru_cache(maxsize=1)
def languages() -> tuple[frozenset, dict]:
    """(language ids, lowercase name -> id) of the 646 languages OmniVoice was trained on."""
    rows = [line.split("\t") for line in LANGUAGES_TSV.read_text(encoding="utf-8").splitlines()
            if line and not line.startswith("#")]
    return frozenset(code for code, _ in rows), {name: code for code, name in rows}


def resolve_language(language: str | None) -> str | None:
    """A language id (exact) or name (any case) -> its id; None or "none" -> None (language-agnostic)."""
    if language is None or language.lower() == "none":
        return None
    ids, names = languages()
    if language in ids:
        return language
    if language.lower() in names:
        return names[language.lower()]
    # upstream warns and falls back to None: we make it an error
    raise UserError(f"unknown language '{shorten(language, 60)}' — use a code such as en, zh, ja or a name"
                    " such as English (see README)")


# ----------------------------------------------------------------------------- voice design
# each category allows one item; English -> Chinese where both exist
INSTRUCT_TRANSLATED = dict(
    gender={"male": "男", "female": "女"},
    age={"child": "儿童", "teenager": "少年", "young adult": "青年", "middle-aged": "中年", "elderly": "老年"},
    pitch={"very low pitch": "极低音调", "low pitch": "低音调", "moderate pitch": "中音调", "high pitch": "高音调",
           "very high pitch": "极高音调"},
    style={"whisper": "耳语"},
)
ACCENTS = ("american accent", "british accent", "australian accent", "chinese accent",  # English only
           "canadian accent", "indian accent", "korean accent", "portuguese accent", "russian accent",
           "japanese accent")
DIALECTS = ("河南话", "陕西话", "四川话", "贵州话", "云南话", "桂林话", "济南话", "石家庄话",  # Chinese only
            "甘肃话", "宁夏话", "青岛话", "东北话")
INSTRUCT_CATEGORIES = [set(en) | set(en.values()) for en in INSTRUCT_TRANSLATED.values()]
INSTRUCT_CATEGORIES += [set(ACCENTS), set(DIALECTS)]
EN_TO_ZH = {en: zh for category in INSTRUCT_TRANSLATED.values() for en, zh in category.items()}
ZH_TO_EN = {zh: en for en, zh in EN_TO_ZH.items()}


def _unknown_attributes(items: list[str], most=5) -> UserError:
    """The error for instruct items outside the closed list: the list, and a close match if there is one
    (the first `most` items named, each cut short: a message echoes no megabyte)."""
    english, chinese = [*EN_TO_ZH, *ACCENTS], [*ZH_TO_EN, *DIALECTS]
    named = []
    for item in items[:most]:
        close = difflib.get_close_matches(item, english + chinese, n=1, cutoff=0.6)
        named.append(f"'{shorten(item, 40)}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    if len(items) > most:
        named.append(f"and {len(items) - most} more")
    return UserError(f"instruct: unknown attribute{'s' * (len(items) > 1)} {', '.join(named)} — use only: "
                     f"{', '.join(english)} (English, comma + space) or {'，'.join(chinese)} (Chinese,"
                     " full-width comma)")


def resolve_instruct(instruct: str | None, use_zh: bool = False) -> str | None:
    """A voice-design instruct -> upstream's canonical string: known attributes only, lower case, all in
    Chinese (use_zh, or any dialect) or all in English (otherwise, or any accent), one per category."""
    if instruct is None or not instruct.strip():
        return None
    items = [item.strip().lower() for item in re.split(r"\s*[,，]\s*", instruct.strip()) if item]
    unknown = [item for item in items if item not in EN_TO_ZH and item not in ZH_TO_EN
               and item not in ACCENTS and item not in DIALECTS]
    if unknown:
        raise _unknown_attributes(unknown)
    has_dialect, has_accent = any(i in DIALECTS for i in items), any(i in ACCENTS for i in items)
    if has_dialect and has_accent:
        raise UserError("instruct: a Chinese dialect and an English accent cannot be mixed — dialects are for"
                        " Chinese speech, accents for English speech")
    use_zh = has_dialect or (use_zh and not has_accent)
    items = [(EN_TO_ZH if use_zh else ZH_TO_EN).get(item, item) for item in items]
    repeated = [item for item in dict.fromkeys(items) if items.count(item) > 1]
    if repeated:  # upstream refuses it too, as a conflict of the item with itself
        raise UserError(f"instruct: '{repeated[0]}' is given twice: give each attribute once")
    clashes = [[i for i in items if i in category] for category in INSTRUCT_CATEGORIES]
    clashes = [" vs ".join(f"'{i}'" for i in hits) for hits in clashes if len(hits) > 1]
    if clashes:
        raise UserError(f"Conflicting instruct items within the same category: {'; '.join(clashes)}. Each"
                        " category (gender, age, pitch, style, accent, dialect) allows at most one item.")
    return ("，" if any(has_cjk(i) for i in items) else ", ").join(items)


def style_prefix(denoise: bool, has_ref: bool, language: str | None, instruct: str | None) -> str:
    """The style text in front of every conditional row (tokenized with the default call)."""
    return (("<|denoise|>" if denoise and has_ref else "") + f"<|lang_start|>{language or 'None'}<|lang_end|>"
            + f"<|instruct_start|>{instruct or 'None'}<|instruct_end|>")


# ----------------------------------------------------------------------------- sentences
SPLIT_PUNCTUATION = set(".,;:!?。，；：！？")
SENTENCE_ENDS = set(".!?。！？")  # where a streamed text is cut (the server's unit: one sentence at a time)
CLOSING_MARKS = set("\"'“”‘’）]》>」】")
END_PUNCTUATION = set(";:,.!?…)]}\"'“”‘’；：，。！？、）】")
ABBREVIATIONS = set("Mr. Mrs. Ms. Dr. Prof. Sr. Jr. Rev. Fr. Hon. Pres. Gov. Capt. Gen. Sen. Rep. Col. "
                    "Maj. Lt. Cmdr. Sgt. Cpl. Co. Corp. Inc. Ltd. Est. Dept. St. Ave. Blvd. Rd. Mt. Ft. No. "
                    "Jan. Feb. Mar. Apr. Aug. Sep. Sept. Oct. Nov. Dec. i.e. e.g. vs. Vs. Etc. approx. fig. "
                    "def.".split())


def add_punctuation(text: str) -> str:
    """Strip; end with "。" (Chinese) or "." unless the text already ends in punctuation or a closing mark."""
    text = text.strip()
    if text and text[-1] not in END_PUNCTUATION:
        text += "。" if has_cjk(text) else "."
    return text


def _sentences(text: str, marks=SPLIT_PUNCTUATION) -> list[list[str]]:
    """Characters cut after each split mark (not after an abbreviation's '.'); marks and closing quotes
    that would start a sentence stay with the one before."""
    sentences, current = [], []
    for ch in text:
        if not current and sentences and (ch in marks or ch in CLOSING_MARKS):
            sentences[-1].append(ch)
            continue
        current.append(ch)
        if ch in marks and not (ch == "." and "".join(current).split()[-1] in ABBREVIATIONS):
            sentences.append(current)
            current = []
    return sentences + [current] if current else sentences


def chunk_text_punctuation(text: str, chunk_len: int, min_chunk_len: int = 3, marks=SPLIT_PUNCTUATION
                           ) -> list[str]:
    """A long text -> chunks of at most chunk_len characters where sentences allow (longer sentences stay
    whole); chunks under min_chunk_len join the one before (the first one joins the next). marks: where a
    sentence ends (upstream's: at commas too)."""
    merged = []
    for sentence in _sentences(text, marks):
        if merged and len(merged[-1]) + len(sentence) <= chunk_len:
            merged[-1] = merged[-1] + sentence
        else:
            merged.append(sentence)
    min_chunk_len = min_chunk_len or 0
    chunks = []
    for i, chunk in enumerate(merged):
        first_was_short = i == 1 and len(merged[0]) < min_chunk_len
        if chunks and (first_was_short or len(chunk) < min_chunk_len):
            chunks[-1] = chunks[-1] + chunk
        else:
            chunks.append(chunk)
    return [s for s in ("".join(chunk).strip() for chunk in chunks) if s]


MIN_CUT = 20  # characters: no run is cut shorter (a word or two), however slow the speech it is said at


def split_sentences(text: str, chunk_len: int) -> list[str]:
    """A text -> its sentences (cut after . ! ? and their full-width forms), each one longer than chunk_len
    characters cut further as upstream cuts a long text (chunk_text_punctuation, at commas too); pieces
    under 3 characters join a neighbour, as upstream's do. A run without punctuation: see cut_runs."""
    pieces = []
    for sentence in chunk_text_punctuation(text, 0, marks=SENTENCE_ENDS):  # 0: no two sentences merge
        pieces += chunk_text_punctuation(sentence, chunk_len) if len(sentence) > chunk_len else [sentence]
    return cut_runs(pieces, chunk_len)


def cut_runs(pieces: list[str], chunk_len: int) -> list[str]:
    """Pieces longer than twice chunk_len (at least MIN_CUT) -> cut into parts of at most that many
    characters, at a space where one is in the part's second half. Upstream leaves a run without
    punctuation whole however long (4096 letters: one 290 s chunk, its attention quadratic in it); a
    sentence of normal text is never that long, so upstream's chunks stay as they are."""
    chunk_len, out = max(MIN_CUT, chunk_len), []
    for piece in pieces:
        if len(piece) > 2 * chunk_len:
            size = -(-len(piece) // -(-len(piece) // chunk_len))  # parts of equal size: no short tail
            while len(piece) > size:
                space = piece.rfind(" ", size // 2, size + 1)
                cut = space if space > 0 else size
                out.append(piece[:cut].strip())
                piece = piece[cut:].strip()
        out.append(piece)
    return [piece for piece in out if piece]


# ----------------------------------------------------------------------------- length
# Speaking time per character relative to a Latin letter: (last codepoint of a run of Unicode blocks, weight).
# Upstream's block table with neighbouring blocks of equal weight merged (bisect gives the same answers).
SCRIPT_WEIGHTS = [
    (0x058F, 1.0),  # Latin, IPA, Greek, Cyrillic, Armenian
    (0x08FF, 1.5),  # Hebrew, Arabic, Syriac
    (0x0DFF, 1.8),  # Devanagari .. Sinhala
    (0x0EFF, 1.5),  # Thai, Lao
    (0x109F, 1.8),  # Tibetan, Myanmar
    (0x10FF, 1.0),  # Georgian
    (0x11FF, 2.5),  # Hangul Jamo
    (0x139F, 3.0),  # Ethiopic
    (0x177F, 1.0),  # Cherokee, Canadian syllabics, Ogham, Runic, Philippine scripts
    (0x17FF, 1.8),  # Khmer
    (0x18FF, 1.0),  # Mongolian, Canadian syllabics extended
    (0x1C7F, 1.8),  # Limbu .. Ol Chiki
    (0x1CBF, 1.0),  # Cyrillic Extended-C, Georgian Extended
    (0x1CFF, 1.8),  # Sundanese Supplement, Vedic
    (0x1EFF, 1.0),  # phonetic extensions, combining marks supplement, Latin Extended Additional
    (0x30FF, 2.2),  # Hiragana, Katakana; upstream's entry reaches back to U+1F00 (Greek Extended, ℓ, ...)
    (0x312F, 3.0),  # Bopomofo
    (0x318F, 2.5),  # Hangul Compatibility Jamo
    (0xA4CF, 3.0),  # CJK Unified Ideographs, Yi
    (0xA7FF, 1.0),  # Lisu, Vai, Cyrillic Extended-B, Bamum, Latin Extended-D
    (0xA82F, 1.8),  # Syloti Nagri
    (0xA87F, 1.0),  # Phags-pa
    (0xA95F, 1.8),  # Saurashtra, Devanagari Extended, Kayah Li, Rejang
    (0xA97F, 2.5),  # Hangul Jamo Extended-A
    (0xAAFF, 1.8),  # Javanese, Myanmar extended, Cham, Tai Viet, Meetei Mayek extensions
    (0xAB2F, 3.0),  # Ethiopic Extended-A
    (0xABBF, 1.0),  # Latin Extended-E, Cherokee Supplement
    (0xABFF, 1.8),  # Meetei Mayek
    (0xD7AF, 2.5),  # Hangul Syllables
    (0xFAFF, 3.0),  # CJK Compatibility Ideographs
    (0xFDFF, 1.5),  # Arabic Presentation Forms-A
    (0xFE6F, 1.0),  # variation selectors, small forms
    (0xFEFF, 1.5),  # Arabic Presentation Forms-B
    (0xFFEF, 1.0),  # full-width forms
]
SCRIPT_ENDS = [end for end, _ in SCRIPT_WEIGHTS]
CATEGORY_WEIGHTS = dict(M=0.0, P=0.5, S=0.5, Z=0.2, N=3.5)  # marks, punctuation, symbols, separators, digits
NO_REF_TEXT, NO_REF_TOKENS = "Nice to meet you.", 25  # upstream's length reference when there is no voice


def _char_weight(ch: str) -> float:
    code = ord(ch)
    if ch.isascii() and ch.isalpha():
        return 1.0
    if code == 0x20:
        return 0.2
    if code == 0x0640:  # Arabic tatweel: a stretch, not a sound
        return 0.0
    weight = CATEGORY_WEIGHTS.get(unicodedata.category(ch)[0])
    if weight is not None:
        return weight
    if code <= SCRIPT_ENDS[-1]:
        return SCRIPT_WEIGHTS[bisect.bisect_left(SCRIPT_ENDS, code)][1]
    return 3.0 if code > 0x20000 else 1.0  # upstream's '>' leaves U+20000 itself (CJK Ext-B) at 1.0


def text_weight(text: str) -> float:
    """Upstream's rule of thumb for how long a text takes to say, in Latin letters (tags count as text)."""
    return sum(_char_weight(ch) for ch in text)


def estimate_duration(text: str, ref_text: str, ref_duration: float) -> float:
    """text's length in ref_duration's unit at the reference's weight rate; short ones lengthened on a
    cube-root curve below 50."""
    ref_weight = text_weight(ref_text) if ref_text and ref_duration > 0 else 0
    if ref_weight == 0:
        return 0.0
    estimate = text_weight(text) / (ref_weight / ref_duration)
    return 50 * (estimate / 50) ** (1 / 3) if estimate < 50 else estimate


def estimate_target_tokens(text: str, ref_text: str | None, ref_tokens: int | None, speed: float = 1.0
                           ) -> int:
    """The number of audio frames to generate for text, from the reference's frames per weight."""
    if ref_tokens is None or not ref_text:
        # upstream's fallback is 25 frames for "Nice to meet you.", whatever the codec's frame rate
        ref_text, ref_tokens = NO_REF_TEXT, NO_REF_TOKENS
    estimate = estimate_duration(text, ref_text, ref_tokens)
    if speed > 0 and speed != 1.0:
        estimate /= speed
    return max(1, int(estimate))


# ----------------------------------------------------------------------------- silence
# pydub 0.25.1's arithmetic on int16 (C, N) arrays: lengths and positions in ms, loudness as integer rms.
SILENCE_DBFS = -50  # every trim of upstream's
SEEK_MS = 10  # split_on_silence's seek step and detect_leading_silence's chunk


def _to_pcm16(x: np.ndarray) -> np.ndarray:
    # upstream's float -> int16 truncates toward zero (astype), it does not round
    return (x * 32768.0).clip(-32768, 32767).astype(np.int16)


def _length_ms(pcm: np.ndarray, sr: int) -> int:
    return round(1000 * (pcm.shape[-1] / sr))  # Python round: half to even


def _slice_ms(pcm: np.ndarray, sr: int, start: int, end: int | None = None) -> np.ndarray:
    """pydub's segment[start:end]: ms clamped to the length, samples truncated, and zero-filled (under
    2 ms) where the rounded length runs past the data, unless the slice starts past it."""
    length = _length_ms(pcm, sr)
    end = length if end is None else min(end, length)
    a, b = int(min(start, length) * (sr / 1000.0)), int(end * (sr / 1000.0))
    part = pcm[:, a:b]
    if 0 < part.shape[-1] < b - a:
        part = np.pad(part, ((0, 0), (0, b - a - part.shape[-1])))
    return part


def _rms16(pcm: np.ndarray) -> int:
    """audioop.rms: floor(sqrt(sum of squares / samples)), 0 when empty."""
    flat = pcm.astype(np.int64).ravel()
    return int(math.sqrt(float(flat @ flat) / flat.size)) if flat.size else 0


def _detect_silence(pcm: np.ndarray, sr: int, min_len: int) -> list[list[int]]:
    """[start, end] ms of the runs of quiet min_len windows, tried every 10 ms plus the last start."""
    length = _length_ms(pcm, sr)
    if length < min_len:
        return []
    threshold = 10 ** (SILENCE_DBFS / 20) * 32768.0
    last = length - min_len
    starts = list(range(0, last + 1, SEEK_MS)) + ([last] if last % SEEK_MS else [])
    ranges = []
    for i in starts:
        if _rms16(_slice_ms(pcm, sr, i, i + min_len)) > threshold:
            continue
        # a window that overlaps the silence so far, or starts one seek step after its last window, extends it
        if ranges and (i <= ranges[-1][1] or i == ranges[-1][1] - min_len + SEEK_MS):
            ranges[-1][1] = i + min_len
        else:
            ranges.append([i, i + min_len])
    return ranges


def _detect_nonsilent(pcm: np.ndarray, sr: int, min_len: int) -> list[list[int]]:
    length = _length_ms(pcm, sr)
    silent = _detect_silence(pcm, sr, min_len)
    if not silent:
        return [[0, length]]
    if silent[0] == [0, length]:
        return []
    edges = [0] + [ms for r in silent for ms in r] + [length]
    loud = [edges[k:k + 2] for k in range(0, len(edges), 2)]
    if loud[-1][0] == length:  # the audio ends in silence
        loud.pop()
    return loud[1:] if loud[0] == [0, 0] else loud


def _split_on_silence(pcm: np.ndarray, sr: int, min_len: int, keep: int) -> list[np.ndarray]:
    """The sounding parts, each with `keep` ms of its silence on both sides; where two parts' kept
    silences overlap, they meet halfway (floor)."""
    ranges = [[a - keep, b + keep] for a, b in _detect_nonsilent(pcm, sr, min_len)]
    for left, right in zip(ranges, ranges[1:]):
        if right[0] < left[1]:
            left[1] = right[0] = (left[1] + right[0]) // 2
    length = _length_ms(pcm, sr)
    return [_slice_ms(pcm, sr, max(a, 0), min(b, length)) for a, b in ranges]


def _leading_silence(pcm: np.ndarray, sr: int) -> int:
    """pydub's detect_leading_silence: ms of whole 10 ms chunks quieter than -50 dBFS at the start."""
    length, ms = _length_ms(pcm, sr), 0
    while ms < length:
        rms = _rms16(_slice_ms(pcm, sr, ms, ms + SEEK_MS))
        if rms and 20 * math.log(rms / 32768.0, 10) >= SILENCE_DBFS:
            break
        ms += SEEK_MS
    return min(ms, length)


def _trim_edges(pcm: np.ndarray, sr: int, lead_sil: int, trail_sil: int) -> np.ndarray:
    pcm = _slice_ms(pcm, sr, max(0, _leading_silence(pcm, sr) - lead_sil))
    pcm = pcm[:, ::-1]  # the tail is trimmed as the head of the reversed audio, ms counted from its end
    return _slice_ms(pcm, sr, max(0, _leading_silence(pcm, sr) - trail_sil))[:, ::-1]


def remove_silence(x: np.ndarray, sr: int, mid_sil: int, lead_sil: int, trail_sil: int) -> np.ndarray:
    """Upstream's silence trimming, (C, N) float32 -> (C, M) float32 on the int16 grid: silences longer
    than mid_sil ms cut to mid_sil ms (0: keep them), then the edges cut to lead_sil / trail_sil ms."""
    pcm = _to_pcm16(x)
    if mid_sil > 0:
        pieces = _split_on_silence(pcm, sr, mid_sil, keep=mid_sil)
        pcm = np.concatenate(pieces, axis=-1) if pieces else pcm[:, :0]
    return _trim_edges(pcm, sr, lead_sil, trail_sil).astype(np.float32) / 32768.0


# ----------------------------------------------------------------------------- levels
def fade_and_pad(x: np.ndarray, pad_duration: float, fade_duration: float, sample_rate: int) -> np.ndarray:
    """(C, N) float32: linear fade-in and fade-out (each at most half the audio), then zeros on both sides."""
    if x.shape[-1] == 0:
        return x
    x, fade, pad = x.copy(), int(fade_duration * sample_rate), int(pad_duration * sample_rate)
    k = min(fade, x.shape[-1] // 2)
    if k > 0:
        x[..., :k] *= np.linspace(0, 1, k, dtype=np.float32)
        x[..., -k:] *= np.linspace(1, 0, k, dtype=np.float32)
    if pad > 0:
        zeros = np.zeros((x.shape[0], pad), dtype=x.dtype)
        x = np.concatenate([zeros, x, zeros], axis=-1)
    return x


def cross_fade_chunks(chunks: list[np.ndarray], sample_rate: int, silence_duration: float = 0.3
                      ) -> np.ndarray:
    """(C, N_i) chunks joined as: tail faded out over a third of silence_duration, a third of silence,
    the next chunk faded in over a third."""
    if len(chunks) == 1:
        return chunks[0]
    fade = int(silence_duration * sample_rate) // 3
    merged = chunks[0].copy()
    for chunk in chunks[1:]:
        out_n, in_n = min(fade, merged.shape[-1]), min(fade, chunk.shape[-1])
        if out_n > 0:
            merged[..., -out_n:] *= np.linspace(1, 0, out_n, dtype=np.float32)
        chunk = chunk.copy()
        if in_n > 0:
            chunk[..., :in_n] *= np.linspace(0, 1, in_n, dtype=np.float32)
        gap = np.zeros((chunks[0].shape[0], fade), dtype=np.float32)
        merged = np.concatenate([merged, gap, chunk], axis=-1)
    return merged


def rms(x: np.ndarray) -> float:
    """sqrt(mean(x²)) of a float32 array in float32 (numpy's pairwise mean), as a Python float."""
    return float(np.sqrt(np.mean(x ** 2)))


def normalize_reference(x: np.ndarray, ref_rms: float) -> np.ndarray:
    """A reference quieter than RMS 0.1 scaled up to it: (x * 0.1) / ref_rms, two float32 roundings."""
    return x * 0.1 / float(ref_rms) if 0 < ref_rms < 0.1 else x


def output_gain(x: np.ndarray, ref_rms: float | None) -> np.ndarray:
    """The output's level: scaled back down as the reference was scaled up ((x * ref_rms) / 0.1), left alone
    for a reference at RMS >= 0.1, or peak-normalised to 0.5 without a reference."""
    if ref_rms is None:
        peak = np.abs(x).max() if x.size else 0.0
        return x / peak * 0.5 if peak > 1e-6 else x
    return x * float(ref_rms) / 0.1 if ref_rms < 0.1 else x
