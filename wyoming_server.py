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
import os
import re
import sys
import threading
import time

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice, TtsVoiceSpeaker
from wyoming.server import AsyncEventHandler, AsyncTcpServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

import common
import omnivoice_text

EVENTS = ("describe", "synthesize", "synthesize-start", "synthesize-chunk", "synthesize-stop")  # answered
SAMPLES_PER_CHUNK = 1024  # samples an audio-chunk carries at most (wyoming-piper's)
WIDTH = 2  # bytes a sample: 16-bit PCM, as the HTTP route's pcm
WATCH = 1.0  # seconds between checks that the engine is alive while a request waits for audio
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
        self.max_text = helpers["max_text"]
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
        self.server, self.events = server, asyncio.Queue()
        self.request, self.gone = None, False
        self.stream = None  # the streaming form's: voice and options, the text not yet a sentence, failed
        self.worker = asyncio.create_task(self.work())

    async def handle_event(self, event) -> bool:
        self.events.put_nowait(event)
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
                metrics.end("wyoming", kind, status)

    async def answer(self, event):
        data = event.data
        if Describe.is_type(event.type):
            await self.write_event(self.server.info().event())
        elif Synthesize.is_type(event.type) and self.stream is None:  # in a stream: the same text, again,
            self.check_format(data)  # for servers that do not stream
            voice = self.server.options(data.get("voice"), self.extras(data))
            await self.speak(self.server.job(data.get("text"), voice))
        elif SynthesizeStart.is_type(event.type):
            self.check_format(data)
            voice = self.server.options(data.get("voice"), self.extras(data))  # checked before any text
            self.stream = dict(voice=voice, text="", failed=False)
        elif SynthesizeChunk.is_type(event.type) and self.stream is not None:
            await self.stream_text(data.get("text"))
        elif SynthesizeStop.is_type(event.type) and self.stream is not None:
            stream, self.stream = self.stream, None
            if stream["text"].strip() and not stream["failed"]:
                await self.speak(self.server.job(stream["text"], stream["voice"]))
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
        """A synthesize-chunk: each sentence it completes is spoken now, the rest waits for more."""
        stream = self.stream
        if not isinstance(text, str):
            raise common.UserError("synthesize-chunk's text must be a string")
        if stream["failed"]:
            return
        sentences, stream["text"] = complete_sentences(stream["text"] + text)
        if len(stream["text"]) > self.server.max_text:
            raise common.UserError(f"the streamed text has {len(stream['text'])} characters without a"
                                   f" sentence end, at most {self.server.max_text} are allowed")
        for sentence in sentences:
            await self.speak(self.server.job(sentence, stream["voice"]))

    async def speak(self, job: dict):
        """audio-start, the request's audio as it is made (16-bit PCM chunks), audio-stop. Nothing is sent
        before the request is taken: a full queue or an unknown voice is one error event."""
        loop, pieces, model = asyncio.get_running_loop(), asyncio.Queue(), self.server.model
        threading.Thread(target=self.produce, args=(job, lambda item: loop.call_soon_threadsafe(
            pieces.put_nowait, item)), name="fishfast-wyoming-request", daemon=True).start()
        started, audio = False, dict(rate=model.sample_rate, width=WIDTH, channels=1)
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
                return await self.write_event(AudioStop().event())
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
                print(f"fishfast: a Wyoming request ended while the server closed: {e}", file=sys.stderr)
        finally:
            if request is not None:
                request.cancel()  # a no-op once it has finished; frees the row if the client is gone


def start(app, host: str, port: int, **helpers) -> WyomingServer:
    """Serve `app`'s model over Wyoming on host:port, from a thread (`close()` ends it)."""
    return WyomingServer(app, host, port, helpers).start()
