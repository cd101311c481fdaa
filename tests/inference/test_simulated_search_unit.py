"""Simulated search (ZeroSearch): the curriculum against its formula, reply parsing, the noisy/useful
draws with a real in-process engine (tiny random Llama through HFEngine), checkpoint state, and
bounded failure when the simulator server is down or hangs. The test against a real vLLM server
lives in tests/inference/test_simulated_search.py (it needs that directory's server fixture)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from inference.simulated_search import SimulatedSearch, SimulatorUnavailable, build_messages, noise_probability, parse_document
from utils.dist import free_port

# --- the curriculum -------------------------------------------------------------------------------


def test_curriculum_values():
    s, e, T = 0.1, 0.7, 200
    assert noise_probability(0, T, s, e) == pytest.approx(s)
    assert noise_probability(T, T, s, e) == pytest.approx(e)
    # b = 4 at half-way: start + (4^0.5 - 1)/3 * (end - start) = a third of the way
    assert noise_probability(T // 2, T, s, e) == pytest.approx(s + (2 - 1) / 3 * (e - s))
    # against the formula at every step, and monotone
    ps = [noise_probability(t, T, s, e) for t in range(T + 1)]
    ref = [s + (4 ** (t / T) - 1) / 3 * (e - s) for t in range(T + 1)]
    assert ps == pytest.approx(ref, abs=1e-12)
    assert all(a < b for a, b in zip(ps, ps[1:]))
    # convex (slow start): below the straight line everywhere inside
    assert all(p < s + t / T * (e - s) for t, p in enumerate(ps) if 0 < t < T)
    # clamped outside [0, T]; a falling schedule and the linear limit b = 1 work too
    assert noise_probability(-5, T, s, e) == pytest.approx(s) and noise_probability(10 * T, T, s, e) == pytest.approx(e)
    assert noise_probability(T // 2, T, 0.8, 0.2) == pytest.approx(0.8 - 0.6 / 3)
    assert noise_probability(50, 100, 0.0, 1.0, base=1.0) == pytest.approx(0.5)
    assert noise_probability(50, 100, 0.0, 1.0, base=2.0) == pytest.approx(2 ** 0.5 - 1)


@pytest.mark.parametrize("args, match", [
    ((0, 0, 0.1, 0.5), "total_steps"),
    ((0, 10, -0.1, 0.5), "start"),
    ((0, 10, 0.1, 1.5), "end"),
    ((0, 10, 0.1, 0.5, 0.0), "base"),
])
def test_curriculum_bad_values(args, match):
    with pytest.raises(ValueError, match=match):
        noise_probability(*args)


# --- prompts and parsing -------------------------------------------------------------------------


def test_prompts_show_question_and_answer_and_differ_by_kind():
    ctx = {"question": "Which city is the capital of France?", "answer": ["Paris", "City of Paris"]}
    useful = build_messages("capital of france", False, ctx, 1, 3)[0]["content"]
    noisy = build_messages("capital of france", True, ctx, 2, 3)[0]["content"]
    assert useful != noisy
    for text in (useful, noisy):
        assert "capital of france" in text and "Which city is the capital of France?" in text
        assert "Paris / City of Paris" in text and "Title:" in text
    assert "never mention" in noisy and "never mention" not in useful
    bare = build_messages("capital of france", False, None, 1, 3)[0]["content"]
    assert "Paris" not in bare and "capital of france" in bare
    proposer = build_messages("eiffel tower", False, {"question": "", "answer": "Paris"}, 1, 3)[0]["content"]
    assert "Paris" in proposer


@pytest.mark.parametrize("reply, title, text", [
    ("Title: Paris\nParis is the capital of France.", "Paris", "Paris is the capital of France."),
    ("**Title:** Paris\n\nText: Paris is the capital.\nIt has 2 million people.", "Paris",
     "Paris is the capital. It has 2 million people."),
    ("<think>let me write</think>\nTitle: \"Paris\"\nThe capital.", "Paris", "The capital."),
    ("Here is a result.\nTitle: Paris\nThe capital.", "Paris", "Here is a result. The capital."),
    ("Paris is the capital of France.", "capital of france", "Paris is the capital of France."),
    ("Title:\nSome text only.", "capital of france", "Some text only."),
    ("Title: The capital of France is Paris.", "capital of france", "The capital of France is Paris."),
    ("Title: Paris", "capital of france", "Paris"),
    ("Title: **Title:** Paris\nThe capital.", "Paris", "The capital."),
])
def test_parse_document(reply, title, text):
    assert parse_document(reply, "capital of france") == (title, text)


@pytest.mark.parametrize("reply", [None, "", "   \n ", "Title:  ", "**Title:**", "<think>only thinking</think>"])
def test_parse_document_without_text(reply):
    assert parse_document(reply, "q") is None


def test_constructor_errors():
    with pytest.raises(ValueError, match="exactly one"):
        SimulatedSearch()
    with pytest.raises(ValueError, match="total_steps"):
        SimulatedSearch(url="http://127.0.0.1:1", total_steps=0)
    with pytest.raises(ValueError, match="noise start"):
        SimulatedSearch(url="http://127.0.0.1:1", noise_start=2.0)
    class NoTemplate:
        class tokenizer:
            chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        SimulatedSearch(engine=NoTemplate())
    SimulatedSearch(engine=NoTemplate(), template="r_search")  # a base model with the plain template is fine
    sim = SimulatedSearch(url="http://127.0.0.1:1", model="m")
    with pytest.raises(ValueError, match="contexts"):
        sim.search(["a", "b"], 2, contexts=[None])
    with pytest.raises(ValueError, match="not a SimulatedSearch state"):
        sim.load_state_dict({"step": 3})
    # the rollout loop looks for the flag on the bound method it is given
    assert sim.wants_context and getattr(sim.search, "wants_context", False)


# --- failures: bounded time, counted, and an outage raised (not "no results") ----------------------


@pytest.mark.timeout(60)
def test_server_down_is_counted_fast_and_raised():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sim = SimulatedSearch(url=url, model="sim", retries=1, timeout_s=2.0, noise_start=0.5, noise_end=0.5)
    sim.client.backoff_s = 0.01
    t0 = time.monotonic()
    with pytest.raises(SimulatorUnavailable, match="all 9 document requests failed"):
        sim.search(["q1", "q2", "q3"], topk=3)
    assert time.monotonic() - t0 < 15
    assert sim.stats == {"queries": 3, "calls": 9, "docs": 0, "noisy": 0, "failures": 9, "unparsed": 0, "empty": 3}
    # model discovery against a dead server fails the whole batch at once
    sim = SimulatedSearch(url=url, retries=0)
    with pytest.raises(SimulatorUnavailable):
        sim.search(["q"], topk=2)
    assert sim.stats["failures"] == 2
    # only empty queries: nothing was asked, so nothing failed
    assert sim.search(["", " "], topk=2) == [[], []]


@pytest.mark.timeout(60)
def test_hanging_server_is_bounded_by_the_timeout():
    # A socket that accepts connections (kernel backlog) and never answers: every read times out.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        url = "http://127.0.0.1:%d" % srv.getsockname()[1]
        sim = SimulatedSearch(url=url, model="sim", retries=0, timeout_s=1.0, max_concurrency=8)
        t0 = time.monotonic()
        with pytest.raises(SimulatorUnavailable):
            sim.search(["a", "b"], topk=2)
        took = time.monotonic() - t0
    assert sim.stats["failures"] == 4 and sim.stats["empty"] == 2
    assert 0.9 < took < 10, took


# --- a real in-process engine: the tiny random Llama through HFEngine -----------------------------


class Recording:
    """Passes generate() through to a real engine and keeps every prompt it was given."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.max_model_len = engine, engine.tokenizer, engine.max_model_len
        self.prompts: list[list[int]] = []

    def generate(self, prompts, sampling):
        self.prompts += [list(p) for p in prompts]
        return self.engine.generate(prompts, sampling)


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    from inference.hf_engine import HFEngine

    return HFEngine(tiny_model_dir, batch_size=32)


def _sim(engine, **kw):
    kw = {"noise_start": 0.0, "noise_end": 1.0, "total_steps": 10, "max_tokens": 8, "seed": 3, **kw}
    return SimulatedSearch(engine=engine, **kw)


@pytest.mark.timeout(300)
def test_engine_documents_have_the_retriever_format(hf_engine):
    eng = Recording(hf_engine)
    sim = _sim(eng, max_tokens=16)
    qs = ["capital of france", "who wrote hamlet"]
    ctx = [{"question": "What is the capital of France?", "answer": "Paris"}, None]
    res = sim.search(qs, topk=3, contexts=ctx)
    assert [len(r) for r in res] == [3, 3] and sim.stats["failures"] == 0 and sim.stats["calls"] == 6
    for q, docs in zip(qs, res):
        for rank, d in enumerate(docs):
            assert set(d) == {"id", "contents", "score", "simulated"}
            assert d["id"].startswith("sim-") and isinstance(d["score"], float) and d["score"] == 1.0 / (rank + 1)
            title, sep, text = d["contents"].partition("\n")
            assert sep and title.strip() and text.strip()
            assert d["simulated"] == "useful"  # step 0: p = start = 0
    # the prompts went through the chat template and carried the context of their own query
    texts = [eng.tokenizer.decode(p) for p in eng.prompts]
    assert all(t.startswith("<|im_start|>") and t.rstrip().endswith("assistant") for t in texts)
    assert all("What is the capital of France?" in t for t in texts[:3])
    assert not any("France" in t for t in texts[3:])
    assert all("whose correct answer is Paris" in t for t in texts[:3])
    # show_answer=False (evaluation): the question is shown, the golden answer is not
    hidden = _sim(eng, show_answer=False)
    start = len(eng.prompts)
    hidden.search(qs[:1], topk=1, contexts=ctx[:1])
    (t,) = [eng.tokenizer.decode(p) for p in eng.prompts[start:]]
    assert "What is the capital of France?" in t and "Paris" not in t
    # an empty query asks for nothing and is counted as empty
    before = dict(sim.stats)
    assert sim.search([""], topk=2) == [[]]
    assert sim.stats["empty"] == before["empty"] + 1 and sim.stats["calls"] == before["calls"]


def test_noise_draws_track_the_curriculum():
    # The draws alone, at scale (plan() is what search() draws with); no LLM involved.
    sim = SimulatedSearch(url="http://127.0.0.1:1", model="m", noise_start=0.2, noise_end=0.8, total_steps=100, seed=1)
    fracs = []
    for step in (0, 25, 50, 75, 100):
        sim.set_step(step)
        jobs = sim.plan([f"q{i}" for i in range(1000)], topk=5)
        assert len(jobs) == 5000 and len({seed for *_, seed in jobs}) > 4900  # engine seeds differ per document
        fracs.append(sum(noisy for _, _, noisy, _ in jobs) / len(jobs))
        # 5000 independent draws: 4 sd of the fraction is <= 0.028
        assert abs(fracs[-1] - noise_probability(step, 100, 0.2, 0.8)) < 0.028, (step, fracs[-1])
    assert fracs == sorted(fracs) and abs(fracs[2] - 0.4) < 0.028  # b = 4: a third of the way at T/2
    assert [j[:2] for j in sim.plan(["a", "", "b"], 2)] == [(0, 0), (0, 1), (2, 0), (2, 1)]  # empty query: no request


@pytest.mark.timeout(300)
def test_noisy_flags_come_from_the_noisy_prompt(hf_engine):
    eng = Recording(hf_engine)
    sim = _sim(eng, noise_start=0.2, noise_end=0.8, total_steps=100)
    twin = _sim(hf_engine, noise_start=0.2, noise_end=0.8, total_steps=100)  # same seed: the same draws
    sim.set_step(50)
    twin.set_step(50)
    qs = [f"query {i}" for i in range(15)]
    res = sim.search(qs, topk=4)
    assert all(len(r) == 4 for r in res) and sim.stats["failures"] == 0  # so docs map one to one onto requests
    flags = [d["simulated"] == "noisy" for r in res for d in r]
    assert flags == [noisy for _, _, noisy, _ in twin.plan(qs, 4)]
    # each document was written from the prompt of its own kind
    assert flags == ["poor match" in eng.tokenizer.decode(p) for p in eng.prompts]
    assert 0 < sum(flags) < len(flags) and sim.stats["noisy"] == sum(flags) and sim.stats["docs"] == 60

    # p = 0 and p = 1 exactly
    lo = _sim(hf_engine, noise_start=0.0, noise_end=0.0)
    hi = _sim(hf_engine, noise_start=1.0, noise_end=1.0)
    assert all(d["simulated"] == "useful" for r in lo.search(qs[:3], 2) for d in r)
    assert all(d["simulated"] == "noisy" for r in hi.search(qs[:3], 2) for d in r)
    assert hi.stats["noisy"] == hi.stats["docs"] == 6


@pytest.mark.timeout(300)
def test_state_dict_resumes_the_same_draws(hf_engine):
    a = _sim(hf_engine, noise_start=0.5, noise_end=0.5, seed=7)
    a.search(["warm up"], topk=3)
    a.set_step(4)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    first = a.search(["x", "y"], topk=3)

    b = _sim(hf_engine, noise_start=0.5, noise_end=0.5, seed=123)
    b.load_state_dict(state)
    assert b.step == 4 and b.stats["docs"] == 3
    again = b.search(["x", "y"], topk=3)
    # same noise draws and same engine seeds -> the same documents
    assert again == first
    assert [d["simulated"] for r in again for d in r] == [d["simulated"] for r in first for d in r]
    # a different seed gives different draws somewhere
    c = _sim(hf_engine, noise_start=0.5, noise_end=0.5, seed=8)
    c.search(["warm up"], topk=3)
    assert c.search(["x", "y"], topk=3) != first


@pytest.mark.timeout(120)
def test_engine_failure_and_oversized_prompt_are_counted(hf_engine, tiny_model_dir):
    class Broken:
        tokenizer = hf_engine.tokenizer
        max_model_len = 4096

        def generate(self, prompts, sampling):
            raise RuntimeError("engine crashed")

    sim = _sim(Broken())
    with pytest.raises(SimulatorUnavailable, match="RuntimeError: engine crashed") as err:
        sim.search(["a", "b"], topk=2)
    assert isinstance(err.value.__cause__, RuntimeError)  # the engine's own error, for the log
    assert sim.stats["failures"] == 4 and sim.stats["empty"] == 2
    # a prompt that cannot fit the engine's context fails alone; the others still come back
    small = Recording(hf_engine)
    small.max_model_len = 400
    sim = _sim(small, max_tokens=8)
    res = sim.search(["short", "long " * 400], topk=2)
    assert [len(r) for r in res] == [2, 0] and sim.stats["failures"] == 2 and len(small.prompts) == 2


@pytest.mark.timeout(120)
def test_an_outage_is_a_failed_search_in_the_rollout(hf_engine):
    # Through the rollout loop: the trajectory records search_failed (the game leaves its group out of
    # the loss) instead of reading an empty <information> block as if the search had found nothing.
    from inference.engine_api import GenOutput
    from inference.prompts import build_solver_prompt
    from inference.rollout import SEARCH_FAILED_TEXT, RolloutConfig, RolloutRequest, run_rollouts

    class Broken:
        tokenizer = hf_engine.tokenizer
        max_model_len = 4096

        def generate(self, prompts, sampling):
            raise RuntimeError("pipeline model parallel group is not initialized")

    class Replay:
        tokenizer, max_model_len = hf_engine.tokenizer, 4096

        def __init__(self, turns):
            self.turns = list(turns)

        def generate(self, prompts, sampling):
            text = self.turns.pop(0)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return [GenOutput(ids, [-1.0] * len(ids), text, "stop", text[text.rfind("</"):]) for _ in prompts]

    sim = _sim(Broken())
    prompt = build_solver_prompt(hf_engine.tokenizer, "Who wrote Hamlet?")
    (t,) = run_rollouts(Replay(["<search> Hamlet author </search>", "<answer> x </answer>"]),
                        [RolloutRequest("solver", "g", prompt, question="Who wrote Hamlet?")], sim.search,
                        RolloutConfig(topk=2, max_info_tokens=64))
    assert t.search_failed == 1 and SEARCH_FAILED_TEXT.strip() in t.response_text
