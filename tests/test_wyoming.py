"""wyoming_server.py: app.py's Wyoming server driven by the wyoming package's own client over loopback, for
both models on the tiny checkpoints: describe/info, synthesize (the HTTP route's PCM), the streaming form, two
clients at once, a hang-up, a full queue, bad input; the flags of app.py."""
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

import app
import codec
import common
import omnivoice
import wyoming_server
from conftest import CKPT, OV_CKPT, OV_GOLDEN, free_port, serve, stop_server, untimed_compile_cache
from test_app import call, wait_for
from wyoming.client import AsyncTcpClient
from wyoming.event import Event
from wyoming.info import Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

ENDS = ("audio-stop", "error")  # what ends a synthesize's answer
S2_SAY = dict(max_new_tokens=12)  # S2-Pro's tiny model: a short answer


@contextlib.contextmanager
def servers(checkpoint, folder: Path, *flags):
    """app.py's HTTP server and its Wyoming server (app.serve_wyoming) for one App."""
    http = serve("--checkpoint", checkpoint, "--voices", folder, *flags)
    args = types.SimpleNamespace(host="127.0.0.1", wyoming_host=None, wyoming_port=free_port())
    wyoming = app.serve_wyoming(wyoming_server, http.app, args)
    try:
        yield types.SimpleNamespace(http=http, port=wyoming.port, app=http.app)
    finally:
        wyoming.close()
        stop_server(http)


@pytest.fixture(scope="module")
def s2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wyoming-s2")
    codec.save_codes(folder / "keep.npy", torch.randint(0, 1024, (10, 20), generator=torch.Generator()
                                                        .manual_seed(0)))
    (folder / "keep.txt").write_text("A saved voice.\n")
    with servers(CKPT, folder, "--slots", "2", "--queue", "1") as both:
        yield both


@pytest.fixture(scope="module")
def ov(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wyoming-ov")
    fox = omnivoice.load_voice(OV_GOLDEN / "prompt_ref24.pt")
    omnivoice.save_voice(folder / f"fox{omnivoice.VOICE_SUFFIX}", fox)
    with servers(OV_CKPT, folder, "--slots", "2", "--queue", "1") as both:
        yield both


def exchange(port: int, events: list, ends=ENDS) -> list:
    """Send `events` with the package's client, read the answers up to one of `ends`."""
    async def run():
        async with AsyncTcpClient("127.0.0.1", port) as client:
            for event in events:
                await client.write_event(event)
            got = []
            while not got or got[-1].type not in ends:
                got.append(await asyncio.wait_for(client.read_event(), 60))
                assert got[-1] is not None, f"the server hung up after {[e.type for e in got[:-1]]}"
            return got
    return asyncio.run(run())


def synthesize(text, voice=None, **extras) -> Event:
    event = Synthesize(text=text, voice=voice).event()
    event.data.update(extras)  # fishfast's extras (seed, the speech API's sampling fields)
    return event


def pcm_of(events: list) -> bytes:
    return b"".join(e.payload or b"" for e in events if e.type == "audio-chunk")


def http_pcm(server, **body) -> bytes:
    status, _, data = call(server.http, "POST", "/v1/audio/speech", dict(body, response_format="pcm"))
    assert status == 200, data[:300]
    return data


def held(monkeypatch, server) -> threading.Event:
    """The engine's steps wait until the returned event is set: what is submitted stays where it is."""
    scheduler, go = server.app.engine.scheduler, threading.Event()
    step = scheduler.step
    monkeypatch.setattr(scheduler, "step", lambda: go.wait(60) and step())
    return go


def submitted(monkeypatch, server) -> list:
    made, submit = [], server.app.model.submit
    monkeypatch.setattr(server.app.model, "submit", lambda *args: made.append(submit(*args)) or made[-1])
    return made


# ----------------------------------------------------------------------------- describe
def test_describe_lists_the_models_own_and_saved_voices_languages_and_streaming(s2, ov):
    (s2_info,) = exchange(s2.port, [Event("describe")], ("info",))
    (program,) = Info.from_event(s2_info).tts
    assert program.name == "fishfast" and program.installed and program.supports_synthesize_streaming
    assert program.attribution.url == "https://huggingface.co/fishaudio/s2-pro"
    assert program.version == CKPT.name  # the checkpoint served, by name (never its path)
    assert [v.name for v in program.voices] == ["default", "keep"]
    assert program.voices[0].attribution.name == "fishaudio" and program.voices[0].speakers is None
    assert program.voices[1].languages == list(wyoming_server.S2_LANGUAGES) and len(set(program.voices[1]
                                                                                        .languages)) == 83
    (ov_info,) = exchange(ov.port, [Event("describe")], ("info",))
    (program,) = Info.from_event(ov_info).tts
    assert [v.name for v in program.voices] == ["auto", "design", "fox"]
    assert program.voices[0].attribution.name == "k2-fsa"
    assert all(len(v.languages) == 646 and "en" in v.languages for v in program.voices)
    design = [s.name for s in program.voices[1].speakers]
    assert len(design) == 2 + 5 + 5 + 1 + 10 + 12 and "british accent" in design and "四川话" in design


def test_a_saved_voice_hides_the_models_own_voice_of_its_name(s2):
    folder = s2.app.voices
    codec.save_codes(folder / "default.npy", torch.randint(0, 1024, (10, 20), generator=torch.Generator()
                                                           .manual_seed(1)))
    (folder / "default.txt").write_text("A saved voice named default.\n")
    try:
        (info,) = exchange(s2.port, [Event("describe")], ("info",))
        (program,) = Info.from_event(info).tts
        assert [v.name for v in program.voices] == ["default", "keep"]
        assert program.voices[0].description == f"saved voice 'default' ({folder}/)"
        default = SynthesizeVoice(name="default")
        events = exchange(s2.port, [synthesize("Hi there.", default, seed=3, **S2_SAY)])
        assert pcm_of(events) == http_pcm(s2, input="Hi there.", voice="default", seed=3, **S2_SAY)
        assert pcm_of(events) != http_pcm(s2, input="Hi there.", seed=3, **S2_SAY)
    finally:
        (folder / "default.txt").unlink()
        (folder / "default.npy").unlink()


# ----------------------------------------------------------------------------- synthesize
def test_synthesize_gives_the_http_routes_pcm_in_chunks_at_the_models_rate(s2, ov):
    keep = SynthesizeVoice(name="keep")
    events = exchange(s2.port, [synthesize("Hello from Wyoming.", keep, seed=7, **S2_SAY)])
    assert [e.type for e in (events[0], events[-1])] == ["audio-start", "audio-stop"]
    assert events[0].data == dict(rate=44100, width=2, channels=1, timestamp=None)
    chunks = events[1:-1]
    assert {e.type for e in chunks} == {"audio-chunk"} and max(len(e.payload) for e in chunks) == 2048
    assert all(e.data["rate"] == 44100 and e.data["width"] == 2 for e in chunks)
    want = http_pcm(s2, input="Hello from Wyoming.", voice="keep", seed=7, **S2_SAY)
    assert len(want) == 11 * 2048 * 2 and pcm_of(events) == want  # the last frame is dropped, as upstream

    text = "Good morning. The second sentence."
    events = exchange(ov.port, [synthesize(text, SynthesizeVoice(name="design", speaker="female, low pitch"),
                                           seed=3)])
    assert events[0].data["rate"] == 24000 and [e.type for e in events].count("audio-start") == 1
    assert pcm_of(events) == http_pcm(ov, input=text, instructions="female, low pitch", seed=3)
    events = exchange(ov.port, [synthesize(text, SynthesizeVoice(name="fox"), seed=4)])
    assert pcm_of(events) == http_pcm(ov, input=text, voice="fox", seed=4)
    raw = Event("synthesize", dict(text=text, voice=dict(name="auto", language="de-DE"), seed=5))
    assert pcm_of(exchange(ov.port, [raw])) == http_pcm(ov, input=text, language="de", seed=5)


def test_the_streaming_form_speaks_each_sentence_once_it_is_complete(ov):
    seed = dict(seed=9)
    start = SynthesizeStart(voice=SynthesizeVoice(name="fox")).event()
    start.data.update(seed)

    async def run():
        async with AsyncTcpClient("127.0.0.1", ov.port) as client:
            await client.write_event(start)
            await client.write_event(SynthesizeChunk(text="It was 3.5 metres, Mr. Smith").event())
            await client.write_event(SynthesizeChunk(text=" said. How are").event())
            got = [await asyncio.wait_for(client.read_event(), 60)]
            while got[-1].type != "audio-stop":  # the first sentence, before the rest of the text is sent
                got.append(await asyncio.wait_for(client.read_event(), 60))
            # Home Assistant sends the whole text as one synthesize too, for servers that do not stream
            whole = "It was 3.5 metres, Mr. Smith said. How are you? 好的。再见"
            await client.write_event(Synthesize(text=whole).event())
            await client.write_event(SynthesizeChunk(text=" you? 好的。再见").event())
            await client.write_event(SynthesizeStop().event())
            while got[-1].type != "synthesize-stopped":
                got.append(await asyncio.wait_for(client.read_event(), 60))
            return got
    events = asyncio.run(run())
    sentences = ["It was 3.5 metres, Mr. Smith said.", "How are you?", "好的。", "再见"]
    assert [e.type for e in events].count("audio-start") == [e.type for e in events].count("audio-stop") == 4
    pieces, piece = [], []
    for event in events[:-1]:
        piece.append(event)
        if event.type == "audio-stop":
            pieces.append(pcm_of(piece))
            piece = []
    for sentence, got in zip(sentences, pieces, strict=True):
        assert got == http_pcm(ov, input=sentence, voice="fox", **seed), sentence


def test_s2pros_streaming_form_gives_each_sentences_http_audio(s2):
    start = SynthesizeStart(voice=SynthesizeVoice(name="keep")).event()
    start.data.update(seed=6, **S2_SAY)
    chunks = [SynthesizeChunk(text=text).event() for text in ("First one! Sec", "ond one")]
    events = exchange(s2.port, [start, *chunks, SynthesizeStop().event()], ("synthesize-stopped",))
    stops = [i for i, e in enumerate(events) if e.type == "audio-stop"]
    assert len(stops) == 2 and events[-1].type == "synthesize-stopped"
    pieces = (events[:stops[0]], events[stops[0]:])
    for sentence, piece in zip(["First one!", "Second one"], pieces, strict=True):
        assert pcm_of(piece) == http_pcm(s2, input=sentence, voice="keep", seed=6, **S2_SAY), sentence


def test_complete_sentences_wait_for_the_space_after_an_end():
    assert wyoming_server.complete_sentences("One. Two! Thr") == (["One.", "Two!"], "Thr")
    assert wyoming_server.complete_sentences("Pi is 3.") == ([], "Pi is 3.")
    assert wyoming_server.complete_sentences("e.g. this, and Dr. Who said “hi.” Then") == (
        ["e.g. this, and Dr. Who said “hi.”"], "Then")
    assert wyoming_server.complete_sentences("你好！我") == (["你好！"], "我")
    assert wyoming_server.complete_sentences("Wait... what?! “No.”  OK。。好") == (
        ["Wait...", "what?!", "“No.”", "OK。。"], "好")


def test_a_run_of_end_marks_splits_in_linear_time():
    """Issue 58 item 1: a stream chunk of a million dots (no space: no sentence) is split at once, not by
    backtracking from every start (16,000 dots took 9 s, the GIL held: every thread, HTTP too, froze)."""
    script = ("import wyoming_server as w; print(w.complete_sentences('.' * 10**6 + '!' * 10**6)[0],"
              " w.complete_sentences('。' * 10**6)[0])")
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(wyoming_server.__file__).parent,
                         capture_output=True, text=True, timeout=120)  # quadratic: hours
    assert run.returncode == 0 and run.stdout.split() == ["[]", "['" + "。" * 10**6 + "']"], run.stderr[-500:]


# ----------------------------------------------------------------------------- load
@pytest.mark.parametrize("which", ["s2", "ov"])
def test_two_clients_at_once_are_batched_and_each_gets_its_own_audio(request, which, monkeypatch):
    server, say = request.getfixturevalue(which), S2_SAY if which == "s2" else {}
    requests = [synthesize("The first client.", seed=21, **say),
                synthesize("And the other.", SynthesizeVoice(name="fox") if which == "ov" else None, seed=22,
                           **say)]
    alone = [pcm_of(exchange(server.port, [event])) for event in requests]
    scheduler, rows = server.app.engine.scheduler, []
    step = scheduler.step
    monkeypatch.setattr(scheduler, "step", lambda: rows.append(scheduler.running) or step())
    go = held(monkeypatch, server)
    made, answers = submitted(monkeypatch, server), [None, None]

    def client(i):
        answers[i] = exchange(server.port, [requests[i]])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(made) == 2, 30, "both requests to be submitted")
    go.set()
    for thread in threads:
        thread.join()
    assert max(rows) == 2  # one step held both
    for got, want in zip(answers, alone, strict=True):
        assert pcm_of(got) == want


@pytest.mark.parametrize("which", ["s2", "ov"])
def test_a_client_that_hangs_up_frees_its_row(request, which, monkeypatch):
    server = request.getfixturevalue(which)
    made = submitted(monkeypatch, server)
    text = " ".join(f"Sentence number {i}." for i in range(12))

    async def run():
        async with AsyncTcpClient("127.0.0.1", server.port) as client:
            await client.write_event(synthesize(text, seed=1, max_new_tokens=0) if which == "s2" else
                                     synthesize(text, seed=1))
            while (await asyncio.wait_for(client.read_event(), 60)).type != "audio-chunk":
                pass
    asyncio.run(run())  # gone after its first audio
    engine = server.app.engine
    wait_for(lambda: made[0].done and engine.stats()["busy"] == 0, 10, "the row to be freed")
    assert made[0].cancelled and engine.stats()["queued"] == 0
    if which == "s2":
        assert sum(c.size(1) for c in made[0].chunks) < 200
    else:
        assert len(made[0].tokens) < 12


@pytest.mark.parametrize("which", ["s2", "ov"])
def test_a_full_queue_is_an_error_event_and_a_waiting_hang_up_leaves_it(request, which, monkeypatch):
    server = request.getfixturevalue(which)
    go, made = held(monkeypatch, server), submitted(monkeypatch, server)
    say = synthesize("Waiting my turn.", seed=2, **(S2_SAY if which == "s2" else {}))
    clients = []

    async def hold(client):
        await client.connect()
        await client.write_event(say)
        clients.append(client)

    async def run():
        for _ in range(3):  # two slots and a place in the queue: the engine's steps are held
            await hold(AsyncTcpClient("127.0.0.1", server.port))
            await asyncio.wait_for(wait_until(lambda: len(made) == len(clients)), 30)
        answer = await exchange_in_loop(server.port, say)
        for client in clients:
            await client.disconnect()
        return answer
    answer = asyncio.run(run())
    assert [e.type for e in answer] == ["error"]
    assert answer[0].data == dict(text="the server is busy: 1 requests are waiting already: try again later",
                                  code="QueueFull")
    wait_for(lambda: all(r.cancelled for r in made), 10, "the hang-ups to be seen")
    assert server.app.engine.stats()["queued"] == 0
    go.set()
    wait_for(lambda: server.app.engine.stats()["busy"] == 0, 10, "the rows to empty")


async def wait_until(condition):
    while not condition():
        await asyncio.sleep(0.02)


async def exchange_in_loop(port, event) -> list:
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(event)
        got = [await asyncio.wait_for(client.read_event(), 30)]
        while got[-1].type not in ENDS:
            got.append(await asyncio.wait_for(client.read_event(), 30))
        return got


# ----------------------------------------------------------------------------- bad input
S2_BAD = [
    (synthesize(""), "text is empty: give the text as a non-empty string"),
    (synthesize("x" * 4097), "text has 4097 characters, at most 4096 are allowed"),
    (synthesize("Hi.", SynthesizeVoice(name="nobody")), "unknown voice 'nobody': GET /v1/audio/voices lists"
     " the saved ones. Save one with POST /v1/audio/voices, or send no voice for plain text-to-speech"),
    (synthesize("Hi.", SynthesizeVoice(name="../keep")), "voice name '../keep' is not allowed: use 1-64"
     " letters, digits, '_', '-' or inner spaces"),
    (synthesize("Hi.", SynthesizeVoice(name="keep", speaker="x")), "S2-Pro's voices have no speakers: give"
     " style as inline tags in the text, e.g. '[whispering] Hello'"),
    (synthesize("Hi.", seed=-1), "seed must be an integer from 0 to 2**63 - 1, got -1"),
    (Event("synthesize", dict(text="Hi.", text_format="ssml")), "text_format 'ssml' is not supported: send"
     " plain text"),
    (Event("synthesize", dict(text="Hi.", voice="keep")),
     "voice must be an object {name, language, speaker}"),
    (SynthesizeChunk(text="Hi.").event(), "synthesize-chunk without synthesize-start"),
]
OV_BAD = [
    (synthesize("Hi.", SynthesizeVoice(name="design", speaker="cheerful")),
     "speaker (a voice design): unknown attribute 'cheerful' — use only: male, female, "),
    (Event("synthesize", dict(text="Hi.", voice=dict(language="xx-YY"))), "unknown language 'xx-YY' — use a"
     " code such as en, zh, ja or a name such as English (see README)"),
    (synthesize("Hi.", temperature=0.5), "temperature is an S2-Pro option: OmniVoice takes language,"
     " num_step, guidance_scale, duration, seed, speed and instructions (docs/api.md)"),
]


@pytest.mark.parametrize("which, event, message", [("s2", *case) for case in S2_BAD]
                         + [("ov", *case) for case in OV_BAD])
def test_bad_input_is_one_error_event_with_one_line_and_the_connection_serves_on(request, which, event,
                                                                                 message):
    server = request.getfixturevalue(which)
    answer = exchange(server.port, [event, Event("describe")], ("info",))
    assert [e.type for e in answer] == ["error", "info"]
    assert answer[0].data["text"].startswith(message) and "\n" not in answer[0].data["text"]
    assert answer[0].data["code"] == "UserError"


def test_a_stream_that_fails_drops_its_text_and_still_ends(s2):
    start = SynthesizeStart(voice=SynthesizeVoice(name="keep")).event()
    chunks = [SynthesizeChunk(text=text).event() for text in ("x" * 4097, "More. ")]
    events = exchange(s2.port, [start, *chunks, SynthesizeStop().event()], ("synthesize-stopped",))
    assert [e.type for e in events] == ["error", "synthesize-stopped"]
    assert events[0].data["text"] == ("the streamed text has 4097 characters without a sentence end, at most"
                                      " 4096 are allowed")


# ----------------------------------------------------------------------------- app.py's flags
def test_the_flags_say_what_is_missing_in_one_line(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        app.parse_args(["--no-http"])
    error = capsys.readouterr().err
    assert "--no-http serves the Wyoming protocol alone: give --wyoming-port PORT too" in error
    assert app.wyoming_module(app.parse_args([])) is None  # without the flag nothing is imported
    for name in [m for m in sys.modules if m == "wyoming_server" or m.split(".")[0] == "wyoming"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "wyoming", None)  # the package is not installed
    with pytest.raises(common.UserError, match=r"^--wyoming-port needs the wyoming package: pip install"
                                               r" wyoming$"):
        app.wyoming_module(app.parse_args(["--wyoming-port", "10200"]))


def test_a_port_in_use_is_one_line(s2, capsys):
    with pytest.raises(SystemExit):  # the flags' check, before the model loads
        app.parse_args(["--port", "0", "--wyoming-port", str(s2.port)])
    error = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{s2.port} (Wyoming): Address already in use" in error
    args = types.SimpleNamespace(host="127.0.0.1", wyoming_host=None, wyoming_port=s2.port)
    with pytest.raises(common.UserError, match=rf"^cannot listen on 127.0.0.1:{s2.port} \(Wyoming\): Address"
                                               r" already in use$"):
        app.serve_wyoming(wyoming_server, s2.app, args)


def test_no_http_serves_wyoming_alone_and_sigterm_ends_it(tmp_path):
    port = free_port()
    command = [sys.executable, str(Path(app.__file__).resolve()), "--checkpoint", str(CKPT), "--device",
               "cpu", "--voices", str(tmp_path), "--no-http", "--wyoming-port", str(port)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(untimed_compile_cache(tmp_path / "compile")))
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.strip().endswith(f"-> tcp://127.0.0.1:{port} (Wyoming)") and "http://" not in line
        events = exchange(port, [synthesize("Alone.", seed=1, **S2_SAY)])
        assert events[0].type == "audio-start" and len(pcm_of(events)) == 11 * 2048 * 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        process.kill()
    assert "Traceback" not in process.stderr.read()
