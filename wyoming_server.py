"""fishfast's Wyoming server: Home Assistant's protocol for local text-to-speech, for the model app.py serves,
beside its HTTP server or alone (docs/api.md, Wyoming):

    python app.py --wyoming-port 10200              # HTTP on 7560 and Wyoming on 10200
    python app.py --wyoming-port 10200 --no-http    # Wyoming alone

    describe          -> info: one TTS program, its voices (the saved ones, the model's own), languages
    synthesize        -> audio-start, audio-chunk (16-bit mono PCM at the model's rate) ..., audio-stop
    synthesize-start, synthesize-chunk ..., synthesize-stop
                      -> each sentence as it completes: audio-start ... audio-stop; then synthesize-stopped

One asyncio loop, in a thread of its own, serves every connection (the wyoming package's AsyncTcpServer).
A request goes to app.py's engine as an HTTP request does (App.references, the model's `options`, `submit`
and `waves`: the same slots, queue and limits) and is read in a thread of its own. A connection's events are
answered in order by one task, while its reader watches for the hang-up that cancels its request; each event
is counted in the App's metrics as a request of route "wyoming". This module never imports app.py: `start` is
given the App and the server's helpers.
"""
import asyncio
import contextlib
import ipaddress
import json
import os
import re
import sys
import threading
import time

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice, TtsVoiceSpeaker
from wyoming.server import AsyncEventHandler, AsyncTcpServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

import common
import omnivoice_text

EVENTS = ("describe", "synthesize", "synthesize-start", "synthesize-chunk", "synthesize-stop")  # answered
SAMPLES_PER_CHUNK = 1024  # samples an audio-chunk carries at most (wyoming-piper's)
WIDTH = 2  # bytes a sample: 16-bit PCM, as the HTTP route's pcm
WATCH = 1.0  # seconds between checks that the engine is alive while a request waits for audio
# what one event may hold (a TTS server is sent text: its 4,096 characters are ~16 KB of JSON at most), and
# how many a connection may have waiting before its reader stops reading (the client's writes then block)
MAX_HEADER, MAX_DATA, MAX_PAYLOAD, MAX_WAITING = 64 * 1024, 256 * 1024, 64 * 1024, 16
IDLE = 120  # seconds a client may send nothing while nothing of its is answered (HTTP's idle timeout)
# what a synthesize event may carry besides text and voice: the speech API's extras, fishfast's own
EXTRAS = ("seed", "temperature", "top_p", "top_k", "max_new_tokens", "chunk_length",  # S2-Pro's
          "num_step", "guidance_scale", "speed", "duration")  # OmniVoice's
# a sentence ends at . ! ? (and closing quotes) before a space, or at a full-width end mark. Linear: a match
# starts only where a run of end marks starts and never gives back what it took (a run of 16,000 dots
# cost 9 s of backtracking from every start, the GIL held, every thread frozen)
SENTENCE_END = re.compile(r"(?<![.!?])[.!?]++[\"'”’)\]]*+\s+|(?<![。！？])[。！？]++[”’」』）】]*+\s*")
# fishaudio/s2-pro's model card (its metadata's languages): S2-Pro reads the language from the text itself
S2_LANGUAGES = tuple("zh en ja ko es pt ar ru fr de sv it tr no nl cy eu ca da gl ta hu fi pl et hi la ur th"
                     " vi jw bn yo sl cs sw nn he ms uk id kk bg lv my tl sk ne fa af el bo hr ro sn mi yi am"
                     " be km is az sd br sq ps mn ht ml sr sa te ka bs pa lt kn si hy mr as gu fo".split())


# ----------------------------------------------------------------------------- each model's own voices
def design_attributes() -> list:
    """OmniVoice's closed list of voice-design attributes (docs/api.md, `instructions`)."""
    return [*omnivoice_text.EN_TO_ZH, *omnivoice_text.ACCENTS, *omnivoice_text.DIALECTS]


def omnivoice_language(code: str) -> str:
    """Home Assistant's language ("en-US", "de_DE") -> OmniVoice's id ("en") where only the region is extra;
    anything else as it is (the model's options check it)."""
    ids, names = omnivoice_text.languages()
    base = re.split(r"[-_]", code)[0]
    return code if code in ids or code.lower() in names or base not in ids else base


# kind -> where it is from, its languages, its own voices (name -> description), the speakers a voice lists
MODES = {
    "s2-pro": dict(url="https://huggingface.co/fishaudio/s2-pro", languages=lambda: list(S2_LANGUAGES),
                   voices=dict(default="S2-Pro's own voice, a new one each time (no reference)"),
                   speakers=dict()),
    "omnivoice": dict(url="https://huggingface.co/k2-fsa/OmniVoice",
                      languages=lambda: sorted(omnivoice_text.languages()[0]),
                      voices=dict(auto="OmniVoice's auto voice, a new one each time (no reference)",
                                  design="a designed voice: the speaker names its attributes, comma-separated"
                                         " (e.g. 'female, low pitch, british accent')"),
                      speakers=dict(design=design_attributes)),
}


def speech_fields(kind: str, voice: dict, saved: dict) -> tuple:
    """A synthesize event's voice {name, language, speaker} -> (a saved voice's name or None, the speech
    API's fields it sets): a saved voice wins over the model's own of its name. S2-Pro reads the language
    from the text; OmniVoice's speaker is a voice design."""
    if not isinstance(voice, dict):
        raise common.UserError("voice must be an object {name, language, speaker}")
    name, language, speaker = (voice.get(key) for key in ("name", "language", "speaker"))
    for key, value in (("voice name", name), ("language", language), ("speaker", speaker)):
        if value is not None and not isinstance(value, str):
            raise common.UserError(f"{key} must be a string")
    name = None if not name or (name in MODES[kind]["voices"] and name not in saved) else name
    if kind == "s2-pro":
        if speaker:
            raise common.UserError("S2-Pro's voices have no speakers: give style as inline tags in the text,"
                                   " e.g. '[whispering] Hello'")
        return name, {}
    fields = dict(instructions=speaker or None)
    if language:
        fields["language"] = omnivoice_language(language)
    return name, fields


# ----------------------------------------------------------------------------- sentences of a text stream
def complete_sentences(text: str) -> tuple:
    """A streamed text so far -> (its complete sentences, the rest): a sentence is complete once the space
    after its end mark has come (a '.' may be a decimal point, or an abbreviation's: not an end)."""
    sentences, start = [], 0
    for end in SENTENCE_END.finditer(text):
        words = text[start:end.start() + 1].split()
        if text[end.start()] == "." and words and words[-1] in omnivoice_text.ABBREVIATIONS:
            continue
        sentence = text[start:end.end()].strip()
        if sentence:
            sentences.append(sentence)
        start = end.end()
    return sentences, text[start:]


# ----------------------------------------------------------------------------- the server
class WyomingServer:
    """The asyncio loop's thread, serving the App's model on host:port until `close`. helpers: app.py's
    check_text, pcm16 and error_answer (its limits, its audio bytes, its errors' messages)."""

    def __init__(self, app, host: str, port: int, helpers: dict):
        self.app, self.model, self.host, self.port = app, app.model, host, port
        self.check_text, self.pcm16, self.error_answer = (helpers[key] for key in
                                                          ("check_text", "pcm16", "error_answer"))
        self.max_text, self.max_connections = helpers["max_text"], helpers["max_connections"]
        self.max_duration = helpers["max_duration"]  # seconds of audio a request (and a stream) may make
        self.allow = helpers.get("allow")  # the client networks answered (None: any)
        self.open = set()  # the connections open now (the loop's thread alone changes it)
        self.loop, self.stopping, self.failed = None, None, None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.run, name="fishfast-wyoming", daemon=True)

    def run(self):
        asyncio.run(self.serve())

    async def serve(self):
        self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
        tcp = AsyncTcpServer(self.host, self.port)
        try:
            await tcp.start(lambda reader, writer: Connection(self, reader, writer))
        except OSError as e:  # asyncio's words hold the address again: the system's alone
            self.failed = common.UserError(f"cannot listen on {self.host}:{self.port} (Wyoming):"
                                           f" {os.strerror(e.errno) if e.errno else e}")
            return self.ready.set()
        self.ready.set()
        await self.stopping.wait()
        await asyncio.gather(*(connection.refuse(SHUTDOWN) for connection in list(self.open)))
        await tcp.stop()  # every connection's reader ends: their requests are cancelled

    def start(self):
        self.thread.start()
        self.ready.wait()
        if self.failed:
            raise self.failed
        return self

    def close(self, wait: float = 5):
        if self.loop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(wait)

    def allows(self, peer) -> bool:
        """Whether a client at `peer` (asyncio's peername: (host, port, ...)) is in --wyoming-allow's
        networks (any client where none are given)."""
        if self.allow is None:
            return True
        try:
            address = ipaddress.ip_address(peer[0].split("%")[0])  # an IPv6 scope id is not the address
        except (TypeError, ValueError, IndexError):
            return False
        address = getattr(address, "ipv4_mapped", None) or address  # ::ffff:10.0.0.1 is 10.0.0.1
        return any(address in network for network in self.allow)

    def info(self) -> Info:
        """What `describe` answers: one TTS program, the model's own voices (but those a saved voice's name
        hides) and this model's saved ones."""
        model, modes, names = self.model, MODES[self.model.kind], sorted(self.app.voice_files())
        languages, by = modes["languages"](), Attribution(name=model.owner, url=modes["url"])
        speakers = {name: [TtsVoiceSpeaker(name=item) for item in listed()]
                    for name, listed in modes["speakers"].items()}
        own = [TtsVoice(name=name, description=about, attribution=by, installed=True, version=None,
                        languages=languages, speakers=speakers.get(name))
               for name, about in modes["voices"].items() if name not in names]
        saved = [TtsVoice(name=name, description=f"saved voice {name!r} ({self.app.voices}/)", attribution=by,
                          installed=True, version=None, languages=languages)
                 for name in names]
        program = TtsProgram(name="fishfast", description=f"fishfast: {model.title} ({self.app.name})",
                             attribution=Attribution(name="fishfast", url=modes["url"]), installed=True,
                             version=str(self.app.info["checkpoint"]), voices=own + saved,
                             supports_synthesize_streaming=True)
        return Info(tts=[program])

    def options(self, voice, extras: dict) -> tuple:
        """A synthesize event's voice and extras -> (a saved voice's name or None, the model's options),
        checked as HTTP checks a request's."""
        name, fields = speech_fields(self.model.kind, voice or {}, self.app.voice_files())
        try:
            return name, self.model.options(dict(extras, **fields))
        except common.UserError as e:  # the speech API's word for what Wyoming calls the speaker
            raise common.UserError(re.sub(r"^instructions", "speaker (a voice design)", str(e))) from None

    def job(self, text, voice: tuple) -> dict:
        """A text and (voice name, options) -> app.py's job."""
        return dict(text=self.check_text(text, "text", self.max_text), voice=voice[0], clips=[],
                    options=voice[1], format="pcm", send="chunked")



class Connection(AsyncEventHandler):
    """One client: its events answered in order by `work` (a task), so that the reader, which the package's
    `run` loops on, sees a hang-up while a request waits or generates, and `disconnect` cancels it."""

    def __init__(self, server: WyomingServer, reader, writer):
        super().__init__(reader, writer)
        self.server, self.events = server, asyncio.Queue(MAX_WAITING)
        self.request, self.gone, self.answering = None, False, False
        self.stream = None  # the streaming form's: voice and options, the text not yet a sentence, failed
        self.worker = asyncio.create_task(self.work())

    async def run(self):
        """The package's loop, on `read_event`: an event that breaks the protocol or its bounds, a client
        beyond --max-connections or one silent for IDLE seconds is one error event (code BadEvent, Busy or
        Idle), then the connection closes; a hang-up ends it quietly."""
        server = self.server
        server.open.add(self)
        try:
            if not server.allows(self.writer.get_extra_info("peername")):
                raise Refused("Forbidden", "this address may not use the server (--wyoming-allow)")
            if len(server.open) > server.max_connections:
                raise Refused("Busy", f"the server is busy: {server.max_connections} Wyoming connections are"
                                      " open (--max-connections), try again later")
            while (event := await self.read_event()) is not None:
                await self.handle_event(event)
        except Refused as e:
            await self.refuse(e)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            server.open.discard(self)
            await self.disconnect()
            self.writer.close()

    async def refuse(self, why: "Refused"):
        """Its request cancelled (what it was sending stops at an event's end), then one error event saying
        why the connection ends (a second at most: a client that reads nothing does not hold the close)."""
        await self.disconnect()
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            await asyncio.wait_for(self.write_event(Error(text=str(why), code=why.code).event()), 1)

    async def read(self, read, what: str):
        """await read() (the reader's readline or readexactly: a cancelled one leaves what came in the
        buffer), given up after IDLE seconds in which nothing of this client's was being answered."""
        while True:
            try:
                return await asyncio.wait_for(read(), IDLE)
            except asyncio.TimeoutError:
                if self.events.empty() and not self.answering:
                    raise Refused("Idle", f"nothing came for {IDLE} s ({what}): closed") from None

    async def read_event(self):
        """One event as the protocol sends it (a JSON header line, then data_length bytes of JSON data and
        payload_length bytes of payload), each part checked before it is read; None at the end."""
        try:
            line = await self.read(self.reader.readline, "an event")
        except (ValueError, asyncio.LimitOverrunError):  # asyncio's own limit, MAX_HEADER
            raise BadEvent(f"an event's header line is over {MAX_HEADER} bytes") from None
        if not line:
            return None
        header = json_object(line, "an event's header")
        kind, data = header.get("type"), header.get("data", {})
        if not isinstance(kind, str) or not isinstance(data, dict):
            raise BadEvent("an event's header needs a string type and object data")
        sizes = [header.get(key) or 0 for key in ("data_length", "payload_length")]
        for key, size, most in zip(("data_length", "payload_length"), sizes, (MAX_DATA, MAX_PAYLOAD)):
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= most:
                raise BadEvent(f"{key} must be an integer from 0 to {most}, got {str(size)[:20]}")
        if sizes[0]:
            raw = await self.read(lambda: self.reader.readexactly(sizes[0]), "the event's data")
            data = dict(data, **json_object(raw, "an event's data"))
        if sizes[1]:
            payload = await self.read(lambda: self.reader.readexactly(sizes[1]), "the event's payload")
        else:
            payload = None
        return Event(type=kind, data=data, payload=payload)

    async def handle_event(self, event) -> bool:
        await self.events.put(event)  # a full queue stops this reader: back-pressure on the client
        return True

    async def disconnect(self):
        self.gone = True  # before the request is read: see `produce`
        self.worker.cancel()
        if self.request is not None:
            self.request.cancel()

    async def work(self):
        metrics = self.server.app.metrics  # each event answered is a request of route "wyoming"
        while True:
            event = await self.events.get()
            kind, status = event.type if event.type in EVENTS else "other", None  # None: the client left
            metrics.begin()
            self.answering = True
            try:
                await self.answer(event)
                status = 200
            except ConnectionError:  # the client went away while we wrote: `disconnect` follows
                return
            except Exception as e:
                if self.stream is not None:
                    self.stream["failed"] = True  # its later chunks are dropped, its stop still answered
                status, message, _, _ = self.server.error_answer(e)  # a bug's traceback is logged
                with contextlib.suppress(ConnectionError):
                    await self.write_event(Error(text=message, code=type(e).__name__).event())
            finally:  # a hang-up cancels this task (disconnect): still counted
                self.answering = False
                metrics.end("wyoming", kind, status)

    async def answer(self, event):
        data = event.data  # an object: `read_event` takes no other
        if Describe.is_type(event.type):
            await self.write_event(self.server.info().event())
        elif Synthesize.is_type(event.type) and self.stream is None:  # in a stream: the same text, again,
            self.check_format(data)  # for servers that do not stream
            voice = self.server.options(data.get("voice"), self.extras(data))
            await self.speak(self.server.job(data.get("text"), voice))
        elif SynthesizeStart.is_type(event.type):
            self.check_format(data)
            voice = self.server.options(data.get("voice"), self.extras(data))  # checked before any text
            self.stream = dict(voice=voice, text="", length=0, seconds=0.0, failed=False)
        elif SynthesizeChunk.is_type(event.type) and self.stream is not None:
            await self.stream_text(data.get("text"))
        elif SynthesizeStop.is_type(event.type) and self.stream is not None:
            stream, self.stream = self.stream, None
            if stream["text"].strip() and not stream["failed"]:
                await self.speak_in_stream(stream, stream["text"])
            await self.write_event(SynthesizeStopped().event())
        elif SynthesizeChunk.is_type(event.type) or SynthesizeStop.is_type(event.type):
            raise common.UserError(f"{event.type} without synthesize-start")
        # any other event is dropped, as the protocol asks of servers

    @staticmethod
    def check_format(data: dict):
        if data.get("text_format") not in (None, "text"):
            raise common.UserError(f"text_format {str(data['text_format'])[:20]!r} is not supported: send"
                                   " plain text")

    @staticmethod
    def extras(data: dict) -> dict:
        return {key: data[key] for key in EXTRAS if key in data}

    async def stream_text(self, text):
        """A synthesize-chunk: each sentence it completes is spoken now, the rest waits for more. A stream's
        chunks together are one request's text: at most max_text characters, checked before any split."""
        stream = self.stream
        if not isinstance(text, str):
            raise common.UserError("synthesize-chunk's text must be a string")
        if stream["failed"]:
            return
        stream["length"] += len(text)
        if stream["length"] > self.server.max_text:
            raise common.UserError(f"the stream's text has {stream['length']} characters so far, at most"
                                   f" {self.server.max_text} are allowed (as in one synthesize)")
        sentences, stream["text"] = complete_sentences(stream["text"] + text)
        for sentence in sentences:
            await self.speak_in_stream(stream, sentence)

    async def speak_in_stream(self, stream: dict, text: str):
        """A stream's sentence, within the audio one request may make less what the stream has made."""
        model, most = self.server.model, self.server.max_duration
        frames = int((most - stream["seconds"]) * model.sample_rate) // model.hop
        if frames < 1:
            raise common.UserError(f"the stream's audio has {stream['seconds']:.1f} s, at most {most} s are"
                                   " allowed (as in one synthesize)")
        samples = await self.speak(dict(self.server.job(text, stream["voice"]), max_frames=frames))
        stream["seconds"] += samples / model.sample_rate

    async def speak(self, job: dict):
        """audio-start, the request's audio as it is made (16-bit PCM chunks), audio-stop -> the samples
        sent. Nothing is sent before the request is taken: a full queue or an unknown voice is one error
        event."""
        loop, pieces, model = asyncio.get_running_loop(), asyncio.Queue(), self.server.model
        threading.Thread(target=self.produce, args=(job, lambda item: loop.call_soon_threadsafe(
            pieces.put_nowait, item)), name="fishfast-wyoming-request", daemon=True).start()
        started, audio, samples = False, dict(rate=model.sample_rate, width=WIDTH, channels=1), 0
        while True:
            try:
                piece = await asyncio.wait_for(pieces.get(), WATCH)
            except asyncio.TimeoutError:
                if not self.server.app.alive and self.request is not None:
                    self.request.finish(RuntimeError("the engine stopped: see the server's log"))
                continue
            if isinstance(piece, Exception):
                raise piece
            if not started:
                await self.write_event(AudioStart(**audio).event())
                started = True
            if piece is None:
                await self.write_event(AudioStop().event())
                return samples
            samples += len(piece) // WIDTH
            for at in range(0, len(piece), SAMPLES_PER_CHUNK * WIDTH):
                chunk = piece[at:at + SAMPLES_PER_CHUNK * WIDTH]
                await self.write_event(AudioChunk(audio=chunk, **audio).event())

    def produce(self, job: dict, put):
        """The request's thread: submit, then each wave as PCM bytes to `put`; None at the end, or the
        error."""
        request, model, samples, first, start = None, self.server.model, 0, None, time.perf_counter()
        try:
            request = self.request = self.server.app.submit(job)
            if self.gone:  # hung up while it was submitted: `disconnect` may have missed it
                request.cancel()
            for wave in model.waves(request):
                first = first or time.perf_counter() - start
                samples += len(wave)
                put(self.server.pcm16(wave))
            wall, seconds = time.perf_counter() - start, samples / model.sample_rate
            whole = samples and not request.cancelled
            self.server.app.metrics.speech(model.kind, seconds, first, wall / seconds if whole else None)
            put(None)
        except Exception as e:
            try:
                put(e)
            except RuntimeError:  # the loop is closed: the server is shutting down
                line = f"fishfast: a Wyoming request ended while the server closed: {e}\n"
                sys.stderr.write(line)  # one write: print's two could run into another thread's line
        finally:
            if request is not None:
                request.cancel()  # a no-op once it has finished; frees the row if the client is gone


class Refused(Exception):
    """Why a connection is closed: answered with one error event of `code`, then the close."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class BadEvent(Refused):
    """An event that breaks the protocol or its bounds."""

    def __init__(self, message: str):
        super().__init__("BadEvent", message)


SHUTDOWN = Refused("Shutdown", "the server is shutting down: its requests are cancelled")


def json_object(raw: bytes, what: str) -> dict:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: a deeply nested value
        raise BadEvent(f"{what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise BadEvent(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def start(app, host: str, port: int, **helpers) -> WyomingServer:
    """Serve `app`'s model over Wyoming on host:port, from a thread (`close()` ends it)."""
    return WyomingServer(app, host, port, helpers).start()
