"""One round of the search self-play game: propose, check the questions, solve, reward.

    props = run_rollouts(proposer prompts x G_p)               # multi-turn, with search
    for each proposer trajectory:
        question = its final <question> (the parser's last complete action)
        reason   = check_question(...)                         # cheap filters, named reasons
        rag      = answer it from its own docs + k distractor doc sets; EM, else the judge
    failed slots <- distinct questions from the pool of past valid questions (flag)
    sols  = run_rollouts(every question x G_s)                 # ONE batched call
    solver reward   = correct (EM, else judge) / spam_divisor if the answer tag was spammed
                      (self_search_format_reward: 0.9 correct + 0.1 format, inference/self_search.py)
    proposer reward = 1 - acc  |  4 s (1 - s) over its solver group;  format_penalty if invalid
    pool <- each valid question whose solve rate s lies in [pool_min_solve_rate, pool_max_solve_rate]

One pipeline plays it (inference/pipeline.py): each proposer is checked, and its solver group starts, as soon as it
ends; each solver is graded as it ends. Under the turn schedule (or with a search back-end that may not run beside
the engine) the same pipeline runs in waves, one a turn (inference/step_loop.py, barrier). Both give the same round
for one seed.

Slots: slot i belongs to proposer trajectory i (its question when valid, else a pool question drawn by
FillPlan, else none); fixed QA questions take the slots after. Group ids: the G_p samples of proposer prompt i
share "s{step}-p{i}"; the G_s solver samples of slot j share "s{step}-q{j}"; round k >= 1 of a refilled step (training/loop/rounds.py)
names them "s{step}r{k}-p{i}" and "s{step}r{k}-q{j}". Rewards are written into the trajectories;
advantages are the trainer's business.

Failures are left out, never scored (mark_excluded). A failed judge call reads as "wrong",
which gives the solver 0 and the proposer 1 - acc = 1: an outage would pay the proposer. A
failed search shows the model "Search failed" as if it were evidence. So every trajectory
whose reward such a failure decided gets outcome.excluded = "judge_failed" | "search_failed"
(None otherwise), whole groups at a time (a group shares one baseline), and so does the
proposer group whose reward was read off an excluded solver group. The trainer drops them
from the loss; game/excluded_groups over game/groups is what training/guards.FailureGuard watches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from inference.data import ProposerRow
from inference.filters import SHORTCUT_FILTERS, SHORTCUT_REASONS, FilterConfig
# what the round shows (inference/game_metrics.py); its names stay importable from here too
from inference.game_metrics import (COUNT_KEYS, COUNT_PREFIXES, NO_QUESTION_WHY, SOURCES,  # noqa: F401
                                    answer_in_text, answer_is_first_title, is_count, no_question_why,
                                    one_search_answerable, rollout_record, shares, signal_counts)
from inference.game_metrics import mean_or_zero as _mean, round_stats as _stats
from inference.judge import Judge, JudgeItem
# the RAG check (inference/rag_check.py); its names stay importable from here too
from inference.rag_check import (QUESTION_SEARCH_NEEDS, RAG_INSTRUCTION, RAG_VERIFIERS,  # noqa: F401
                                 needs_question_search, rag_prompt, solver_view)
# the round's slots and its pipeline (inference/pipeline.py); qcp_of stays importable from here too
from inference.pool import POOL_SIZE, SEED_STEP, QuestionPool, admit_to_pool, pool_clear_due  # noqa: F401
from inference.pipeline import (QCP_DOC_CHARS, FillPlan, Played, RoundPipeline, judge_item,  # noqa: F401
                                proposer_requests, qa_question, qcp_of, slot_question, solver_requests)
from inference.rag_check import rag_rng
from inference.rewards import PROPOSER_REWARD_KINDS, is_answer_spam, proposer_reward, solver_reward
from inference.rollout import RolloutConfig, needs_barrier, search_attr
from inference.self_search import shape_solver_rewards
from inference.trajectory import GameMeta, Trajectory


SearchFn = Callable[[list[str], int], list[list[dict]]]
EXCLUSION_REASONS = ("judge_failed", "search_failed")
"""Why a group is left out of the loss; when a group has both, the first one names it."""


@dataclass
class GameConfig:
    """The game's settings. Each field's default is the one default of that setting: train.py's flags
    (training/settings/config.py) read it from here, so the two cannot drift apart."""
    # --- sampling ---
    proposer_n: int = 1
    """G_p: proposer rollouts per prompt. 1 is SSP's setting (PROPOSER_N=1); group-norm advantages
    then give the proposer no baseline, so pair G_p=1 with a batch or EMA baseline."""
    solver_n: int = 5
    """G_s: solver rollouts per question. SSP uses 5 (its n); the proposer's reward is read off this group."""
    template: str = "auto"
    """Chat template for both roles (inference.prompts.TEMPLATES)."""
    # --- cheap filters (inference/filters.py) ---
    min_question_chars: int = 10
    max_question_chars: int = 1000
    min_question_words: int = 10
    min_searches: int = 2
    """Distinct non-empty proposer searches required (SSP's code: 2)."""
    searches_at_least_n: bool = False
    """Also require the n searches the prompt asked for (the SSP paper's intent)."""
    # --- RAG check ---
    rag_verify: str = "policy"
    """Who answers the question from the proposer's documents: "judge" (the judge server, as SSP),
    "policy" (the policy itself, greedy, no search) or "off" (skip the check). Also "retrieval",
    "policy+retrieval". The policy by default: it needs no server, and it is the recipe shown to play on CPU
    (scripts/recipe.sh; with "off", "valid" did not mean answerable and the pool recycled questions no solver
    ever solved). With an LLM judge, pass "judge", as SSP does (scripts/train_common.sh does with JUDGE_URL)."""
    shortcut_filter: str = "off"
    """"title", "queries", "both" or "off": refuse shortcut questions, reward 0 (inference/filters.py)."""
    rag_distractors: int = 2
    """Document sets from other proposer trajectories mixed in, so a question that only looks
    answerable because its documents are the only ones shown still fails. 0 = own docs only. 2, not
    more: a small model's context is short, and the budget below drops distractors first anyway."""
    rag_max_tokens: int = 64
    """Room for the RAG answer (a short answer in <answer> tags); raise it for judges that think first."""
    rag_max_doc_chars: int = 1200
    """Each document's text is cut to this many characters in the RAG prompt."""
    rag_max_context_chars: int = 12000
    """All documents together; distractors are dropped first when over (~3k tokens)."""
    # --- pool of past valid questions ---
    use_pool: bool = True
    """Fill the solver slot of an invalid question with a past valid question, so the solver
    batch keeps its size while the proposer is still bad (SSP's get_random_existing_problems)."""
    pool_size: int = POOL_SIZE
    """Oldest questions are dropped past this; bounds memory and checkpoint size. The pool is cleared
    every pool_clear_every steps, so it seldom gets near it."""
    pool_min_solve_rate: float = 0.01
    """A fresh valid question joins the pool only when its solver group's solve rate s is at least this.
    0 admits never-solved questions; > 0 (the default) keeps them out: a group that is always wrong teaches
    nothing, and on CPU the pool otherwise recycled questions no solver ever solved (scripts/recipe.sh)."""
    pool_max_solve_rate: float = 0.99
    """... and at most this: SSP's reuse_success_rate_threshold (it keeps problems with success rate <=
    the threshold; its train_ssp.sh uses 1.0, i.e. every valid question). < 1 (the default) keeps out
    questions every solver answered, whose groups are flat and carry no gradient."""
    pool_clear_every: int = 10
    """Every N steps the trainer removes what the game admitted (SSP's pool_clear_interval, 10 in its
    train_ssp.sh), so stale questions do not outlive the policy that wrote them; rows seeded from a file
    (step SEED_STEP) stay. 0 = never."""
    # --- rewards ---
    proposer_reward: str = "auto"
    """"1-acc" (SSP's default: harder is better), "4s(1-s)" (favours questions solved half the time), or
    "auto": 1-acc when a RAG check rejects unanswerable questions, else 4s(1-s) (resolve_proposer_reward)."""
    format_penalty: float = -1.0
    """Proposer reward for an invalid question; below every valid reward (>= 0) so invalid is always worse."""
    spam_divisor: float = 4.0
    """Solver reward divisor when the answer tag is spammed (SSP divides by 4)."""
    max_answer_tags: int = 1
    """More <answer> openings than this, written by the model, is spam (inference/rewards.py)."""
    self_search_format_reward: bool = False
    """Self-search (SSRL): a solver's reward becomes 0.9 * correct + 0.1 * format (inference/self_search.py),
    so the policy keeps the tag structure its own <information> masking relies on."""
    seed: int = 0
    """Seeds distractor choice, document order and pool sampling (mixed with the step)."""

    def __post_init__(self) -> None:
        if self.proposer_n < 1 or self.solver_n < 1:
            raise ValueError(f"proposer_n and solver_n must be >= 1, got {self.proposer_n}, {self.solver_n}")
        if self.rag_verify not in RAG_VERIFIERS:
            raise ValueError(f"rag_verify must be one of {RAG_VERIFIERS}, got {self.rag_verify!r}")
        if self.shortcut_filter not in SHORTCUT_FILTERS:
            raise ValueError(f"shortcut_filter must be one of {SHORTCUT_FILTERS}, got {self.shortcut_filter!r}")
        self.proposer_reward = resolve_proposer_reward(self.proposer_reward, self.rag_verify)
        if self.proposer_reward not in PROPOSER_REWARD_KINDS:
            raise ValueError(f"proposer_reward must be auto or one of {PROPOSER_REWARD_KINDS}, "
                             f"got {self.proposer_reward!r}")
        if self.rag_distractors < 0 or self.pool_size < 1:
            raise ValueError(f"need rag_distractors >= 0 and pool_size >= 1, got {self.rag_distractors}, {self.pool_size}")
        if not 0.0 <= self.pool_min_solve_rate <= self.pool_max_solve_rate <= 1.0:
            raise ValueError(f"need 0 <= pool_min_solve_rate <= pool_max_solve_rate <= 1, got "
                             f"{self.pool_min_solve_rate}, {self.pool_max_solve_rate}")
        if self.pool_clear_every < 0:
            raise ValueError(f"pool_clear_every must be >= 0 (0 = never), got {self.pool_clear_every}")
        self.filter_config()  # validates the filter fields

    def filter_config(self) -> FilterConfig:
        return FilterConfig(self.min_question_chars, self.max_question_chars, self.min_question_words,
                            self.min_searches, self.searches_at_least_n, self.shortcut_filter in ("queries", "both"))

    def pool_admits(self, solve_rate: float) -> bool:
        """A fresh valid question with this solve rate over its solver group joins the pool."""
        return self.pool_min_solve_rate <= solve_rate <= self.pool_max_solve_rate


def resolve_proposer_reward(kind: str, rag_verify: str) -> str:
    """What proposer_reward "auto" stands for: 1-acc when a RAG check (judge or policy) rejects unanswerable
    questions, else 4s(1-s), since without the check 1-acc pays the most for a question that is wrong.
    Any other kind is kept."""
    if kind != "auto":
        return kind
    return "1-acc" if rag_verify != "off" else "4s(1-s)"


@dataclass
class GameResult:
    trajectories: list[Trajectory]     # proposer trajectories first, then solver trajectories
    stats: dict[str, float] = field(default_factory=dict)


# ---- the round's pieces ------------------------------------------------------------------------
# Each reads what it needs from the trajectories (answer, meta), so they can also be driven on hand-made
# trajectories. The question checks are the pipeline's (inference/pipeline.py), made as each proposer ends.

def _search_fns(search_fn: SearchFn | dict | None) -> tuple[SearchFn | None, SearchFn | None]:
    if isinstance(search_fn, dict):
        unknown = set(search_fn) - {"proposer", "solver"}
        if unknown:
            raise ValueError(f"search_fn dict keys must be 'proposer' and 'solver', got extra {sorted(unknown)}")
        return search_fn.get("proposer"), search_fn.get("solver")
    return search_fn, search_fn


def score(props: list[Trajectory], reasons: list[str | None], sols: list[Trajectory], judge: Judge,
          cfg: GameConfig, verdicts: list | None = None) -> None:
    """Write the rewards of both roles into the trajectories (and the why into their outcome). verdicts: the
    solvers' judge results when already graded (the pipeline grades each as it ends); None = grade them here."""
    items = [judge_item(t) for t in sols]
    if verdicts is None:
        verdicts = judge.judge_many(items)
    correct_by_prop: dict[int, list[float]] = {}
    for t, p, v in zip(sols, (it.answer for it in items), verdicts):
        spam = is_answer_spam(t.response_text, cfg.max_answer_tags)
        t.reward = solver_reward(v.correct, spam, cfg.spam_divisor)
        o = t.outcome
        o.pred, o.correct, o.judge_source, o.judge_failed, o.spam = p, v.correct, v.source, v.judge_failed, spam
        if t.meta.proposer is not None:
            correct_by_prop.setdefault(t.meta.proposer, []).append(float(v.correct))
    for i, t in enumerate(props):
        t.outcome.filter_reason, t.outcome.valid = reasons[i], reasons[i] is None
        if reasons[i] is None:
            if i not in correct_by_prop:
                raise ValueError(f"proposer trajectory {i} is valid but no solver trajectory answers its question")
            t.reward = proposer_reward(correct_by_prop[i], cfg.proposer_reward)
            t.outcome.solver_acc = _mean(correct_by_prop[i])
        else:  # a shortcut question is well formed, only too easy: 0, not the format penalty
            t.reward = 0.0 if reasons[i] in SHORTCUT_REASONS else cfg.format_penalty


def play_round(
    engine: Any,
    rows: Sequence[ProposerRow],
    search_fn: SearchFn | dict[str, SearchFn | None] | None,
    judge: Judge,
    cfg: GameConfig,
    rollout_cfg: RolloutConfig | dict[str, RolloutConfig],
    pool: QuestionPool | None = None,
    step: int = 0,
    qa_questions: Sequence[dict] = (),
    round_idx: int = 0,
) -> GameResult:
    """Play one round on `rows` (B proposer prompts); returns both roles' trajectories with rewards, and stats.

    search_fn: one backend's `search` for both roles, or {"proposer": fn, "solver": fn} (a
        missing key or None = no search tool for that role).
    judge: grades solver answers (Judge() = exact match only); with rag_verify="judge" it
        also answers the RAG check, so it then needs a server.
    pool: past valid questions; read to fill invalid slots (if cfg.use_pool; distinct questions, as many
        as it holds), then extended with this round's valid questions whose solve rate lies in
        [cfg.pool_min_solve_rate, cfg.pool_max_solve_rate] (admit_to_pool). None = no pool.
    step: names the group ids and seeds this round's choices.
    round_idx: k >= 1 (a refill round of the step) adds "r{k}" to the ids and its own seed.
    rollout_cfg: one RolloutConfig, or {"proposer": cfg, "solver": cfg} (e.g. self-search for one role).
    qa_questions: fixed QA pairs ({"question", "answer"}) the solver also plays this round
        (Search-R1-style data, mixed in or alone when `rows` is empty: self-play off).
    """
    if cfg.rag_verify == "judge" and judge.mode != "llm":
        raise ValueError("rag_verify='judge' needs a judge server (Judge(url=...)); "
                         "use rag_verify='policy' or 'off' to run without one")
    if not rows and not qa_questions:
        raise ValueError("play_round needs at least one proposer row or QA question")
    prop_search, solver_search = _search_fns(search_fn)
    q_search = question_searcher(cfg, solver_search)  # refuses a back-end the question checks cannot use
    tag = step if not round_idx else f"{step}r{round_idx}"   # the group ids' "s{tag}-"
    judge_before = dict(judge.stats)

    prop_rcfg, sol_rcfg = ((rollout_cfg["proposer"], rollout_cfg["solver"]) if isinstance(rollout_cfg, dict)
                           else (rollout_cfg, rollout_cfg))
    n_props = len(rows) * cfg.proposer_n
    plan = FillPlan(pool.shuffled() if (pool is not None and cfg.use_pool) else [], n_props)
    rng_for = lambda i: rag_rng(cfg.seed, tag, i)  # noqa: E731  candidate i's own draws, in both schedules
    barrier = needs_barrier(prop_rcfg, prop_search) or needs_barrier(sol_rcfg, solver_search)
    probe_search = uncounted(solver_search)   # a metric's search, not the policy's: not in search/calls
    played = RoundPipeline(engine, judge, cfg, prop_search, solver_search, prop_rcfg, sol_rcfg, tag, plan, rng_for,
                           q_search, barrier, lambda qs, ans: one_search_answerable(qs, ans, probe_search, sol_rcfg.topk)
                           ).play(rows, qa_questions)
    props, reasons, verdict, fills, sols = played.props, played.reasons, played.verdict, played.fills, played.sols
    valid = [i for i, why in enumerate(reasons) if why is None]
    qcps = {i: qcp_of(props[i]) for i in valid}
    score(props, reasons, sols, judge, cfg, played.sol_verdicts)
    for i, t in enumerate(props):
        t.outcome.rag = verdict.get(i)
    excluded = mark_excluded(props, sols, verdict)
    # after the fills were drawn, so a round never re-asks its own fresh questions; after scoring, so each
    # question's solve rate is known
    admitted = admit_to_pool(pool, props, sols, valid, qcps, cfg, step) if pool is not None else 0

    one_search = played.probe   # asked by the pipeline once every proposer was decided
    for f in fills:   # FillPlan hands out the pool's own items: each counts its servings, this one included
        f["served"] = f.get("served", 0) + 1
    stats = _stats(props, sols, reasons, verdict, len(fills), pool, [f["question"] for f in fills], one_search,
                   admitted=admitted, rows=rows, served_counts=[f["served"] for f in fills])
    stats.update(excluded)
    stats["game/pipelined"] = float(not barrier)  # 1: no barrier (the trajectory schedule); 0: in waves, one a turn
    for k in ("calls", "failures", "cache_hits", "em_hits", "unparsed"):
        stats[f"judge/{k}"] = judge.stats[k] - judge_before[k]
    if cfg.self_search_format_reward:
        # reward shaping: after the stats (they report the rewards as scored), before counting the informative
        # groups again, since the shaping decides which solver groups are flat
        shape_solver_rewards(sols, cfg.spam_divisor)
        stats.update(signal_counts(sols))
    return GameResult(props + sols, stats)


def question_searcher(cfg: GameConfig, solver_search: Any) -> Any:
    """The question checks' search (rag_check.py): the solver's, uncounted as the probe's; None when none searches."""
    if needs_question_search(cfg) and (solver_search is None or search_attr(solver_search, "wants_context", False)):
        raise ValueError(QUESTION_SEARCH_NEEDS)
    return uncounted(solver_search) if needs_question_search(cfg) else None


def uncounted(search: Any) -> Any:
    """The probe's search: a metric's, not the policy's, so it must not count in search/calls (a counting wrapper
    offers `uncounted`, training/search.TimedSearch). A simulated backend stays as it is: the probe skips it."""
    if search is None or search_attr(search, "wants_context", False):
        return search
    return search_attr(search, "uncounted", search)


def mark_excluded(props: list[Trajectory], sols: list[Trajectory], verdict: dict[int, bool | None]) -> dict[str, int]:
    """Set outcome.excluded on every trajectory (a reason from EXCLUSION_REASONS, or None); returns the counts.

    Own failures: a solver trajectory whose judging failed (outcome.judge_failed) or whose search
    failed (search_failed > 0, counted by the rollout); a proposer trajectory whose search
    failed or whose RAG check was undecided (verdict None). Then, whole groups: a group with an
    excluded member is excluded, and a proposer trajectory whose reward came from an excluded
    solver group (meta.proposer) is excluded with that group's reason, and its group too.
    Call after score(), which records judge_failed.
    """
    rank = {r: k for k, r in enumerate(EXCLUSION_REASONS)}

    def first(*reasons: str | None) -> str | None:
        named = [r for r in reasons if r]
        return min(named, key=rank.__getitem__) if named else None

    def own(t: Trajectory, rag_undecided: bool = False) -> str | None:
        return first("judge_failed" if (t.outcome.judge_failed or rag_undecided) else None,
                     "search_failed" if t.search_failed > 0 else None)

    def by_group(trajs: Sequence[Trajectory], reasons: list[str | None]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for t, r in zip(trajs, reasons):
            out[t.group_id] = first(out.get(t.group_id), r)
        return out

    sol_groups = by_group(sols, [own(t) for t in sols])
    prop_reasons = [own(t, i in verdict and verdict[i] is None) for i, t in enumerate(props)]
    for t in sols:  # a proposer's reward is read off its solver group
        p = t.meta.proposer
        if p is not None:
            prop_reasons[p] = first(prop_reasons[p], sol_groups[t.group_id])
    prop_groups = by_group(props, prop_reasons)
    for t in props:
        t.outcome.excluded = prop_groups[t.group_id]
    for t in sols:
        t.outcome.excluded = sol_groups[t.group_id]

    groups = [*prop_groups.values(), *sol_groups.values()]
    counts = {"game/groups": len(groups), "game/excluded_groups": sum(r is not None for r in groups),
              "game/excluded_trajs": sum(t.outcome.excluded is not None for t in props + sols)}
    for reason in EXCLUSION_REASONS:
        counts[f"game/excluded/{reason}"] = sum(r == reason for r in groups)
    return counts
