"""The self-play game: a full round with a real tiny model, scripted rounds, and stages on hand-made trajectories.

A tiny random model almost never writes a valid question, so the full round seeds the pool:
the solver path then runs on pool questions and its trajectories are rewarded. The valid-question
path is driven by scripted rounds (tests/scripted_policy.py: both roles from a script on the real tokenizer), which
make the round's own question checks; the filters and the rewards also on hand-made trajectories, whose texts are
written here as data, with the real retriever's documents.
"""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from inference.data import ProposerRow
from inference.filters import FILTER_REASONS
from inference.game import (
    EXCLUSION_REASONS,
    NO_QUESTION_WHY,
    SOURCES,
    GameConfig,
    QuestionPool,
    _search_fns,
    mark_excluded,
    play_round,
    rag_prompt,
    score,
)
from inference.game_metrics import round_stats
from inference.judge import JUDGE_SYSTEM, Judge
from inference.pipeline import filter_reason
from inference.rag_check import _flat_docs
from inference.rollout import RolloutConfig
from inference.trajectory import GameMeta, Outcome, Trajectory
from tests.scripted_policy import LINCOLN, LINCOLN_QUERIES, ScriptedPolicy
from utils.text import exact_match

STAT_KEYS = {
    "game/proposer_trajs", "game/valid_rate", "game/filter_pass_rate", "game/rag_checked", "game/rag_pass_rate",
    "game/rag_unavailable", "game/pool_fills", "game/pool_size", "game/questions", "proposer/reward_mean",
    "proposer/searches_mean", "solver/acc", "solver/reward_mean", "solver/spam_rate", "solver/turns_mean",
    "solver/searches_mean", "solver/judge_failed", "solver/fresh_trajs", "solver/fresh_correct",
    "game/valid_questions", "game/valid_doc1_title",
    *(f"game/filter/{r}" for r in FILTER_REASONS + ("rag_failed",)),
    *(f"judge/{k}" for k in ("calls", "failures", "cache_hits", "em_hits", "unparsed")),
    "game/groups", "game/excluded_groups", "game/excluded_trajs", *(f"game/excluded/{r}" for r in EXCLUSION_REASONS),
    # issue 31: the game's signal, solve rates, stops without a question, question kinds, the pool
    "game/no_question", *(f"game/no_question/{w}" for w in NO_QUESTION_WHY), "game/valid_answer_in_text",
    "game/valid_probed", "game/valid_one_search", "game/fresh_s0", "game/fresh_mid", "game/fresh_s1",
    "game/pool_repeats", "game/pool_served_trajs", "game/pool_served_correct", "game/pool_admitted",
    "game/solver_groups", "game/pipelined",
    "game/informative_groups", *(f"game/{k}/{src}" for k in ("solver_groups", "informative_groups") for src in SOURCES),
    # issue 41: the round per slot; these rows carry no title, so their answer kind is "other"
    "game/solver_slots", "game/empty_slots", "game/pool_servings", "game/proposer_trajs/other",
    "game/valid_questions/other", *(f"game/filter/other/{r}" for r in FILTER_REASONS + ("rag_failed",)),
}
SEED_POOL = [
    {"question": "What is the capital of Algeria?", "answer": ["Algiers"]},
    {"question": "What is the capital of Angola?", "answer": "Luanda"},
    {"question": "What is the capital of Benin?", "answer": ["Porto-Novo", "Porto Novo"]},
    {"question": "What is the capital of Botswana?", "answer": "Gaborone"},
]  # as many as the full round's proposer slots: a draw is without replacement
FAST = RolloutConfig(max_turns=2, max_tokens_per_turn=32, max_total_tokens=1024, max_info_tokens=128, topk=2, seed=1)


def check_well_formed(t: Trajectory) -> None:
    n = len(t.token_ids)
    assert len(t.loss_mask) == n == len(t.logprobs)
    assert t.prompt_len > 0 and not any(t.loss_mask[: t.prompt_len])
    assert t.num_sampled > 0
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0)
    assert all(lp <= 0.0 for lp in t.logprobs)


class Counting:
    """The real retriever's search, recording which queries reached it."""

    def __init__(self, search):
        self.search_fn, self.queries = search, []

    def __call__(self, queries, topk):
        self.queries += list(queries)
        return self.search_fn(queries, topk)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_full_round_tiny_model(vllm_engine, bm25):
    rows = [ProposerRow("Algeria", 2), ProposerRow(["Abraham Lincoln", "Lincoln"], 3)]
    cfg = GameConfig(proposer_n=2, solver_n=3, rag_verify="policy", rag_distractors=1, seed=3)
    pool = QuestionPool.from_list(SEED_POOL, max_size=8, seed=0)
    per_role = {"proposer": Counting(bm25.search), "solver": Counting(bm25.search)}
    res = play_round(vllm_engine, rows, per_role, Judge(), cfg, FAST, pool=pool, step=7)

    props = [t for t in res.trajectories if t.role == "proposer"]
    sols = [t for t in res.trajectories if t.role == "solver"]
    assert len(props) == 4 and res.trajectories[:4] == props
    for t in res.trajectories:
        check_well_formed(t)
    # proposer groups: the G_p samples of one prompt
    assert [t.group_id for t in props] == ["s7-p0", "s7-p0", "s7-p1", "s7-p1"]
    assert props[2].answer == ["Abraham Lincoln", "Lincoln"]

    n_valid = sum(t.outcome.valid for t in props)
    s = res.stats
    assert set(s) == STAT_KEYS | ({"game/pool_served_max"} if s["game/pool_fills"] else set())
    assert s["game/valid_rate"] == n_valid / 4
    assert sum(s[f"game/filter/{r}"] for r in FILTER_REASONS + ("rag_failed",)) == 4 - n_valid
    assert s["game/pool_fills"] == 4 - n_valid          # every invalid slot got a pool question
    assert s["game/questions"] == 4 and len(sols) == 4 * 3
    assert s["judge/calls"] == 0                          # exact-match judge: no server
    # nothing failed (exact-match judge, a local index): every group trains
    assert s["game/groups"] == 2 + 4 and s["game/excluded_groups"] == s["game/excluded_trajs"] == 0
    assert all(t.outcome.excluded is None for t in res.trajectories)

    # solver groups: G_s samples per question, distinct from proposer groups
    groups = {}
    for t in sols:
        groups.setdefault(t.group_id, []).append(t)
    assert len(groups) == 4 and all(len(g) == 3 and len({x.question for x in g}) == 1 for g in groups.values())
    assert all(gid.startswith("s7-q") for gid in groups)
    pool_qs = {p["question"] for p in SEED_POOL}
    assert sum(t.meta.from_pool for t in sols) == 3 * (4 - n_valid)
    assert all(t.question in pool_qs for t in sols if t.meta.from_pool)

    # rewards in range and consistent with the verdicts
    for t in props:
        if t.outcome.valid:
            assert 0.0 <= t.reward <= 1.0
        else:
            assert t.reward == cfg.format_penalty and t.outcome.filter_reason in FILTER_REASONS + ("rag_failed",)
    for t in sols:
        expected = (1.0 / cfg.spam_divisor if t.outcome.spam else 1.0) if t.outcome.correct else 0.0
        assert t.reward == expected
    assert s["solver/acc"] == sum(t.outcome.correct for t in sols) / len(sols)
    assert s["solver/fresh_trajs"] == 3 * n_valid     # this round's own questions, not the pool's
    assert s["solver/fresh_correct"] == sum(t.outcome.correct for t in sols if not t.meta.from_pool)

    # each role's searches went to its own backend, and only there
    assert sorted(per_role["proposer"].queries) == sorted(q for t in props for q in t.queries if q)
    assert sorted(per_role["solver"].queries) == sorted(q for t in sols for q in t.queries if q)
    assert len(pool) >= 3


def _proposer(question, answer, docs, queries, row, stop="question", n=2):
    """A proposer trajectory as the rollout builds it; the token ids are placeholders (scoring never reads them)."""
    return Trajectory("proposer", f"s0-p{row}", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], prompt_len=1,
                      question=question if stop == "question" else "", answer=answer, stop_reason=stop,
                      num_searches=len(queries), queries=queries, docs=docs,
                      meta=GameMeta(search_turns=n, row=row))


def _solver(question, answer, response, proposer, gid):
    return Trajectory("solver", gid, [1, 2], [0, 1], [0.0, -0.5], prompt_len=1, question=question, answer=answer,
                      response_text=response,
                      meta=GameMeta(proposer=proposer, source="pool" if proposer is None else "proposer"))


@pytest.fixture(scope="module")
def handmade(bm25):
    docs_a = bm25.search(["Abraham Lincoln president", "Lincoln assassination theatre"], 2)
    docs_b = bm25.search(["Amazon river", "Andes mountains"], 2)
    q_ok = "Which American president was shot at a theatre in Washington in April of 1865?"
    return [
        _proposer(q_ok, ["Abraham Lincoln", "Lincoln"], docs_a, ["Abraham Lincoln president", "theatre 1865"], 0),
        _proposer("Which president, Abraham Lincoln or another, was shot at a theatre in 1865?", "Abraham Lincoln",
                  docs_a, ["q1", "q2"], 0),                                          # answer leaks
        _proposer("", "Amazon", docs_b, ["Amazon river"], 1, stop="max_turns"),   # no question
        _proposer("Which river carries more water than any other river in the whole world today?", "Amazon",
                  docs_b, ["Amazon river", "Andes mountains"], 1),
    ]


def test_filters_and_score_valid_path(handmade):
    props = handmade
    cfg = GameConfig(rag_verify="off", solver_n=4, proposer_reward="1-acc")
    reasons = [filter_reason(t, cfg) for t in props]   # the round's cheap filters, as each proposer ends
    assert reasons == [None, "answer_in_question", "no_question", None]
    verdict = {0: True, 3: True}   # --rag_verify off passes every filtered question (test_nothing_failed_...)

    q0, q3 = props[0].question, props[3].question
    sols = [
        _solver(q0, props[0].answer, "<think>hm</think><answer>Lincoln</answer>", 0, "s0-q0"),
        _solver(q0, props[0].answer, "<answer>Grant</answer>", 0, "s0-q0"),
        _solver(q0, props[0].answer, "<answer><answer>abraham lincoln</answer>", 0, "s0-q0"),   # spam, right
        _solver(q0, props[0].answer, "no answer at all", 0, "s0-q0"),
        _solver(q3, "Amazon", "<answer>Amazon</answer>", 3, "s0-q1"),
        _solver(q3, "Amazon", "<answer>the Amazon.</answer>", 3, "s0-q1"),
        _solver(q3, "Amazon", "<answer>Amazon</answer>", 3, "s0-q1"),
        _solver(q3, "Amazon", "<answer>Nile</answer>", 3, "s0-q1"),
        _solver("What is the capital of Angola?", "Luanda", "<answer>Luanda</answer>", None, "s0-q2"),
    ]
    score(props, reasons, sols, Judge(), cfg)
    assert [t.reward for t in sols] == [1.0, 0.0, 0.25, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert sols[2].outcome.spam and sols[2].outcome.correct and sols[3].outcome.pred is None
    # proposer: 1 - acc over its own group only (the pool question counts for nobody)
    assert props[0].reward == pytest.approx(1 - 2 / 4) and props[3].reward == pytest.approx(1 - 3 / 4)
    assert props[1].reward == props[2].reward == cfg.format_penalty
    assert props[1].outcome.filter_reason == "answer_in_question"

    # the curriculum metric counts only the round's own questions: 8 fresh, 5 right (the pool's 1 is apart)
    st = round_stats(props, sols, reasons, verdict, 1, None)
    assert (st["solver/fresh_trajs"], st["solver/fresh_correct"]) == (8, 5.0)
    assert st["solver/acc"] == pytest.approx(6 / 9)

    quad = GameConfig(rag_verify="off", proposer_reward="4s(1-s)", format_penalty=0.0)
    score(props, reasons, sols, Judge(), quad)
    assert props[0].reward == pytest.approx(1.0) and props[3].reward == pytest.approx(4 * 0.75 * 0.25)
    assert props[2].reward == 0.0


def test_valid_questions_whose_answer_is_the_first_searchs_doc1_title_are_counted():
    """game/valid_doc1_title counts valid questions built on the page the first search put first (the
    title heuristic's kind); an answer read off a later search's text is kept and not counted."""
    from inference.game import answer_is_first_title

    page = lambda title, text: {"id": title, "contents": f"{title}\n{text}", "score": 1.0}  # noqa: E731
    q = "Which city on the Seine hosted the Summer Olympics held in the year 1900?"
    on_doc1 = _proposer(q, ["Paris", "Paris, France"], [[page("Paris", "Capital of France."), page("Lyon", "City.")],
                                                       [page("1900 Summer Olympics", "Held in Paris.")]],
                        ["Paris", "1900 Olympics"], 0)
    read_later = _proposer("Which river flows through the city that hosted the Summer Olympics in 1900?", "Seine", [[page("1900 Summer Olympics", "Held in Paris.")],
                                                                 [page("Paris", "The Seine flows through it.")]],
                           ["1900 Olympics", "Paris river"], 1)
    second_doc = _proposer(q, "Paris", [[page("Lyon", "City."), page("Paris", "Capital.")], [page("Seine", "River.")]],
                           ["French city", "Seine"], 2)
    untitled = _proposer(q, "Paris", [[{"id": "x", "contents": "Paris", "score": 1.0}], []], ["Paris city", "France"], 3)
    assert [answer_is_first_title(t) for t in (on_doc1, read_later, second_doc, untitled)] == [True, False, False, False]
    props = [on_doc1, read_later, second_doc, untitled]
    reasons = [filter_reason(t, GameConfig(rag_verify="off")) for t in props]
    assert reasons == [None, None, None, None]   # the filters keep an answer that is no Doc-1 title
    reasons[2] = "too_few_searches"              # only valid questions count
    st = round_stats(props, [], reasons, {}, 0, None)
    assert (st["game/valid_questions"], st["game/valid_doc1_title"]) == (3, 1)


def test_rag_prompt_budget_and_distractors(handmade):
    own = _flat_docs(handmade[0].docs)
    own_ids = {d["id"] for d in own}
    other = [d for d in _flat_docs(handmade[3].docs) if d["id"] not in own_ids]
    assert own and other
    cfg = GameConfig(rag_max_doc_chars=200, rag_max_context_chars=100_000)
    text = rag_prompt("Q?", own, other, cfg, random.Random(0))
    for d in own + other:
        assert d["contents"][:200].split("\n", 1)[1][:40] in text
    assert text.count("Doc ") == len(own) + len(other) + 1    # +1: the worked example
    assert text.rstrip().endswith("Question: Q?")
    # tight budget: own docs stay, distractors go first
    tight = GameConfig(rag_max_doc_chars=200, rag_max_context_chars=sum(len(d["contents"][:200]) for d in own))
    text = rag_prompt("Q?", own, other, tight, random.Random(0))
    assert text.count("Doc ") == len(own) + 1
    assert all(d["contents"][:200].split("\n", 1)[1][:40] in text for d in own)
    # a token budget own docs alone exceed: documents get shortened until it fits
    text = rag_prompt("Q?", own, other, cfg, random.Random(0), fits=lambda t: len(t) < 1200)
    assert len(text) < 1200 and text.count("Doc ") == len(own) + 1


# Two rows: the Lincoln proposers' questions pass the filters and are RAG-checked, with the Algeria proposers'
# searches as distractors; the Algeria proposers ask "Capital?", which the filters refuse, so no check reads it.
TWO_ROWS = [ProposerRow(LINCOLN, 2), ProposerRow("Algeria", 2)]


def _checked_round(engine, judge, cfg, bm25):
    """A scripted round of TWO_ROWS; its proposers, after the filters' and the checks' counts were checked."""
    res = play_round(engine, TWO_ROWS, bm25.search, judge, cfg, SCRIPT_ROLLOUT, step=0)
    props = [t for t in res.trajectories if t.role == "proposer"]
    assert [t.outcome.filter_reason for t in props[2:]] == ["too_short", "too_short"]
    assert all(t.outcome.rag is None and t.outcome.rag_answer is None for t in props[2:])   # never checked
    assert res.stats["game/rag_checked"] + res.stats["game/rag_unavailable"] == 2   # a verdict for each candidate
    return res, props[:2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rag_check_policy_verifier(vllm_engine, bm25):
    """The tiny model reads the RAG prompts (the scripted policy plays the rollouts, on the model's tokenizer)."""
    cfg = GameConfig(proposer_n=2, solver_n=1, rag_verify="policy", rag_distractors=1, rag_max_tokens=16)
    engine = ScriptedPolicy(vllm_engine.tokenizer, reader=vllm_engine)
    _, checked = _checked_round(engine, Judge(), cfg, bm25)
    assert [role for _, role, _ in engine.log].count("rag_check") == 2   # the model read them, not the script
    assert all(isinstance(t.outcome.rag, bool) for t in checked)
    for t in checked:
        ans = t.outcome.rag_answer
        assert isinstance(ans, str)
        # the verdict is exact match for an EM-only judge
        assert t.outcome.rag == bool(exact_match(ans, t.answer))
        assert t.outcome.filter_reason == (None if t.outcome.rag else "rag_failed")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rag_check_judge_verifier_real_server(judge_server, tokenizer, bm25):
    judge = Judge(judge_server, model="judge", max_concurrency=2)
    cfg = GameConfig(proposer_n=2, solver_n=1, rag_verify="judge", rag_distractors=1, rag_max_tokens=16,
                     rag_max_context_chars=2000)
    _, checked = _checked_round(ScriptedPolicy(tokenizer), judge, cfg, bm25)
    assert all(isinstance(t.outcome.rag, bool) for t in checked)
    assert all(isinstance(t.outcome.rag_answer, str) for t in checked)
    assert judge.stats["failures"] == 0 and judge.stats["calls"] >= 2


@pytest.mark.timeout(120)
def test_rag_check_judge_down_passes_unchecked(tokenizer, bm25, dead_url):
    judge = Judge(dead_url, model="judge", retries=0, timeout_s=2.0)
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify="judge", rag_distractors=1)
    res, checked = _checked_round(ScriptedPolicy(tokenizer), judge, cfg, bm25)
    assert all(t.outcome.rag is None and t.outcome.valid for t in checked)   # undecided, and so passed
    assert res.stats["game/rag_unavailable"] == 2


def test_pool_bounded_dedup_serialisable():
    pool = QuestionPool(max_size=3, seed=0)
    for i in range(5):
        pool.add(f"Question number {i}?", [f"a{i}"], step=i)
    pool.add("question NUMBER 4", ["dup"])           # same after normalisation
    assert len(pool) == 3 and [it["step"] for it in pool.to_list()] == [2, 3, 4]
    got = pool.sample(3)
    assert len({g["question"] for g in got}) == 3
    assert pool.sample(0) == []             # more than it holds: tests/inference/test_pool.py
    back = QuestionPool.from_list(pool.to_list(), max_size=3)
    assert back.to_list() == pool.to_list()
    assert QuestionPool(2).sample(4) == []


def test_config_and_argument_errors():
    with pytest.raises(ValueError, match="rag_verify"):
        GameConfig(rag_verify="llm")
    with pytest.raises(ValueError, match="proposer_reward"):
        GameConfig(proposer_reward="acc")
    with pytest.raises(ValueError, match="min_chars"):
        GameConfig(min_question_chars=50, max_question_chars=10)
    with pytest.raises(ValueError, match="needs a judge server"):
        play_round(None, [ProposerRow("x", 2)], None, Judge(), GameConfig(rag_verify="judge"), FAST)
    with pytest.raises(ValueError, match="'proposer' and 'solver'"):
        _search_fns({"proposer": None, "judge": None})
    f = object()
    assert _search_fns(f) == (f, f) and _search_fns({"solver": f}) == (None, f)


# ---- failures are left out of the loss, never scored ------------------------------------------------

# tests/scripted_policy.py plays both roles: the proposer searches LINCOLN_QUERIES, then asks its question; the
# solver searches once, then answers what it is told to.
SCRIPT_ROLLOUT = RolloutConfig(max_turns=4, max_tokens_per_turn=32, max_info_tokens=128, topk=2)
ROW = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _round(tokenizer, answer, search, judge, rag="off"):
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify=rag, rag_distractors=0)
    res = play_round(ScriptedPolicy(tokenizer, answer), ROW, search, judge, cfg, SCRIPT_ROLLOUT, step=0)
    props = [t for t in res.trajectories if t.role == "proposer"]
    sols = [t for t in res.trajectories if t.role == "solver"]
    assert len(props) == 2 and all(t.outcome.valid for t in props) and len(sols) == 4   # 1 + 2 groups
    return res, props, sols


@pytest.mark.timeout(120)
def test_judge_outage_leaves_solver_groups_and_their_proposers_out(tokenizer, bm25, dead_url):
    # "Grant" is not an exact match, so every solver answer needs the judge, which is down. Before,
    # that read as "wrong": solver reward 0 and proposer reward 1 - 0 = 1, paid for by the outage.
    judge = Judge(dead_url, model="judge", retries=0, timeout_s=2.0)
    res, props, sols = _round(tokenizer, "Grant", bm25.search, judge)
    assert all(t.outcome.judge_failed for t in sols)
    assert all(t.outcome.excluded == "judge_failed" for t in res.trajectories)
    s = res.stats
    assert (s["game/groups"], s["game/excluded_groups"], s["game/excluded_trajs"]) == (3, 3, 6)
    assert (s["game/excluded/judge_failed"], s["game/excluded/search_failed"]) == (3, 0)


@pytest.mark.timeout(120)
def test_nothing_failed_nothing_left_out(tokenizer, bm25, dead_url):
    # The same round, answered exactly: the dead judge is never asked, so nothing is left out.
    judge = Judge(dead_url, model="judge", retries=0, timeout_s=2.0)
    res, props, sols = _round(tokenizer, "Abraham Lincoln", bm25.search, judge)
    assert all(t.outcome.excluded is None for t in res.trajectories) and res.stats["judge/failures"] == 0
    assert [t.outcome.rag for t in props] == [True, True]   # --rag_verify off passes every filtered question
    assert (res.stats["game/groups"], res.stats["game/excluded_groups"]) == (3, 0)
    assert [t.reward for t in props] == [0.0, 0.0] and all(t.reward == 1.0 for t in sols)


@pytest.mark.timeout(120)
def test_the_game_shapes_self_search_rewards_after_its_stats(tokenizer, bm25):
    """self_search_format_reward (SSRL): the round's solver rewards become 0.9 * correct + 0.1 * format
    (inference/self_search.py); the stats report the rewards as scored, and the informative groups are
    counted again on the shaped rewards. The scripted solver writes no <think>: format 0."""
    from inference.game import signal_counts

    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify="off", rag_distractors=0,
                     self_search_format_reward=True)
    res = play_round(ScriptedPolicy(tokenizer, "Abraham Lincoln"), ROW, bm25.search, Judge(), cfg, SCRIPT_ROLLOUT, step=0)
    props = [t for t in res.trajectories if t.role == "proposer"]
    sols = [t for t in res.trajectories if t.role == "solver"]
    assert len(sols) == 4 and all(t.outcome.correct and t.outcome.format_reward == 0.0 for t in sols)
    assert [t.reward for t in sols] == pytest.approx([0.9] * 4)
    assert [t.reward for t in props] == [0.0, 0.0] and all(t.outcome.format_reward is None for t in props)
    assert res.stats["solver/reward_mean"] == 1.0
    assert {k: res.stats[k] for k in signal_counts(sols)} == signal_counts(sols)
    plain = play_round(ScriptedPolicy(tokenizer, "Abraham Lincoln"), ROW, bm25.search, Judge(),
                       GameConfig(proposer_n=2, solver_n=2, rag_verify="off", rag_distractors=0),
                       SCRIPT_ROLLOUT, step=0)
    assert all(t.reward == 1.0 and t.outcome.format_reward is None for t in plain.trajectories if t.role == "solver")


@pytest.mark.timeout(120)
def test_search_outage_leaves_groups_out(tokenizer, bm25):
    def down(queries, topk):
        raise ConnectionError("retriever at http://127.0.0.1:1 refused the connection")

    # the solver's search is down: its groups, and the proposers paid off them, are left out
    res, props, sols = _round(tokenizer, "Abraham Lincoln", {"proposer": bm25.search, "solver": down}, Judge())
    assert all(t.search_failed == 1 for t in sols) and all(t.search_failed == 0 for t in props)
    assert all(t.outcome.excluded == "search_failed" for t in res.trajectories)
    assert (res.stats["game/excluded/search_failed"], res.stats["game/excluded_groups"]) == (3, 3)

    # the proposer's search is down: its question is refused (too few searches), and that penalty came from
    # the outage, so the proposer group is left out; the solvers of pool questions still train
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify="off")
    pool = QuestionPool.from_list(SEED_POOL, seed=0)
    res = play_round(ScriptedPolicy(tokenizer, "Algiers"), ROW, {"proposer": down, "solver": bm25.search}, Judge(), cfg,
                     SCRIPT_ROLLOUT, pool=pool, step=0)
    props = [t for t in res.trajectories if t.role == "proposer"]
    sols = [t for t in res.trajectories if t.role == "solver"]
    assert all(not t.outcome.valid and t.outcome.excluded == "search_failed" for t in props)
    assert sols and all(t.meta.from_pool and t.outcome.excluded is None for t in sols)
    assert (res.stats["game/groups"], res.stats["game/excluded_groups"]) == (1 + 2, 1)


@pytest.mark.timeout(120)
def test_rag_check_undecided_leaves_the_proposer_group_out(tokenizer, bm25, dead_url):
    # The RAG verifier (the judge) is down: the question passes unchecked (SSP), but whether it was
    # answerable is unknown, so the proposer's reward is not used. The solvers answered exactly.
    judge = Judge(dead_url, model="judge", retries=0, timeout_s=2.0)
    res, props, sols = _round(tokenizer, "Lincoln", bm25.search, judge, rag="judge")
    assert all(t.outcome.rag is None and t.outcome.excluded == "judge_failed" for t in props)
    assert all(t.outcome.excluded is None for t in sols)
    assert (res.stats["game/groups"], res.stats["game/excluded_groups"], res.stats["game/rag_unavailable"]) == (3, 1, 2)


class _RagServer(BaseHTTPRequestHandler):
    """Answers RAG prompts with "<answer> Grant </answer>" and fails (500) every judging request."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["messages"][0]["content"] == JUDGE_SYSTEM:
            self.send_response(500)
            self.end_headers()
            return
        data = json.dumps({"choices": [{"message": {"content": "<answer> Grant </answer>"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.timeout(120)
def test_rag_check_judge_failing_on_a_non_exact_answer_is_undecided(tokenizer, bm25):
    # Before, a judge that failed on a non-EM RAG answer made it "wrong": rag_failed, the invalid penalty.
    # The solvers answer "Lincoln" (exact): the judge is asked to grade the two RAG answers only.
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _RagServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        judge = Judge(f"http://127.0.0.1:{srv.server_address[1]}", model="judge", retries=0, backoff_s=0.0)
        cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify="judge", rag_distractors=1)
        res, checked = _checked_round(ScriptedPolicy(tokenizer), judge, cfg, bm25)
    finally:
        srv.shutdown()
        srv.server_close()
    assert all(t.outcome.rag is None and t.outcome.valid for t in checked) and judge.stats["failures"] == 2
    assert res.stats["game/rag_unavailable"] == 2
    assert all(t.outcome.rag_answer == "Grant" for t in checked)


def test_mark_excluded_groups_and_precedence():
    def sol(gid, proposer, judge_failed=False, search_failed=0):
        return Trajectory("solver", gid, [1], [1], [-1.0], meta=GameMeta(proposer=proposer),
                          outcome=Outcome(judge_failed=judge_failed), search_failed=search_failed)

    props = [Trajectory("proposer", g, [1], [1], [-1.0], search_failed=f, meta=GameMeta(row=0))
             for g, f in (("p0", 0), ("p0", 0), ("p1", 0), ("p1", 0), ("p2", 1))]
    sols = [sol("q0", 0), sol("q0", 0, search_failed=2),             # proposer 0 <- search_failed; p0 with it
            sol("q1", 2), sol("q1", 2, judge_failed=True, search_failed=1),   # both: judge_failed names it
            sol("q2", None, judge_failed=True),                      # a pool question: no proposer to blame
            sol("q3", 3)]                                             # fine, but proposer 3's group has 2
    counts = mark_excluded(props, sols, verdict={0: True, 2: True, 3: True})
    assert [t.outcome.excluded for t in props] == ["search_failed", "search_failed", "judge_failed", "judge_failed",
                                                   "search_failed"]
    assert [t.outcome.excluded for t in sols] == ["search_failed"] * 2 + ["judge_failed"] * 3 + [None]
    assert counts == {"game/groups": 3 + 4, "game/excluded_groups": 6, "game/excluded_trajs": 10,
                      "game/excluded/judge_failed": 3, "game/excluded/search_failed": 3}
    # an undecided RAG check excludes that proposer's group alone
    props = [Trajectory("proposer", "p0", [1], [1], [-1.0]) for _ in range(2)]
    assert mark_excluded(props, [], {0: True, 1: None})["game/excluded/judge_failed"] == 1


@pytest.mark.timeout(120)
def test_solver_questions_carry_their_construction_path_through_the_pool(tokenizer, bm25, tmp_path):
    """Self-distillation's privileged context (issue 22): a fresh question's solver trajectories carry its
    proposer's queries and documents; the pool stores them, a later fill hands them on, and they survive
    the checkpoint's torch.save / torch.load(weights_only=True)."""
    import torch

    from inference.game import QCP_DOC_CHARS, qcp_of

    pool = QuestionPool(8, seed=0)   # SSP's window: every solver right (s = 1) still joins the pool
    cfg = GameConfig(proposer_n=1, solver_n=2, rag_verify="off", pool_min_solve_rate=0.0, pool_max_solve_rate=1.0)
    res = play_round(ScriptedPolicy(tokenizer, "Abraham Lincoln"), ROW, bm25.search, Judge(), cfg, SCRIPT_ROLLOUT,
                     pool=pool, step=0)
    prop = next(t for t in res.trajectories if t.role == "proposer")
    assert prop.outcome.valid
    qcp = qcp_of(prop)
    assert qcp["queries"] == LINCOLN_QUERIES
    assert [[d["id"] for d in call] for call in qcp["docs"]] == [[str(d["id"]) for d in call] for call in prop.docs]
    assert all(len(d["contents"]) <= QCP_DOC_CHARS for call in qcp["docs"] for d in call) and qcp["docs"][0]
    for t in (t for t in res.trajectories if t.role == "solver"):
        assert t.meta.qcp == qcp
    torch.save({"pool": pool.to_list()}, tmp_path / "state.pt")
    back = QuestionPool.from_list(torch.load(tmp_path / "state.pt", weights_only=True)["pool"], 8)
    assert back.to_list() == pool.to_list() and back.to_list()[0]["qcp"] == qcp
    # a round whose question is invalid (it names its own answer) refills from the pool
    leaky = ScriptedPolicy(tokenizer, "Abraham Lincoln", question="Which president was shot at Ford's Theatre in 1865 in Washington?")
    res2 = play_round(leaky, [ProposerRow(["Ford's Theatre"], 2)], bm25.search, Judge(), cfg, SCRIPT_ROLLOUT,
                      pool=back, step=1)
    assert next(t for t in res2.trajectories if t.role == "proposer").outcome.filter_reason == "answer_in_question"
    filled = [t for t in res2.trajectories if t.role == "solver"]
    assert filled and all(t.meta.source == "pool" and t.meta.qcp == qcp for t in filled)


@pytest.mark.timeout(120)
def test_the_pool_admits_by_the_rounds_own_solve_rates(tokenizer, bm25):
    """Issue 31 §2: a fresh valid question joins the pool after its solver group played, when its solve rate s
    lies in [pool_min_solve_rate, pool_max_solve_rate]; the same round's invalid slot is never filled with it."""
    from inference.game import qcp_of

    q = "Which president was shot at Ford's Theatre in 1865 in Washington?"
    rows = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2), ProposerRow(["Ford's Theatre"], 2)]  # 2nd: answer leaks

    def play(answer, **window):
        pool = QuestionPool(8, seed=0)
        window = {"pool_min_solve_rate": 0.0, "pool_max_solve_rate": 1.0, **window}   # SSP's, unless given
        cfg = GameConfig(proposer_n=1, solver_n=2, rag_verify="off", **window)
        res = play_round(ScriptedPolicy(tokenizer, answer, question=q), rows, bm25.search, Judge(), cfg, SCRIPT_ROLLOUT,
                         pool=pool, step=3)
        props = [t for t in res.trajectories if t.role == "proposer"]
        assert [t.outcome.valid for t in props] == [True, False]
        # the pool was empty when the round drew its fills: the invalid slot stays empty, nothing is re-asked
        assert res.stats["game/pool_fills"] == 0
        assert all(t.meta.source == "proposer" for t in res.trajectories if t.role == "solver")
        assert res.stats["game/pool_admitted"] == len(pool) == res.stats["game/pool_size"]
        return props[0], pool

    prop, pool = play("Abraham Lincoln")                                   # every solver right: s = 1
    assert prop.outcome.solver_acc == 1.0 and prop.outcome.pool_admitted
    assert pool.to_list() == [{"question": q, "answer": ["Abraham Lincoln", "Lincoln"], "step": 3, "qcp": qcp_of(prop),
                               "solve_rate": 1.0}]
    prop, pool = play("Abraham Lincoln", pool_max_solve_rate=0.5)         # s = 1 > max: stays out
    assert not prop.outcome.pool_admitted and len(pool) == 0
    prop, pool = play("Grant")                                             # every solver wrong: s = 0
    assert prop.outcome.solver_acc == 0.0 and [it["solve_rate"] for it in pool.to_list()] == [0.0]
    prop, pool = play("Grant", pool_min_solve_rate=0.5)                    # s = 0 < min: stays out
    assert not prop.outcome.pool_admitted and len(pool) == 0
    default = GameConfig()                                                 # the recipe's window, 0.01-0.99
    prop, pool = play("Abraham Lincoln", pool_min_solve_rate=default.pool_min_solve_rate,
                      pool_max_solve_rate=default.pool_max_solve_rate)     # s = 1: a flat group, stays out
    assert not prop.outcome.pool_admitted and len(pool) == 0
