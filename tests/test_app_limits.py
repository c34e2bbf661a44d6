"""Every request's work bounded (issue 45, items 1-5): frames per sentence and per request on both models,
a client's FIN frees its row, slow headers and bodies cut at a total deadline, connections per client
address capped, long values cut short in errors. Real servers on 127.0.0.1, real sockets."""
import base64
import http.client
import io
import json
import re
import select
import socket
import threading
import time

import numpy as np
import pytest
import soundfile as sf
import torch

import app
import common
import dualAR
import omnivoice
import omnivoice_text
from conftest import OV_CKPT, running, stop_server
from test_app import (NATIVE_PCM, SPEECH, call, check_connection_cap, health, peak_mb, post_bytes, reset_peak,
                      server_process, start_server, wait_for)
from test_app_omnivoice import CLIP_WAV, speeches, start_server as start_omnivoice
from test_metrics import request_key, scrape, series


@pytest.fixture(scope="module")
def ov_server(tmp_path_factory):
    yield from running(start_omnivoice(tmp_path_factory.mktemp("limits"), "--slots", "2"))


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """The tiny S2-Pro with a 1 s deadline for headers and for bodies, and 2 connections per client."""
    flags = "--header-timeout", "1", "--body-timeout", "1", "--max-connections-per-client", "2"
    yield from running(start_server(tmp_path_factory.mktemp("strict"), *flags))


def error_of(data: bytes) -> str:
    return json.loads(data)["error"]["message"]


def clip_b64(seconds: float) -> str:
    """The fixture's 2.45 s clip repeated to `seconds`, as a base64 WAV."""
    samples, rate = sf.read(CLIP_WAV, dtype="float32")
    out = io.BytesIO()
    sf.write(out, np.tile(samples, int(np.ceil(seconds * rate / len(samples))))[:int(seconds * rate)], rate,
             format="WAV", subtype="PCM_16")
    return base64.b64encode(out.getvalue()).decode()


# ----------------------------------------------------------------------------- frames per sentence
def test_a_run_without_punctuation_is_cut_at_the_chunk_length_and_sentences_are_not():
    assert [len(p) for p in omnivoice_text.split_sentences("a" * 4096, 300)] == [293] * 13 + [287]
    words = omnivoice_text.split_sentences("word " * 200, 100)  # cut at a space: no word is split
    assert all(len(p) <= 100 for p in words) and " ".join(words) == ("word " * 200).strip()
    sentence = "A sentence under twice the chunk length stays whole."  # as upstream leaves it
    assert omnivoice_text.split_sentences(sentence, len(sentence) // 2) == [sentence]
    assert omnivoice_text.split_sentences("Hello there my friend", 1) == ["Hello there my friend"]  # MIN_CUT


@pytest.fixture(scope="module")
def ov_model():
    return omnivoice.load(OV_CKPT)


def test_generate_cuts_a_long_run_into_chunks_as_a_speech_does(ov_model):
    """generate's path for a text past audio_chunk_threshold (chunked): 600 letters, 40 s, in 3 chunks."""
    gen = omnivoice.generation_config(dict(num_step=1))
    items = omnivoice.plan(ov_model, ["a" * 600], None, None, None, None, None, None, None, gen)
    [chunks] = omnivoice.chunked(ov_model, items, gen, torch.Generator().manual_seed(0))
    assert [c.shape[1] for c in chunks] == [354] * 3  # 200 letters each: 14 s


def test_a_long_sentence_is_spoken_in_chunks_with_the_servers_peak_memory_barely_moving(tmp_path):
    """2000 letters without punctuation (estimated 132 s) were one sentence of 3,300 frames: its logits and
    attention took gigabytes (4096 letters: 4.6 GB on the real model). Cut at the chunk length, each
    sentence is <= 15 s: the peak stays near that of one sentence of 19 s (290 letters, which nothing
    cuts)."""
    with server_process(tmp_path, "--checkpoint", OV_CKPT) as (process, address):
        body = dict(input="a" * 290, num_step=2, seed=1, response_format="pcm")
        assert call(address, "POST", SPEECH, body)[0] == 200
        reset_peak(process)
        before = peak_mb(process)
        status, _, data = call(address, "POST", SPEECH, dict(body, input="a" * 2000))
        grew = peak_mb(process) - before
        assert status == 200 and 130 < len(data) / 2 / 24000 < 150  # with the silences between sentences
        # one sentence of 3,300 frames took ~700 MB more; chunked, what is left is the next sentence's
        # unmasking while the last one is decoded, and the allocator's
        assert grew < 100, f"the server's peak memory grew by {grew:.0f} MB"


# ----------------------------------------------------------------------------- frames per request
@pytest.mark.parametrize("body, message", [
    (dict(input="一" * 4096), "this request would make 868 s of audio, at most 300 s are allowed"),
    (dict(input="Hello there, my friend. " * 60, speed=0.25), "would make 1678 s of audio, at most 300 s"),
    (dict(input="a. " * 1300), "would make 1559 s of audio, at most 300 s"),  # each short one lengthened
    (dict(input="Hello there.", duration=300), "a sentence of this request would last 300 s, at most 60 s"),
], ids=["cjk", "slow", "short-sentences", "stretched"])
def test_a_request_over_the_caps_is_a_400_that_names_them(ov_server, body, message):
    status, _, data = call(ov_server, "POST", SPEECH, dict(body, response_format="pcm"))
    assert status == 400 and message in error_of(data) and "transcript" not in error_of(data)
    assert health(ov_server)["busy"] == 0


def test_a_short_transcript_of_a_long_clip_is_refused_with_peak_memory_barely_moving(tmp_path):
    """ref_text "x" for a 12 s clip: 190 frames a letter. One sentence of four words would be 139 s (the
    sentence cap), twenty "Hi." 374 s (the request cap), each under the sentence cap."""
    clip = clip_b64(12)
    with server_process(tmp_path, "--checkpoint", OV_CKPT) as (process, address):
        honest = dict(input="Hello.", ref_audio=clip, ref_text="The quick brown fox jumps. " * 5, num_step=2,
                      response_format="pcm")
        assert call(address, "POST", SPEECH, honest)[0] == 200  # the allocator's first growth
        reset_peak(process)
        before = peak_mb(process)
        assert call(address, "POST", SPEECH, honest)[0] == 200
        honest_grew = peak_mb(process) - before  # decoding and encoding the clip, then 1 s of speech
        reset_peak(process)
        before = peak_mb(process)
        for text, cap in [("Hello there my friend", "would last 139 s, at most 60 s"),
                          ("Hi. " * 20, "would make 374 s of audio, at most 300 s")]:
            status, _, data = call(address, "POST", SPEECH, dict(honest, ref_text="x", input=text))
            assert status == 400 and cap in error_of(data), (status, data[:300])
            assert "a reference transcript shorter than what its clip says" in error_of(data)
        grew = peak_mb(process) - before
        # a 139 s sentence unmasked took 716 MB more; what is left is the allocator's (a thread each)
        assert grew < honest_grew + 100, f"the server's peak memory grew by {grew:.0f} MB ({honest_grew:.0f})"


def test_a_speech_is_refused_past_max_frames_before_any_work(ov_model):
    """The caps are on what its sentences make: exactly that much is taken, a frame less is refused."""
    scheduler, rate = omnivoice.Scheduler(ov_model), ov_model.frame_rate
    text = "One sentence here. And another one there."
    speech = omnivoice.Speech(ov_model, scheduler, text, seed=0, num_step=1)
    list(speech)
    total, longest = (f(codes.shape[1] for codes in speech.tokens) for f in (sum, max))
    omnivoice.Speech(ov_model, scheduler, text, max_frames=total, max_sentence_frames=longest).cancel()
    scheduler.step()  # the cancelled one leaves
    for caps, message in [(dict(max_frames=total - 1), f"would make .* at most {(total - 1) / rate:g} s"),
                          (dict(max_sentence_frames=longest - 1),
                           f"would last .* at most {(longest - 1) / rate:g} s")]:
        with pytest.raises(common.UserError, match=message):
            omnivoice.Speech(ov_model, scheduler, text, **caps)
        assert not scheduler.busy  # nothing was submitted


def test_an_s2_request_stops_at_max_frames_across_its_text_batches(model):
    text = "<|speaker:0|>One turn here. <|speaker:1|>Another turn there. <|speaker:0|>And a third one."
    codes = dualAR.generate(model, text, seed=3, max_new_tokens=8, chunk_length=1)
    assert codes.size(1) == 3 * 7  # three batches of 7 frames (the 8th is dropped)
    capped = dualAR.generate(model, text, seed=3, max_new_tokens=8, chunk_length=1, max_frames=10)
    assert capped.size(1) == 10 and codes[:, :10].equal(capped)


def test_the_s2_server_caps_a_request_at_the_duration_cap(monkeypatch, tmp_path):
    server = start_server(tmp_path)
    try:
        monkeypatch.setattr(app, "MAX_DURATION", 1)  # 21 frames of S2-Pro's 44.1 kHz / 2048
        for path, body in [(SPEECH, dict(input="Hello.", seed=1, max_new_tokens=0, **NATIVE_PCM)),
                           ("/v1/tts", dict(text="Hello.", seed=1, max_new_tokens=4000, format="wav"))]:
            status, _, data = call(server, "POST", path, body)
            samples = (len(data) - (44 if path == "/v1/tts" else 0)) // 2  # the WAV's header
            assert status == 200 and samples == 21 * app.HOP, path  # the model would say more
    finally:
        stop_server(server)


# ----------------------------------------------------------------------------- a client that closes
def held_forward(monkeypatch, server, made):
    """The engine's forward blocks after a request's first step, until the returned event is set."""
    release, scheduler = threading.Event(), server.app.engine.scheduler
    forward = scheduler.forward

    def held(*args):
        if made and any(job.step for job in scheduler.active):
            release.wait(30)
        return forward(*args)

    monkeypatch.setattr(scheduler, "forward", held)
    return release


@pytest.mark.parametrize("fmt", ["flac", "pcm"])
def test_a_client_that_closes_cleanly_frees_its_row(ov_server, monkeypatch, fmt):
    """A FIN (close, or shutdown of the client's side) is a hang-up: the row is freed at the next step,
    for a whole file (nothing written yet) and for a stream."""
    made = speeches(monkeypatch, ov_server)
    release = held_forward(monkeypatch, ov_server, made)
    sock = socket.create_connection(ov_server.server_address[:2], timeout=30)
    try:
        sock.sendall(post_bytes(SPEECH, dict(input="One sentence. Then the next. And one more.", seed=1,
                                             response_format=fmt)))
        wait_for(lambda: made and made[0].job.step, 10, "the request to be unmasking")
        sock.shutdown(socket.SHUT_WR)  # our FIN; reading on shows the server's end
        wait_for(lambda: made[0].cancelled, 5, "the FIN to be seen")
        release.set()
        wait_for(lambda: health(ov_server)["busy"] == 0 and made[0].done, 10, "the row to be freed")
        assert len(made[0].tokens) < len(made[0].texts)
        sock.settimeout(10)
        while sock.recv(65536):  # the server closes the connection: no audio after the head, if any
            pass
    finally:
        release.set()
        sock.close()


def test_a_pipelined_request_is_no_hang_up(ov_server):
    """Bytes of a next request on the connection are not an EOF: both requests are answered, alike."""
    one = post_bytes(SPEECH, dict(input="Hello.", seed=1, num_step=2, response_format="flac"))
    with socket.create_connection(ov_server.server_address[:2], timeout=60) as sock:
        sock.sendall(one + one)
        reader, answers = sock.makefile("rb"), []
        for _ in range(2):
            head = b"".join(iter(reader.readline, b"\r\n"))
            length = int(re.search(rb"Content-Length: (\d+)", head)[1])
            answers.append((head.split(b" ")[1], reader.read(length)))
    assert answers[0] == answers[1] and answers[0][0] == b"200" and len(answers[0][1]) > 1000


# ----------------------------------------------------------------------------- slow clients
def trickle(server, pieces: list, every: float) -> tuple:
    """Send `pieces` one every `every` seconds until the server answers -> (its answer, seconds taken for
    it to come)."""
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        start = time.monotonic()
        for piece in pieces:
            sock.sendall(piece)
            if select.select([sock], [], [], every)[0]:
                break
        seconds, answer = time.monotonic() - start, b""
        for data in iter(lambda: sock.recv(65536), b""):
            answer += data
        return answer, seconds


def test_slow_headers_are_cut_at_their_deadline_not_per_read(strict):
    lines = [b"GET /health HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n"] + [b"X-Slow: 1\r\n"] * 20 + [b"\r\n"]
    answer, seconds = trickle(strict, lines, 0.3)  # 7 s in all, each line well within a per-read timeout
    assert answer.startswith(b"HTTP/1.1 408") and "--header-timeout" in error_of(answer.split(b"\r\n\r\n")[1])
    assert 0.9 < seconds < 3


def test_a_slow_body_is_cut_at_its_deadline(strict):
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    answer, seconds = trickle(strict, [head] + [b" "] * 30, 0.2)
    assert answer.startswith(b"HTTP/1.1 408") and "--body-timeout" in error_of(answer.split(b"\r\n\r\n")[1])
    assert 0.9 < seconds < 3


@pytest.mark.parametrize("head, status, method, message", [
    (b"GET /a b HTTP/1.1\r\n", 400, "other", "Bad request syntax ('GET /a b HTTP/1.1')"),
    (b"GET /health HTTP/1.1\r\n" + b"X-Many: 1\r\n" * 101, 431, "GET", "Too many headers"),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", 408, "GET",
     "the request's headers took longer than 1 s (--header-timeout): send it faster")],
    ids=["malformed-request-line", "too-many-headers", "headers-past-their-deadline"])
def test_an_answer_before_dispatch_is_counted_under_route_other(strict, head, status, method, message):
    """Answered while its request line or headers were read: counted in fishfast_requests_total all the
    same, its route `other` (none was read), its method where the request line gave one. Nothing is sent
    past what the server reads before it answers, so the connection ends with a FIN, not a reset."""
    def closed():  # the server counts a connection until its thread ends, which may follow the FIN read
        wait_for(lambda: sum(strict.clients.values()) == 0, 10, "the server's connections closed")

    before = series(scrape(strict))
    closed()
    answer, _ = trickle(strict, [head], 5)
    assert answer.startswith(b"HTTP/1.1 %d " % status) and error_of(answer.split(b"\r\n\r\n")[1]) == message
    closed()  # 2 connections a client: a scrape while both of those still count would be a 429
    after = series(scrape(strict))
    moved = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
    assert moved == {request_key("other", method, status): 1, request_key("/metrics", "GET", 200): 1}


def test_an_idle_keep_alive_connection_is_not_cut_at_the_header_deadline(strict):
    conn = http.client.HTTPConnection(*strict.server_address[:2], timeout=10)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        time.sleep(1.5)  # idle past the header deadline: the next request's deadline starts at its bytes
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_connections_beyond_the_per_client_cap_get_a_429_and_others_are_served(strict):
    def another_client_is_served():
        other = http.client.HTTPConnection(*strict.server_address[:2], timeout=10,
                                           source_address=("127.0.0.2", 0))  # another client address
        other.request("GET", "/health")
        assert other.getresponse().status == 200
        other.close()
    check_connection_cap(strict, 429, "--max-connections-per-client", meanwhile=another_client_is_served)


# ----------------------------------------------------------------------------- long values in errors
def test_instructions_have_a_length_cap_and_errors_echo_little(ov_server):
    status, _, data = call(ov_server, "POST", SPEECH, dict(input="Hi.", instructions="female, " * 12500))
    assert status == 400 and len(data) < 300
    assert error_of(data) == f"instructions has 100000 characters, at most {app.MAX_INSTRUCTIONS} are allowed"
    status, _, data = call(ov_server, "POST", SPEECH, dict(input="Hi.", instructions="zz, " * 49 + "y" * 4))
    message = error_of(data)
    assert status == 400 and message.count("'zz'") == 5 and "and 45 more" in message
    status, _, data = call(ov_server, "POST", SPEECH, dict(input="Hi.", instructions="q" * 200))
    assert status == 400 and f"'{'q' * 39}…'" in error_of(data)


def test_every_error_message_is_cut_at_its_cap():
    status, message, _, _ = app.error_answer(common.UserError("x" * 10**6))
    assert status == 400 and message == "x" * (app.MAX_MESSAGE - 1) + "…"
    assert app.error_answer(common.UserError("short"))[1] == "short"
