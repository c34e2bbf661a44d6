"""app.py serving OmniVoice (the tiny checkpoint, and the demo model): the goldens through the server,
sentence streaming, concurrent requests batched, OpenAI's fields (instructions = voice design, speed), voices
of both models in one folder, bad input, the page in a real browser. A real server on 127.0.0.1, real HTTP."""
import base64
import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

import app
import common
import omnivoice
import quantize
from conftest import OV_CASES as CASES, OV_CKPT as CKPT, OV_GOLDEN as GOLDEN, ov_golden as golden
from conftest import CKPT as S2_CKPT, running, save_s2_voice, serve, stop_server
from test_app import LIVEKIT_OPTIONS, browser_on, call, ffmpeg_decoded, health, multipart, open_stream
from test_app import sse_events, tree, wait_for
from test_omnivoice import api_kwargs

SPEECH = "/v1/audio/speech"
CLIP_WAV = GOLDEN / "clip_ref_alt.wav"  # PCM-16, 16 kHz: upstream's prompt_ref_alt_wav was made from it
CLIP_TEXT = "The quick brown fox jumps."
CLIP_B64 = base64.b64encode(CLIP_WAV.read_bytes()).decode()
GOLDEN_VOICES = dict(fox24="prompt_ref24.pt", foxalt="prompt_ref_alt.pt")  # voice name -> upstream's prompt


def start_server(folder: Path, *flags):
    return serve("--checkpoint", CKPT, "--voices", folder / "prompt", *flags)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The voices folder: the goldens' clone prompts saved as voices (GOLDEN_VOICES), and an S2-Pro voice
    `s2voice`."""
    folder = tmp_path_factory.mktemp("app-omnivoice")
    (folder / "prompt").mkdir()
    for name, prompt in GOLDEN_VOICES.items():
        omnivoice.save_voice(folder / "prompt" / f"{name}{omnivoice.VOICE_SUFFIX}",
                             omnivoice.load_voice(GOLDEN / prompt))
    save_s2_voice(folder / "prompt", "s2voice", "An S2-Pro voice.")
    return folder


@pytest.fixture(scope="module")
def server(root):
    yield from running(start_server(root, "--slots", "8", "--queue", "8"))


@pytest.fixture(scope="module")
def model():
    """The same weights as the server's, another instance: the server's belongs to its engine thread."""
    return omnivoice.load(CKPT)


def pcm(wave) -> bytes:
    return app.pcm16(np.asarray(wave, dtype=np.float32))


def solo(model, text, **kwargs) -> bytes:
    """What a request says alone: its sentences through a Scheduler of its own, as 16-bit PCM."""
    pieces = list(omnivoice.stream(model, text, **kwargs))
    return pcm(np.concatenate(pieces) if pieces else np.zeros(0, np.float32))


def speeches(monkeypatch, server) -> list:
    """The omnivoice.Speech of each request the server takes from now on."""
    made, submit = [], server.app.model.submit
    monkeypatch.setattr(server.app.model, "submit", lambda *args: made.append(submit(*args)) or made[-1])
    return made


def wav_bytes(wave: np.ndarray, rate: int, subtype="FLOAT") -> bytes:
    out = io.BytesIO()
    sf.write(out, wave, rate, format="WAV", subtype=subtype)
    return out.getvalue()


def error_of(answer) -> str:
    return json.loads(answer[2])["error"]["message"]


# ----------------------------------------------------------------------------- the goldens, served
SERVED = ["clone", "clone_from_ref_audio", "design", "auto", "speed", "duration", "nonverbal"]  # 1 sentence


def golden_request(case) -> dict:
    """A golden case as an OpenAI request: its voice by name (GOLDEN_VOICES), its clip uploaded as a float WAV
    at its own rate, instruct as instructions."""
    kwargs = api_kwargs(case)
    body = dict(input=kwargs.pop("text"), seed=CASES["generate"][case]["seed"], response_format="wav")
    if "instruct" in kwargs:
        body["instructions"] = kwargs.pop("instruct")
    if "voice" in kwargs:
        codes = kwargs.pop("voice")["codes"]
        body["voice"] = next(name for name, prompt in GOLDEN_VOICES.items()
                             if torch.equal(omnivoice.load_voice(GOLDEN / prompt)["codes"], codes))
    if "ref_audio" in kwargs:
        wave, rate = kwargs.pop("ref_audio")
        body["ref_audio"] = base64.b64encode(wav_bytes(wave, rate)).decode()
    return dict(body, **kwargs)  # language, speed, duration, ref_text


@pytest.mark.parametrize("case", SERVED)
def test_the_goldens_through_the_server_give_upstreams_codes_and_generates_audio(server, model, case,
                                                                                 monkeypatch):
    """Each one-sentence golden as an OpenAI request: upstream's codes, and generate()'s very samples."""
    spec, kwargs, body = CASES["generate"][case], api_kwargs(case), golden_request(case)
    made = speeches(monkeypatch, server)
    status, headers, data = call(server, "POST", SPEECH, body)
    assert status == 200 and headers["Content-Type"] == "audio/wav", data[:300]
    assert sf.info(io.BytesIO(data)).samplerate == 24000
    (speech,) = made
    assert len(speech.tokens) == 1 and torch.equal(speech.tokens[0], golden(spec["token_files"][0]))
    [want] = omnivoice.generate(model, **kwargs, seed=spec["seed"])
    assert data == app.wav_header(rate=24000) + pcm(want)  # streamed: sizes unknown in the header


def test_every_format_and_stream_format(server, model):
    body = dict(input="Good morning. How are you today?", voice="fox24", seed=21, num_step=8)
    want = solo(model, body["input"], voice=omnivoice.load_voice(GOLDEN / "prompt_ref24.pt"), seed=21,
                num_step=8)
    status, headers, data = call(server, "POST", SPEECH, dict(body, response_format="pcm"))
    assert status == 200 and headers["Content-Type"] == "audio/pcm" and data == want
    status, headers, data = call(server, "POST", SPEECH, dict(body, response_format="flac"))
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert status == 200 and rate == 24000 and samples.tobytes() == want  # lossless of the same samples
    for fmt in ("mp3", "opus"):
        if fmt in app.FORMATS:
            status, headers, data = call(server, "POST", SPEECH, dict(body, response_format=fmt))
            samples, rate = sf.read(io.BytesIO(data))
            assert status == 200 and headers["Content-Type"] == app.MEDIA_TYPES[fmt]
            assert rate == 24000 and abs(len(samples) - len(want) / 2) < 0.1 * rate, fmt  # opus has 24 kHz
    conn, response = open_stream(server, dict(body, response_format="wav", stream_format="sse"))
    events = list(sse_events(response))
    conn.close()
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert audio == app.wav_header(rate=24000) + want
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] > 0
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]


def decoded(data: bytes, fmt: str) -> np.ndarray:
    """pcm as it is; a streamed mp3 as ffmpeg decodes it, opus by soundfile."""
    if fmt == "pcm":
        return np.frombuffer(data[:len(data) // 2 * 2], "<i2")
    samples, rate = ffmpeg_decoded(data) if fmt == "mp3" else sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000
    return samples


@pytest.mark.parametrize("fmt, stream_format", [("pcm", "audio"), ("mp3", "audio"), ("mp3", "sse"),
                                                ("opus", "audio"), ("opus", "sse")])
def test_audio_arrives_before_the_last_sentence_is_generated(server, model, monkeypatch, fmt, stream_format):
    """The engine is held once the first of three sentences is unmasked: its audio still arrives, so the
    first audio comes after the first sentence, not after the whole text. mp3 and opus too, raw and in SSE
    deltas (LiveKit's default, mp3 over SSE, came whole at the end): encoded as they are made, their audio
    lasts the pcm's, mp3 within half of one of its frames as players and LiveKit's decoder hear it (< one
    OmniVoice frame)."""
    assert fmt in app.FORMATS  # libsndfile >= 1.1 (requirements.txt's soundfile wheels bundle it)
    made, release = speeches(monkeypatch, server), threading.Event()
    scheduler = server.app.engine.scheduler
    forward = scheduler.forward

    def held(*args):  # every step after the first sentence waits for the test
        if made and made[0].tokens:
            release.wait(60)
        return forward(*args)

    monkeypatch.setattr(scheduler, "forward", held)
    text = "The first sentence is here, and it goes on for a while. Is this the second one? Yes, the third."
    body = dict(input=text, seed=33, num_step=8, response_format=fmt, stream_format=stream_format)
    conn, response = open_stream(server, body)
    pieces = []  # the body as it arrives (SSE: each delta's audio), read by a thread of its own
    if stream_format == "sse":
        def read():
            pieces.extend(base64.b64decode(e["audio"]) for e in sse_events(response) if "audio" in e)
    else:
        def read():
            while piece := response.read1(65536):
                pieces.append(piece)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        wait_for(lambda: pieces, 60, "the first audio")
        speech = made[0]
        assert len(speech.texts) == 3
        assert len(speech.tokens) == 1 and not speech.job.done  # the second sentence is being unmasked
        time.sleep(1)  # what the first sentence made, all sent while the engine is held
        early = b"".join(list(pieces))
        assert len(decoded(early, fmt)) > 24000, len(decoded(early, fmt))  # more than a second of audio
    finally:
        release.set()
        reader.join(60)
        conn.close()
    data = b"".join(pieces)
    want = solo(model, text, seed=33, num_step=8)
    assert len(speech.tokens) == 3
    if fmt == "pcm":
        assert data == want
    elif fmt == "opus":
        assert len(decoded(data, fmt)) == len(want) // 2
    else:
        hop = server.app.model.hop  # 24 kHz samples an OmniVoice frame; 576: an MPEG-2 mp3 frame's
        extra = len(decoded(data, fmt)) - len(want) // 2
        livekit_extra = len(ffmpeg_decoded(data, LIVEKIT_OPTIONS)[0]) - len(want) // 2
        assert abs(extra - 47) <= 576 // 2 and 0 <= livekit_extra < hop, (extra, livekit_extra)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    yield from running(start_server(tmp_path_factory.mktemp("packed"), "--slots", "8", "--packed"))


@pytest.mark.parametrize("which", ["server", "packed"])
def test_eight_concurrent_requests_run_batched_and_each_gets_its_solo_audio(request, model, which,
                                                                            monkeypatch):
    """Requests of other lengths, voices, designs, speeds and step counts, one or two sentences, arriving
    together: one forward per step holds them all, and each says what it says alone."""
    server = request.getfixturevalue(which)
    fox = omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")
    if which == "packed":
        server.app.voices.mkdir(exist_ok=True)
        omnivoice.save_voice(server.app.voices / f"fox24{omnivoice.VOICE_SUFFIX}", fox)
    requests = [dict(input="Good morning everyone.", voice="fox24"),
                dict(input="A short one.", instructions="male, low pitch", num_step=12),
                dict(input="Hello there. This one has two sentences.", speed=1.3),
                dict(input="She sells sea shells by the sea shore.", language="en", num_step=20),
                dict(input="Designed, and cloned as well.", voice="fox24", instructions="whisper"),
                dict(input="Quick!", duration=1.2),
                dict(input="Two of them here. And another, longer one to end.", guidance_scale=1.0),
                dict(input="The last request.", num_step=8, language="English")]
    bodies = [dict(body, seed=100 + i, response_format="pcm") for i, body in enumerate(requests)]
    scheduler, sizes, arrived = server.app.engine.scheduler, [], threading.Event()
    forward = scheduler.forward

    def counted(*args):  # the first step waits until every request has been submitted
        arrived.wait(60)
        sizes.append(len(scheduler.active))
        return forward(*args)

    monkeypatch.setattr(scheduler, "forward", counted)
    made = speeches(monkeypatch, server)
    results = [None] * len(bodies)

    def client(i):
        results[i] = call(server, "POST", SPEECH, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(made) == len(bodies), 60, "every request to be submitted")
    arrived.set()
    for thread in threads:
        thread.join()
    assert max(sizes) == len(bodies)  # all eight in one forward
    for (status, _, data), body in zip(results, bodies, strict=True):
        assert status == 200, data[:300]
        options = app.omnivoice_options(body)
        want = solo(model, body["input"], voice=fox if body.get("voice") else None, **options)
        assert data == want, body


def test_a_client_that_hangs_up_frees_its_place_in_the_batch(server, monkeypatch):
    made, release = speeches(monkeypatch, server), threading.Event()
    scheduler = server.app.engine.scheduler
    forward = scheduler.forward

    def held(*args):
        if made and made[0].tokens:
            release.wait(60)
        return forward(*args)

    monkeypatch.setattr(scheduler, "forward", held)
    conn, response = open_stream(server, dict(input="One sentence. Then the next. And one more.", seed=1,
                                              response_format="pcm"))
    try:
        assert len(response.read(2)) == 2
        conn.close()
        wait_for(lambda: made[0].cancelled, 10, "the hang-up to be seen")
        release.set()
        wait_for(lambda: health(server)["busy"] == 0 and made[0].done, 10, "the sentence to leave")
        assert len(made[0].tokens) == 1 and health(server)["queued"] == 0
    finally:
        release.set()


# ----------------------------------------------------------------------------- OpenAI's client
def test_openai_client_instructions_speed_builtin_voices_and_streaming(server, model, root):
    import openai  # requirements-test.txt
    url = "http://%s:%d/v1" % server.server_address[:2]
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    speech, extra = client.audio.speech, dict(seed=41, num_step=8)
    text = "Hello from the OpenAI client."
    audio = speech.create(model="tts-1", voice="alloy", input=text, instructions="female, high pitch",
                          speed=1.2, response_format="pcm", extra_body=extra)
    assert audio.content == solo(model, text, instruct="female, high pitch", speed=1.2, **extra)
    for name in ("marin", "cedar"):  # OpenAI's newest two of its 13: plain speech, as alloy
        plain = speech.create(model="tts-1", voice=name, input=text, response_format="pcm", extra_body=extra)
        assert plain.content == solo(model, text, **extra)  # pcm: OpenAI's 24 kHz, OmniVoice's own
    design = r"unknown attribute 'speak cheerfully\.' .* use only: male, female"
    with pytest.raises(openai.BadRequestError, match=design):
        speech.create(model="tts-1", voice="alloy", input=text, instructions="Speak cheerfully.")
    with speech.with_streaming_response.create(model="tts-1", voice="alloy", input=text,
                                               response_format="wav", stream_format="sse",
                                               extra_body=extra) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    got = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert got == app.wav_header(rate=24000) + solo(model, text, **extra)


# ----------------------------------------------------------------------------- voices
def test_voices_save_list_use_and_delete_beside_s2pros(server, model, root):
    """A saved OmniVoice voice is upstream's voice prompt of the clip, one file the CLI reads; the list
    names every voice in the folder and the model it is for."""
    status, _, data = call(server, "POST", "/v1/audio/voices",
                           dict(name="fox", audio=CLIP_B64, text=CLIP_TEXT))
    assert status == 201 and json.loads(data) == dict(name="fox", frames=55, seconds=2.2, model="omnivoice")
    saved = omnivoice.load_voice(root / "prompt" / f"fox{omnivoice.VOICE_SUFFIX}", model)  # the CLI's --voice
    upstream = torch.load(GOLDEN / "prompt_ref_alt_wav.pt", weights_only=True)
    assert torch.equal(saved["codes"], upstream["ref_audio_tokens"]) and saved["text"] == upstream["ref_text"]
    stereo = np.load(GOLDEN / "clip_ref_alt.npy")
    stereo = np.stack([stereo, -0.5 * stereo[::-1]], 1).astype(np.float32)  # the stereo golden's clip
    content_type, form = multipart(dict(name="fox two", text=CLIP_TEXT, audio=wav_bytes(stereo, 16000)))
    assert call(server, "POST", "/v1/audio/voices", form, content_type=content_type)[0] == 201
    two = omnivoice.load_voice(root / "prompt" / f"fox two{omnivoice.VOICE_SUFFIX}")
    assert torch.equal(two["codes"], golden("prompt_ref_alt_stereo_tokens.npy"))

    listed = json.loads(call(server, "GET", "/v1/audio/voices")[2])
    assert {"fox", "fox two", "fox24"} <= set(listed["voices"]) and "s2voice" not in listed["voices"]
    assert dict(name="s2voice", model="s2-pro") in listed["all"]
    assert dict(name="fox", model="omnivoice") in listed["all"]
    upstream_list = json.loads(call(server, "GET", "/v1/references/list?format=json")[2])
    assert upstream_list["reference_ids"] == listed["voices"]

    text = "Spoken in the saved voice."
    body = dict(input=text, seed=5, response_format="pcm")
    status, _, data = call(server, "POST", SPEECH, dict(body, voice="fox"))
    assert status == 200 and data == solo(model, text, voice=saved, seed=5)
    clip = [dict(audio=CLIP_B64, text=CLIP_TEXT)]
    status, _, data = call(server, "POST", SPEECH, dict(body, references=clip))
    assert status == 200 and data == solo(model, text, voice=saved, seed=5)  # the clip: the same prompt

    assert call(server, "POST", "/v1/audio/voices", dict(name="s2voice", audio=CLIP_B64,
                                                        text=CLIP_TEXT))[0] == 409  # one name space for both
    assert call(server, "DELETE", "/v1/audio/voices/fox")[0] == 200
    assert call(server, "DELETE", "/v1/audio/voices/fox%20two")[0] == 200
    assert not list((root / "prompt").glob("fox.*")) and not list((root / "prompt").glob("fox two*"))
    assert call(server, "DELETE", "/v1/audio/voices/fox")[0] == 404
    assert "unknown voice" in error_of(call(server, "POST", SPEECH, dict(input=text, voice="fox")))


def test_a_designed_voice_is_kept_from_its_generation_and_cloned_later(server, model, root):
    """from_generation: the speech request run, its first sentence's codes and text kept (a text of one
    sentence: upstream's designed voice itself)."""
    spec = CASES["generate"]["design"]
    made = dict(input=spec["kwargs"]["text"], instructions=spec["kwargs"]["instruct"], language="en",
                seed=spec["seed"])
    status, _, data = call(server, "POST", "/v1/audio/voices", dict(name="her", from_generation=made))
    assert status == 201 and json.loads(data) == dict(name="her", frames=49, seconds=1.96, model="omnivoice")
    voice = omnivoice.load_voice(root / "prompt" / f"her{omnivoice.VOICE_SUFFIX}", model)
    assert torch.equal(voice["codes"], golden("gen_design_tokens.npy")) and voice["text"] == made["input"]
    text = "Spoken in the kept voice."
    body = dict(input=text, voice="her", seed=5, response_format="pcm")
    status, _, data = call(server, "POST", SPEECH, body)
    assert status == 200 and data == solo(model, text, voice=voice, seed=5)
    two = dict(made, input="First one here. And a second one.", seed=3)
    assert call(server, "POST", "/v1/audio/voices", dict(name="two", from_generation=two))[0] == 201
    speech = omnivoice.Speech(model, omnivoice.Scheduler(model, max_batch=1), two["input"], language="en",
                              instruct=two["instructions"], seed=3)
    list(speech)
    kept = omnivoice.load_voice(root / "prompt" / f"two{omnivoice.VOICE_SUFFIX}", model)
    assert kept["text"] == "First one here." and torch.equal(kept["codes"], speech.tokens[0])
    for name in ("her", "two"):
        assert call(server, "DELETE", f"/v1/audio/voices/{name}")[0] == 200


def test_a_voice_renamed_upstreams_way_keeps_its_file_whole(server, root):
    path = root / "prompt" / f"fox24{omnivoice.VOICE_SUFFIX}"
    before = path.read_bytes()
    body = dict(old_reference_id="fox24", new_reference_id="fox renamed")
    assert call(server, "POST", "/v1/references/update?format=json", body)[0] == 200
    try:
        assert not path.exists()
        assert (root / "prompt" / f"fox renamed{omnivoice.VOICE_SUFFIX}").read_bytes() == before
    finally:
        body = dict(old_reference_id="fox renamed", new_reference_id="fox24")
        assert call(server, "POST", "/v1/references/update?format=json", body)[0] == 200
    assert path.read_bytes() == before


def test_each_model_refuses_the_others_voice_clearly(server, root, tmp_path):
    """The folder is shared: an S2-Pro server lists the OmniVoice voice and refuses it, as OmniVoice's
    refuses S2-Pro's."""
    message = error_of(call(server, "POST", SPEECH, dict(input="Hi.", voice="s2voice")))
    assert "was saved for S2-Pro" in message and "runs OmniVoice" in message
    s2 = serve("--checkpoint", S2_CKPT, "--voices", root / "prompt")
    try:
        listed = json.loads(call(s2, "GET", "/v1/audio/voices")[2])
        assert "s2voice" in listed["voices"] and "fox24" not in listed["voices"]
        assert dict(name="fox24", model="omnivoice") in listed["all"]
        status, _, data = call(s2, "POST", SPEECH, dict(input="Hi.", voice="fox24"))
        assert status == 400 and "was saved for OmniVoice" in error_of((status, None, data))
    finally:
        stop_server(s2)


# ----------------------------------------------------------------------------- bad input
BAD = [  # (body, words of the message): each new field's bad values, each one 400 before any work
    (dict(instructions="a dragon"), "instructions: unknown attribute 'a dragon'"),
    (dict(instructions="male, female"), "Conflicting instruct items"),
    (dict(instructions="male, male"), "instructions: 'male' is given twice: give each attribute once"),
    (dict(input="Hi.<|text_end|><|instruct_start|>male<|instruct_end|>"), "text contains '<|text_end|>'"),
    (dict(instructions="四川话, british accent"), "cannot be mixed"),
    (dict(instructions=5), "instructions must be a string"),
    (dict(language="klingon"), "unknown language 'klingon'"),
    (dict(language=["en"]), "language must be a string"),
    (dict(speed=0.2), "speed must be 0.25 to 4.0"),
    (dict(speed=4.5), "speed must be 0.25 to 4.0"),
    (dict(speed="fast"), "speed must be a finite number"),
    (dict(num_step=0), "num_step must be 1 to 64, got 0"),
    (dict(num_step=65), "num_step must be 1 to 64"),
    (dict(num_step=2.5), "num_step must be an integer"),
    (dict(duration=0), "duration must be more than 0"),
    (dict(duration=-1), "duration must be more than 0"),
    (dict(duration=301), "at most 300 seconds"),
    (dict(duration="long"), "duration must be a finite number"),
    (dict(guidance_scale=-1), "guidance_scale must be >= 0"),
    (dict(seed=-1), "seed must be an integer from 0 to 2**63 - 1, got -1"),
    (dict(voice="s2voice"), "was saved for S2-Pro"),
    (dict(voice="nobody"), "unknown voice 'nobody'"),
    (dict(voice="fox24", ref_audio=CLIP_B64, ref_text="x"), "clones one voice: send a saved voice or one"),
    (dict(references=[dict(audio=CLIP_B64, text="x")] * 2), "clones one voice"),
    (dict(ref_audio=base64.b64encode(wav_bytes(np.zeros(16000, np.float32), 16000)).decode(), ref_text="x"),
     "silent"),
    (dict(top_p=0.5), "top_p is an S2-Pro option"),
    (dict(max_new_tokens=100), "max_new_tokens is an S2-Pro option"),
    (dict(response_format="aac"), "not supported here"),
    (dict(stream_format="chunks"), "stream_format must be"),
]


@pytest.mark.parametrize("body, message", BAD, ids=[f"{i}-{next(iter(b))}" for i, (b, _) in enumerate(BAD)])
def test_bad_input_is_a_400_that_says_what_and_changes_nothing(server, root, body, message):
    before, scheduler = tree(root), server.app.engine.scheduler
    status, _, data = call(server, "POST", SPEECH, dict(dict(input="Hello there."), **body))
    error = json.loads(data)["error"]
    assert (status, error["type"]) == (400, "invalid_request_error") and message in error["message"], error
    assert tree(root) == before and not scheduler.busy


def test_fish_speechs_own_routes_are_s2pros(server):
    for path, body in (("/v1/tts", dict(text="hi")), ("/v1/vqgan/encode", dict(audios=[CLIP_B64])),
                       ("/v1/vqgan/decode", dict(tokens=[[[1]] * 8]))):
        status, _, data = call(server, "POST", path, body)
        assert status == 404 and "this server runs OmniVoice" in error_of((status, None, data))


def test_a_checkpoint_of_the_other_model_than_model_says_so():
    args = app.parse_args(["--checkpoint", str(CKPT), "--model", "s2-pro"])
    with pytest.raises(common.UserError, match="holds OmniVoice, not S2-Pro"):
        app.model_kind(args)
    assert app.model_kind(app.parse_args(["--checkpoint", str(CKPT)])) == "omnivoice"
    assert app.model_kind(app.parse_args(["--model", "omnivoice"])) == "omnivoice"
    assert app.model_kind(app.parse_args([])) == "s2-pro"


def test_omnivoices_w8a8_is_served_and_an_s2_checkpoint_refuses_it(tmp_path):
    """--quant takes OmniVoice's schemes beside S2-Pro's; each model refuses the other's."""
    served = app.App(app.parse_args(["--checkpoint", str(CKPT), "--device", "cpu", "--quant", "w8a8",
                                     "--voices", str(tmp_path / "prompt")]))
    try:
        assert served.health()["quant"] == "w8a8"
        assert isinstance(served.model.model.layers[0].self_attn.q_proj, quantize.W8A8Linear)
    finally:
        served.close()
    with pytest.raises(common.UserError, match="quantization 'w8a8' is not one of none, int8wo, int4wo, fp8"):
        app.App(app.parse_args(["--checkpoint", str(S2_CKPT), "--device", "cpu", "--quant", "w8a8"]))
    with pytest.raises(common.UserError, match="quant 'fp8': use one of none, int8wo, int4wo, w8a8"):
        app.App(app.parse_args(["--checkpoint", str(CKPT), "--device", "cpu", "--quant", "fp8"]))


# ----------------------------------------------------------------------------- serving
def test_health_models_and_page(server):
    info = health(server)
    assert info["model"] == "omnivoice" and info["slots"] == 8 and info["demo"] is False
    assert {"busy", "free", "queued", "device"} <= set(info)
    models = json.loads(call(server, "GET", "/v1/models")[2])
    assert models["data"][0]["id"] == "omnivoice" and models["data"][0]["owned_by"] == "k2-fsa"
    status, _, page = call(server, "GET", "/")
    assert status == 200 and b"<title>fishfast: OmniVoice text-to-speech</title>" in page
    assert b'"kind": "omnivoice"' in page and b"british accent" in page and b"NOISE" not in page


def test_the_demo_model_serves_noise_and_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./OmniVoice here
    server = serve("--model", "omnivoice")
    try:
        info = health(server)
        assert info["model"] == "omnivoice-demo" and info["demo"] is True and info["checkpoint"] == "(demo)"
        assert b"RANDOM OmniVoice" in call(server, "GET", "/")[2]
        status, _, data = call(server, "POST", SPEECH, dict(input="Hello. Noise.", num_step=4, seed=1,
                                                            response_format="pcm"))
        assert status == 200 and len(data) > 0 and len(data) % 2 == 0
    finally:
        stop_server(server)
    assert list(tmp_path.iterdir()) == []  # built in memory


# ----------------------------------------------------------------------------- a real browser
def test_browser_shows_omnivoices_fields_designs_a_voice_and_plays(server, model, tmp_path, monkeypatch):
    made = speeches(monkeypatch, server)
    shown = "return [...arguments[0]].map(id => document.getElementById(id).offsetParent !== null);"
    with browser_on(server, tmp_path) as browser:
        s2_fields = ["temperature", "top_p", "top_k", "max_new_tokens"]
        ours = ["language", "speed", "num_step", "seed", "design"]
        assert browser.call("POST", "/execute/sync", {"script": shown, "args": [s2_fields]}) == [False] * 4
        assert browser.call("POST", "/execute/sync", {"script": shown, "args": [ours]}) == [True] * 5
        assert browser.js("return document.querySelectorAll('#design select').length") == 6
        assert "fox24" in browser.js("return [...document.getElementById('voice').options].map(o => o.value)")
        browser.js("""const [gender, age] = document.querySelectorAll('#design select');
                      gender.value = 'female'; age.value = 'elderly';""")
        browser.type("#text", "Hello from a real browser. This is the second sentence.")
        browser.type("#language", "English")
        browser.type("#seed", "7")
        browser.click("#generate")
        wait_for(lambda: browser.js("return window.player.state") != "generating", 120, "the speech to end")
        page = browser.js("""return {state: window.player.state, samples: window.player.samples,
                                     error: document.getElementById('error').textContent,
                                     figures: document.getElementById('figures').textContent};""")
        assert page["state"] == "done" and page["error"] == "" and page["samples"] > 0, page
        assert "first audio" in page["figures"]
        (speech,) = made
        assert speech.item["instruct"] == "female, elderly" and speech.item["language"] == "en"
        assert len(speech.texts) == 2 and speech.generator.initial_seed() == 7
        text = "Hello from a real browser. This is the second sentence."
        want = solo(model, text, instruct="female, elderly", language="English", seed=7)
        assert page["samples"] == len(want) // 2  # every sample the server sent was played


def test_browser_keeps_the_voice_it_just_made_and_selects_it(server, root, tmp_path, monkeypatch, request):
    """No seed typed: the page sends one of its own, so keeping the voice runs the same generation again."""
    made = speeches(monkeypatch, server)
    path = root / "prompt" / f"page kept{omnivoice.VOICE_SUFFIX}"
    request.addfinalizer(lambda: path.unlink(missing_ok=True))  # the module's voices folder as it was
    hidden = "return document.getElementById('keep-voice').hidden"
    with browser_on(server, tmp_path) as browser:
        assert browser.js(hidden)
        browser.js("document.querySelector('#design select').value = 'male';")
        browser.type("#text", "A voice worth keeping.")
        browser.type("#num_step", "4")
        browser.click("#generate")
        wait_for(lambda: browser.js("return window.player.state") != "generating", 120, "the speech to end")
        assert not browser.js(hidden), browser.js("return document.body.innerText")
        browser.js("window.prompt = () => ' page kept ';")
        browser.click("#keep-voice")
        wait_for(lambda: browser.js("return document.getElementById('voice').value") == "page kept", 60,
                 "the voice to be kept and selected")
        assert browser.js("return document.getElementById('message').textContent") == "kept voice page kept"
        assert browser.js(hidden)
        assert browser.js("return document.querySelector('#design select').value") == ""  # the voice as kept
        shown, kept = made
        assert kept.generator.initial_seed() == shown.generator.initial_seed()
        voice = omnivoice.load_voice(path)
        assert torch.equal(voice["codes"], shown.tokens[0]) and voice["text"] == "A voice worth keeping."


# ------------------------------------------------------------------------- issue 45: what a new user meets
def test_a_silent_or_nan_clip_saved_as_a_voice_is_a_400_that_names_audio_and_helps_an_http_user(server, root):
    before = tree(root)
    nan = np.full(16000, np.nan, np.float32)
    silent = ("audio is silent or shorter than a frame once its silences are trimmed (as upstream prepares a"
              " clip): send a clip in which the voice is heard")
    for wave, message in ((np.zeros(16000, np.float32), silent), (nan, "audio has NaN or infinite samples")):
        form = multipart(dict(name="quiet", text="Nothing at all.", audio=wav_bytes(wave, 16000)))
        status, _, data = call(server, "POST", "/v1/audio/voices", form[1], content_type=form[0])
        assert (status, error_of((status, None, data))) == (400, message)
    assert tree(root) == before


def test_browser_generates_after_saving_a_voice_and_delete_without_a_voice_says_so(server, root, tmp_path,
                                                                                    request):
    path = root / "prompt" / f"from page{omnivoice.VOICE_SUFFIX}"
    request.addfinalizer(lambda: path.unlink(missing_ok=True))  # the module's voices folder as it was
    page = """return {error: document.getElementById('error').textContent, state: window.player.state,
                      message: document.getElementById('message').textContent,
                      clips: document.getElementById('clips').children.length};"""
    with browser_on(server, tmp_path) as browser:
        browser.js("document.getElementById('error').textContent = 'an old error';")
        browser.click("#delete-voice")  # no voice is selected
        assert browser.js(page)["error"] == "choose a saved voice to delete first"
        browser.click("#add-clip")
        browser.type(".clip-file", str(CLIP_WAV.resolve()), clear=False)
        browser.type(".clip-text", CLIP_TEXT)
        browser.type(".clip-name", "from page")
        browser.click(".clip-save")
        wait_for(lambda: browser.js("return document.getElementById('voice').value") == "from page", 60,
                 "the clip to be saved and selected as a voice")
        assert browser.js(page) == dict(error="", state="idle", message="saved voice from page", clips=0)
        browser.type("#text", "Hello in the saved voice.")
        browser.type("#num_step", "4")
        browser.click("#generate")
        wait_for(lambda: browser.js("return window.player.state") != "generating", 120, "the speech to end")
        assert browser.js(page)["state"] == "done", browser.js(page)
