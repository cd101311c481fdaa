"""One round of the search self-play game: propose, validate, solve, reward.

    props = run_rollouts(proposer prompts x G_p)               # multi-turn, with search
    for each proposer trajectory:
        question = its final <question> (the parser's last complete action)
        reason   = check_question(...)                         # cheap filters, named reasons
        rag      = answer it from its own docs + k distractor doc sets; EM, else the judge
    failed slots <- questions from the pool of past valid questions (flag)
    sols  = run_rollouts(every question x G_s)                 # ONE batched call
    solver reward   = correct (EM, else judge) / spam_divisor if the answer tag was spammed
    proposer reward = 1 - acc  |  4 s (1 - s) over its solver group;  invalid_penalty if invalid

Group ids: the G_p samples of proposer prompt i share "s{step}-p{i}"; the G_s solver
samples of question j share "s{step}-q{j}"; round k >= 1 of a refilled step (training/rounds.py)
names them "s{step}r{k}-p{i}" and "s{step}r{k}-q{j}". Rewards are written into the trajectories;
advantages are the trainer's business.

Failures are left out, never scored (mark_excluded). A failed judge call reads as "wrong",
which gives the solver 0 and the proposer 1 - acc = 1: an outage would pay the proposer. A
failed search shows the model "Search failed" as if it were evidence. So every trajectory
whose reward such a failure decided gets info["excluded"] = "judge_failed" | "search_failed"
(None otherwise), whole groups at a time (a group shares one baseline), and so does the
proposer group whose reward was read off an excluded solver group. The trainer drops them
from the loss; game/excluded_groups over game/groups is what training/guards.FailureGuard watches.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from inference.data import ProposerRow
from inference.filters import FILTER_REASONS, FilterConfig, check_question
from inference.judge import Judge, JudgeItem
from inference.prompts import (build_proposer_prompt, build_solver_prompt, doc_title, encode_prompt, format_docs,
                               render_chat)
from inference.rewards import PROPOSER_REWARD_KINDS, extract_answer, is_answer_spam, proposer_reward, solver_reward
from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts
from inference.self_search import build_self_search_prompt
from inference.trajectory import Trajectory
from utils.text import contains_answer, exact_match, normalize_answer

log = logging.getLogger(__name__)

SearchFn = Callable[[list[str], int], list[list[dict]]]
RAG_VERIFIERS = ("judge", "policy", "off")
EXCLUSION_REASONS = ("judge_failed", "search_failed")
"""Why a group is left out of the loss; when a group has both, the first one names it."""


@dataclass
class GameConfig:
    # --- sampling ---
    proposer_samples: int = 1
    """G_p: proposer rollouts per prompt. 1 is SSP's setting (PROPOSER_N=1); group-norm advantages
    then give the proposer no baseline, so pair G_p=1 with a batch or EMA baseline."""
    solver_samples: int = 5
    """G_s: solver rollouts per question. SSP uses 5; the proposer's reward is read off this group."""
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
    rag_verifier: str = "judge"
    """Who answers the question from the proposer's documents: "judge" (the judge server, as SSP),
    "policy" (the policy itself, greedy, no search) or "off" (skip the check)."""
    rag_distractors: int = 4
    """Document sets from other proposer trajectories mixed in, so a question that only looks
    answerable because its documents are the only ones shown still fails. 0 = own docs only."""
    rag_max_tokens: int = 64
    """Room for the RAG answer (a short answer in <answer> tags); raise it for judges that think first."""
    rag_max_doc_chars: int = 1200
    """Each document's text is cut to this many characters in the RAG prompt."""
    rag_max_context_chars: int = 12000
    """All documents together; distractors are dropped first when over (~3k tokens)."""
    # --- pool of past valid questions ---
    pool_fill: bool = True
    """Fill the solver slot of an invalid question with a past valid question, so the solver
    batch keeps its size while the proposer is still bad (SSP's get_random_existing_problems)."""
    pool_size: int = 1024
    """Oldest questions are dropped past this; bounds memory and checkpoint size."""
    # --- rewards ---
    proposer_reward: str = "1-acc"
    """"1-acc" (SSP's default: harder is better) or "4s(1-s)" (favours questions solved half the time)."""
    invalid_penalty: float = -1.0
    """Proposer reward for an invalid question; below every valid reward (>= 0) so invalid is always worse."""
    spam_divisor: float = 4.0
    """Solver reward divisor when the answer tag is spammed (SSP divides by 4)."""
    max_answer_tags: int = 1
    """More <answer> openings than this, written by the model, is spam (inference/rewards.py)."""
    seed: int = 0
    """Seeds distractor choice, document order and pool sampling (mixed with the step)."""

    def __post_init__(self) -> None:
        if self.proposer_samples < 1 or self.solver_samples < 1:
            raise ValueError(f"proposer_samples and solver_samples must be >= 1, got {self.proposer_samples}, {self.solver_samples}")
        if self.rag_verifier not in RAG_VERIFIERS:
            raise ValueError(f"rag_verifier must be one of {RAG_VERIFIERS}, got {self.rag_verifier!r}")
        if self.proposer_reward not in PROPOSER_REWARD_KINDS:
            raise ValueError(f"proposer_reward must be one of {PROPOSER_REWARD_KINDS}, got {self.proposer_reward!r}")
        if self.rag_distractors < 0 or self.pool_size < 1:
            raise ValueError(f"need rag_distractors >= 0 and pool_size >= 1, got {self.rag_distractors}, {self.pool_size}")
        self.filter_config()  # validates the filter fields

    def filter_config(self) -> FilterConfig:
        return FilterConfig(self.min_question_chars, self.max_question_chars, self.min_question_words,
                            self.min_searches, self.searches_at_least_n)


class QuestionPool:
    """Past valid questions with their answers: bounded FIFO, de-duplicated, serialisable for checkpoints."""

    def __init__(self, max_size: int = 1024, seed: int = 0):
        self.max_size = max_size
        self.items: deque[dict] = deque(maxlen=max_size)
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, question: str, answer: Any, step: int = 0, qcp: dict | None = None) -> None:
        """qcp: the question's construction path (qcp_of), kept for the solver's self-distillation teacher."""
        key = normalize_answer(question)
        if any(normalize_answer(it["question"]) == key for it in self.items):
            return
        self.items.append({"question": question, "answer": answer, "step": step, **({"qcp": qcp} if qcp else {})})

    def sample(self, k: int) -> list[dict]:
        """k questions, distinct while the pool has enough."""
        if not self.items or k <= 0:
            return []
        items = list(self.items)
        if k <= len(items):
            return self.rng.sample(items, k)
        return [self.rng.choice(items) for _ in range(k)]

    def to_list(self) -> list[dict]:
        return [dict(it) for it in self.items]

    @classmethod
    def from_list(cls, items: Sequence[dict], max_size: int = 1024, seed: int = 0) -> "QuestionPool":
        pool = cls(max_size, seed)
        for it in items:
            pool.add(it["question"], it["answer"], it.get("step", 0), it.get("qcp"))
        return pool


QCP_DOC_CHARS = 1200  # a stored document's contents are cut here (the teacher's token budget cuts again)


def qcp_of(t: Trajectory) -> dict:
    """A proposer trajectory's question construction path (QCP): its queries in order and the documents
    each returned. The solver's self-distillation teacher reads it as privileged context (issue 22;
    inference/prompts.teacher_context)."""
    docs = [[{"id": str(d.get("id", "")), "contents": str(d.get("contents", ""))[:QCP_DOC_CHARS]} for d in call]
            for call in (t.info.get("docs") or [])]
    return {"queries": [str(q) for q in (t.info.get("queries") or [])], "docs": docs}


@dataclass
class GameResult:
    trajectories: list[Trajectory]     # proposer trajectories first, then solver trajectories
    stats: dict[str, float] = field(default_factory=dict)


# ---- RAG check -------------------------------------------------------------------------------

RAG_INSTRUCTION = (
    "Answer the question using only the documents below. Give just the short answer inside "
    "<answer> and </answer>.\n\n"
    "Example:\nDocuments:\nDoc 1 (Title: Eiffel Tower) The Eiffel Tower in Paris was designed by the engineering "
    "company of Gustave Eiffel.\nQuestion: Whose company designed the landmark tower in Paris?\n"
    "<answer> Gustave Eiffel </answer>\n\n"
    "Documents:\n{docs}Question: {question}\n"
)


def _flat_docs(docs: Sequence[Sequence[dict]]) -> list[dict]:
    seen, out = set(), []
    for call in docs:
        for d in call:
            key = d.get("id") or d.get("contents")
            if key not in seen and str(d.get("contents", "")).strip():
                seen.add(key)
                out.append(d)
    return out


def rag_prompt(question: str, own: list[dict], distractors: list[dict], cfg: GameConfig, rng: random.Random,
               fits: Callable[[str], bool] = lambda s: True) -> str:
    """The RAG-check user message: own docs always, distractors while they fit, all in shuffled order.

    Over budget, distractors go first; then every document is shortened, halving until it fits.
    """
    own_ids = {d.get("id") for d in own}
    extra = [d for d in distractors if d.get("id") not in own_ids]
    doc_chars = cfg.rag_max_doc_chars
    while True:
        chosen = [{**d, "contents": str(d.get("contents", ""))[:doc_chars]} for d in own]
        budget = cfg.rag_max_context_chars - sum(len(d["contents"]) for d in chosen)
        for d in extra:
            d = {**d, "contents": str(d.get("contents", ""))[:doc_chars]}
            if len(d["contents"]) <= budget:
                chosen.append(d)
                budget -= len(d["contents"])
        rng.shuffle(chosen)
        text = RAG_INSTRUCTION.format(docs=format_docs(chosen), question=question.strip())
        if (budget >= 0 and fits(text)) or doc_chars <= 50:
            return text
        if extra:
            extra = []
        else:
            doc_chars //= 2


def _rag_answer_text(reply: str | None) -> str | None:
    if reply is None:
        return None
    ans = extract_answer(reply)
    if ans is None:  # a verifier that ignored the tags: take its first non-empty line
        lines = [ln.strip() for ln in reply.replace("<answer>", "").splitlines() if ln.strip()]
        ans = lines[0] if lines else ""
    return ans


def rag_check(candidates: list[int], props: list[Trajectory], engine: Any, judge: Judge, cfg: GameConfig,
              rng: random.Random) -> dict[int, bool | None]:
    """RAG verdict per candidate proposer index: True pass, False fail, None when it could not be decided
    (the verifier gave no reply, or the judge failed on a non-exact-match answer).

    Distractors come from trajectories of *other* proposer prompts (info["meta"]["row"]): the
    G_p samples of one prompt search around the same answer, so their documents would help.
    """
    if not candidates:
        return {}
    prompts = []
    for i in candidates:
        row = props[i].info["meta"]["row"]
        others = [j for j, t in enumerate(props) if t.info["meta"]["row"] != row and _flat_docs(t.info.get("docs", []))]
        picked = rng.sample(others, min(cfg.rag_distractors, len(others)))
        distractors = [d for j in picked for d in _flat_docs(props[j].info["docs"])]
        prompts.append((i, distractors))

    if cfg.rag_verifier == "policy":
        from inference.engines import SamplingConfig

        tok = engine.tokenizer
        limit = int(getattr(engine, "max_model_len", 4096)) - cfg.rag_max_tokens

        def ids_of(text: str) -> list[int]:
            return encode_prompt(tok, render_chat(tok, text, cfg.template), cfg.template)

        texts = [rag_prompt(props[i].question, _flat_docs(props[i].info["docs"]), dis, cfg, rng,
                            fits=lambda t: len(ids_of(t)) < limit) for i, dis in prompts]
        outs = engine.generate([ids_of(t) for t in texts],
                               SamplingConfig(temperature=0.0, max_tokens=cfg.rag_max_tokens, stop=["</answer>"]))
        replies: list[str | None] = [o.text for o in outs]
    else:
        texts = [rag_prompt(props[i].question, _flat_docs(props[i].info["docs"]), dis, cfg, rng) for i, dis in prompts]
        replies = judge.chat_many([[{"role": "user", "content": t}] for t in texts], max_tokens=cfg.rag_max_tokens)

    verdict: dict[int, bool | None] = {}
    ask = []
    for (i, _), reply in zip(prompts, replies):
        pred = _rag_answer_text(reply)
        props[i].info["rag_answer"] = pred
        if pred is None:
            verdict[i] = None
        elif exact_match(pred, props[i].answer):
            verdict[i] = True
        else:
            ask.append((i, pred))
    results = judge.judge_many([JudgeItem(props[i].question, props[i].answer, p) for i, p in ask])
    for (i, _), res in zip(ask, results):
        # A judge that is down decides nothing: "wrong" would give the proposer the invalid penalty
        # for an outage. Undecided passes unchecked, and mark_excluded leaves the proposer group out.
        verdict[i] = None if res.judge_failed else res.correct
    return verdict


# ---- the round, in stages ----------------------------------------------------------------------
# Each stage reads what it needs from the trajectories (answer, info["meta"]), so the
# stages can also be driven on hand-made trajectories.

def _search_fns(search_fn: SearchFn | dict | None) -> tuple[SearchFn | None, SearchFn | None]:
    if isinstance(search_fn, dict):
        unknown = set(search_fn) - {"proposer", "solver"}
        if unknown:
            raise ValueError(f"search_fn dict keys must be 'proposer' and 'solver', got extra {sorted(unknown)}")
        return search_fn.get("proposer"), search_fn.get("solver")
    return search_fn, search_fn


def propose(engine: Any, rows: Sequence[ProposerRow], search_fn: SearchFn | None, cfg: GameConfig,
            rollout_cfg: RolloutConfig, step: int | str) -> list[Trajectory]:
    """G_p proposer rollouts per row; the G_p samples of row i share group id "s{step}-p{i}"."""
    reqs = []
    for i, row in enumerate(rows):
        ids = build_proposer_prompt(engine.tokenizer, row.answer, row.search_turns, cfg.template)
        reqs += [RolloutRequest("proposer", f"s{step}-p{i}", ids, answer=row.answer,
                                meta={"search_turns": row.search_turns, "row": i})] * cfg.proposer_samples
    return run_rollouts(engine, reqs, search_fn, rollout_cfg)


def validate(props: list[Trajectory], engine: Any, judge: Judge, cfg: GameConfig,
             rng: random.Random) -> tuple[list[str | None], dict[int, bool | None]]:
    """Per proposer trajectory, the reason it is invalid (None = valid), and the RAG verdicts.

    The question is the rollout's final <question> action (parsed by inference/parser.py);
    a trajectory that stopped any other way has none.
    """
    fcfg = cfg.filter_config()
    reasons: list[str | None] = []
    for t in props:
        q = t.question if t.stop_reason == "question" else None
        reasons.append(check_question(q, t.answer, t.info.get("queries", []), t.info.get("docs", []),
                                      t.info["meta"]["search_turns"], fcfg))
    survivors = [i for i, why in enumerate(reasons) if why is None]
    if cfg.rag_verifier == "off":
        return reasons, {i: True for i in survivors}
    verdict = rag_check(survivors, props, engine, judge, cfg, rng)
    unavailable = sum(v is None for v in verdict.values())
    if unavailable:
        # SSP lets a question through when its RAG check errors; the count is in the stats, and
        # mark_excluded leaves those proposer groups out of the loss (their validity is unknown).
        log.warning("RAG check undecided for %d questions (verifier or judge failed); they pass unchecked "
                    "and their proposer groups are left out of the loss", unavailable)
    for i in survivors:
        if verdict[i] is False:
            reasons[i] = "rag_failed"
    return reasons, verdict


def solve(engine: Any, questions: list[dict], search_fn: SearchFn | None, cfg: GameConfig,
          rollout_cfg: RolloutConfig, step: int | str) -> list[Trajectory]:
    """G_s solver rollouts per question in ONE batched call; question j's group is "s{step}-q{j}".

    questions: {"question", "answer", "proposer": index of the proposer trajectory or None (from the pool)}.
    """
    reqs = []
    for j, q in enumerate(questions):
        ids = (build_self_search_prompt if rollout_cfg.self_search else build_solver_prompt)(
            engine.tokenizer, q["question"], cfg.template)
        source = q.get("source", "proposer" if q["proposer"] is not None else "pool")
        meta = {"proposer": q["proposer"], "from_pool": source == "pool", "source": source, "qcp": q.get("qcp")}
        reqs += [RolloutRequest("solver", f"s{step}-q{j}", ids, question=q["question"], answer=q["answer"],
                                meta=meta)] * cfg.solver_samples
    return run_rollouts(engine, reqs, search_fn, rollout_cfg) if reqs else []


def score(props: list[Trajectory], reasons: list[str | None], sols: list[Trajectory], judge: Judge,
          cfg: GameConfig) -> None:
    """Write the rewards of both roles into the trajectories (and the why into their info)."""
    preds = [extract_answer(t.response_text) for t in sols]
    verdicts = judge.judge_many([JudgeItem(t.question, t.answer, p) for t, p in zip(sols, preds)])
    correct_by_prop: dict[int, list[float]] = {}
    for t, p, v in zip(sols, preds, verdicts):
        spam = is_answer_spam(t.response_text, cfg.max_answer_tags)
        t.reward = solver_reward(v.correct, spam, cfg.spam_divisor)
        t.info.update(pred=p, correct=v.correct, judge_source=v.source, judge_failed=v.judge_failed, spam=spam,
                      from_pool=t.info["meta"]["from_pool"])
        if t.info["meta"]["proposer"] is not None:
            correct_by_prop.setdefault(t.info["meta"]["proposer"], []).append(float(v.correct))
    for i, t in enumerate(props):
        t.info.update(filter_reason=reasons[i], valid=reasons[i] is None)
        if reasons[i] is None:
            if i not in correct_by_prop:
                raise ValueError(f"proposer trajectory {i} is valid but no solver trajectory answers its question")
            t.reward = proposer_reward(correct_by_prop[i], cfg.proposer_reward)
            t.info["solver_acc"] = _mean(correct_by_prop[i])
        else:
            t.reward = cfg.invalid_penalty


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
    judge: grades solver answers (Judge() = exact match only); with rag_verifier="judge" it
        also answers the RAG check, so it then needs a server.
    pool: past valid questions; read to fill invalid slots (if cfg.pool_fill), then extended
        with this round's valid questions. None = no pool.
    step: names the group ids and seeds this round's choices; round_idx k >= 1 (a refill round of the
        step) adds "r{k}" to the ids and its own seed.
    rollout_cfg: one RolloutConfig, or {"proposer": cfg, "solver": cfg} (e.g. self-search for one role).
    qa_questions: fixed QA pairs ({"question", "answer"}) the solver also plays this round
        (Search-R1-style data, mixed in or alone when `rows` is empty: self-play off).
    """
    if cfg.rag_verifier == "judge" and judge.mode != "llm":
        raise ValueError("rag_verifier='judge' needs a judge server (Judge(url=...)); "
                         "use rag_verifier='policy' or 'off' to run without one")
    if not rows and not qa_questions:
        raise ValueError("play_round needs at least one proposer row or QA question")
    prop_search, solver_search = _search_fns(search_fn)
    rng = random.Random(cfg.seed * 1_000_003 + step if not round_idx else f"{cfg.seed}/{step}/{round_idx}")
    tag = step if not round_idx else f"{step}r{round_idx}"   # the group ids' "s{tag}-"
    judge_before = dict(judge.stats)

    prop_rcfg, sol_rcfg = ((rollout_cfg["proposer"], rollout_cfg["solver"]) if isinstance(rollout_cfg, dict)
                           else (rollout_cfg, rollout_cfg))
    props = propose(engine, rows, prop_search, cfg, prop_rcfg, tag) if rows else []
    reasons, verdict = validate(props, engine, judge, cfg, rng) if props else ([], {})
    valid = [i for i, why in enumerate(reasons) if why is None]
    qcps = {i: qcp_of(props[i]) for i in valid}
    questions = [{"question": props[i].question, "answer": props[i].answer, "proposer": i, "qcp": qcps[i]}
                 for i in valid]
    fills = pool.sample(len(props) - len(valid)) if (pool is not None and cfg.pool_fill) else []
    questions += [{"question": f["question"], "answer": f["answer"], "proposer": None, "qcp": f.get("qcp")}
                  for f in fills]
    questions += [{"question": q["question"], "answer": q["answer"], "proposer": None, "source": "qa"}
                  for q in qa_questions]
    if pool is not None:   # after filling, so a round never re-asks its own fresh questions
        for i in valid:
            pool.add(props[i].question, props[i].answer, step, qcps[i])
    sols = solve(engine, questions, solver_search, cfg, sol_rcfg, tag)
    score(props, reasons, sols, judge, cfg)
    for i, t in enumerate(props):
        t.info["rag"] = verdict.get(i)
    excluded = mark_excluded(props, sols, verdict)

    one_search = one_search_answerable([props[i].question for i in valid], [props[i].answer for i in valid],
                                       solver_search, sol_rcfg.topk)
    stats = _stats(props, sols, reasons, verdict, len(fills), pool, [f["question"] for f in fills], one_search)
    stats.update(excluded)
    for k in ("calls", "failures", "cache_hits", "em_hits", "unparsed"):
        stats[f"judge/{k}"] = judge.stats[k] - judge_before[k]
    return GameResult(props + sols, stats)


def mark_excluded(props: list[Trajectory], sols: list[Trajectory], verdict: dict[int, bool | None]) -> dict[str, int]:
    """Set info["excluded"] on every trajectory (a reason from EXCLUSION_REASONS, or None); returns the counts.

    Own failures: a solver trajectory whose judging failed (info["judge_failed"]) or whose search
    failed (info["search_failed"] > 0, counted by the rollout); a proposer trajectory whose search
    failed or whose RAG check was undecided (verdict None). Then, whole groups: a group with an
    excluded member is excluded, and a proposer trajectory whose reward came from an excluded
    solver group (info["meta"]["proposer"]) is excluded with that group's reason, and its group too.
    Call after score(), which records judge_failed.
    """
    rank = {r: k for k, r in enumerate(EXCLUSION_REASONS)}

    def first(*reasons: str | None) -> str | None:
        named = [r for r in reasons if r]
        return min(named, key=rank.__getitem__) if named else None

    def own(t: Trajectory, rag_undecided: bool = False) -> str | None:
        return first("judge_failed" if (t.info.get("judge_failed") or rag_undecided) else None,
                     "search_failed" if t.info.get("search_failed", 0) > 0 else None)

    def by_group(trajs: Sequence[Trajectory], reasons: list[str | None]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for t, r in zip(trajs, reasons):
            out[t.group_id] = first(out.get(t.group_id), r)
        return out

    sol_groups = by_group(sols, [own(t) for t in sols])
    prop_reasons = [own(t, i in verdict and verdict[i] is None) for i, t in enumerate(props)]
    for t in sols:  # a proposer's reward is read off its solver group
        p = t.info["meta"].get("proposer")
        if p is not None:
            prop_reasons[p] = first(prop_reasons[p], sol_groups[t.group_id])
    prop_groups = by_group(props, prop_reasons)
    for t in props:
        t.info["excluded"] = prop_groups[t.group_id]
    for t in sols:
        t.info["excluded"] = sol_groups[t.group_id]

    groups = [*prop_groups.values(), *sol_groups.values()]
    counts = {"game/groups": len(groups), "game/excluded_groups": sum(r is not None for r in groups),
              "game/excluded_trajs": sum(t.info["excluded"] is not None for t in props + sols)}
    for reason in EXCLUSION_REASONS:
        counts[f"game/excluded/{reason}"] = sum(r == reason for r in groups)
    return counts


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def answer_is_first_title(t: Trajectory) -> bool:
    """The proposer's answer is the title of Doc 1 of its first search: a question built on that page alone
    is one the "search once, answer Doc 1's title" heuristic (issue 21) may solve without the later searches."""
    docs = t.info.get("docs") or []
    title = doc_title(docs[0][0]) if docs and docs[0] else ""
    return bool(title) and bool(exact_match(title, t.answer))


# ---- what the round shows: counts the trainer sums over ranks, and the shares made from them -------------

NO_QUESTION_WHY = ("turn_cap", "total_cap", "out_of_turns", "eos", "no_action", "empty")
"""Why a proposer rollout ended without a question: its turn hit --max_tokens_per_turn, the trajectory hit its
total budget, it still searched in its last turn, it stopped (EOS) or wrote no usable action, or its
<question></question> was empty."""
SOURCES = ("fresh", "pool", "qa")
"""Where a solver question came from: this round's proposer, the pool of earlier valid questions, fixed QA rows."""
COUNT_KEYS = frozenset({
    "game/groups", "game/excluded_groups", "game/excluded_trajs", "game/proposer_trajs", "game/questions",
    "game/pool_fills", "game/pool_repeats", "game/pool_served_trajs", "game/pool_served_correct",
    "game/rag_checked", "game/rag_unavailable", "game/valid_questions", "game/valid_doc1_title",
    "game/valid_answer_in_text", "game/valid_probed", "game/valid_one_search", "game/no_question",
    "game/fresh_s0", "game/fresh_mid", "game/fresh_s1", "game/rounds",
    "solver/fresh_trajs", "solver/fresh_correct", "solver/judge_failed"})
COUNT_PREFIXES = ("game/filter/", "game/no_question/", "game/excluded/", "game/solver_groups", "game/informative_groups")


def is_count(key: str) -> bool:
    """A game stat that is a count, summed over ranks; every other game stat is a per-rank mean."""
    return key in COUNT_KEYS or key.startswith(COUNT_PREFIXES)


def no_question_why(t: Trajectory) -> str | None:
    """NO_QUESTION_WHY's reason a proposer trajectory has no question; None when it wrote one."""
    if t.stop_reason == "question":
        return None if (t.question or "").strip() else "empty"
    if t.stop_reason == "max_tokens":
        return "total_cap" if t.info.get("cap") == "total" else "turn_cap"
    return {"max_turns": "out_of_turns", "eos": "eos"}.get(t.stop_reason, "no_action")


def signal_counts(sols: Sequence[Trajectory]) -> dict[str, float]:
    """Solver groups, and the informative ones among them (rewards not all equal: the only groups a group
    baseline gives any gradient), in all and per SOURCES. A group left out of the loss (info["excluded"])
    carries no signal. Call again after anything reshapes the rewards (self-search's format reward)."""
    groups: dict[str, tuple[str, set, bool]] = {}
    for t in sols:
        src, rewards, excl = groups.get(t.group_id, (t.info["meta"].get("source", "fresh"), set(), False))
        rewards.add(round(float(t.reward), 9))
        groups[t.group_id] = (src if src != "proposer" else "fresh", rewards, excl or bool(t.info.get("excluded")))
    out = {"game/solver_groups": 0.0, "game/informative_groups": 0.0}
    for src in SOURCES:
        out[f"game/solver_groups/{src}"] = out[f"game/informative_groups/{src}"] = 0.0
    for src, rewards, excl in groups.values():
        live = float(len(rewards) > 1 and not excl)
        out["game/solver_groups"] += 1
        out["game/informative_groups"] += live
        out[f"game/solver_groups/{src}"] += 1
        out[f"game/informative_groups/{src}"] += live
    return out


def shares(summed: dict[str, float]) -> dict[str, float]:
    """The shares of a step (or window) read off counts summed over ranks; a share with no denominator is left
    out (no value, not 0)."""
    def ratio(key: str, num: str | Sequence[str], den: str) -> None:
        d = summed.get(den, 0.0)
        if d:
            out[key] = sum(summed.get(n, 0.0) for n in ([num] if isinstance(num, str) else num)) / d
    out: dict[str, float] = {}
    ratio("game/informative_share", "game/informative_groups", "game/solver_groups")
    for src in SOURCES:
        ratio(f"game/informative_share/{src}", f"game/informative_groups/{src}", f"game/solver_groups/{src}")
    ratio("solver/acc_fresh", "solver/fresh_correct", "solver/fresh_trajs")
    fresh = ("game/fresh_s0", "game/fresh_mid", "game/fresh_s1")
    summed = {**summed, "game/fresh_questions": sum(summed.get(k, 0.0) for k in fresh)}
    for k in fresh:
        ratio(k + "_share", k, "game/fresh_questions")
    ratio("game/valid_doc1_title_share", "game/valid_doc1_title", "game/valid_questions")
    ratio("game/valid_answer_in_text_share", "game/valid_answer_in_text", "game/valid_questions")
    ratio("game/valid_one_search_share", "game/valid_one_search", "game/valid_probed")
    ratio("game/no_question_share", "game/no_question", "game/proposer_trajs")
    ratio("game/pool_served_acc", "game/pool_served_correct", "game/pool_served_trajs")
    return out


def rollout_record(t: Trajectory) -> dict:
    """One trajectory as a JSON line for reading what the game plays (--dump_rollouts): the text, the reward and
    every why the round recorded. Token ids stay out; the documents appear as the titles each search returned."""
    keys = ("filter_reason", "valid", "rag", "rag_answer", "solver_acc", "pred", "correct", "spam", "excluded", "cap")
    return {"role": t.role, "group_id": t.group_id, "source": t.info.get("meta", {}).get("source"),
            "question": t.question, "answer": t.answer, "reward": t.reward, "stop_reason": t.stop_reason,
            "no_question": no_question_why(t) if t.role == "proposer" else None,
            "turns": t.num_turns, "searches": t.num_searches, "sampled_tokens": t.num_sampled,
            "queries": t.info.get("queries", []),
            "titles": [[doc_title(d) for d in call] for call in (t.info.get("docs") or [])],
            "response": t.response_text, **{k: t.info[k] for k in keys if k in t.info}}


def answer_in_text(t: Trajectory) -> bool:
    """The answer (any alias) sits in the text of a document the proposer retrieved, title line left out: a
    question about a fact read off a page, not only about the page's name."""
    return any(contains_answer(str(d.get("contents", "")).partition("\n")[2], t.answer)
               for call in (t.info.get("docs") or []) for d in call)


def one_search_answerable(questions: Sequence[str], answers: Sequence[Any], search: SearchFn | None,
                          topk: int) -> list[bool] | None:
    """Per question: does searching the question itself once return a document (title or text) that holds the
    answer? True means one search can do; False, that the question needs more than its own words as a query.
    None when there is no retriever to ask (no search, or a simulated one, which writes its documents)."""
    if search is None or getattr(search, "wants_context", False) or not questions:
        return None
    try:
        res = search(list(questions), topk)
    except Exception as e:  # noqa: BLE001 - a metric must never stop the round
        log.warning("question-kind probe: search failed (%s: %s); game/valid_one_search left out", type(e).__name__, e)
        return None
    return [any(contains_answer(str(d.get("contents", "")), a) for d in docs) for docs, a in zip(res, answers)]


def _stats(props, sols, reasons, verdict, n_fills, pool, served=(), one_search=None) -> dict:
    counts = Counter(r for r in reasons if r is not None)
    valid = [t for t, r in zip(props, reasons) if r is None]
    checked = [v for v in verdict.values() if v is not None]
    fresh = [t for t in sols if t.info["meta"]["source"] == "proposer"]  # set by solve()
    s = {
        "game/proposer_trajs": len(props),
        "game/valid_rate": _mean([float(r is None) for r in reasons]),
        "game/filter_pass_rate": _mean([float(r in (None, "rag_failed")) for r in reasons]),
        "game/rag_checked": len(checked),
        "game/rag_pass_rate": _mean([float(v) for v in checked]),
        "game/rag_unavailable": sum(v is None for v in verdict.values()),
        "game/pool_fills": n_fills,
        # counts (summed over ranks; the trainer logs game/valid_doc1_title_share): valid questions, and those
        # whose answer is Doc 1's title of the proposer's first search (the title heuristic's kind)
        "game/valid_questions": len(valid),
        "game/valid_doc1_title": sum(answer_is_first_title(t) for t in valid),
        "game/pool_size": len(pool) if pool is not None else 0,
        "game/questions": len({t.group_id for t in sols}),
        "proposer/reward_mean": _mean([t.reward for t in props]),
        "proposer/searches_mean": _mean([t.num_searches for t in props]),
        "solver/acc": _mean([float(t.info["correct"]) for t in sols]),
        "solver/reward_mean": _mean([t.reward for t in sols]),
        "solver/spam_rate": _mean([float(t.info["spam"]) for t in sols]),
        "solver/turns_mean": _mean([t.num_turns for t in sols]),
        "solver/searches_mean": _mean([t.num_searches for t in sols]),
        "solver/judge_failed": sum(bool(t.info["judge_failed"]) for t in sols),
        # the curriculum: solver accuracy on this round's own (fresh) proposer questions, apart from
        # pool refills and fixed QA rows; counts, so a ratio over ranks and steps stays exact
        "solver/fresh_trajs": len(fresh),
        "solver/fresh_correct": sum(float(t.info["correct"]) for t in fresh),
    }
    for reason in FILTER_REASONS + ("rag_failed",):
        s[f"game/filter/{reason}"] = counts.get(reason, 0)
    # why no question was written, and what kind of question the valid ones are
    whys = Counter(no_question_why(t) for t in props)
    s["game/no_question"] = sum(v for k, v in whys.items() if k is not None)
    for why in NO_QUESTION_WHY:
        s[f"game/no_question/{why}"] = whys.get(why, 0)
    s["game/valid_answer_in_text"] = sum(answer_in_text(t) for t in valid)
    s["game/valid_probed"] = len(one_search) if one_search is not None else 0
    s["game/valid_one_search"] = sum(one_search) if one_search is not None else 0
    # solve rates of the fresh questions: s = 0 (nobody), 0 < s < 1, s = 1 (everybody)
    by_q: dict[str, list[float]] = {}
    for t in fresh:
        by_q.setdefault(t.group_id, []).append(float(t.info["correct"]))
    rates = [_mean(v) for v in by_q.values()]
    s["game/fresh_s0"] = sum(r == 0 for r in rates)
    s["game/fresh_s1"] = sum(r == 1 for r in rates)
    s["game/fresh_mid"] = len(rates) - s["game/fresh_s0"] - s["game/fresh_s1"]
    # what the pool served: repeats within the round, and how often its questions were solved
    keys = [normalize_answer(q) for q in served]
    s["game/pool_repeats"] = len(keys) - len(set(keys))
    pooled = [t for t in sols if t.info["meta"]["source"] == "pool"]
    s["game/pool_served_trajs"] = len(pooled)
    s["game/pool_served_correct"] = sum(float(t.info["correct"]) for t in pooled)
    s.update(signal_counts(sols))
    return s
