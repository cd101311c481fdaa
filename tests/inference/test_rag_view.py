"""The policy's RAG check reads what a solver's own searches would have shown (issue 31 §2).

The reference is the rollout loop itself: a solver that writes the proposer's queries gets a token sequence
from inference/rollout.py; the verifier's prompt without distractors must be that very sequence (same prompt,
same search turns, the same documents cut the same way)."""

from __future__ import annotations

import random

import pytest

from inference.engine_api import GenOutput
from inference.game import GameConfig, solver_view
from inference.judge import Judge, JudgeItem
from inference.prompts import build_solver_prompt
from inference.rag_check import pick_distractors, rag_graded, rag_reply, rag_request
from inference.rollout import INFO_OPEN, RolloutConfig, RolloutRequest, run_rollouts
from inference.trajectory import GameMeta, Trajectory

Q = "Which city on the river Seine hosted the Summer Olympic Games in the year 1900?"


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


class Searcher:
    """Writes the given queries one per turn (as a solver would), then an answer."""

    def __init__(self, tok, queries, answer="Paris"):
        self.tokenizer, self.max_model_len, self.queries, self.answer = tok, 4096, queries, answer
        self.prompts = []

    def generate(self, prompts, sampling):
        self.prompts += [list(p) for p in prompts]
        k = self.tokenizer.decode(prompts[0]).count(INFO_OPEN)   # blocks the environment appended so far
        text = f"<search> {self.queries[k]} </search>" if k < len(self.queries) else f"<answer> {self.answer} </answer>"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [GenOutput(ids, [-1.0] * len(ids), text, "stop", text[text.rfind("</"):])]


def _proposer(row, queries, docs, question=Q):
    return Trajectory("proposer", f"s0-p{row}", [1, 2], [0, 1], [0.0, -1.0], question=question, answer="Paris",
                      stop_reason="question", num_searches=len(queries),
                      queries=queries, docs=docs, meta=GameMeta(search_turns=2, row=row))


def test_the_verifier_reads_exactly_the_solvers_rollout(tok, bm25):
    queries = ["Summer Olympics 1900", "Paris Seine"]
    docs = bm25.search(queries, 3)
    cfg = RolloutConfig(max_turns=3, max_tokens_per_turn=64, max_info_tokens=40, topk=3)
    eng = Searcher(tok, queries)
    (sol,) = run_rollouts(eng, [RolloutRequest("solver", "g", build_solver_prompt(tok, Q), question=Q)], bm25.search, cfg)
    want = eng.prompts[-1]                       # what the solver read before writing its answer
    got = solver_view(tok, Q, list(zip(queries, docs)), [], "auto", cfg.max_info_tokens, 4096, random.Random(0))
    assert got == want
    # the cut is the rollout's: text past max_info_tokens of a block is not there
    full = docs[0][0]["contents"].split("\n", 1)[1]
    assert full[-40:] not in tok.decode(got)


def test_distractors_are_shuffled_in_and_dropped_first_when_over_budget(tok, bm25):
    own = list(zip(["Paris Seine"], bm25.search(["Paris Seine"], 3)))
    other = list(zip(["Amazon river", "Andes"], bm25.search(["Amazon river", "Andes"], 3)))
    full = solver_view(tok, Q, own, other, "auto", 64, 10_000, random.Random(1))
    text = tok.decode(full)
    assert all(f"<search> {q} </search>" in text for q in ("Paris Seine", "Amazon river", "Andes"))
    n = len(build_solver_prompt(tok, Q))
    firsts = {tok.decode(solver_view(tok, Q, own, other, "auto", 64, 10_000, random.Random(s))[n:]).split(" </search>")[0]
              for s in range(8)}
    assert len(firsts) > 1                                           # the first search shown varies with the seed
    tight = solver_view(tok, Q, own, other, "auto", 64, len(full) - 1, random.Random(1))
    kept = tok.decode(tight)
    assert "<search> Paris Seine </search>" in kept and len(tight) < len(full)   # own kept, a distractor dropped
    alone = solver_view(tok, Q, own, other, "auto", 64, 1, random.Random(1))
    assert "<search> Paris Seine </search>" in tok.decode(alone) and "Amazon" not in tok.decode(alone)


def test_policy_verdicts_follow_the_reply_and_the_prompt_is_the_solver_view(tok, bm25):
    """The pieces RoundPipeline makes a policy RAG check of: candidate 0's distractors (pick_distractors), its prompt
    (rag_request), and the verdict a reply gives (rag_reply; a non-exact answer is the judge's to grade, rag_graded)."""
    props = [_proposer(0, ["Paris Seine", "Olympics 1900"], bm25.search(["Paris Seine", "Olympics 1900"], 3)),
             _proposer(1, ["Amazon river", "Andes"], bm25.search(["Amazon river", "Andes"], 3), "Which river? " * 3)]
    cfg = GameConfig(rag_verify="policy", rag_distractors=1, rag_max_tokens=16)
    rng = random.Random(0)
    picked = pick_distractors(0, props, cfg.rag_distractors, rng, [t.meta.row for t in props])
    prompt = rag_request(0, picked, props, tok, cfg, rng, 96, 1024 - cfg.rag_max_tokens)
    assert picked == [1]
    assert prompt[:len(build_solver_prompt(tok, Q))] == build_solver_prompt(tok, Q)
    assert "<search> Amazon river </search>" in tok.decode(prompt)    # the other row's searches are the distractors
    assert rag_reply(props[0], "<think> Doc 1 says so. </think>\n<answer> Paris </answer>") is True
    assert props[0].outcome.rag_answer == "Paris"
    wrong = rag_reply(props[0], "<answer> Lyon </answer>")
    assert wrong == "Lyon" and rag_graded(Judge().judge_many([JudgeItem(Q, "Paris", wrong)])[0]) is False
