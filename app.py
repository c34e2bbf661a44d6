"""fishfast's web demo and speech server: one page (app.html), an OpenAI-compatible API and upstream
fish-speech's /v1/tts, on the standard library's HTTP server.

    python app.py            # -> http://127.0.0.1:7560 (the tiny demo model, noise, if ./s2-pro is absent)
    curl -s localhost:7560/v1/audio/speech -H 'Content-Type: application/json' \
        -d '{"input": "Hello!", "response_format": "wav"}' -o hello.wav

    python app.py --checkpoint OmniVoice     # k2-fsa/OmniVoice (the kind is read from config.json)
    python app.py --model omnivoice          # ./OmniVoice, or OmniVoice's tiny demo model

One engine thread owns the model (common.EngineThread, its Scheduler: --slots rows, continuous batching). Each
HTTP request runs in its own thread: it validates, submits, and turns the codes into audio as they come. The
server talks to each model through the same few verbs (SpeechModel: load, a reference from a clip, a saved
voice read and written, submit, the waves of a request, its usage), so the handler and the page know no model
but through them: a third model is a third class beside S2ProModel and OmniVoiceModel. GET /metrics is
Prometheus' text format (Metrics), each request counted where it ends, HTTP's and Wyoming's.
"""
import argparse
import base64
import collections
import contextlib
import email.parser
import email.policy
import fcntl
import functools
import hmac
import importlib.util
import io
import ipaddress
import json
import math
import os
import re
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional, Protocol
from urllib.parse import parse_qs, unquote

import numpy as np
import soundfile as sf
import soxr
import torch

import codec
import common
import cpu_fast
import dualAR
import omnivoice
import omnivoice_text
import quantize


# ----------------------------------------------------------------------------- limits and validation
MAX_TEXT = 4096  # characters of text to speak (OpenAI's limit)
MAX_TRANSCRIPT = 2000  # characters of a reference transcript
MAX_CLIP_SECONDS = 30
CLIP_RATES, MAX_CLIP_CHANNELS = (8000, 192000), 2  # Hz, and mono or stereo: a voice clip, nothing odder
# bytes a sample takes in the uncompressed subtypes of the uncompressed formats (FLAC's are PCM_16 too),
# whose frames are bounded by the file's own size
SAMPLE_BYTES = dict(PCM_S8=1, PCM_U8=1, ULAW=1, ALAW=1, PCM_16=2, PCM_24=3, PCM_32=4, FLOAT=4, DOUBLE=8)
UNCOMPRESSED = {"WAV", "WAVEX", "W64", "RF64", "AIFF", "AU", "CAF"}
MAX_BODY = 48 << 20  # bytes: four 30 s 16-bit clips, base64 in JSON, fit with room
EOF_EVENT = getattr(select, "POLLRDHUP", select.POLLIN)  # a peer's FIN; Linux's, without the bytes before it
LINGER = 2  # seconds a closing connection reads what its client still sends (as Apache's lingering close)
SAMPLE_RATE, HOP = codec.CONFIG["sample_rate"], codec.hop_length()  # S2-Pro's; HOP: samples per frame
STREAMABLE = ("wav", "pcm")  # written piece by piece
ENCODED_AS_MADE = ("mp3", "opus")  # encoded piece by piece (`StreamedFile`); flac from the whole waveform
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # the only rates opus exists at
OUTPUT_RATES = (8000, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # what `sample_rate` may ask for
OPENAI_PCM_RATE = 24000  # OpenAI's pcm is 24 kHz: its clients (Pipecat, LiveKit) play raw pcm at that rate


def file_rate(fmt: str, rate: int) -> int:
    """The sample rate a response format is written at for a model's rate: its own, or opus's 48 kHz."""
    return 48000 if fmt == "opus" and rate not in OPUS_RATES else rate


# response_format -> (soundfile format, subtype, sample rate for S2-Pro's 44.1 kHz)
SOUNDFILE_FORMATS = {name: (kind, subtype, file_rate(name, SAMPLE_RATE)) for name, kind, subtype in
                     (("flac", "FLAC", "PCM_16"), ("mp3", "MP3", "MPEG_LAYER_III"), ("opus", "OGG", "OPUS"))}
FORMATS = [*STREAMABLE, *(name for name, (f, sub, _) in SOUNDFILE_FORMATS.items() if sf.check_format(f, sub))]
OPENAI_FORMAT = "mp3" if "mp3" in FORMATS else "wav"  # OpenAI's default (libsndfile before 1.1 has no mp3)
MEDIA_TYPES = dict(wav="audio/wav", pcm="audio/pcm", flac="audio/flac", mp3="audio/mpeg", opus="audio/ogg")
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_busy", 507: "insufficient_storage"}
OPENAI_DEFAULTS = dict(temperature=0.7, top_p=0.7, top_k=30, max_new_tokens=0, chunk_length=300)  # the CLI's
FISH_DEFAULTS = dict(temperature=0.8, top_p=0.8, top_k=30, max_new_tokens=1024, chunk_length=200)  # upstream
# upstream's ServeTTSRequest (fish_speech/utils/schema.py): what its pydantic model answers with a 422
UPSTREAM_RANGES = dict(top_p=(0.1, 1.0), temperature=(0.1, 1.0), repetition_penalty=(0.9, 2.0))
UPSTREAM_CHOICES = dict(format=tuple(FORMATS), latency=("normal", "balanced"), use_memory_cache=("on", "off"))
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")  # names any server answers to, whatever --host
AUTHORITY = re.compile(r"(?:\[([0-9a-f:.]+)\]|([a-z0-9._-]+))(?::([0-9]{1,5}))?")  # name[:port], [v6][:port]
OPENAI_VOICES = set("alloy ash ballad cedar coral echo fable marin nova onyx sage shimmer verse".split())
MAX_DURATION = omnivoice.MAX_DURATION  # seconds of audio a request may make (both models): `duration`'s cap
MAX_SENTENCE = 60  # seconds one OmniVoice sentence may last: its attention grows with its square
MAX_INSTRUCTIONS = 200  # characters of OmniVoice's `instructions` (every attribute of the list fits in 70)
MAX_MESSAGE = 1000  # characters of an error message: whatever it echoes, it is cut there
S2_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "chunk_length")  # S2-Pro's sampling extras
OMNIVOICE_FIELDS = ("num_step", "guidance_scale", "duration")  # OmniVoice's unmasking extras
MAX_CODES = 8  # audios or token arrays in one /v1/vqgan request
FISH_ROUTES = ("/v1/tts", "/v1/vqgan/encode", "/v1/vqgan/decode")  # upstream fish-speech's, S2-Pro's only
DEMO_FRAMES = 200  # the demo model's length (the page's default, the API's for no limit): seconds of noise
DEMO_NOTICE = ("DEMO: no checkpoint found, so a tiny RANDOM model is serving and the audio is NOISE. For"
               f" speech, download fishaudio/s2-pro into {dualAR.DEFAULT_CHECKPOINT} (see README).")


# upstream's clients send msgpack: ormsgpack, else msgpack (both have packb and unpackb), else none
MSGPACK = next((importlib.import_module(m) for m in ("ormsgpack", "msgpack") if importlib.util.find_spec(m)),
               None)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers=None, body=None):
        super().__init__(message)
        self.status, self.headers, self.body = status, headers or {}, body


# what a request may meet that is no bug of ours -> (status, message prefix, headers)
ERROR_STATUS = {common.UserError: (400, "", {}),
                common.QueueFull: (503, "the server is busy: ", {"Retry-After": "2"}),
                common.EngineClosed: (503, "the server is shutting down: ", {})}


def error_answer(e: Exception) -> tuple:
    """An exception -> (status, message, headers, body) of its error answer; a bug's traceback is logged."""
    if isinstance(e, HTTPError):
        return e.status, common.shorten(str(e), MAX_MESSAGE), e.headers, e.body
    for kind, (status, prefix, headers) in ERROR_STATUS.items():
        if isinstance(e, kind):
            return status, common.shorten(prefix + str(e), MAX_MESSAGE), headers, None
    traceback.print_exception(e)
    return 500, f"internal error: {common.shorten(str(e), 200)} (see the server's log)", {}, None


def authority(text):
    """A Host header or an origin's netloc (name[:port], [v6]:port) -> (lower-case name, port or None),
    None when malformed."""
    match = AUTHORITY.fullmatch(text.lower()) if isinstance(text, str) else None
    if match is None or (match[3] and int(match[3]) > 65535):
        return None
    return match[1] or match[2], int(match[3]) if match[3] else None


def is_ip_address(name: str) -> bool:
    with contextlib.suppress(ValueError):
        return bool(ipaddress.ip_address(name))
    return False


def served_names(host: str, allowed) -> set:
    """The names the server answers to: the --host it binds, localhost, its loopback addresses, and each
    --allow-host (`*`: any)."""
    return {host.strip("[]").lower(), *LOOPBACK_NAMES, *(name.lower() for name in allowed or ())}


def is_served(name: str, names: set) -> bool:
    return "*" in names or name in names or is_ip_address(name)


def check_host(hosts: list, names: set, version="HTTP/1.1") -> str:
    """The Host header(s) -> the one Host. DNS rebinding: a page of evil.example, once that name resolves
    to this machine, is of the same origin as the server to the browser, so no Origin check can tell it
    apart: only its Host can. An IP address needs no check (a rebinding page needs a name of its own); a
    name must be one we serve. HTTP/1.0 may send no Host; HTTP/1.1 must send one, and two are a 400 (RFC
    9112 3.2)."""
    if len(hosts) > 1:
        raise HTTPError(400, "more than one Host header")
    if not hosts and version != "HTTP/1.0":
        raise HTTPError(400, f"no Host header: an {version[:20]} request must send one (RFC 9112)")
    host = hosts[0] if hosts else None
    found = authority(host) if host is not None else (None, None)
    if found is None:
        raise HTTPError(400, "malformed Host header: send host[:port]")
    if found[0] is not None and not is_served(found[0], names):
        raise HTTPError(421, f"this server does not answer to the name {found[0][:100]!r}: start it with"
                             " --allow-host NAME to serve that name (a proxy's, a LAN name)")
    return host


def request_target(target: str) -> tuple:
    """The request line's target -> (its authority or None, path, query): /path?query, or the absolute
    form proxies may send, http://host/path?query. Anything else is a 400."""
    if target.startswith("/"):
        path, _, query = target.partition("?")
        return None, path, query
    scheme, sep, rest = target.partition("://")
    host = re.match(r"[^/?]*", rest)[0]
    if sep and scheme.lower() in ("http", "https") and authority(host) is not None:
        path, _, query = ("/" + rest[len(host):].lstrip("/")).partition("?")
        return host, path, query
    raise HTTPError(400, f"bad request target {target[:100]!r}: send /path or http://host/path")


def body_length(lengths: list, codings: list) -> int:
    """A request's framing headers (every Content-Length, every Transfer-Encoding) -> its body's length.
    Two of either, or a coding other than one chunked, is a 400 (RFC 9112: request smuggling behind a
    proxy that reads the other one)."""
    if codings:
        if len(codings) == 1 and codings[0].strip().lower() == "chunked":
            raise HTTPError(411, "chunked request bodies are not supported: send Content-Length")
        raise HTTPError(400, "Transfer-Encoding is not supported in requests: send one Content-Length")
    if len(lengths) > 1:
        raise HTTPError(400, "more than one Content-Length header")
    if lengths and not re.fullmatch(r"[0-9]+", lengths[0].strip()):  # no sign either: "-5" is no length
        raise HTTPError(400, "Content-Length must be a number of bytes")
    return int(lengths[0]) if lengths else 0


def same_origin(origin: str, host, names: set) -> bool:
    """Whether a page's Origin is this server: a name we serve (see check_host) and the Host it asked."""
    scheme, _, netloc = origin.partition("://")
    found = authority(netloc) if scheme in ("http", "https") else None
    return found is not None and found == authority(host or "") and is_served(found[0], names)


def max_frames(job: dict, frame_rate: float) -> int:
    """The frames a job may make: MAX_DURATION's, or fewer where the job says (a Wyoming stream's rest)."""
    return min(int(MAX_DURATION * frame_rate), job.get("max_frames", math.inf))


def check_text(text, what="input", limit=MAX_TEXT) -> str:
    if text is not None and not isinstance(text, str):
        raise common.UserError(f"{what} must be a string, not {type(text).__name__}")
    if text is None or not text.strip():
        raise common.UserError(f"{what} is empty: give the text as a non-empty string")
    if len(text) > limit:
        raise common.UserError(f"{what} has {len(text)} characters, at most {limit} are allowed")
    if any("\ud800" <= c <= "\udfff" for c in text):  # JSON may carry a lone surrogate ("\\ud800")
        raise common.UserError(f"{what} is not valid Unicode text")
    return text


# msgpack's type bytes -> (bytes of the length that follows, bytes fixed after it, objects inside per length
# unit); fix* types carry their length in the type byte itself (see msgpack_end)
MSGPACK_TYPES = {0xc0: (0, 0, 0), 0xc2: (0, 0, 0), 0xc3: (0, 0, 0), 0xca: (0, 4, 0), 0xcb: (0, 8, 0),
                 0xdc: (2, 0, 1), 0xdd: (4, 0, 1), 0xde: (2, 0, 2), 0xdf: (4, 0, 2),
                 **{0xc4 + i: (1 << i, 0, 0) for i in range(3)},  # bin 8/16/32
                 **{0xc7 + i: (1 << i, 1, 0) for i in range(3)},  # ext 8/16/32: a type byte after the length
                 **{0xcc + i: (0, 1 << i, 0) for i in range(4)},  # uint 8-64
                 **{0xd0 + i: (0, 1 << i, 0) for i in range(4)},  # int 8-64
                 **{0xd4 + i: (0, 1 + (1 << i), 0) for i in range(5)},  # fixext 1-16
                 **{0xd9 + i: (1 << i, 0, 0) for i in range(3)}}  # str 8/16/32


def msgpack_end(data: bytes) -> int:
    """Where the first msgpack object of `data` ends (no decoding): ormsgpack reads it and ignores what
    follows, msgpack refuses that; both are then refused the same."""
    pos, pending = 0, 1
    while pending and pos < len(data):
        pending, kind = pending - 1, data[pos]
        pos += 1
        if kind <= 0x7f or kind >= 0xe0:  # fixint
            continue
        if kind <= 0x9f:  # fixmap, fixarray
            pending += (kind & 0x0f) * (2 if kind <= 0x8f else 1)
        elif kind <= 0xbf:  # fixstr
            pos += kind & 0x1f
        elif kind in MSGPACK_TYPES:
            size, fixed, inside = MSGPACK_TYPES[kind]
            length = int.from_bytes(data[pos:pos + size], "big")
            pos += size + fixed
            pending, pos = (pending + length * inside, pos) if inside else (pending, pos + length)
        else:  # 0xc1: never used
            return -1
    return pos if not pending else -1


def parse_body(kind: str, body: bytes) -> dict:
    """A JSON or msgpack body (upstream's tools/api_client.py: bytes stay bytes, raw audio) -> its object."""
    def refuse_constant(name):  # NaN, Infinity, -Infinity
        raise ValueError(f"{name} is not a JSON number")
    what = "msgpack" if kind == "application/msgpack" else "JSON"
    if what == "msgpack" and MSGPACK is None:
        raise HTTPError(415, "application/msgpack needs a msgpack library on the server: pip install"
                             " ormsgpack (or msgpack), or send JSON")
    try:
        if what == "msgpack" and msgpack_end(body) != len(body):
            raise ValueError("trailing bytes after the object, or an object cut short")
        data = MSGPACK.unpackb(body) if what == "msgpack" else \
            json.loads(body, parse_constant=refuse_constant)
    except (ValueError, TypeError, RecursionError) as e:  # both libraries' errors, the depth limits too
        raise common.UserError(f"malformed {what} body: {str(e)[:100] or type(e).__name__}") from None
    if not isinstance(data, dict):
        raise common.UserError(f"the {what} body must be an object (a map)")
    return data


def parse_form(content_type: str, body: bytes) -> dict:
    """multipart/form-data -> {field: text, audio: bytes}, parsed by the standard library's email parser."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise common.UserError("malformed multipart/form-data body")
    fields = {part.get_param("name", header="content-disposition"): part.get_payload(decode=True) or b""
              for part in message.iter_parts()}
    return {name: value if name == "audio" else value.decode("utf-8", "replace")
            for name, value in fields.items() if name}


def decode_base64(value, what: str) -> bytes:
    """base64 text (JSON), wrapped or not -> bytes; bytes (msgpack, multipart) are the audio itself."""
    if isinstance(value, bytes) and value:
        return value
    if not isinstance(value, str) or not value:
        raise common.UserError(f"{what} must be a base64 string of an audio file")
    if value.startswith("data:") and ";base64," in value:  # a data URL, as browsers make them
        value = value.split(",", 1)[1]
    try:  # the line breaks (and spaces) of wrapped base64 are no data: `base64` prints 76-column lines
        return base64.b64decode("".join(value.split()), validate=True)
    except ValueError:  # binascii.Error is one
        raise common.UserError(f"{what} is not valid base64") from None


def check_clip_header(what: str, rate: int, channels: int, frames: int, kind: str, subtype: str, size: int):
    """An uploaded clip's header (soundfile.info), checked before a sample is decoded: a 2 KB file can
    declare 1000 s at 1 Hz (44 M samples once resampled), 46 KB of FLAC 30 s of 8 channels at 192 kHz."""
    if not CLIP_RATES[0] <= rate <= CLIP_RATES[1]:
        raise common.UserError(f"{what} has a sample rate of {rate} Hz: {CLIP_RATES[0]} to {CLIP_RATES[1]}"
                               " Hz are allowed")
    if not 1 <= channels <= MAX_CLIP_CHANNELS:
        raise common.UserError(f"{what} has {channels} channels: send a mono or stereo clip")
    if frames > MAX_CLIP_SECONDS * rate:
        raise common.UserError(f"{what} is {frames / rate:.1f} s long, at most {MAX_CLIP_SECONDS} s are"
                               " allowed")
    if kind in UNCOMPRESSED and subtype in SAMPLE_BYTES and frames * channels * SAMPLE_BYTES[subtype] > size:
        raise common.UserError(f"{what} declares {frames} frames, more than its {size} bytes hold")


def number_field(body: dict, key: str, default, integer=False, low=None):
    value = body.get(key, default)
    if value is None:
        return default
    try:
        finite = not isinstance(value, bool) and math.isfinite(value)
    except (TypeError, OverflowError):  # not a number; a JSON integer too large for a float
        finite = False
    if not finite:  # the value shown, never deep: a nested list is named, not printed
        shown = repr(value)[:40] if isinstance(value, (str, int, float)) else type(value).__name__
        raise common.UserError(f"{key} must be a finite number, got {shown}")
    if integer and value != int(value):
        raise common.UserError(f"{key} must be an integer, got {value}")
    if low is not None and value < low:
        raise common.UserError(f"{key} must be >= {low}, got {value}")
    return int(value) if integer else float(value)


def seed_field(body: dict):
    return common.check_seed(number_field(body, "seed", None, integer=True))


def sampling_fields(body: dict, defaults: dict) -> dict:
    """The types are checked here, the ranges by dualAR when the request is submitted."""
    fields = {key: number_field(body, key, default, integer=isinstance(default, int))
              for key, default in defaults.items()}  # top_k, max_new_tokens, chunk_length
    return dict(seed=seed_field(body), **fields)


def reference_clips(items, what="references") -> list:
    """[{audio: base64, text}] -> [(audio bytes, transcript)]."""
    if not isinstance(items, list):
        raise common.UserError(f"{what} must be a list of {{audio, text}} objects")
    dualAR.check_reference_count(len(items))
    out = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise common.UserError(f"{what}[{i}] must be an object {{audio, text}}")
        text = check_text(item.get("text"), f"reference {i} transcript (text)", MAX_TRANSCRIPT)
        out.append((decode_base64(item.get("audio"), f"reference {i} audio"), text))
    return out


def is_code_lists(codes) -> bool:
    """Codes as a client sends them: lists of integers (no floats, no booleans: bool is an int)."""
    return isinstance(codes, list) and all(isinstance(row, list) and all(type(code) is int for code in row)
                                           for row in codes)


def check_format(fmt) -> str:
    if fmt not in FORMATS:
        raise common.UserError(f"response format {str(fmt)[:20]!r} is not supported here: use one of"
                               f" {', '.join(FORMATS)}")
    return fmt


def s2_options(body: dict) -> dict:
    """S2-Pro's fields of a speech request: OpenAI's speed and instructions refused, OmniVoice's extras too,
    our sampling extras."""
    given = [key for key in OMNIVOICE_FIELDS if key in body]
    if given:  # as OmniVoice refuses S2-Pro's: an option that does nothing is said, not dropped
        raise common.UserError(f"{given[0]} is an OmniVoice option: S2-Pro takes seed, temperature, top_p,"
                               " top_k, max_new_tokens and chunk_length (docs/api.md)")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or speed != 1:
        raise common.UserError("speed: only 1.0 is supported")
    if body.get("instructions"):
        raise common.UserError("instructions are not supported: S2-Pro takes style as inline tags in the"
                               " input text itself, e.g. '[whispering] Hello' (see README)")
    return sampling_fields(body, OPENAI_DEFAULTS)


def omnivoice_options(body: dict) -> dict:
    """OmniVoice's fields of a speech request -> omnivoice.Speech's keyword arguments: OpenAI's instructions
    (voice design, the closed attribute list) and speed, our extras language, num_step, guidance_scale,
    duration, seed. Checked here, before any clip is encoded."""
    given = [key for key in S2_FIELDS if key in body]
    if given:
        raise common.UserError(f"{given[0]} is an S2-Pro option: OmniVoice takes language, num_step,"
                               " guidance_scale, duration, seed, speed and instructions (docs/api.md)")
    speed = number_field(body, "speed", 1.0)
    instruct, language = body.get("instructions") or None, body.get("language")
    for key, value in (("instructions", instruct), ("language", language)):
        if value is not None and not isinstance(value, str):
            raise common.UserError(f"{key} must be a string")
        if value is not None and len(value) > MAX_INSTRUCTIONS:
            raise common.UserError(f"{key} has {len(value)} characters, at most {MAX_INSTRUCTIONS} are"
                                   " allowed")
    try:
        omnivoice_text.resolve_instruct(instruct)
    except common.UserError as e:  # its words are the library's: `instruct: ...`, or upstream's own sentence
        message = str(e)
        message = message.removeprefix("instruct") if message.startswith("instruct") else f": {message}"
        raise common.UserError("instructions" + message) from None
    omnivoice_text.resolve_language(language)
    num_step = number_field(body, "num_step", omnivoice.GENERATION["num_step"], integer=True)
    guidance = number_field(body, "guidance_scale", omnivoice.GENERATION["guidance_scale"])
    duration = number_field(body, "duration", None)
    omnivoice.check_limits(num_step, guidance, speed, duration)  # the CLI's
    return dict(language=language, instruct=instruct, speed=speed, duration=duration, seed=seed_field(body),
                num_step=num_step, guidance_scale=guidance)


def openai_job(body: dict, options) -> dict:
    """POST /v1/audio/speech (OpenAI's fields and our extras) -> a job: what to say, how, how to send it.
    options(body): the model's own fields (s2_options, omnivoice_options)."""
    stream = body.get("stream_format", "audio")
    if stream not in ("audio", "sse"):
        raise common.UserError("stream_format must be 'audio' or 'sse'")
    voice = body.get("voice")
    voice = voice.get("id") if isinstance(voice, dict) else voice  # OpenAI's custom voice object {id}
    references = reference_clips(body.get("references", []))
    if "ref_audio" in body or "ref_text" in body:
        one = dict(audio=body.get("ref_audio"), text=body.get("ref_text"))
        references += reference_clips([one], "ref_audio")
    fmt = check_format(body.get("response_format", OPENAI_FORMAT))
    return dict(text=check_text(body.get("input")), voice=common.voice_name(voice) if voice else None,
                clips=references, options=options(body), format=fmt, rate=output_rate(body, fmt),
                send="sse" if stream == "sse" else "chunked" if fmt in STREAMABLE + ENCODED_AS_MADE
                else "whole")


def output_rate(body: dict, fmt: str):
    """The OpenAI route's `sample_rate` (an extra): the rate the audio is sent at; by default pcm's 24 kHz
    (OpenAI's), the model's own for a format whose header says its rate (None: the model's)."""
    rate = body.get("sample_rate")
    if rate is None:
        return OPENAI_PCM_RATE if fmt == "pcm" else None
    if isinstance(rate, bool) or rate not in OUTPUT_RATES:
        raise common.UserError(f"sample_rate must be one of {', '.join(map(str, OUTPUT_RATES))} (Hz), got"
                               f" {str(rate)[:20]}")
    if fmt == "opus" and rate not in OPUS_RATES:
        raise common.UserError(f"opus exists at {', '.join(map(str, OPUS_RATES))} Hz only, not {rate}")
    return rate


def json_input(value):
    """A client's value echoed in a 422, as pydantic's JSON echoes it: NaN and infinities as null (JSON has
    no literal for them), lists and maps element by element."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, dict)):
        try:
            json.dumps(value, allow_nan=False, default=str)  # bytes: send_json writes them as base64
            return value
        except ValueError:  # a NaN inside
            items = value.items() if isinstance(value, dict) else enumerate(value)
            shown = {key: json_input(item) for key, item in items}
            return shown if isinstance(value, dict) else list(shown.values())
        except RecursionError:  # too deep to show
            return type(value).__name__
    return value


def upstream_errors(body: dict) -> list:
    """The fields upstream's pydantic model refuses with a 422 -> its error list, in pydantic's shape."""
    errors = []
    for key, (low, high) in UPSTREAM_RANGES.items():
        value = body.get(key, low)
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # strict: no "0.5", no true
            errors.append(dict(type="float_type", loc=[key], input=json_input(value),
                               msg="Input should be a valid number"))
        elif not low <= value <= high:
            words, op, bound = ("greater", "ge", low) if not value >= low else ("less", "le", high)
            errors.append(dict(type=f"{words}_than_equal", loc=[key], input=json_input(value),
                               ctx={op: bound}, msg=f"Input should be {words} than or equal to {bound:g}"))
    for key, allowed in UPSTREAM_CHOICES.items():
        if key in body and not any(body[key] == choice for choice in allowed):
            expected = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
            errors.append(dict(type="literal_error", loc=[key], msg=f"Input should be {expected}",
                               input=json_input(body[key]), ctx=dict(expected=expected)))
    return [dict(error, **{"in": "body"}) for error in errors]


def fish_job(body: dict) -> dict:
    """POST /v1/tts, upstream's ServeTTSRequest: its defaults and checks, reference_id = a saved voice.
    repetition_penalty, normalize, latency, use_memory_cache: checked, no effect, as upstream's S2-Pro."""
    errors = upstream_errors(body)
    if errors:
        raise HTTPError(422, "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in errors), body=errors)
    streaming = body.get("streaming", False)
    if not isinstance(streaming, bool):
        raise common.UserError("streaming must be true or false")
    fmt = check_format(body.get("format", "wav"))
    if streaming and fmt != "wav":
        raise common.UserError(f"streaming: only format 'wav' can be streamed, not {fmt!r} (as upstream)")
    voice = body.get("reference_id")
    return dict(text=check_text(body.get("text"), "text"), voice=common.voice_name(voice) if voice else None,
                clips=reference_clips(body.get("references") or []), format=fmt,
                options=sampling_fields(body, FISH_DEFAULTS), send="chunked" if streaming else "whole")


# ----------------------------------------------------------------------------- audio bytes
def wav_header(data_bytes=0xFFFFFFFF, rate=SAMPLE_RATE) -> bytes:
    """16-bit mono PCM WAV header. Streamed, the length is unknown: 0xFFFFFFFF sizes, which players accept."""
    return (b"RIFF" + struct.pack("<I", min(36 + data_bytes, 0xFFFFFFFF)) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, 2 * rate, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


def sse_event(**payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def pcm16(wave) -> bytes:
    """A 1-D float wave (tensor or array) -> 16-bit little-endian PCM."""
    wave = torch.as_tensor(wave).float().cpu()
    return (wave.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()


def resampled(resampler, data: bytes, last=False) -> bytes:  # 16-bit PCM through soxr's stream
    return resampler.resample_chunk(np.frombuffer(data, dtype="<i2"), last=last).astype("<i2").tobytes()


MP3_STREAM = dict(bitrate_mode="CONSTANT", compression_level=0.5)  # ~85 kbps


class StreamedFile:
    """mp3 or opus encoded as the audio comes: `write` gives the bytes the encoder has finished (mp3: a
    frame at a time; ogg opus: a page, about a second). mp3 is constant-bitrate here: without a length
    header players size a stream from its bytes, which only a constant rate makes right (soundfile read a
    streamed 8 s variable-rate one as 4.6 s). LAME's first frame is a placeholder, all zeros, that it fills
    in (its Info tag) only at the end, which a stream cannot go back to: `stream_tag` takes its place.
    Nor can a stream say where its audio ends, so decoders play the last frame's padding: an mp3 stream ends
    on the nearest frame boundary, a tail of at most half a frame cut (12 ms at 24 kHz, 13 at 44.1 kHz), not
    padded to a whole frame. That keeps LiveKit's decoder within an OmniVoice frame at 24 kHz: it drops the
    first frame as it probes the stream, and the decoder delay's skip with it (529 samples more)."""

    def __init__(self, fmt: str, rate: int):
        kind, subtype, _ = SOUNDFILE_FORMATS[fmt]
        self.fmt, self.rate, self.out, self.sent = fmt, rate, io.BytesIO(), 0
        self.held = b""  # mp3: PCM bytes held back for the next piece
        mp3 = MP3_STREAM if fmt == "mp3" else {}
        self.file = sf.SoundFile(self.out, "w", rate, 1, format=kind, subtype=subtype, **mp3)

    def write(self, data: bytes, last=False) -> bytes:  # 16-bit PCM -> the bytes finished since
        if self.fmt == "mp3":  # whole mp3 frames, the rest held until the next piece or the end
            data, frame = self.held + data, 2 * mp3_frame_samples(self.rate)
            tail = len(data) % frame
            self.held = b"" if last else data[len(data) - tail:]
            cut = not last or 2 * tail <= frame and (self.file.frames or len(data) > tail)  # never to nothing
            data = data[:len(data) - tail] if cut else data
        if data:
            self.file.write(np.frombuffer(data, dtype="<i2"))
        if last:
            self.file.close()
        written = bytes(self.out.getbuffer()[self.sent:])
        if self.sent == 0 and self.fmt == "mp3":
            size = mp3_frame_bytes(written[:4]) if len(written) >= 4 else None
            if size is None or len(written) < size:
                return b""  # the first frame is not whole yet
            first = written[:size]
            if not any(first[4:]) or b"Info" in first or b"Xing" in first:  # LAME's tag frame
                written = stream_tag(first[:4], self.rate) + written[size:]  # as long as LAME's
        self.sent += len(written)
        return written


@functools.cache
def lame_tag(rate: int) -> Optional[tuple]:
    """LAME's Info tag in a whole mp3 of ours at this rate: (its offset in the first frame, its LAME
    extension: 36 bytes, the encoder delay and end padding in 3 of them); None if it wrote none."""
    out = io.BytesIO()
    with sf.SoundFile(out, "w", rate, 1, format="MP3", subtype="MPEG_LAYER_III", **MP3_STREAM) as f:
        f.write(np.zeros(rate // 10, "<i2"))
    data = out.getvalue()
    first = data[:mp3_frame_bytes(data[:4])]
    offset, lame = first.find(b"Info"), first.find(b"LAME")
    return (offset, first[lame:lame + 36]) if 0 < offset < lame and len(first) >= lame + 36 else None


def stream_tag(header: bytes, rate: int) -> bytes:
    """A stream's first mp3 frame (b"" where LAME writes no tag): an Info tag with LAME's encoder delay only,
    no frame count or end padding (unknown until the end) and the size 0xFFFFFFFF (unknown, as the streamed
    wav's: ffmpeg skips a tag frame only where it has a count or a size). ffmpeg (browsers, PyAV) then drops
    the delay: the audio starts in time, not a frame late."""
    tag = lame_tag(rate)
    if tag is None:
        return b""
    offset, lame = tag
    lame = lame[:22] + bytes([lame[22] & 0xF0, 0]) + lame[24:28] + bytes(8)  # no padding, length or CRCs
    frame = header + bytes(offset - 4) + b"Info" + (2).to_bytes(4, "big") + b"\xff" * 4 + lame  # flag 2: size
    return frame + bytes(mp3_frame_bytes(header) - len(frame))


MPEG1_KBPS = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)  # by bitrate index
MPEG2_KBPS = (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)  # MPEG-2 and 2.5, layer III


def mp3_frame_samples(rate: int) -> int:
    return 1152 if rate >= 32000 else 576  # MPEG-1 (32, 44.1, 48 kHz); MPEG-2 and 2.5 below


def mp3_frame_bytes(header) -> int:
    """The length of the MPEG layer III frame that starts with these 4 bytes."""
    version, index, rate_index, padding = (header[1] >> 3) & 3, header[2] >> 4, (header[2] >> 2) & 3, \
        (header[2] >> 1) & 1  # version 3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5
    rate = (44100, 48000, 32000)[rate_index] >> {3: 0, 2: 1, 0: 2}[version]
    kbps = (MPEG1_KBPS if version == 3 else MPEG2_KBPS)[index]
    return (144 if version == 3 else 72) * kbps * 1000 // rate + padding


def audio_file_bytes(wave, fmt: str, rate=SAMPLE_RATE, out_rate=None) -> bytes:
    """A whole wave at `rate` -> the bytes of a response_format file at `out_rate` (default: `rate`, opus's
    48 kHz where opus has no such rate)."""
    samples = np.frombuffer(pcm16(wave), dtype="<i2")  # the wav's very samples: flac is lossless of them
    out_rate = out_rate or file_rate(fmt, rate)
    if out_rate != rate:
        samples = soxr.resample(samples, rate, out_rate)
    if fmt in STREAMABLE:
        data = samples.astype("<i2").tobytes()
        return data if fmt == "pcm" else wav_header(len(data), out_rate) + data
    kind, subtype, _ = SOUNDFILE_FORMATS[fmt]
    out = io.BytesIO()
    sf.write(out, samples, out_rate, format=kind, subtype=subtype)
    return out.getvalue()


def clip_samples(data: bytes, what: str) -> tuple:
    """Uploaded audio bytes -> (float32 mono samples, their rate): channels averaged, decoded from memory (no
    temp file holds the upload) once its header is checked, a second at a time and never past
    MAX_CLIP_SECONDS (a header may lie about its length)."""
    if not data:
        raise common.UserError(f"{what} is empty")
    blocks, frames = [], 0
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:  # soundfile tells the format from the bytes
            check_clip_header(what, f.samplerate, f.channels, f.frames, f.format, f.subtype, len(data))
            most, rate = MAX_CLIP_SECONDS * f.samplerate, f.samplerate
            for block in f.blocks(blocksize=rate, dtype="float32", always_2d=True):
                blocks.append(block.mean(1))
                frames += len(block)
                if frames > most:
                    raise common.UserError(f"{what} is longer than its header says and than the"
                                           f" {MAX_CLIP_SECONDS} s allowed")
    except common.UserError:
        raise
    except Exception:  # soundfile's errors for what it cannot parse (as codec.load_audio)
        raise common.UserError(f"{what} is not an audio file soundfile can read (wav, flac, ogg, mp3)") \
            from None
    if not frames:
        raise common.UserError(f"{what} contains no audio samples")
    samples = np.concatenate(blocks)
    if not np.isfinite(samples).all():  # a float file may hold them
        raise common.UserError(f"{what} has NaN or infinite samples")
    return samples, rate


# ----------------------------------------------------------------------------- the model side
class Gate:
    """At most `size` holders at once and `waiting` more waiting their turn; beyond that a 503 with
    Retry-After (what --slots and --queue are to generation, for the codec work requests bring)."""

    def __init__(self, size: int, waiting: int, what: str):
        self.size, self.waiting, self.what = size, waiting, what
        self.running, self.queued, self.turn, self.closed = 0, 0, threading.Condition(), False

    @contextlib.contextmanager
    def hold(self):
        with self.turn:
            if self.running >= self.size and self.queued >= self.waiting:
                raise HTTPError(503, f"the server is busy: {self.running} {self.what} running and"
                                     f" {self.queued} waiting, try again later", {"Retry-After": "2"})
            self.queued += 1
            self.turn.wait_for(lambda: self.running < self.size or self.closed)
            self.queued -= 1
            if self.closed:
                raise common.EngineClosed("no more work is taken")
            self.running += 1
        try:
            yield
        finally:
            with self.turn:
                self.running -= 1
                self.turn.notify()

    def close(self):
        """Those waiting are told the server is shutting down; those running finish."""
        with self.turn:
            self.closed = True
            self.turn.notify_all()


class ModelEngine(Protocol):
    """What the server uses of a model's engine (common.EngineThread)."""
    thread: threading.Thread

    def check_room(self): ...  # a 503 (common.QueueFull) when no request can wait
    def stats(self) -> dict: ...  # busy, free, queued, ... for /health
    def close(self): ...


class SpeechRequest(Protocol):
    """What the server uses of a request a model's `submit` returns (dualAR.Request, omnivoice.Speech)."""
    done: bool
    cancelled: bool

    def cancel(self): ...
    def finish(self, error: Exception): ...


class SpeechModel(Protocol):
    """The verbs the server speaks to a model, built from the command line as `Model(args)` and listed in
    MODELS. A reference is whatever the model's `submit` takes (S2-Pro: codes and transcript; OmniVoice: a
    voice prompt), from a clip or a saved voice (its own files in the shared voices folder)."""
    kind: str  # --model's name, and the model a listed voice is for
    model_types: tuple  # the model_type values of its checkpoints' config.json
    title: str
    owner: str  # /v1/models' owned_by
    fish_api: bool  # whether it serves upstream fish-speech's routes (/v1/tts, /v1/vqgan: FishSpeechModel)
    sample_rate: int
    hop: int  # samples per frame
    max_references: int
    engine: ModelEngine
    demo: bool  # a tiny random model (no checkpoint): `notice` says its audio is noise
    notice: str
    name: str
    info: dict  # what /health says of it

    @staticmethod
    def options(body: dict) -> dict: ...  # its fields of a speech request -> the job's options

    @staticmethod
    def check_references(count: int): ...  # before any clip is encoded

    @staticmethod
    def voice_files(folder: Path) -> dict: ...  # -> {name: (kind, path)}, its voices in the folder

    @staticmethod
    def voice_paths(folder: Path, name: str) -> list: ...  # a voice's files, in the order they are removed

    def read_voice(self, kind: str, path: Path, codec_work): ...  # -> a reference
    def clip_reference(self, samples: np.ndarray, rate: int, text: str, what: str): ...  # -> a reference
    def write_voice(self, folder: Path, name: str, reference) -> dict: ...  # -> what POST answers
    def voice_of(self, request: SpeechRequest): ...  # -> the reference a request without one made up
    def submit(self, job: dict, references: list) -> SpeechRequest: ...
    def waves(self, request: SpeechRequest): ...  # -> 1-D waves at sample_rate, as they are made
    def whole(self, request: SpeechRequest): ...  # -> the whole wave
    def usage(self, request: SpeechRequest, samples: int) -> tuple: ...  # -> (input tokens, output tokens)
    def page(self) -> dict: ...  # its part of the page's CONFIG


class FishSpeechModel(SpeechModel, Protocol):
    """A model with `fish_api`: upstream's /v1/vqgan routes use its codec too."""
    def encode(self, samples: np.ndarray, rate: int) -> torch.Tensor: ...
    def check_codes(self, codes, what: str) -> torch.Tensor: ...
    def decode(self, codes: torch.Tensor) -> torch.Tensor: ...


class S2ProModel:
    """S2-Pro behind the server's verbs (SpeechModel, and FishSpeechModel's for fish-speech's own routes):
    the model, codec and engine loaded; a reference is codes (10, T) and a transcript."""
    kind, title, owner, fish_api = "s2-pro", "S2-Pro", "fishaudio", True
    model_types = ("fish_qwen3_omni", "dual_ar")
    sample_rate, hop, options = SAMPLE_RATE, HOP, staticmethod(s2_options)
    max_references = dualAR.MAX_REFERENCES

    @staticmethod
    def check_references(count: int):
        dualAR.check_reference_count(count)

    def __init__(self, args):
        self.device, dtype, compiled = dualAR.model_settings(args)  # as the CLI
        self.demo = args.checkpoint is None and not Path(dualAR.DEFAULT_CHECKPOINT).exists()
        self.checkpoint = "(demo)" if self.demo else args.checkpoint or dualAR.DEFAULT_CHECKPOINT
        if self.demo:  # built in memory
            self.model, self.dac = dualAR.demo_models(self.device, dtype)
            dualAR.optimize(self.model, args.quant, compiled, args.compile_cache, args.fast_prefill)
        else:
            self.model = dualAR.load(self.checkpoint, self.device, dtype, args.quant, compiled,
                                     args.compile_cache, args.fast_prefill)
            self.dac = codec.load(self.checkpoint, self.device, torch.float32)  # references encode in fp32
        # this CPU's faster matmuls for the engine's batches (the codec stays eager: clips encode to
        # upstream's codes)
        if not args.no_tune:
            cpu_fast.tune(self.model, rows=args.slots)
        self.max_context = min(args.max_context, self.model.config["max_seq_len"])
        # a fixed cache of --max-context positions a row: each row count's frame step is compiled once, here
        scheduler = dualAR.Scheduler(self.model, slots=args.slots, context=self.max_context)
        if compiled:
            print("compiling the frame step for each row count the engine runs (--compile)", file=sys.stderr)
            scheduler.warm_up(lambda n, seconds: print(f"  {n} row(s): {seconds:.1f} s", file=sys.stderr))
        self.engine = common.EngineThread(scheduler, max_queue=args.queue).start()
        self.name, self.notice = "fishfast-demo" if self.demo else "s2-pro", DEMO_NOTICE
        # the checkpoint folder's name, never its path: /health answers without a key
        self.info = dict(model=self.name, checkpoint=Path(self.checkpoint).resolve().name,
                         device=str(self.device), dtype=str(dtype).replace("torch.", ""),
                         quant=args.quant or "none", compile=compiled,
                         max_context=self.max_context, demo=self.demo)

    # voices: prompt/<name>.npy (codes) or an audio file, + prompt/<name>.txt, the layout the CLI reads
    @staticmethod
    def voice_files(folder: Path) -> dict:  # -> {name: (kind, path)}
        return {path.stem: (kind, path) for kind, path in codec.default_references(folder)}

    @staticmethod
    def voice_paths(folder: Path, name: str) -> list:
        """A voice's files, the transcript first: removed first, the voice is gone before its codes are."""
        found = [p for p in folder.glob("*") if p.stem == name
                 and p.suffix.lower() in {".npy", *common.AUDIO_EXTENSIONS}]
        return [p for p in (folder / f"{name}.txt", *found) if p.exists()]

    def read_voice(self, kind: str, path: Path, codec_work) -> tuple:
        # a voice kept as audio is encoded each time it is used: codec work as an upload's
        with codec_work() if kind != "codes" else contextlib.nullcontext():
            codes = codec.reference_codes(kind, path, self.model.config, lambda: self.dac)
        return codes, codec.read_transcript(path.with_suffix(".txt"))

    def clip_reference(self, samples, rate: int, text: str, what: str) -> tuple:
        common.check_plain_text(self.model.tokenizer, text, f"{what}'s transcript", dualAR.SPEAKER_TAG)
        return self.encode(samples, rate), text

    def encode(self, samples, rate: int) -> torch.Tensor:
        """A clip's mono samples -> codes (10, T), as codec.load_audio + codec.encode read a file."""
        return codec.encode(self.dac, codec.mono_at(samples, rate, SAMPLE_RATE))[0].cpu()

    def write_voice(self, folder: Path, name: str, reference: tuple) -> dict:
        codes, text = reference
        codec.write_reference(folder, name, codes, text)  # listed and usable once its transcript is whole
        return dict(name=name, frames=codes.size(1), seconds=round(codes.size(1) * HOP / SAMPLE_RATE, 2))

    def voice_of(self, request) -> tuple:
        """Its first text batch's codes and text (all of a text but a long dialogue), as the CLI keeps."""
        request.codes()  # waits for the end
        if request.cancelled:  # the client hung up
            raise ConnectionError("the client hung up")
        if not request.history or request.history[0][1].size(1) == 0:
            raise common.UserError("the model said nothing (it stopped at once): no voice to keep, try"
                                   " another seed")
        text, codes = request.history[0]
        return codes, text

    def check_codes(self, codes, what: str) -> torch.Tensor:
        """A client's codes (nested lists) -> (10, T) on the device; the codec clamps big ones (upstream)."""
        rows, frames = self.model.config["num_codebooks"], self.max_context
        if is_code_lists(codes):  # integers only: torch would take 1.5 and true as 1
            with contextlib.suppress(ValueError, RuntimeError, OverflowError):  # ragged, too large
                codes = torch.tensor(codes, dtype=torch.long)
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.size(0) != rows \
                or not 0 < codes.size(1) <= frames or codes.min() < 0:
            raise common.UserError(f"{what} must be {rows} equal lists of 1 to {frames} integers >= 0")
        return codes.to(self.device)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codec.decode(self.dac, codes)[0]

    def submit(self, job: dict, references: list):
        sampling = dict(job["options"])
        if self.demo and not sampling["max_new_tokens"]:  # random weights rarely stop: the page's length
            sampling["max_new_tokens"] = DEMO_FRAMES
        return self.engine.submit(dualAR.Request(self.model, job["text"], references,
                                                 max_context=self.max_context,
                                                 max_frames=max_frames(job, SAMPLE_RATE / HOP), **sampling))

    def waves(self, request):
        for wave in codec.decode_stream(self.dac, request):  # decoded as the codes come
            yield wave[0]

    def whole(self, request) -> torch.Tensor:
        codes = request.codes()
        if request.cancelled:  # the client hung up: nobody to decode for
            raise ConnectionError("the client hung up")
        return codec.decode(self.dac, codes.to(self.device))[0] if codes.size(1) else torch.zeros(0)

    def usage(self, request, samples: int) -> tuple:
        return request.prefill_tokens, round(samples / HOP)

    def page(self) -> dict:
        return dict(maxFrames=DEMO_FRAMES if self.demo else 0)


class OmniVoiceModel:
    """OmniVoice behind the same verbs (SpeechModel): its engine (common.EngineThread) batches the requests'
    sentences, each request an omnivoice.Speech (sentence streaming, its own random stream); a reference is
    a voice prompt (codes, transcript, level), saved as <name>.omnivoice.safetensors."""
    kind, title, owner, fish_api, model_types = "omnivoice", "OmniVoice", "k2-fsa", False, ("omnivoice",)
    options, max_references = staticmethod(omnivoice_options), 1

    @staticmethod
    def check_references(count: int):
        if count > 1:
            raise common.UserError(f"OmniVoice clones one voice: send a saved voice or one reference clip,"
                                   f" not {count}")

    def __init__(self, args):
        self.device, dtype, _ = dualAR.model_settings(args)
        compiled = args.compile is True  # asked for only: its compiled forward has not run on a GPU yet
        self.demo = args.checkpoint is None and not Path(omnivoice.DEFAULT_CHECKPOINT).is_dir()
        self.checkpoint = "(demo)" if self.demo else args.checkpoint or omnivoice.DEFAULT_CHECKPOINT
        if self.demo:  # built in memory
            self.model = quantize.quantize(omnivoice.demo_model(self.device, dtype), args.quant)
        else:
            self.model = omnivoice.load(self.checkpoint, self.device, dtype, args.quant)
        if compiled:  # CPU: one graph for every batch (the flat row); else a graph per (rows, length bucket)
            omnivoice.compile_forward(self.model, cache=args.compile_cache)
        if not args.no_tune:
            cpu_fast.tune(self.model)  # this CPU's faster matmuls (--packed's flat row)
        self.sample_rate, self.hop = self.model.sample_rate, self.model.audio_tokenizer.hop_length
        scheduler = omnivoice.Scheduler(self.model, max_batch=args.slots, packed=args.packed)
        self.engine = common.EngineThread(scheduler, max_queue=args.queue).start()
        self.name = "omnivoice-demo" if self.demo else "omnivoice"
        self.notice = ("DEMO: no checkpoint found, so a tiny RANDOM OmniVoice is serving and the audio is"
                       f" NOISE. For speech, download k2-fsa/OmniVoice into {omnivoice.DEFAULT_CHECKPOINT}"
                       " (see README).")
        # the checkpoint folder's name, never its path: /health answers without a key
        self.info = dict(model=self.name, checkpoint=Path(self.checkpoint).resolve().name,
                         device=str(self.device), dtype=str(dtype).replace("torch.", ""),
                         quant=args.quant or "none", compile=compiled,
                         packed=args.packed, demo=self.demo)

    @staticmethod
    def voice_files(folder: Path) -> dict:
        suffix = omnivoice.VOICE_SUFFIX
        found = sorted(folder.glob("*" + suffix)) if folder.is_dir() else []
        return {path.name[:-len(suffix)]: ("omnivoice", path) for path in found}

    @staticmethod
    def voice_paths(folder: Path, name: str) -> list:
        return [p for p in (folder / f"{name}{omnivoice.VOICE_SUFFIX}",) if p.exists()]

    def read_voice(self, kind: str, path: Path, codec_work) -> dict:
        return omnivoice.load_voice(path, self.model)  # codes: no codec work

    def clip_reference(self, samples, rate: int, text: str, what: str) -> dict:
        """upstream's voice-clone prompt of the clip (its own resampling, level, silence trimming)."""
        try:
            return omnivoice.voice_prompt(self.model, (samples, rate), text)
        except omnivoice.SilentClip:  # its hint is the library's flag, which HTTP does not offer
            raise common.UserError(f"{what} is silent or shorter than a frame once its silences are trimmed"
                                   " (as upstream prepares a clip): send a clip in which the voice is heard"
                                   ) from None

    def write_voice(self, folder: Path, name: str, reference: dict) -> dict:
        omnivoice.save_voice(folder / f"{name}{omnivoice.VOICE_SUFFIX}", reference)  # one file, written whole
        frames = reference["codes"].shape[1]
        return dict(name=name, frames=frames, seconds=round(frames / self.model.frame_rate, 2))

    def voice_of(self, request: omnivoice.Speech) -> dict:
        """Its first sentence's codes and text (Speech.voice): the rest is not waited for."""
        pieces = iter(request)
        for _ in pieces:
            if request.tokens:
                break
        pieces.close()
        if request.cancelled:  # the client hung up
            raise ConnectionError("the client hung up")
        return request.voice()

    def submit(self, job: dict, references: list) -> omnivoice.Speech:
        voice = references[0] if references else None
        return omnivoice.Speech(self.model, self.engine, job["text"], voice=voice,
                                max_frames=max_frames(job, self.model.frame_rate),
                                max_sentence_frames=MAX_SENTENCE * self.model.frame_rate, **job["options"])

    def waves(self, request: omnivoice.Speech):
        return iter(request)

    def whole(self, request: omnivoice.Speech) -> np.ndarray:
        pieces = list(request)
        if request.cancelled:  # the client hung up
            raise ConnectionError("the client hung up")
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    def usage(self, request: omnivoice.Speech, samples: int) -> tuple:
        return request.input_tokens, sum(codes.shape[1] for codes in request.tokens)

    def page(self) -> dict:
        attributes = {name: list(items) for name, items in omnivoice_text.INSTRUCT_TRANSLATED.items()}
        attributes.update(accent=list(omnivoice_text.ACCENTS), dialect=list(omnivoice_text.DIALECTS))
        return dict(attributes=attributes, languages=sorted(omnivoice_text.languages()[1]),
                    numStep=omnivoice.GENERATION["num_step"], maxSteps=omnivoice.MAX_STEPS,
                    speeds=omnivoice.SPEEDS)


MODELS: dict[str, type[SpeechModel]] = {model.kind: model for model in (S2ProModel, OmniVoiceModel)}


def model_kind(args) -> str:
    """The model to serve: --checkpoint's (its config.json's model_type), else --model (default s2-pro)."""
    kind = args.model or "s2-pro"
    if args.checkpoint:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # the loader says what is wrong
            found = json.loads((Path(args.checkpoint) / "config.json").read_text(encoding="utf-8"))
            model_type = found.get("model_type")  # one no model has: S2-Pro's loader says what is wrong
            kind = next((name for name, model in MODELS.items() if model_type in model.model_types), "s2-pro")
        if args.model and args.model != kind:
            raise common.UserError(f"--checkpoint {args.checkpoint} holds {MODELS[kind].title}, not"
                                   f" {MODELS[args.model].title} (its config.json says): leave out --model")
    return kind


class App:
    """The model (a SpeechModel), its engine and the voices folder, shared by every request thread."""

    def __init__(self, args):
        self.page = read_page()  # before the model: a missing file is told at once, not after the load
        self.model: SpeechModel = MODELS[model_kind(args)](args)
        self.engine, self.demo, self.info, self.name = (self.model.engine, self.model.demo, self.model.info,
                                                        self.model.name)
        self.voices, self.api_key, self.max_voices = Path(args.voices), args.api_key, args.max_voices
        self.default_voice, self.allow_origins = args.default_voice, set(args.allow_origin or ())
        self.hosts = served_names(args.host, args.allow_host)
        # decoding and encoding clips (uploads, voices kept as audio), /v1/vqgan: seconds each, not in --slots
        self.codec_gate = Gate(args.codec_workers, args.queue, "codec jobs (uploads, /v1/vqgan)")
        self.codec_work = self.codec_gate.hold
        self.metrics = Metrics(self.model.kind)

    def close(self):
        self.codec_gate.close()
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self.engine.thread.is_alive()

    def health(self) -> dict:
        note = dict(note="DEMO: a tiny random model, the audio is noise") if self.demo else {}
        status = "ok" if self.alive else "the engine stopped: see the server's log"
        return dict(status=status, **self.info, **note, **self.engine.stats())

    def gauges(self) -> list:
        """-> [(name, help, value)]: the engine's and the codec's load now, for GET /metrics."""
        stats, gate = self.engine.stats(), self.codec_gate
        return [("fishfast_engine_up", "1 while the engine runs, 0 once it stopped", int(self.alive)),
                ("fishfast_slots", "Rows the engine generates together (--slots)", stats["slots"]),
                ("fishfast_slots_busy", "Rows generating now", stats["busy"]),
                ("fishfast_queue_depth", "Requests waiting for a row", stats["queued"]),
                ("fishfast_codec_jobs_running", "Codec jobs (uploads, /v1/vqgan) running", gate.running),
                ("fishfast_codec_jobs_queued", "Codec jobs waiting for a --codec-workers turn", gate.queued)]

    # voices: one folder, one name space, each model's own files (S2ProModel.voice_files and OmniVoice's)
    def voice_files(self) -> dict:  # -> {name: (kind, path)}: this model's
        found = self.model.voice_files(self.voices)
        return {name: where for name, where in found.items() if common.is_voice_name(name)}

    def every_voice(self) -> dict:
        """-> {name: [the models it has a voice for]}, every model's voices in the folder."""
        found = {}
        for kind, model in MODELS.items():
            for name in model.voice_files(self.voices):
                if common.is_voice_name(name):
                    found.setdefault(name, []).append(kind)
        return found

    def builtin_voice(self, name):
        """OpenAI's built-in names (hard-coded in clients): a saved voice, else --default-voice, else none."""
        if name in OPENAI_VOICES and name not in self.voice_files():
            return self.default_voice
        return name

    def voice_reference(self, name: str):
        for again in (True, False):  # deleted (and maybe saved anew) by another server while we read: afresh
            kind, path = self.voice_files().get(common.voice_name(name), (None, None))
            if path is None:
                others = self.every_voice().get(name)
                if others:
                    raise common.UserError(f"voice {name!r} was saved for {MODELS[others[0]].title}, and this"
                                           f" server runs {self.model.title}: save the clip again here (POST"
                                           " /v1/audio/voices, under another name)")
                raise common.UserError(f"unknown voice {name!r}: GET /v1/audio/voices lists the saved ones."
                                       " Save one with POST /v1/audio/voices, or send no voice for plain"
                                       " text-to-speech")
            try:
                return self.model.read_voice(kind, path, self.codec_work)
            except common.UserError as e:  # the server's file, not the client's input
                if not again:
                    raise HTTPError(500, f"voice {name!r} cannot be read: {e}") from None

    def clip_reference(self, data: bytes, what: str, text: str):
        """Uploaded audio bytes (any format soundfile reads) and its transcript -> the model's reference."""
        with self.codec_work():
            return self.model.clip_reference(*clip_samples(data, what), text, what)

    def clip_codes(self, data: bytes, what: str) -> torch.Tensor:
        """Uploaded audio bytes -> S2-Pro's codes (10, T) (/v1/vqgan/encode)."""
        with self.codec_work():
            return self.model.encode(*clip_samples(data, what))

    def submit(self, job: dict):
        """A speech job to the engine, as every route (and the Wyoming server) submits one: a 503 at once
        when the engine stopped or no request can wait, before its voice is read or its clips encoded."""
        if not self.alive:
            raise HTTPError(503, "the engine stopped (see the server's log): restart the server")
        self.engine.check_room()
        return self.model.submit(job, self.references(job))

    def references(self, job: dict) -> list:
        given = [self.voice_reference(job["voice"])] if job["voice"] else []
        self.model.check_references(len(given) + len(job["clips"]))  # before any clip is encoded
        return given + [self.clip_reference(audio, f"reference {i} audio", text)
                        for i, (audio, text) in enumerate(job["clips"], 1)]

    def check_voices(self, saved=None, free=None, adds=False):
        """A 404 if `saved` is not a saved voice (of any model), a 409 if `free` is, a 507 if a voice `adds`
        to --max-voices. Each change checks first without the lock (a refusal makes no lock file, encodes no
        audio), then under it."""
        names = self.every_voice()
        if saved is not None and saved not in names:
            raise HTTPError(404, f"no voice named {saved!r}")
        if free in names:
            raise HTTPError(409, f"voice {free!r} exists already: delete it first")
        if adds and len(names) >= self.max_voices:
            raise HTTPError(507, f"{len(names)} voices are saved, as many as this server keeps (--max-voices"
                                 f" {self.max_voices}): delete one first")

    @contextlib.contextmanager
    def voices_locked(self, saved=None, free=None, adds=False):
        """One save, delete or rename at a time among threads and servers sharing the folder (an flock on
        each call's own descriptor). Readers take no lock: a voice appears once its transcript is in place."""
        self.voices.mkdir(parents=True, exist_ok=True)
        with open(self.voices / ".fishfast-lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.check_voices(saved, free, adds)
            yield

    def voice_paths(self, name: str) -> list:
        """A name's files, every model's: S2-Pro's transcript first (removed first, the voice is gone
        before its codes are)."""
        return [path for model in MODELS.values() for path in model.voice_paths(self.voices, name)]

    def save_voice(self, name: str, audio: bytes, text: str) -> dict:
        self.check_voices(free=name, adds=True)
        return self.write_voice(name, self.clip_reference(audio, "audio", text))  # all checked before

    def write_voice(self, name: str, reference) -> dict:
        with self.voices_locked(free=name, adds=True):
            try:
                saved = self.model.write_voice(self.voices, name, reference)
            except common.UserError as e:  # a full disk, a folder gone
                raise HTTPError(500, f"cannot save voice {name!r}: {e}") from None
        return dict(saved, model=self.model.kind)

    def delete_voice(self, name: str):
        self.check_voices(saved=name)
        with self.voices_locked(saved=name):
            for path in self.voice_paths(name):
                path.unlink(missing_ok=True)

    def rename_voice(self, old: str, new: str):
        self.check_voices(saved=old, free=new)
        with self.voices_locked(saved=old, free=new):
            for path in reversed(self.voice_paths(old)):  # the transcript last: then the new name appears
                path.rename(path.with_name(new + path.name[len(old):]))


# ----------------------------------------------------------------------------- metrics
TTFA_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)  # seconds: a GPU's first sentence to a loaded CPU's
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5)  # work seconds per audio second; 1: real time
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format
CLIENT_LEFT = 499  # a request whose client left before any answer (nginx's code for it)
HTTP_METHODS = ("GET", "HEAD", "POST", "DELETE", "PUT", "PATCH", "OPTIONS")  # others: "other", as labels


def label_text(labels: dict) -> str:
    """{name: value} -> '{name="value",...}', values escaped as the text format asks (\\, \", \n)."""
    escaped = {key: str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               for key, value in labels.items()}
    return "{" + ",".join(f'{key}="{value}"' for key, value in escaped.items()) + "}" if labels else ""


def sample_value(value) -> str:
    return "+Inf" if value == math.inf else repr(float(value)) if isinstance(value, float) else str(value)


class Metrics:
    """What GET /metrics reports, counted where each request ends (HTTP's and Wyoming's alike) under one
    lock; the engine's gauges are read when scraped (App.gauges). Written in Prometheus' text format by
    hand: no prometheus_client needed."""

    def __init__(self, model: str):
        self.lock, self.in_flight = threading.Lock(), 0
        self.requests = collections.Counter()  # (route, method, status) -> requests ended
        self.audio_seconds = {model: 0.0}  # each served model's series exists from the start, at 0
        self.ttfa = {model: self.histogram(TTFA_BUCKETS)}
        self.rtf = {model: self.histogram(RTF_BUCKETS)}

    @staticmethod
    def histogram(bounds: tuple) -> dict:
        return dict(bounds=(*bounds, math.inf), counts=[0] * (len(bounds) + 1), sum=0.0, count=0)

    @staticmethod
    def observe(histogram: dict, value: float):
        """Counted in its own bucket only; render makes them cumulative."""
        histogram["counts"][next(i for i, bound in enumerate(histogram["bounds"]) if value <= bound)] += 1
        histogram["sum"] += value
        histogram["count"] += 1

    def begin(self):
        with self.lock:
            self.in_flight += 1

    def end(self, route: str, method: str, status, began=True):
        """A request ended (`began`: it was counted in flight) with its answer's status (None: the client
        left before any answer)."""
        with self.lock:
            self.in_flight -= bool(began)
            self.requests[route, method, str(status or CLIENT_LEFT)] += 1

    def speech(self, model: str, seconds: float, first_audio, rtf):
        """A request's audio: its seconds, its time to first audio (None: none came) and RTF (None: not
        made whole)."""
        with self.lock:
            self.audio_seconds[model] = self.audio_seconds.get(model, 0.0) + seconds
            if first_audio is not None:
                self.observe(self.ttfa.setdefault(model, self.histogram(TTFA_BUCKETS)), first_audio)
            if rtf is not None:
                self.observe(self.rtf.setdefault(model, self.histogram(RTF_BUCKETS)), rtf)

    def families(self, gauges: list) -> list:
        """-> [(name, type, help, [(suffix, labels, value)])]; gauges: [(name, help, value)], read now."""
        with self.lock:
            requests = [("", dict(route=route, method=method, status=status), count)
                        for (route, method, status), count in sorted(self.requests.items())]
            audio = [("", dict(model=model), seconds)
                     for model, seconds in sorted(self.audio_seconds.items())]
            ttfa, rtf = ({model: dict(h, counts=list(h["counts"])) for model, h in kind.items()}
                         for kind in (self.ttfa, self.rtf))
            in_flight = self.in_flight
        return [("fishfast_requests_total", "counter", "Requests answered, by route, method and"
                 f" status (Wyoming's: route wyoming, method the event; {CLIENT_LEFT}: the client left"
                 " first)", requests),
                ("fishfast_requests_in_flight", "gauge", "Requests being answered now, this scrape too",
                 [("", {}, in_flight)]),
                *[(name, "gauge", about, [("", {}, value)]) for name, about, value in gauges],
                ("fishfast_audio_seconds_total", "counter", "Seconds of audio generated, by model", audio),
                ("fishfast_time_to_first_audio_seconds", "histogram", "Seconds from a request read to its"
                 " first audio sent, by model", self.histogram_samples(ttfa)),
                ("fishfast_real_time_factor", "histogram", "Seconds of generation per second of audio of each"
                 " request made whole, by model", self.histogram_samples(rtf))]

    @staticmethod
    def histogram_samples(histograms: dict) -> list:
        samples = []
        for model, h in sorted(histograms.items()):
            total = 0
            for bound, count in zip(h["bounds"], h["counts"]):
                total += count
                samples.append(("_bucket", dict(model=model, le=sample_value(float(bound))), total))
            samples += [("_sum", dict(model=model), h["sum"]), ("_count", dict(model=model), h["count"])]
        return samples

    def render(self, gauges: list) -> str:
        """The text exposition format (0.0.4): # HELP, # TYPE, then each sample, one a line."""
        lines = []
        for name, kind, about, samples in self.families(gauges):
            lines += [f"# HELP {name} {about}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{suffix}{label_text(labels)} {sample_value(value)}"
                      for suffix, labels, value in samples]
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- HTTP
class Overdue(HTTPError):
    """A request's headers or body past their deadline (--header-timeout, --body-timeout): a 408."""
    def __init__(self, what: str, seconds: float, flag: str):
        super().__init__(408, f"the request's {what} took longer than {seconds:g} s ({flag}): send it faster")


class DeadlineReader(io.RawIOBase):
    """The socket's bytes for a handler's rfile, each read bounded by what is left of the handler's deadline
    (`reading`: what it reads and by when) instead of a timeout per read, which a client that sends a
    byte a minute never meets. The first byte of a request starts its headers' deadline; between requests
    the idle timeout (Handler.timeout) holds."""

    def __init__(self, sock, handler):
        self.sock, self.handler = sock, handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        handler = self.handler
        if handler.reading is not None:
            left = handler.reading[1] - time.monotonic()
            if left <= 0:
                raise handler.overdue()
            self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            if handler.reading is None:
                raise
            raise handler.overdue() from None
        finally:
            self.sock.settimeout(handler.timeout)  # writes keep the idle timeout
        if n and handler.reading is None and not handler.dispatched:
            handler.reading = ("headers", time.monotonic() + handler.server.header_timeout)
        return n


class Handler(BaseHTTPRequestHandler):
    """Routes -> validate -> submit -> stream the answer. Every error leaves through `send_json_error`."""
    protocol_version = "HTTP/1.1"
    server_version = "fishfast"
    timeout = 120  # seconds a silent client may hold its thread
    routes = {"/": dict(GET="page"), "/health": dict(GET="health"), "/v1/models": dict(GET="models"),
              "/v1/audio/speech": dict(POST="speech"), "/v1/tts": dict(POST="tts"),
              "/metrics": dict(GET="metrics"),
              "/v1/audio/voices": dict(GET="list_voices", POST="save_voice"),
              "/v1/audio/voices/{name}": dict(DELETE="delete_voice"),
              # upstream fish-speech's API (tools/server/views.py)
              "/v1/health": dict(GET="health", POST="health"),
              "/v1/references/add": dict(POST="save_voice"), "/v1/references/list": dict(GET="list_voices"),
              "/v1/references/delete": dict(DELETE="delete_voice"),
              "/v1/references/update": dict(POST="rename_voice"),
              "/v1/vqgan/encode": dict(POST="vqgan_encode"), "/v1/vqgan/decode": dict(POST="vqgan_decode")}

    def setup(self):
        super().setup()
        self.reading, self.dispatched = None, False
        self.rfile.close()  # the socket's own file: a file left open would keep the socket from closing
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, self))

    def overdue(self) -> Overdue:
        if self.reading[0] == "headers":
            return Overdue("headers", self.server.header_timeout, "--header-timeout")
        return Overdue("body", self.server.body_timeout, "--body-timeout")

    def handle_one_request(self):
        self.started = False  # whether this response's headers went out: then no other status can
        self.app, self.cors, self.packed, self.error_fields = self.server.app, None, False, None
        self.length, self.body_read, self.reading, self.dispatched = 0, False, None, False
        self.command, self.request_version, self.requestline = "", "HTTP/1.1", "(headers not read)"
        self.status, self.route = None, "other"  # sent (send_head), and the route's name in the metrics
        try:
            super().handle_one_request()
        except Overdue as e:  # a slow client's headers: the answer, then the connection is closed
            self.send_json_error(e.status, str(e))
        except (ConnectionError, TimeoutError):  # gone while we wrote, even an error: nobody to tell
            self.close_connection = True
        finally:  # every request that was answered, or dispatched and left by its client, is counted
            if self.status is not None or self.dispatched:
                method = self.command if self.command in HTTP_METHODS else "other"
                self.app.metrics.end(self.route, method, self.status, self.dispatched)

    def dispatch(self):
        self.reading, self.dispatched = None, True  # the headers are in: the body has a deadline of its own
        self.app.metrics.begin()
        try:
            host, path, self.query = request_target(self.path)
            self.length = body_length(self.headers.get_all("Content-Length", []),
                                      self.headers.get_all("Transfer-Encoding", []))
            given = check_host(self.headers.get_all("Host", []), self.app.hosts, self.request_version)
            self.host = given if host is None else check_host([host], self.app.hosts)  # absolute-form's wins
            route, self.name, self.route_path = path, None, path
            if path.startswith("/v1/audio/voices/"):
                route, self.name = "/v1/audio/voices/{name}", unquote(path[len("/v1/audio/voices/"):])
            self.check_origin()
            methods = self.routes.get(route)
            self.route = route if methods else "other"  # a client's paths are no label values
            if methods is None:
                raise HTTPError(404, f"no route {path[:100]}: see README for the API")
            allowed = [*methods, *(["HEAD"] if "GET" in methods else []), "OPTIONS"]
            if self.command not in allowed:
                raise HTTPError(405, f"{self.command} is not allowed on {route}: use {', '.join(allowed)}",
                                {"Allow": ", ".join(allowed)})
            if self.command == "OPTIONS":
                return self.preflight(allowed)
            if path.startswith("/v1/"):
                self.authorize()
            if route in FISH_ROUTES and not self.app.model.fish_api:
                raise HTTPError(404, f"{route} is fish-speech's API for S2-Pro; this server runs"
                                     f" {self.app.model.title}: use POST /v1/audio/speech (docs/api.md)")
            getattr(self, methods["GET" if self.command == "HEAD" else self.command])()
            if self.length and not self.body_read:  # a body no route reads (a GET's) is no next request
                self.close_connection = True
        except (ConnectionError, TimeoutError):  # the client went away
            self.close_connection = True
        except Exception as e:
            self.send_json_error(*error_answer(e))

    do_GET = do_HEAD = do_POST = do_DELETE = do_PUT = do_PATCH = do_OPTIONS = dispatch

    def check_origin(self):
        """A page of another site may read nothing and change nothing here unless --allow-origin names it.
        Refusing only the answer is not enough: a form POST reaches the server without a CORS preflight."""
        origin, site = self.headers.get("Origin"), self.headers.get("Sec-Fetch-Site")
        own = origin is None or same_origin(origin, self.host, self.app.hosts)
        if own and site not in ("cross-site", "same-site"):
            return  # our own page, or not a browser (curl, SDKs send no Origin)
        if origin and ({"*", origin} & self.app.allow_origins):
            self.cors = origin
        elif self.command not in ("GET", "HEAD", "OPTIONS"):
            raise HTTPError(403, f"cross-site request from {str(origin)[:100]} refused: start the server with"
                                 " --allow-origin ORIGIN to let that site's pages use the API")

    def preflight(self, allowed: list):
        """OPTIONS: which methods a route takes, and for an allowed origin the CORS preflight's answer."""
        headers = {"Allow": ", ".join(allowed)}
        if self.cors:
            asked = self.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type")
            headers.update({"Access-Control-Allow-Methods": ", ".join(allowed),
                            "Access-Control-Allow-Headers": asked, "Access-Control-Max-Age": "600"})
        self.send_bytes(b"", None, 204, headers)

    def authorized(self) -> bool:
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        key = self.app.api_key  # the scheme is case-insensitive (RFC 9110), the key is not
        return key is None or (scheme.lower() == "bearer"
                               and hmac.compare_digest(given.strip().encode(), key.encode()))

    def authorize(self):
        if not self.authorized():
            raise HTTPError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            {"WWW-Authenticate": "Bearer"})

    # --- reading
    def body(self) -> bytes:
        length, self.body_read = self.length, True
        if length > MAX_BODY:
            raise HTTPError(413, f"the request body must be 0 to {MAX_BODY >> 20} MiB")
        self.reading = ("body", time.monotonic() + self.server.body_timeout)
        try:
            data = self.rfile.read(length)
        finally:
            self.reading = None
        if len(data) < length and self.server.closing:  # Server.close ended the reading
            raise common.EngineClosed(f"the body was cut after {len(data)} of its {length} bytes")
        if len(data) < length:
            raise HTTPError(400, f"the body ended after {len(data)} of its {length} bytes (Content-Length)")
        return data

    def data(self, form=False) -> dict:
        """The body as a dict: JSON, msgpack or, where `form`, multipart/form-data (text, audio as bytes)."""
        kinds = ("application/json", "application/msgpack", *(["multipart/form-data"] if form else []))
        kind = self.headers.get_content_type()
        if not self.length:  # without a Content-Type, email's rule makes it text/plain: say what is missing
            raise common.UserError(f"the request has no body: send its fields as {' or '.join(kinds)}")
        if kind not in kinds:
            raise HTTPError(415, f"Content-Type {kind} is not supported here: send {' or '.join(kinds)}")
        if kind == "multipart/form-data":
            return parse_form(self.headers["Content-Type"], self.body())
        return parse_body(kind, self.body())

    def wants_msgpack(self) -> bool:
        """Upstream's rule: msgpack unless ?format=json or an Accept that names JSON and not msgpack."""
        asked = parse_qs(self.query).get("format", [""])[0].lower()
        accept = self.headers.get("Accept", "").lower()
        if asked in ("json", "application/json", "msgpack", "application/msgpack"):
            return MSGPACK is not None and "msgpack" in asked
        return MSGPACK is not None and ("application/json" not in accept or "application/msgpack" in accept)

    # --- writing
    def send_json(self, data, status=200, headers=None):
        """JSON (bytes as base64), or msgpack for upstream's routes when the client asks for it."""
        if self.packed:
            return self.send_bytes(MSGPACK.packb(data), "application/msgpack", status, headers)
        body = json.dumps(data, default=lambda value: base64.b64encode(value).decode()
                          if isinstance(value, bytes) else repr(value))
        self.send_bytes(body.encode(), "application/json", status, headers)

    def error_body(self, status: int, message: str) -> dict:
        """Ours: {error: {message, type}}. Upstream's routes: its {success: false, message, ...ids}."""
        if self.error_fields:
            return dict(self.error_fields, message=message)
        return dict(error=dict(message=message, type=ERROR_TYPES.get(status, "invalid_request_error")))

    def send_json_error(self, status: int, message: str, headers=None, body=None):
        """The one way an error leaves (`body`: /v1/tts's 422, pydantic's list of errors, as upstream)."""
        self.close_connection = True  # the request's body may be left unread
        if self.started:  # too late for a status: the client sees a cut-off body
            return
        body = self.error_body(status, message) if body is None else body
        self.send_json(body, status, {"Connection": "close", **(headers or {})})

    def send_error(self, code, message=None, explain=None):
        """The base class's own errors (bad request line, oversized headers) as JSON too."""
        self.send_json_error(code, message or self.responses.get(code, ("error",))[0])

    def send_head(self, status: int, headers: dict):
        self.send_response(status)
        self.status = status
        cors = {"Access-Control-Allow-Origin": self.cors, "Vary": "Origin"} if self.cors else {}
        for key, value in {**headers, **cors}.items():
            if value:
                self.send_header(key, value)
        self.end_headers()
        self.started = True

    def send_bytes(self, body: bytes, media_type, status=200, headers=None):
        length = str(len(body))
        self.send_head(status, {"Content-Type": media_type, **(headers or {}), "Content-Length": length})
        if self.command != "HEAD":
            self.wfile.write(body)

    def write_chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    # --- routes
    def page(self):
        self.send_bytes(render_page(self.app).encode(), "text/html; charset=utf-8")

    def health(self):
        """With --api-key, a client without the key learns only whether the server is up and its model (a
        load balancer's probe needs no key)."""
        info = self.app.health()
        if not self.authorized():
            info = dict(status=info["status"], model=info["model"])
        self.send_json(info, 200 if self.app.alive else 503)

    def metrics(self):
        """Prometheus' text format (Metrics); the key is needed as on /v1/ when --api-key is set."""
        self.authorize()
        text = self.app.metrics.render(self.app.gauges())
        self.send_bytes(text.encode(), METRICS_TYPE)

    def models(self):
        self.send_json(dict(object="list", data=[dict(id=self.app.name, object="model", created=0,
                                                      owned_by=self.app.model.owner)]))

    # the voices, ours and upstream's /v1/references/ (its answers: {success, message, ...ids})
    def list_voices(self):
        """voices: this model's (the ones a request may name); all: every voice in the folder, with the
        model it is for."""
        self.upstream()
        names, every = sorted(self.app.voice_files()), self.app.every_voice()
        listed = [dict(name=name, model=kind) for name in sorted(every) for kind in every[name]]
        self.voice_done(dict(voices=names, all=listed), f"{len(names)} references", reference_ids=names)

    def save_voice(self):
        """{name (upstream: id), text, audio} as JSON, msgpack or a form; ours also {name, from_generation: a
        speech request's fields}: the voice that request makes up (kept_voice)."""
        upstream = self.upstream(reference_id="")
        data = self.data(form=True)
        name = self.echo("reference_id", data.get("id" if upstream else "name"))
        if "from_generation" in data and not upstream:
            if "audio" in data:
                raise common.UserError("give audio and text, or from_generation, not both")
            self.app.check_voices(free=name, adds=True)  # before any work
            saved = self.app.write_voice(name, self.kept_voice(data["from_generation"]))
            return self.voice_done(saved, f"reference {name!r} added", 201)
        text = check_text(data.get("text"), "text (the clip's transcript)", MAX_TRANSCRIPT)
        saved = self.app.save_voice(name, decode_base64(data.get("audio"), "audio"), text)
        self.voice_done(saved, f"reference {name!r} added", 201)

    def kept_voice(self, body):
        """A speech request without a voice, run as /v1/audio/speech runs it (its checks, caps, queue) ->
        the reference it made up: the model's voice_of (its codes and text)."""
        if not isinstance(body, dict):
            raise common.UserError("from_generation must be an object of a speech request's fields (input,"
                                   " instructions, seed, ...)")
        job = openai_job(body, self.app.model.options)
        if job["voice"] or job["clips"]:
            raise common.UserError("from_generation keeps a voice the model makes up: leave out voice and"
                                   " references (a saved voice is kept already)")
        request = self.app.submit(job)
        try:
            self.watch(request)
            return self.app.model.voice_of(request)
        finally:
            request.cancel()  # what it would still say is not needed

    def delete_voice(self):
        upstream = self.upstream(reference_id="")
        name = self.echo("reference_id", self.data().get("reference_id") if upstream else self.name)
        self.app.delete_voice(name)
        self.voice_done(dict(deleted=name), f"reference {name!r} deleted")

    def rename_voice(self):
        self.upstream(old_reference_id="", new_reference_id="")
        data = self.data()
        old, new = (self.echo(key, data.get(key)) for key in ("old_reference_id", "new_reference_id"))
        if old == new:
            raise common.UserError("new_reference_id must differ from old_reference_id")
        self.app.rename_voice(old, new)
        self.voice_done(None, f"reference {old!r} renamed to {new!r}")

    def upstream(self, **ids) -> bool:
        """Whether this is upstream's route: then its answers and errors, JSON or msgpack (wants_msgpack)."""
        if self.route_path.startswith("/v1/references/"):
            self.packed, self.error_fields = self.wants_msgpack(), dict(success=False, **ids)
        return self.error_fields is not None

    def voice_done(self, ours, message: str, status=200, **extra):
        """Our answer, or upstream's: {success: true, message, ...the ids it was given (see echo)}."""
        if self.error_fields is None:
            return self.send_json(ours, status)
        self.send_json(dict(self.error_fields, success=True, message=message, **extra))

    def echo(self, key: str, name) -> str:
        """A voice name from the request -> the name, checked; upstream's error answers repeat it."""
        if self.error_fields:
            self.error_fields[key] = name if isinstance(name, str) else ""
        return common.voice_name(name)

    def speech(self):
        job = openai_job(self.data(), self.app.model.options)
        self.answer(dict(job, voice=self.app.builtin_voice(job["voice"])))

    def tts(self):
        self.answer(fish_job(self.data()))

    def batch(self, key: str) -> list:
        """Upstream's /v1/vqgan body: {key: [1 to MAX_CODES items]} -> [(item, its name for errors)]."""
        self.packed = self.wants_msgpack()
        items = self.data().get(key)
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_CODES:
            raise common.UserError(f"{key} must be a list of 1 to {MAX_CODES} items")
        return [(item, f"{key}[{i}]") for i, item in enumerate(items)]

    def vqgan_encode(self):
        """{audios: [audio file bytes]} -> {tokens: [codes (10, T) as nested lists]}."""
        tokens = [self.app.clip_codes(decode_base64(audio, what), what).tolist()
                  for audio, what in self.batch("audios")]
        self.send_json(dict(tokens=tokens))

    def vqgan_decode(self):
        """{tokens: [codes (10, T)]} -> {audios: [float16 samples, as bytes]}, as upstream."""
        waves = []
        for codes, what in self.batch("tokens"):
            codes = self.app.model.check_codes(codes, what)
            with self.app.codec_work():
                waves.append(self.app.model.decode(codes))
        self.send_json(dict(audios=[wave.cpu().numpy().astype("<f2").tobytes() for wave in waves]))

    def answer(self, job: dict):
        """Submit the job, then send its audio: whole, as raw chunked bytes, or as server-sent events."""
        self.began, self.first_audio = time.perf_counter(), None  # time to first audio: from here
        model = self.app.model
        request, start = self.app.submit(job), time.perf_counter()
        try:
            self.watch(request)
            if job["send"] == "whole":
                wave = model.whole(request)  # a late error is still a clean 400
                self.first_audio = time.perf_counter()
                self.send_bytes(audio_file_bytes(wave, job["format"], model.sample_rate, job.get("rate")),
                                MEDIA_TYPES[job["format"]])
                samples = len(wave)
            else:
                samples = self.stream(request, job)
        finally:
            gone = request.cancelled  # by watch: the client hung up
            request.cancel()  # a no-op once it has finished; frees the row if the client is gone
        self.log_figures(start, samples, gone)

    def stream(self, request, job: dict) -> int:
        model, fmt, sse = self.app.model, job["format"], job["send"] == "sse"
        self.send_head(200, {"Content-Type": "text/event-stream" if sse else MEDIA_TYPES[fmt],
                             "Cache-Control": "no-cache", "Transfer-Encoding": "chunked"})

        def send(data: bytes):
            if not data:  # a resampler's first piece may hold nothing yet; an empty chunk would end the body
                return
            if sse:
                data = sse_event(type="speech.audio.delta", audio=base64.b64encode(data).decode())
            self.write_chunk(data)

        samples, rate = 0, job.get("rate") or file_rate(fmt, model.sample_rate)
        resampler = soxr.ResampleStream(model.sample_rate, rate, 1, dtype="int16") \
            if rate != model.sample_rate else None
        encoder = StreamedFile(fmt, rate) if fmt in ENCODED_AS_MADE else None

        def pcm_out(data: bytes, last=False) -> bytes:  # 16-bit PCM at the model's rate -> what is sent
            data = data if resampler is None else resampled(resampler, data, last)
            return data if encoder is None else encoder.write(data, last)

        try:
            if fmt == "wav":
                send(wav_header(rate=rate))
            if fmt in STREAMABLE + ENCODED_AS_MADE:
                for wave in model.waves(request):  # as they are made
                    self.first_audio = self.first_audio or time.perf_counter()
                    send(pcm_out(pcm16(wave)))
                    samples += len(wave)
                send(pcm_out(b"", last=True))  # what the resampler and the encoder still hold
            else:  # sse of a format that is encoded whole: one delta
                wave = model.whole(request)
                self.first_audio = time.perf_counter()
                send(audio_file_bytes(wave, fmt, model.sample_rate, job.get("rate")))
                samples = len(wave)
            tokens_in, tokens_out = model.usage(request, samples)
            end = dict(type="speech.audio.done", usage=dict(input_tokens=tokens_in, output_tokens=tokens_out,
                                                            total_tokens=tokens_in + tokens_out))
        except (ConnectionError, TimeoutError):
            raise
        except Exception as e:  # failed after the 200 went out: an error event (SSE), else a cut-off body,
            self.close_connection = True  # but a shutdown ends the audio where it got to, cleanly
            status, message, _, _ = error_answer(e)  # a bug's traceback is logged
            end = dict(type="error", **self.error_body(status, message)) if sse else \
                {} if isinstance(e, common.EngineClosed) else None
        if end is not None and not request.cancelled:  # else a body cut off, or a client that hung up
            if sse:
                self.write_chunk(sse_event(**end))
            self.write_chunk(b"")
        return samples

    def watch(self, request):
        """A thread that cancels `request` once its client is gone, even while it waits in the queue, and
        ends it if the engine dies. Gone: a reset, or an EOF (a FIN): a client that closed cannot be told
        from one that only half-closed until we write, and a whole file is written at its end, so an EOF
        is taken as gone (as nginx and Go's net/http take it). Bytes of a next request (pipelining) do not
        wake it (POLLRDHUP, not POLLIN, where the system has it), nor does Server.close's own SHUT_RD."""
        sock, app, server, poller = self.connection, self.app, self.server, select.poll()
        poller.register(sock, EOF_EVENT)

        def run():
            try:
                while not request.done:
                    if not app.alive:
                        return request.finish(RuntimeError("the engine stopped: see the server's log"))
                    events = poller.poll(50)
                    if not events:
                        continue
                    if request.done:  # all made: a client that closes once it has read it cancels nothing
                        return
                    hung_up = events[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL)
                    if not hung_up and (server.closing or EOF_EVENT == select.POLLIN
                                        and sock.recv(1, socket.MSG_PEEK)):
                        poller.modify(sock, 0)  # from now on only a reset or a hang-up
                        continue
                    return request.cancel()
            except (OSError, ValueError):  # a reset, or the socket closed: a no-op once the answer is sent
                request.cancel()

        threading.Thread(target=run, name="fishfast-watch", daemon=True).start()

    def log_figures(self, start: float, samples: int, cancelled=False):
        model = self.app.model
        wall, seconds, frames = time.perf_counter() - start, samples / model.sample_rate, samples / model.hop
        first = self.first_audio - self.began if self.first_audio else None
        rtf = None if cancelled or not samples else wall / seconds
        self.app.metrics.speech(model.kind, seconds, first, rtf)
        if cancelled or not samples:  # no rate of what was not made
            what = "cancelled (the client hung up)" if cancelled else "no audio"
            return self.log_message("%s: %s after %.2f s, %d frames made", self.path, what, wall, frames)
        self.log_message("%s: %d frames, %.2f s of audio in %.2f s: %.1f frames/s, RTF %.3f", self.path,
                         frames, seconds, wall, frames / max(wall, 1e-9), wall / seconds)


class Refusal(Handler):
    """A connection beyond --max-connections (a 503) or --max-connections-per-client (a 429), answered at
    once (no request is read): the server's `refusal`, (status, message)."""
    timeout = 1  # seconds the accepting thread may spend writing it

    def handle(self):
        self.started, self.app, self.cors, self.packed, self.error_fields = False, None, None, False, None
        self.command, self.request_version, self.requestline = "", "HTTP/1.1", "(a connection refused)"
        self.send_json_error(*self.server.refusal, {"Retry-After": "2"})
        self.server.app.metrics.end("other", "other", self.server.refusal[0], began=False)


class Server(ThreadingHTTPServer):  # its `app` and `max_connections` are set by make_server
    """A thread per connection, each known (`connections`), so that `close` can end them all."""
    request_queue_size = 128  # connections the kernel holds before accept: 5 made every 6th of 100 wait 1 s
    block_on_close = False  # server_close does not wait for the request threads: `close` does, bounded
    closing = False

    def __init__(self, *args):
        super().__init__(*args)
        self.connections, self.lock = {}, threading.Lock()  # socket -> its thread
        self.clients = collections.Counter()  # client address -> its connections open

    def refusal_for(self, client: str):
        """-> (status, message) for a new connection beyond a cap, else None."""
        if len(self.connections) >= self.max_connections:
            return 503, (f"the server is busy: {self.max_connections} connections are open"
                         " (--max-connections), try again later")
        if self.clients[client] >= self.max_per_client:
            return 429, (f"too many connections from {client}: {self.max_per_client} are open"
                         " (--max-connections-per-client), close one or try again later")
        return None

    def process_request(self, request, client_address):
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  daemon=True)
        with self.lock:
            self.refusal = self.refusal_for(client_address[0])
            if self.refusal is None:
                self.connections[request] = thread
                self.clients[client_address[0]] += 1
        if self.refusal is None:
            return thread.start()
        with contextlib.suppress(OSError):  # beyond a cap: its answer, written here, nothing read
            Refusal(request, client_address, self)
            request.shutdown(socket.SHUT_WR)
            while request.recv(65536, socket.MSG_DONTWAIT):  # what came already (the accepting thread
                pass  # cannot linger): closed unread, it would be a reset, which may outrun our answer
        self.close_request(request)

    def shutdown_request(self, request):
        """A request thread's close: our FIN, then what the client still sends is read and dropped until its
        own FIN, for up to LINGER seconds: a close with bytes unread (a refused request's body) is a reset,
        which may reach the client before our answer and take it away (RFC 9112 9.6)."""
        with contextlib.suppress(OSError):  # gone already, or silent past the deadline
            request.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER
            while (left := deadline - time.monotonic()) > 0:
                request.settimeout(left)
                if not request.recv(65536):
                    break
        self.close_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.connections.pop(request, None)
                self.clients[client_address[0]] -= 1
                if not self.clients[client_address[0]]:
                    del self.clients[client_address[0]]

    def close(self, wait: float) -> int:
        """After serve_forever: stop listening, end every request (streams end with their last chunk,
        whole answers are a 503, idle and half-read connections read an EOF), wait up to `wait` seconds
        for their threads -> how many are still running."""
        self.server_close()
        self.closing = True
        self.app.close()
        with self.lock:
            connections = dict(self.connections)
        for sock in connections:
            with contextlib.suppress(OSError):  # closed meanwhile
                sock.shutdown(socket.SHUT_RD)
        deadline = time.monotonic() + wait
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(thread.is_alive() for thread in connections.values())


# ----------------------------------------------------------------------------- the page
PAGE_FILE = Path(__file__).with_name("app.html")  # HTML, CSS and script in one file: nothing fetched, offline


def read_page() -> str:
    try:
        return PAGE_FILE.read_text(encoding="utf-8")
    except OSError as e:
        raise common.UserError(f"cannot read the page {PAGE_FILE}: {e.strerror or e} (it ships beside app.py:"
                               " git checkout app.html)") from None


def render_page(app: App) -> str:
    """app.html with the model's title, the demo's banner and the script's CONFIG filled in."""
    model = app.model
    banner = f'<p class="demo">{model.notice}</p>' if app.demo else ""
    config = dict(sampleRate=model.sample_rate, hop=model.hop, auth=app.api_key is not None,
                  wavHeader=base64.b64encode(wav_header(0, model.sample_rate)).decode(), kind=model.kind,
                  model=f"{app.info['model']} on {app.info['device']} ({app.info['dtype']})",
                  maxReferences=model.max_references, **model.page())
    config = json.dumps(config).replace("<", "\\u003c")  # nothing in it can close the <script>
    return app.page.replace("{{title}}", model.title).replace("{{banner}}", banner) \
        .replace("{{config}}", config)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = common.ArgumentParser(description="fishfast web demo and OpenAI-compatible speech server.")
    ap.add_argument("--checkpoint", help="an S2-Pro or OmniVoice checkpoint dir, the kind read from its"
                    " config.json (default ./s2-pro, or ./OmniVoice with --model omnivoice; if that is"
                    " absent, the model's tiny demo, whose audio is noise)")
    ap.add_argument("--model", choices=list(MODELS), help="the model to serve without --checkpoint (default"
                    " s2-pro)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine)")
    ap.add_argument("--port", type=int, default=7560, help="port (default 7560, 0: any free one)")
    # --device cuda:N: one server per GPU (docs/api.md, Replicas)
    dualAR.add_model_args(ap, quantize.OMNIVOICE_SCHEMES, "; OmniVoice: int8wo, int4wo, w8a8 (int8 weights"
                          " and activations, CPU)")
    ap.add_argument("--slots", type=int, default=4, help="requests generated together (default 4)")
    ap.add_argument("--packed", action="store_true", help="OmniVoice: each request's conditional and"
                    " unconditional sequences in one row (faster on CPU fp32, docs/omnivoice.md)")
    ap.add_argument("--max-context", type=int, default=dualAR.DEFAULT_CONTEXT, help="positions (prompt +"
                    f" frames) a request may use, as the CLI's (default {dualAR.DEFAULT_CONTEXT})")
    ap.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot (and codec jobs"
                    " for a --codec-workers turn), beyond that a 503 (default 16; 0: served only while one is"
                    " free)")
    ap.add_argument("--codec-workers", type=int, default=2, help="uploaded clips, voices kept as audio and"
                    " /v1/vqgan items decoded or encoded at once, --queue more may wait, beyond that a 503"
                    " (default 2)")
    ap.add_argument("--max-connections", type=int, default=256, help="connections served at once (a"
                    " thread each, idle ones too), beyond that a 503 at once; the Wyoming port's too, counted"
                    " apart, beyond that an error event (default 256)")
    ap.add_argument("--max-connections-per-client", type=int, default=128, metavar="N", help="connections"
                    " one client address may hold open, beyond that a 429 at once (default 128: one client"
                    " never takes every connection; behind a proxy every client is the proxy: raise it)")
    ap.add_argument("--header-timeout", type=float, default=20, metavar="SECONDS", help="how long a"
                    " request's headers may take in all, from their first byte, beyond that a 408 (default"
                    " 20)")
    ap.add_argument("--body-timeout", type=float, default=120, metavar="SECONDS", help="how long a"
                    " request's body may take in all, beyond that a 408 (default 120)")
    ap.add_argument("--shutdown-wait", type=float, default=8, metavar="SECONDS", help="on SIGTERM or"
                    " Ctrl-C, how long running requests may take to end (default 8: docker stop waits 10)")
    ap.add_argument("--voices", default="prompt", help="saved voices: S2-Pro's <name>.npy + .txt, OmniVoice's"
                    " <name>.omnivoice.safetensors (default prompt/)")
    ap.add_argument("--max-voices", type=int, default=1000, help="voices the folder may hold, every model's;"
                    " saving one more is a 507 (default 1000)")
    ap.add_argument("--api-key", default=os.environ.get("FISHFAST_API_KEY"), help="require"
                    " 'Authorization: Bearer KEY' on /v1/ and /metrics (default $FISHFAST_API_KEY, else"
                    " none)")
    ap.add_argument("--allow-origin", action="append", metavar="ORIGIN", help="let pages of this origin"
                    " (e.g. https://app.example.com, or *) use the API from a browser, with CORS; repeatable."
                    " Default: pages of other sites can neither write nor generate here")
    ap.add_argument("--allow-host", action="append", metavar="NAME", help="a name the server answers to"
                    " besides --host, localhost and IP addresses: the public name a proxy serves it under, a"
                    " LAN name (repeatable; * for any). Other names in Host get a 421 (DNS rebinding)")
    ap.add_argument("--default-voice", metavar="NAME", help="the saved voice OpenAI's built-in voice names"
                    " (alloy, ash, ...) speak with, unless a voice has that name (default: none, plain TTS)")
    ap.add_argument("--wyoming-port", type=int, metavar="PORT", help="also serve Home Assistant's Wyoming"
                    " protocol on this port (e.g. 10200; needs pip install wyoming; docs/api.md, Wyoming)")
    ap.add_argument("--wyoming-host", help="address the Wyoming server binds (default: --host's)")
    ap.add_argument("--wyoming-allow", type=client_networks, metavar="ADDRESSES", help="the only client"
                    " addresses the Wyoming port answers, comma-separated addresses or networks, e.g."
                    " 192.168.1.10,10.0.0.0/8 (default: any; the protocol has no authentication)")
    ap.add_argument("--no-http", action="store_true", help="serve the Wyoming protocol alone (with"
                    " --wyoming-port): no HTTP port, no page")
    args = ap.parse_args(argv)
    if args.no_http and args.wyoming_port is None:
        ap.error("--no-http serves the Wyoming protocol alone: give --wyoming-port PORT too")
    if min(args.slots, args.codec_workers, args.max_connections, args.max_connections_per_client,
           args.max_voices) < 1 or args.queue < 0 or args.max_context < 2 or not args.shutdown_wait >= 0:
        ap.error("--slots, --codec-workers, --max-connections(-per-client) and --max-voices must be >= 1,"
                 " --queue and --shutdown-wait >= 0 and --max-context >= 2")
    if not (args.header_timeout > 0 and args.body_timeout > 0):
        ap.error("--header-timeout and --body-timeout must be > 0 seconds")
    if args.default_voice and not common.is_voice_name(args.default_voice):
        ap.error(f"--default-voice {args.default_voice!r}: use 1-64 letters, digits, '_', '-', inner spaces")
    if Path(args.voices).exists() and not Path(args.voices).is_dir():
        ap.error(f"--voices {args.voices}: not a folder")
    listens = [] if args.no_http else [(args.host, args.port, "")]
    if args.wyoming_port is not None:
        listens.append((args.wyoming_host or args.host, args.wyoming_port, " (Wyoming)"))
    for host, port, what in listens:  # now, not after minutes of loading
        unusable = address_error(host, port)
        if unusable:
            ap.error(f"cannot listen on {host}:{port}{what}: {unusable}")
    return args


def address_error(host: str, port: int):
    """What is wrong with --host and --port (a port out of range or in use, an address this machine lacks),
    bound once and let go -> None if nothing."""
    if not 0 <= port <= 65535:
        return "a port is 0 to 65535 (0: any free one)"
    try:
        with socket.socket(Server.address_family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind((host, port))
    except OSError as e:  # gaierror too: a name that does not resolve
        return e.strerror or str(e)
    return None


def make_server(args) -> Server:
    """Load the models and bind the port (not yet serving: call serve_forever)."""
    app = App(args)
    try:
        server = Server((args.host, args.port), Handler)
    except OSError as e:
        app.close()
        raise common.UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    server.app, server.max_connections = app, args.max_connections
    server.max_per_client = args.max_connections_per_client
    server.header_timeout, server.body_timeout = args.header_timeout, args.body_timeout
    return server


def wyoming_module(args):
    """wyoming_server.py for --wyoming-port (its package is an optional extra), imported before the model
    loads: a missing package is one line at once."""
    if args.wyoming_port is None:
        return None
    try:
        import wyoming_server
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "wyoming":
            raise
        raise common.UserError("--wyoming-port needs the wyoming package: pip install wyoming") from None
    return wyoming_server


def client_networks(text: str) -> tuple:
    """--wyoming-allow's "192.168.1.10,10.0.0.0/8" -> the networks (an address is a network of one)."""
    try:
        return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def serve_wyoming(module, app: App, args):
    """The Wyoming server for `app`'s model, from a thread of its own (close() ends it)."""
    return module.start(app, args.wyoming_host or args.host, args.wyoming_port, check_text=check_text,
                        pcm16=pcm16, error_answer=error_answer, max_text=MAX_TEXT, max_duration=MAX_DURATION,
                        max_connections=args.max_connections, allow=args.wyoming_allow)


def main(argv=None):
    args = parse_args(argv)
    module = wyoming_module(args)
    server = None if args.no_http else make_server(args)
    app = server.app if server else App(args)
    try:
        wyoming = serve_wyoming(module, app, args) if module else None
    except common.UserError:  # its port is taken
        if server:
            server.server_close()
        app.close()
        raise
    if app.demo:
        print(app.model.notice, file=sys.stderr)
    where = [f"http://{server.server_address[0]}:{server.server_address[1]}"] if server else []
    where += [f"tcp://{wyoming.host}:{wyoming.port} (Wyoming)"] if wyoming else []
    print(f"fishfast: {app.info['model']} on {app.info['device']}, {args.slots} slots,"
          f" voices in {app.voices}/ -> {', '.join(where)}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # docker stop, systemd: clean up as Ctrl-C
    try:
        if server:
            server.serve_forever()
        else:
            wyoming.thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the wait below is bounded: no second interrupt in it
            signal.signal(sig, signal.SIG_IGN)
        if wyoming:
            wyoming.close()  # its connections end, their requests cancelled
        left = server.close(args.shutdown_wait) if server else app.close() or 0
    if left:  # a thread still in torch when Python exits aborts the process ("terminate called ...")
        print(f"fishfast: {left} request(s) still running after {args.shutdown_wait:g} s: exiting",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    common.cli(main)
