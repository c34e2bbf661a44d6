"""GET /metrics (app.Metrics): Prometheus' text format read back by a small parser of its own (HELP and TYPE
lines, samples, escaped label values), counts that move by exactly the requests made, histograms whose
buckets are cumulative, the gauges, the API key; both models, HTTP and Wyoming."""
import io
import json
import re
import socket
import threading
import time
import types

import pytest
import soundfile as sf

import app
import wyoming_server
from conftest import CKPT, OV_CKPT, free_port, serve, stop_server, wyoming_args
from test_app import call, wait_for
from test_wyoming import exchange, pcm_of, synthesize

KEY = {"Authorization": "Bearer secret"}
SPEECH = "/v1/audio/speech"
SAY = {"s2-pro": dict(max_new_tokens=8), "omnivoice": dict(num_step=4)}  # tiny models: short answers
SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(?:,|$)')
SUFFIXES = dict(counter=("",), gauge=("",), histogram=("_bucket", "_sum", "_count"))


# ----------------------------------------------------------------------------- the text format, read back
def parse_labels(text: str) -> tuple:
    labels, pos = {}, 0
    while pos < len(text):
        match = LABEL.match(text, pos)
        assert match, f"bad labels at {text[pos:]!r}"
        labels[match[1]] = re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], match[2])
        pos = match.end()
    return tuple(sorted(labels.items()))


def parse(text: str) -> dict:
    """The text format (0.0.4) -> {family: dict(type, help, samples={(name, labels): value})}: each family's
    HELP, then its TYPE, then its samples, one family after another, no series twice."""
    assert text.endswith("\n")
    families, current = {}, None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, about = line[len("# HELP "):].split(" ", 1)
            assert name not in families and about
            families[name], current = dict(help=about, type=None, samples={}), None
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE "):].split(" ")
            assert families[name]["type"] is None and kind in SUFFIXES
            families[name]["type"], current = kind, name
        else:
            name, labels, value = SAMPLE.fullmatch(line).groups()
            assert current and name in [current + suffix for suffix in SUFFIXES[families[current]["type"]]]
            key = name, parse_labels(labels or "")
            assert key not in families[current]["samples"]
            families[current]["samples"][key] = float(value)  # float reads +Inf too
    return families


def series(families: dict) -> dict:
    return {key: value for family in families.values() for key, value in family["samples"].items()}


def scrape(server, settled=True) -> dict:
    """GET /metrics, parsed. settled: first wait until no request is in flight (one is counted once its
    thread goes on after the last write, which the client may read before that)."""
    if settled:
        wait_for(lambda: server.app.metrics.in_flight == 0, 10, "the requests counted")
    status, headers, data = call(server, "GET", "/metrics", headers=KEY)
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return parse(data.decode())


def check_histograms(families: dict):
    """Each histogram's buckets rise with le, end at +Inf, and +Inf's count is _count."""
    for name, family in families.items():
        if family["type"] != "histogram":
            continue
        models = {dict(labels)["model"] for _, labels in family["samples"]}
        for model in models:
            buckets = sorted((float(dict(labels)["le"]), value) for (sample, labels), value in
                             family["samples"].items() if sample == name + "_bucket")
            counts = [value for _, value in buckets]
            assert buckets[-1][0] == float("inf") and counts == sorted(counts), (name, buckets)
            assert counts[-1] == family["samples"][name + "_count", (("model", model),)]


def request_key(route, method, status) -> tuple:
    return "fishfast_requests_total", (("method", method), ("route", route), ("status", str(status)))


def model_key(name, model, **labels) -> tuple:
    return name, tuple(sorted(dict(labels, model=model).items()))


# ----------------------------------------------------------------------------- Metrics alone
def test_label_values_are_escaped_and_read_back():
    metrics, odd = app.Metrics("s2-pro"), 'a "quoted" back\\slash\nand a new line}'
    metrics.begin()
    metrics.end(odd, "GET", 200)
    families = parse(metrics.render([("fishfast_x", "a gauge", 3)]))
    assert series(families)[request_key(odd, "GET", 200)] == 1
    assert families["fishfast_x"] == dict(help="a gauge", type="gauge", samples={("fishfast_x", ()): 3})
    assert series(families)["fishfast_requests_in_flight", ()] == 0
    assert families["fishfast_audio_seconds_total"]["type"] == "counter"


def test_an_observation_on_a_bound_counts_in_that_bucket_and_every_later_one():
    metrics = app.Metrics("omnivoice")
    metrics.speech("omnivoice", 1.5, 0.25, 7.0)  # 0.25 is a TTFA bound; 7 is above every RTF bound
    metrics.speech("omnivoice", 2.0, None, None)  # no audio came: its seconds alone
    found = series(parse(metrics.render([])))
    ttfa = {le: found[model_key("fishfast_time_to_first_audio_seconds_bucket", "omnivoice", le=le)]
            for le in ("0.1", "0.25", "0.5", "60.0", "+Inf")}
    assert ttfa == {"0.1": 0, "0.25": 1, "0.5": 1, "60.0": 1, "+Inf": 1}
    assert found[model_key("fishfast_real_time_factor_bucket", "omnivoice", le="5.0")] == 0
    assert found[model_key("fishfast_real_time_factor_bucket", "omnivoice", le="+Inf")] == 1
    assert found[model_key("fishfast_real_time_factor_sum", "omnivoice")] == 7.0
    assert found[model_key("fishfast_audio_seconds_total", "omnivoice")] == 3.5
    assert found[model_key("fishfast_time_to_first_audio_seconds_count", "omnivoice")] == 1


# ----------------------------------------------------------------------------- the servers
@pytest.fixture(scope="module", params=["s2-pro", "omnivoice"])
def both(request, tmp_path_factory):
    """Each model's HTTP server with --api-key, and its Wyoming server on the same App."""
    checkpoint = CKPT if request.param == "s2-pro" else OV_CKPT
    http = serve("--checkpoint", checkpoint, "--voices", tmp_path_factory.mktemp("voices"), "--slots", "1",
                 "--api-key", "secret")
    args = wyoming_args(free_port())
    wyoming = app.serve_wyoming(wyoming_server, http.app, args)
    yield types.SimpleNamespace(http=http, port=wyoming.port, app=http.app, kind=request.param)
    wyoming.close()
    stop_server(http)


def test_counts_move_by_exactly_the_requests_made(both):
    server, kind = both.http, both.kind
    before = series(scrape(server))
    began = time.perf_counter()
    status, _, data = call(server, "POST", SPEECH, dict(input="Hello there.", response_format="flac",
                                                        seed=1, **SAY[kind]), headers=KEY)
    wall = time.perf_counter() - began
    assert status == 200
    audio, rate = sf.read(io.BytesIO(data))
    assert call(server, "POST", SPEECH, dict(input=""), headers=KEY)[0] == 400
    assert call(server, "GET", "/health")[0] == 200
    families = scrape(server)
    after = series(families)
    moved = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
    seconds, ttfa, rtf = (moved.pop(model_key(f"fishfast_{name}", kind)) for name in
                          ("audio_seconds_total", "time_to_first_audio_seconds_sum", "real_time_factor_sum"))
    assert seconds == pytest.approx(len(audio) / rate, abs=1e-9) and len(audio) > 0
    assert 0 < ttfa <= wall and 0 < rtf <= wall / seconds
    for name, value in (("time_to_first_audio_seconds", ttfa), ("real_time_factor", rtf)):
        for (sample, labels), bound in [(key, dict(key[1])["le"]) for key in after
                                        if key[0] == f"fishfast_{name}_bucket"]:
            assert moved.pop((sample, labels), 0) == (value <= float(bound)), (name, bound, value)
        assert moved.pop(model_key(f"fishfast_{name}_count", kind)) == 1
    assert moved == {request_key(SPEECH, "POST", 200): 1, request_key(SPEECH, "POST", 400): 1,
                     request_key("/health", "GET", 200): 1, request_key("/metrics", "GET", 200): 1}
    check_histograms(families)
    assert not any(key[0].startswith("fishfast_audio") and dict(key[1])["model"] != kind for key in after)


def test_wyoming_events_are_counted_under_their_own_route(both):
    kind, rate = both.kind, both.app.model.sample_rate
    before = series(scrape(both.http))
    events = exchange(both.port, [synthesize("Hi from Wyoming.", seed=2, **SAY[kind])])
    assert events[-1].type == "audio-stop"
    assert exchange(both.port, [synthesize("")])[-1].type == "error"  # an empty text: a 400's error event
    after = series(scrape(both.http))
    assert after["fishfast_requests_in_flight", ()] == 1
    for status in (200, 400):
        key = request_key("wyoming", "synthesize", status)
        assert after[key] - before.get(key, 0) == 1, status
    moved = after[model_key("fishfast_audio_seconds_total", kind)] - \
        before[model_key("fishfast_audio_seconds_total", kind)]
    assert moved == pytest.approx(len(pcm_of(events)) / 2 / rate, abs=1e-9) and moved > 0
    for name in ("real_time_factor_count", "time_to_first_audio_seconds_count"):
        assert after[model_key(f"fishfast_{name}", kind)] - before[model_key(f"fishfast_{name}", kind)] == 1


def test_the_gauges_are_the_engines_load(both, monkeypatch):
    """The engine held after its first step: one request in the row, two waiting, all three in flight."""
    scheduler, go = both.app.engine.scheduler, threading.Event()
    step = scheduler.step
    monkeypatch.setattr(scheduler, "step", lambda: step() or go.wait(60))
    body = dict(input="Waiting my turn.", response_format="flac", seed=3, **SAY[both.kind])
    threads = [threading.Thread(target=call, args=(both.http, "POST", SPEECH, body, KEY)) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: both.app.engine.stats() == dict(slots=1, busy=1, free=0, queued=2), what="the load")
        found = series(scrape(both.http, settled=False))
    finally:
        go.set()
        for thread in threads:
            thread.join(60)
    assert {name: found[f"fishfast_{name}", ()] for name in ("slots", "slots_busy", "queue_depth")} == \
        dict(slots=1, slots_busy=1, queue_depth=2)
    assert found["fishfast_requests_in_flight", ()] == 4  # the three requests and this scrape
    assert found["fishfast_engine_up", ()] == 1 and found["fishfast_codec_jobs_running", ()] == 0


def test_metrics_need_the_api_key(both):
    before = series(scrape(both.http))
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, answer, data = call(both.http, "GET", "/metrics", headers=headers)
        assert status == 401 and answer["WWW-Authenticate"] == "Bearer" and b"fishfast_" not in data
    refused = request_key("/metrics", "GET", 401)
    assert series(scrape(both.http))[refused] - before.get(refused, 0) == 2


def test_a_request_whose_client_left_before_its_answer_is_a_499(both, monkeypatch):
    """The engine held: the request waits in the queue while its client hangs up."""
    scheduler, go = both.app.engine.scheduler, threading.Event()
    step = scheduler.step
    monkeypatch.setattr(scheduler, "step", lambda: go.wait(60) and step())
    left = request_key(SPEECH, "POST", 499)
    before = series(scrape(both.http)).get(left, 0)
    body = json.dumps(dict(input="Never heard.", response_format="flac", **SAY[both.kind])).encode()
    head = f"POST {SPEECH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer secret\r\n" \
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    try:
        with socket.create_connection(both.http.server_address[:2]) as sock:
            sock.sendall(head.encode() + body)
            wait_for(lambda: both.app.engine.stats()["queued"] == 1, what="the request waiting")
        wait_for(lambda: both.app.engine.stats()["queued"] == 0, what="the request cancelled")
    finally:
        go.set()
    assert series(scrape(both.http))[left] - before == 1
