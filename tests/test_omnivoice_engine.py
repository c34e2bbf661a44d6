"""omnivoice.py's serving side: the step engine (Scheduler, on a common.EngineThread: requests batched, each
with its own random stream), sentence streaming (Speech, and omnivoice_text's split_sentences) and the
streamed cross-fade (CrossFade), against generate() and upstream's goldens on the tiny checkpoint."""
import threading

import numpy as np
import pytest
import torch

import common
import omnivoice
import omnivoice_text
from conftest import OV_CASES as CASES, OV_CKPT as CKPT, OV_GOLDEN as GOLDEN, ov_golden as golden
from test_omnivoice import api_kwargs  # a golden case's generate() arguments, its voices read

SR = 24000


@pytest.fixture(scope="module")
def model():
    return omnivoice.load(CKPT)


@pytest.fixture(scope="module")
def voice():
    return omnivoice.load_voice(GOLDEN / "prompt_ref24.pt")  # the goldens' clone prompt


# ----------------------------------------------------------------------------- the streamed cross-fade
@pytest.mark.parametrize("pad, fade", [(0.1, 0.1), (0.05, 0.02), (0.0, 0.25)])  # defaults, alt_params', long
@pytest.mark.parametrize("lengths", [[5000], [100], [0], [0, 0], [30000, 200, 5000], [2400, 2400, 2400],
                                     [10, 7000, 3], [48000, 0, 12000], [4800, 2400], [7200, 7201],
                                     [2600, 3000], [2600]])  # the last two: a fade-in sent in two parts
def test_the_streamed_cross_fade_is_upstreams_join_exactly(lengths, pad, fade):
    """Chunk by chunk, the same samples as fade_and_pad(cross_fade_chunks(all of them)), bit for bit, for
    chunks shorter than the fades too (the first ones then wait); fades shorter and longer than the
    cross-fade's 0.1 s."""
    rng = np.random.default_rng(len(lengths))
    chunks = [rng.standard_normal(n).astype(np.float32) for n in lengths]
    joined = omnivoice_text.cross_fade_chunks([c[None] for c in chunks], SR)
    want = omnivoice_text.fade_and_pad(joined, pad, fade, SR)[0]
    join = omnivoice.CrossFade(SR, pad, fade)
    pieces = [join.push(chunk) for chunk in chunks]
    got = np.concatenate([*pieces, join.end()])
    assert got.dtype == np.float32 and np.array_equal(got, want)
    held = max(int(0.1 * SR), int(fade * SR))  # what the next chunk, or the end, fades out
    if lengths[0] >= 2 * held:  # a long first chunk is sent at once, but for that
        assert len(pieces[0]) == int(pad * SR) + lengths[0] - held


def test_the_cross_fade_leaves_the_chunks_it_is_given_alone():
    chunk = np.ones(10000, np.float32)
    join = omnivoice.CrossFade(SR, 0.1, 0.1)
    join.push(chunk)
    join.push(chunk)
    join.end()
    assert (chunk == 1).all()


# ----------------------------------------------------------------------------- sentences
def test_text_is_cut_at_sentence_ends_not_at_commas_nor_abbreviations():
    text = "Hello there, Dr. Smith! How are you? Fine, thanks. 你好，世界！今天天气很好。"
    assert omnivoice_text.split_sentences(text, 1000) == ["Hello there, Dr. Smith!", "How are you?",
                                                          "Fine, thanks.", "你好，世界！", "今天天气很好。"]
    assert omnivoice_text.split_sentences("No end mark at all", 1000) == ["No end mark at all"]


def test_a_sentence_longer_than_upstreams_chunk_is_cut_as_upstream_cuts_one():
    long = "One clause here, another clause there, and a third to end it."
    assert omnivoice_text.split_sentences(f"Short. {long}", 20) == [
        "Short.", *omnivoice_text.chunk_text_punctuation(long, 20)]
    assert omnivoice_text.chunk_text_punctuation(long, 20) == ["One clause here,", "another clause there,",
                                                               "and a third to end it."]


@pytest.mark.parametrize("case", ["long_chunked_ref", "long_chunked_noref"])
def test_sentence_streaming_gives_upstreams_chunked_codes(model, case):
    """The goldens' long text in 4 chunks (with upstream's chunk length, 1.2 s here): spoken sentence by
    sentence, each sentence gets upstream's chunk's codes, with the voice or (without one) conditioned on
    the first chunk's codes and text."""
    spec, kwargs = CASES["generate"][case], api_kwargs(case)
    kwargs.pop("audio_chunk_threshold")  # a Speech always goes sentence by sentence
    speech = omnivoice.Speech(model, omnivoice.Scheduler(model), seed=spec["seed"], **kwargs)
    audio = np.concatenate(list(speech))
    assert len(speech.texts) == len(spec["token_files"]) == 4
    for codes, name in zip(speech.tokens, spec["token_files"], strict=True):
        assert torch.equal(codes, golden(name)), name
    assert audio.dtype == np.float32 and np.isfinite(audio).all() and audio.size > 0
    assert speech.done and not speech.cancelled


@pytest.mark.parametrize("case", ["clone", "design", "auto", "speed", "duration", "nonverbal"])
def test_one_sentence_is_generates_own_request(model, case):
    """A text of one sentence: generate()'s item, codes and audio, bit for bit."""
    spec, kwargs = CASES["generate"][case], api_kwargs(case)
    audios, tokens = omnivoice.generate(model, **kwargs, seed=spec["seed"], return_tokens=True)
    speech = omnivoice.Speech(model, omnivoice.Scheduler(model), seed=spec["seed"], **kwargs)
    audio = np.concatenate(list(speech))
    assert speech.texts == [kwargs["text"]] and torch.equal(speech.tokens[0], golden(spec["token_files"][0]))
    assert torch.equal(speech.tokens[0], tokens[0]) and np.array_equal(audio, audios[0])


def test_one_sentence_with_a_duration_is_exactly_as_long_as_generates(model):
    """plan() turns a duration into a speed from its whole-frame estimate: a chunk's length estimated again
    from that speed may miss by one (133 frames for 5.3 s here); one sentence keeps generate()'s length."""
    _, [codes] = omnivoice.generate(model, "Thank you very much!", duration=5.3, seed=2, num_step=4,
                                    return_tokens=True)
    speech = omnivoice.Speech(model, omnivoice.Scheduler(model), "Thank you very much!", duration=5.3, seed=2,
                              num_step=4)
    list(speech)
    assert codes.shape[1] == 132 and torch.equal(speech.tokens[0], codes)


def test_the_first_sentence_comes_before_the_next_is_unmasked(model, voice):
    scheduler = omnivoice.Scheduler(model)
    speech = omnivoice.Speech(model, scheduler, "First one here. Then a second. And a third.", voice=voice,
                              seed=3, num_step=8)
    pieces = iter(speech)
    first = next(pieces)
    assert first.size > 0 and len(speech.tokens) == 1 and len(speech.texts) == 3
    assert speech.job.step == 0 and not speech.job.done  # the second sentence: submitted, not yet run
    rest = list(pieces)
    assert len(speech.tokens) == 3 and rest
    again = omnivoice.stream(model, "First one here. Then a second. And a third.", voice=voice, seed=3,
                             num_step=8)
    assert np.array_equal(np.concatenate([first, *rest]), np.concatenate(list(again)))


def test_a_cancelled_speech_stops_and_says_nothing_more(model):
    scheduler = omnivoice.Scheduler(model)
    speech = omnivoice.Speech(model, scheduler, "One. Two sentences. Three of them.", seed=1, num_step=4)
    pieces = iter(speech)
    next(pieces)
    speech.cancel()
    assert list(pieces) == [] and speech.done and len(speech.tokens) == 1
    assert not scheduler.busy  # the sentence it was unmasking left the batch


@pytest.mark.parametrize("kwargs, message", [
    (dict(text="Hi.", instruct="a dragon"), "unknown attribute"),
    (dict(text="Hi.", language="klingon"), "unknown language"),
    (dict(text="Hi.", speed=0), "speed must be a number > 0"),
    (dict(text="Hi.", num_step=0), "num_step must be an integer >= 1"),
    (dict(text=["a", "b"]), "text must be a string"),
    (dict(text="Hi.", seed=1.5), "seed must be an integer"),
])
def test_a_speech_checks_everything_before_it_queues(model, kwargs, message):
    scheduler = omnivoice.Scheduler(model)
    with pytest.raises(common.UserError, match=message):
        omnivoice.Speech(model, scheduler, **kwargs)
    assert not scheduler.busy


# ----------------------------------------------------------------------------- batches and random streams
def batch_items(model):
    """The golden batch case's two requests, planned."""
    kwargs, gen = api_kwargs("batch"), omnivoice.generation_config({})
    return omnivoice.plan(model, kwargs["text"], kwargs["language"], None, None, kwargs["voice"], None,
                          kwargs["speed"], None, gen), gen


def test_one_generator_for_the_batch_is_upstreams_batch(model):
    """Upstream's batch draws from its one global stream, request after request each step: generate()'s
    batch with seed=S gives its goldens."""
    items, gen = batch_items(model)
    seed = CASES["generate"]["batch"]["seed"]
    codes = omnivoice.unmask(model, items, gen, torch.Generator().manual_seed(seed))
    for got, name in zip(codes, CASES["generate"]["batch"]["token_files"], strict=True):
        assert torch.equal(got, golden(name)), name


def test_a_stream_per_request_gives_each_its_solo_codes_and_upstreams_batch_differs(model):
    """One generator per request (the server's way): each request's codes are the ones it gets alone; in
    upstream's batch (one stream for both) they are not, for the same seed."""
    items, gen = batch_items(model)
    seed = CASES["generate"]["batch"]["seed"]
    alone = [omnivoice.unmask(model, [item], gen, torch.Generator().manual_seed(seed))[0] for item in items]
    together = omnivoice.unmask(model, items, gen, [torch.Generator().manual_seed(seed) for _ in items])
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)
    shared = [golden(name) for name in CASES["generate"]["batch"]["token_files"]]
    for a, b in zip(alone, shared):  # from step 1 on, each draws after the other's draws
        assert not torch.equal(a, b)


@pytest.mark.parametrize("packed", [False, True])
def test_texts_joining_and_leaving_at_other_steps_get_their_solo_codes(model, voice, packed):
    """Requests of other lengths, step counts, options and references, admitted a few steps apart and
    retired when each is done: every one gets what it gets alone."""
    gen = omnivoice.generation_config
    requests = [("Good morning everyone.", dict(voice=voice), gen(dict(num_step=12))),
                ("A longer sentence, with a clause or two, to be said.", dict(), gen(dict(num_step=6))),
                ("Designed.", dict(instruct="male, low pitch"), gen(dict(num_step=9, guidance_scale=1.0))),
                ("Quick!", dict(speed=1.4), gen(dict(num_step=3, class_temperature=0.8)))]

    def job(i):
        text, kwargs, options = requests[i]
        [item] = omnivoice.plan(model, [text], kwargs.get("language"), None, None, kwargs.get("voice"),
                                kwargs.get("instruct"), kwargs.get("speed"), None, options)
        return omnivoice.Unmasking(model, item, options, torch.Generator().manual_seed(10 + i))

    alone = []
    for i in range(len(requests)):
        solo = omnivoice.Scheduler(model, packed=packed)
        alone.append(solo.wait(solo.submit(job(i))))
    scheduler, jobs, sizes = omnivoice.Scheduler(model, max_batch=3, packed=packed), [], []
    forward = scheduler.forward
    scheduler.forward = lambda ids, *rest: sizes.append(len(scheduler.active)) or forward(ids, *rest)
    for i in range(len(requests)):  # one joins every 2 steps; at most 3 run at once
        jobs.append(scheduler.submit(job(i)))
        scheduler.step()
        scheduler.step()
    while scheduler.busy:
        scheduler.step()
    assert max(sizes) == 3 and min(sizes) == 1
    for a, j in zip(alone, jobs, strict=True):
        assert torch.equal(a, j.codes())


def test_the_engine_thread_batches_submitters_and_bounds_its_queue(model):
    scheduler = omnivoice.Scheduler(model, max_batch=2)
    engine = common.EngineThread(scheduler, max_queue=1)
    gen = omnivoice.generation_config(dict(num_step=4))
    [item] = omnivoice.plan(model, ["Hello there."], None, None, None, None, None, None, None, gen)
    gate, release = threading.Event(), threading.Event()
    forward = scheduler.forward
    scheduler.forward = lambda *args: (gate.set(), release.wait(30), forward(*args))[2]
    try:
        jobs = [engine.submit(omnivoice.Unmasking(model, item, gen, torch.Generator().manual_seed(i)))
                for i in range(2)]
        assert gate.wait(30)  # the engine is in a step: two texts run, or wait, and one more may wait
        jobs.append(engine.submit(omnivoice.Unmasking(model, item, gen, torch.Generator().manual_seed(2))))
        assert engine.stats()["slots"] == 2
        with pytest.raises(common.QueueFull):
            engine.submit(omnivoice.Unmasking(model, item, gen, torch.Generator()))
        later = engine.submit(omnivoice.Unmasking(model, item, gen, torch.Generator().manual_seed(3)),
                              new_request=False)  # a request's next sentence is never refused
        jobs[2].cancel()
        release.set()
        solo = omnivoice.Scheduler(model)
        for i, job in ((0, jobs[0]), (1, jobs[1]), (3, later)):
            want = solo.wait(solo.submit(omnivoice.Unmasking(model, item, gen,
                                                             torch.Generator().manual_seed(i))))
            assert torch.equal(engine.wait(job), want)
        assert jobs[2].done and jobs[2].step == 0
    finally:
        release.set()
        engine.close()
    with pytest.raises(common.EngineClosed):
        engine.submit(omnivoice.Unmasking(model, item, gen, torch.Generator()))


def test_a_failed_step_fails_its_texts_and_the_engine_keeps_serving(model):
    scheduler = omnivoice.Scheduler(model)
    engine = common.EngineThread(scheduler)
    gen = omnivoice.generation_config(dict(num_step=2))
    [item] = omnivoice.plan(model, ["Hello there."], None, None, None, None, None, None, None, gen)
    forward = scheduler.forward

    def broken(*args):
        raise RuntimeError("a simulated failure")
    scheduler.forward = broken
    try:
        job = engine.submit(omnivoice.Unmasking(model, item, gen, torch.Generator()))
        with pytest.raises(RuntimeError, match="generation failed: RuntimeError: a simulated failure"):
            job.codes()
        scheduler.forward = forward
        job = engine.submit(omnivoice.Unmasking(model, item, gen, torch.Generator()))
        assert engine.wait(job).shape == (8, item["target_len"])
    finally:
        engine.close()
