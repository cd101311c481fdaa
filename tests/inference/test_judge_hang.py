"""A judge that accepts connections and never answers (issue 40, defect 2).

A refused connection fails at once (tests/inference/test_judge.py, test_game.py: dead_url); a hung judge
process costs a full timeout per try. The client's breaker must make an outage cost one wave of timeouts,
not one per call, and the pipeline must send the RAG candidates that are ready together in one call.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import pytest

from inference.data import ProposerRow
from inference.game import GameConfig, play_round
from inference.judge import Judge, JudgeResult
from inference.rollout import RolloutConfig
from tests.scripted_policy import ScriptedPolicy
from utils.text import exact_match

CHAT = [{"role": "user", "content": "Who wrote Hamlet?"}]


class HangingServer:
    """Listens on 127.0.0.1, accepts every connection and never reads or answers: every request times out."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.sock.settimeout(0.05)
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    @property
    def accepted(self) -> int:
        return len(self.conns)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.conns.append(conn)   # held open, never read: the client waits for its timeout

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def hang():
    srv = HangingServer()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def hang_url(hang):
    return hang.url


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


# ---- the client: one wave of timeouts per outage ------------------------------------------------------

@pytest.mark.timeout(120)
def test_calls_one_after_another_under_a_hanging_judge_cost_one_wave(hang):
    from tests.inference.test_judge import HARD

    judge = Judge(hang.url, model="judge", timeout_s=1.0, retries=1, backoff_s=0.0)
    wave = judge.timeout_s * (judge.retries + 1)
    t0 = time.monotonic()
    res = [judge.judge_many([HARD[k % 3]])[0] for k in range(6)]
    chats = [judge.chat_many([CHAT]) for _ in range(4)]
    took = time.monotonic() - t0
    assert all(r.judge_failed and r.source == "judge_failed" and not r.correct for r in res)
    assert chats == [[None]] * 4
    assert judge.stats["failures"] == 10
    # the first request tried 1 + retries times; the calls after it failed without the network
    assert judge.stats["calls"] == judge.retries + 1 and hang.accepted == judge.retries + 1
    assert took < 3 * wave, f"{took:.1f} s for 10 calls; one wave is {wave:.1f} s"


# ---- the pipeline: a whole round under the hanging judge ----------------------------------------------

def _scripted_round(tokenizer, bm25, judge, rag, proposer_n=6, answer="Grant"):
    from tests.inference.test_game import ROW, SCRIPT_ROLLOUT

    cfg = GameConfig(proposer_n=proposer_n, solver_n=2, rag_verify=rag, rag_distractors=0)
    return play_round(ScriptedPolicy(tokenizer, answer), ROW, bm25.search, judge, cfg, SCRIPT_ROLLOUT, step=0)


@pytest.mark.timeout(300)
def test_a_pipelined_round_under_a_hanging_judge_ends_in_one_wave(tokenizer, bm25, hang):
    # The same round without a judge: what the round costs by itself on this machine.
    t0 = time.monotonic()
    _scripted_round(tokenizer, bm25, Judge(), "off")
    base = time.monotonic() - t0

    # Six valid candidates, each RAG-checked by the hung judge; the solvers answer "Grant" (not an exact
    # match), so grading them needs the judge too.
    judge = Judge(hang.url, model="judge", timeout_s=1.0, retries=1, backoff_s=0.0)
    wave = judge.timeout_s * (judge.retries + 1)
    t0 = time.monotonic()
    res = _scripted_round(tokenizer, bm25, judge, "judge")
    took = time.monotonic() - t0
    props = [t for t in res.trajectories if t.role == "proposer"]
    sols = [t for t in res.trajectories if t.role == "solver"]
    assert len(props) == 6 and len(sols) == 2 * 6
    # undecided, not failed: each question passes unchecked and its proposer group is left out
    assert all(t.outcome.valid and t.outcome.rag is None and t.outcome.excluded == "judge_failed" for t in props)
    assert all(t.outcome.judge_failed and t.outcome.excluded == "judge_failed" for t in sols)
    assert res.stats["game/rag_unavailable"] == 6
    # one wave: the six RAG requests went out together, nothing after them reached the network
    assert res.stats["judge/calls"] <= 6 * (judge.retries + 1), res.stats["judge/calls"]
    assert took < base + 3 * wave, f"{took:.1f} s (the round alone: {base:.1f} s; one wave: {wave:.1f} s)"


# ---- the pipeline's RAG batches: one call for what is ready, verdict i on candidate i -----------------

WORDS = ("Lincoln", "Honest Abe", "Grant")


class RagJudge(Judge):
    """A judge server's answers without the server. The RAG reply depends on the prompt it is given (so a reply
    that lands on the wrong candidate shows); "Lincoln" is an exact match, "Honest Abe" is judged right, "Grant"
    wrong. Records the size of every call."""

    def __init__(self, short: int = 0):
        super().__init__("http://127.0.0.1:9", model="m")
        self.chats: list[int] = []
        self.graded: list[int] = []
        self.short = short   # drop this many replies: a client bug the pipeline must not paper over

    def chat_many(self, messages, max_tokens=64, temperature=0.0):
        self.chats.append(len(messages))
        out = []
        for m in messages:
            h = int(hashlib.sha256(m[-1]["content"].encode()).hexdigest(), 16)
            out.append(f"<answer> {WORDS[h % 3]} </answer>")
        return out[: len(out) - self.short]

    def judge_many(self, items):
        self.graded.append(len(items))
        return [JudgeResult(bool(exact_match(it.answer or "", it.reference)) or it.answer == "Honest Abe", "llm")
                for it in items]


def _two_rows(tokenizer, bm25, judge, schedule):
    rows = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2), ProposerRow(["Abraham Lincoln", "Lincoln"], 2)]
    cfg = GameConfig(proposer_n=4, solver_n=2, rag_verify="judge", rag_distractors=1, min_searches=2, seed=5)
    rcfg = RolloutConfig(max_turns=4, max_tokens_per_turn=32, max_info_tokens=128, topk=2, seed=3, schedule=schedule)
    return play_round(ScriptedPolicy(tokenizer), rows, bm25.search, judge, cfg, rcfg, step=4)


@pytest.mark.timeout(300)
def test_rag_candidates_ready_together_go_in_one_call_and_keep_their_verdicts(tokenizer, bm25):
    from tests.inference.test_pipeline import _same_round

    staged_judge, piped_judge = RagJudge(), RagJudge()
    staged = _two_rows(tokenizer, bm25, staged_judge, "turn")
    piped = _two_rows(tokenizer, bm25, piped_judge, "trajectory")
    # the staged round checks every candidate at once: the reference for which verdict is whose
    _same_round(staged, piped)
    props = [t for t in piped.trajectories if t.role == "proposer"]
    assert len(props) == 8 and all(t.outcome.rag_answer in WORDS for t in props)
    assert {t.outcome.rag for t in props} == {True, False}, [t.outcome.rag_answer for t in props]
    # the eight proposers end in one engine step: one RAG call, one grading call for the non-exact answers
    n_judged = sum(t.outcome.rag_answer != "Lincoln" for t in props)
    assert piped_judge.chats == [8], piped_judge.chats
    assert piped_judge.graded[0] == n_judged, piped_judge.graded


@pytest.mark.timeout(300)
def test_a_judge_that_returns_too_few_replies_stops_the_round(tokenizer, bm25):
    with pytest.raises(RuntimeError, match="8 RAG prompts"):
        _two_rows(tokenizer, bm25, RagJudge(short=1), "trajectory")
