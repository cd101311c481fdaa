"""What a round shows (issue 31): the counts the trainer sums over ranks, and the shares made from them.

play_round (inference/game.py) calls `round_stats` on its trajectories; the trainer sums every count (`is_count`) over
ranks and then makes the shares (`shares`) from the global counts, so a share over ranks and steps stays exact.
Also here: why a proposer wrote no question, which solver groups carry signal, what kind the valid questions are,
and one trajectory as a JSON line for --dump_rollouts.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Sequence

from inference.filters import FILTER_REASONS
from inference.prompts import doc_title
from inference.rollout import SearchFn
from inference.trajectory import Trajectory
from utils.metrics import summed
from utils.text import contains_answer, exact_match, normalize_answer

log = logging.getLogger(__name__)


def mean_or_zero(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def answer_is_first_title(t: Trajectory) -> bool:
    """The proposer's answer is the title of Doc 1 of its first search: a question built on that page alone
    is one the "search once, answer Doc 1's title" heuristic (issue 21) may solve without the later searches."""
    docs = t.docs or []
    title = doc_title(docs[0][0]) if docs and docs[0] else ""
    return bool(title) and bool(exact_match(title, t.answer))


NO_QUESTION_WHY = ("turn_cap", "total_cap", "out_of_turns", "eos", "no_action", "empty")
"""Why a proposer rollout ended without a question: its turn hit --max_tokens_per_turn, the trajectory hit its
total budget, it still searched in its last turn, it stopped (EOS) or wrote no usable action, or its
<question></question> was empty."""
SOURCES = ("fresh", "pool", "qa")
"""Where a solver question came from: this round's proposer, the pool of earlier valid questions, fixed QA rows."""
ANSWER_KINDS = ("name", "fact", "chain_end", "other")
"""What a proposer row's answer is (answer_kind): a page's name, a fact read off a page's text, the end of a two-hop
chain, or none of these (a row that says nothing of its kind)."""
COUNT_KEYS = frozenset({
    "game/groups", "game/excluded_groups", "game/excluded_trajs", "game/proposer_trajs", "game/questions",
    "game/pool_fills", "game/pool_repeats", "game/pool_served_trajs", "game/pool_served_correct",
    "game/pool_admitted", "game/pool_cleared",
    "game/rag_checked", "game/rag_unavailable", "game/valid_questions", "game/valid_doc1_title",
    "game/valid_answer_in_text", "game/valid_probed", "game/valid_one_search", "game/no_question",
    "game/fresh_s0", "game/fresh_mid", "game/fresh_s1", "game/solver_slots", "game/empty_slots", "game/pool_servings",
    "solver/fresh_trajs", "solver/fresh_correct", "solver/judge_failed"})
COUNT_PREFIXES = ("game/filter/", "game/no_question/", "game/excluded/", "game/solver_groups",
                  "game/informative_groups", "game/proposer_trajs/", "game/valid_questions/")
summed(*COUNT_KEYS, prefixes=COUNT_PREFIXES)  # the step metrics sum the counts over ranks (utils/metrics.py)


def is_count(key: str) -> bool:
    """A game stat that is a count, summed over ranks; every other game stat is a per-rank mean."""
    return key in COUNT_KEYS or key.startswith(COUNT_PREFIXES)


def no_question_why(t: Trajectory) -> str | None:
    """NO_QUESTION_WHY's reason a proposer trajectory has no question; None when it wrote one."""
    if t.stop_reason == "question":
        return None if (t.question or "").strip() else "empty"
    if t.stop_reason == "max_tokens":
        return "total_cap" if t.cap == "total" else "turn_cap"
    return {"max_turns": "out_of_turns", "eos": "eos"}.get(t.stop_reason, "no_action")


def answer_kind(row: Any) -> str:
    """A proposer row's ANSWER_KINDS kind. Rows carry no kind field: its data_source when that names a kind
    (dataprep/reading_sets.py writes "name", "fact" and "chain_end" into data/train/proposer_mix.jsonl), else
    "name" when the row's page title (meta["title"]) is its answer (any alias), as in every row of
    data/train/proposer.jsonl ({"answer", "search_turns", "data_source": "wiki", "title", "doc_id"}), else "other"."""
    src = str(getattr(row, "data_source", "") or "")
    if src in ANSWER_KINDS[:3]:
        return src
    title = (getattr(row, "meta", None) or {}).get("title")
    return "name" if isinstance(title, str) and title.strip() and exact_match(title, row.answer) else "other"


def signal_counts(sols: Sequence[Trajectory]) -> dict[str, float]:
    """Solver groups, and the informative ones among them (rewards not all equal: the only groups a group
    baseline gives any gradient), in all and per SOURCES. A group left out of the loss (outcome.excluded)
    carries no signal. Call again after anything reshapes the rewards (self-search's format reward)."""
    groups: dict[str, tuple[str, set, bool]] = {}
    for t in sols:
        src, rewards, excl = groups.get(t.group_id, (t.meta.source or "fresh", set(), False))
        rewards.add(round(float(t.reward), 9))
        groups[t.group_id] = (src if src != "proposer" else "fresh", rewards, excl or bool(t.outcome.excluded))
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
    # per proposer slot, the empty ones counted (game/informative_share leaves them out, and counts pool replays):
    # the fresh questions' informative groups, and the slots that held no solver group at all
    ratio("game/informative_per_slot", "game/informative_groups/fresh", "game/solver_slots")
    ratio("game/empty_slot_share", "game/empty_slots", "game/solver_slots")
    ratio("game/pool_served_mean", "game/pool_servings", "game/pool_fills")
    for kind in ANSWER_KINDS:
        ratio(f"game/valid_rate/{kind}", f"game/valid_questions/{kind}", f"game/proposer_trajs/{kind}")
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


RECORD_KEYS = {"proposer": ("filter_reason", "valid", "rag", "rag_answer", "solver_acc", "pool_admitted", "excluded"),
               "solver": ("pred", "correct", "spam", "excluded")}
"""The outcome fields a rollout record shows, per role: those the game writes for that role."""


def rollout_record(t: Trajectory) -> dict:
    """One trajectory as a JSON line for reading what the game plays (--dump_rollouts): the text, the reward and
    every why the round recorded: its role's RECORD_KEYS of the outcome, null where the round did not reach that
    stage, and the cap. Token ids stay out; the documents appear as the titles each search returned."""
    o = t.outcome
    return {"role": t.role, "group_id": t.group_id, "source": t.meta.source,
            "question": t.question, "answer": t.answer, "reward": t.reward, "stop_reason": t.stop_reason,
            "no_question": no_question_why(t) if t.role == "proposer" else None,
            "turns": t.num_turns, "searches": t.num_searches, "sampled_tokens": t.num_sampled,
            "queries": t.queries,
            "titles": [[doc_title(d) for d in call] for call in (t.docs or [])],
            "response": t.response_text, **{k: getattr(o, k) for k in RECORD_KEYS[t.role]}, "cap": t.cap}


def answer_in_text(t: Trajectory) -> bool:
    """The answer (any alias) sits in the text of a document the proposer retrieved, title line left out: a
    question about a fact read off a page, not only about the page's name."""
    return any(contains_answer(str(d.get("contents", "")).partition("\n")[2], t.answer)
               for call in (t.docs or []) for d in call)


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


def round_stats(props, sols, reasons, verdict, n_fills, pool, served=(), one_search=None, admitted=0, rows=None,
                served_counts=()) -> dict:
    """The round's stats: counts (is_count) and per-rank means; the trainer makes the shares (`shares`).

    served: the pool questions served this round; served_counts: how many times each has been served so far, this
    round included (play_round keeps the count on the pool's item, key "served"; to_list saves it, but
    QuestionPool.from_list keeps only what add takes, so a resumed run counts again from 0). rows: the round's
    proposer rows, for the valid rate per answer kind (each proposer trajectory's row is rows[meta.row]); None
    leaves the kinds out.

    Slots (inference/pipeline.py): slot i belongs to proposer trajectory i and holds its own question when valid,
    else a pool question (FillPlan), else nothing. game/solver_slots counts these proposer slots, the empty ones
    included; game/empty_slots those with no solver group. The fixed QA questions' slots come after and are not in
    game/solver_slots: each holds a group, counted as game/solver_groups/qa (the QA slots). The other slot counts
    are signal_counts': game/informative_groups/fresh (informative groups on this round's own fresh questions, the
    numerator of game/informative_per_slot) and game/solver_groups/pool (pool replays, = game/pool_fills).

    Served pool questions: game/pool_servings sums served_counts (a count: summed over ranks and rounds, so
    game/pool_served_mean = game/pool_servings / game/pool_fills, made by `shares`, is exact); game/pool_served_max
    is this rank's largest, only when it served one: the step's value is the mean over the ranks that served
    of each rank's max over its rounds (training/loop/rounds.py), not the global max.

    Per answer kind k (answer_kind) present this round: game/proposer_trajs/k, game/valid_questions/k and
    game/filter/k/<reason> (FILTER_REASONS and rag_failed), all counts; `shares` makes game/valid_rate/k."""
    counts = Counter(r for r in reasons if r is not None)
    valid = [t for t, r in zip(props, reasons) if r is None]
    checked = [v for v in verdict.values() if v is not None]
    fresh = [t for t in sols if t.meta.source == "proposer"]  # set by solve()
    s = {
        "game/proposer_trajs": len(props),
        "game/valid_rate": mean_or_zero([float(r is None) for r in reasons]),
        "game/filter_pass_rate": mean_or_zero([float(r in (None, "rag_failed")) for r in reasons]),
        "game/rag_checked": len(checked),
        "game/rag_pass_rate": mean_or_zero([float(v) for v in checked]),
        "game/rag_unavailable": sum(v is None for v in verdict.values()),
        "game/pool_fills": n_fills,
        # counts (summed over ranks; the trainer logs game/valid_doc1_title_share): valid questions, and those
        # whose answer is Doc 1's title of the proposer's first search (the title heuristic's kind)
        "game/valid_questions": len(valid),
        "game/valid_doc1_title": sum(answer_is_first_title(t) for t in valid),
        "game/pool_size": len(pool) if pool is not None else 0,
        "game/questions": len({t.group_id for t in sols}),
        "proposer/reward_mean": mean_or_zero([t.reward for t in props]),
        "proposer/searches_mean": mean_or_zero([t.num_searches for t in props]),
        "solver/acc": mean_or_zero([float(t.outcome.correct) for t in sols]),
        "solver/reward_mean": mean_or_zero([t.reward for t in sols]),
        "solver/spam_rate": mean_or_zero([float(t.outcome.spam) for t in sols]),
        "solver/turns_mean": mean_or_zero([t.num_turns for t in sols]),
        "solver/searches_mean": mean_or_zero([t.num_searches for t in sols]),
        "solver/judge_failed": sum(bool(t.outcome.judge_failed) for t in sols),
        # the curriculum: solver accuracy on this round's own (fresh) proposer questions, apart from
        # pool refills and fixed QA rows; counts, so a ratio over ranks and steps stays exact
        "solver/fresh_trajs": len(fresh),
        "solver/fresh_correct": sum(float(t.outcome.correct) for t in fresh),
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
        by_q.setdefault(t.group_id, []).append(float(t.outcome.correct))
    rates = [mean_or_zero(v) for v in by_q.values()]
    s["game/fresh_s0"] = sum(r == 0 for r in rates)
    s["game/fresh_s1"] = sum(r == 1 for r in rates)
    s["game/fresh_mid"] = len(rates) - s["game/fresh_s0"] - s["game/fresh_s1"]
    # what the pool served: repeats within the round, and how often its questions were solved
    keys = [normalize_answer(q) for q in served]
    s["game/pool_repeats"] = len(keys) - len(set(keys))
    pooled = [t for t in sols if t.meta.source == "pool"]
    s["game/pool_served_trajs"] = len(pooled)
    s["game/pool_served_correct"] = sum(float(t.outcome.correct) for t in pooled)
    s["game/pool_admitted"] = admitted   # fresh questions the pool took (game/pool_cleared: the trainer's)
    s["game/pool_servings"] = sum(served_counts)
    if served_counts:
        s["game/pool_served_max"] = max(served_counts)
    # the proposer slots, and those left empty: an invalid slot the pool had no question for
    held = {t.group_id for t in sols if t.meta.source != "qa"}
    s["game/solver_slots"] = len(props)
    s["game/empty_slots"] = len(props) - len(held)
    if rows is not None:   # why each kind of answer fails
        by_kind: dict[str, Counter] = {}
        kinds = [answer_kind(r) for r in rows]
        for t, r in zip(props, reasons):
            by_kind.setdefault(kinds[t.meta.row] if t.meta.row is not None else "other", Counter())[r] += 1
        for kind, c in by_kind.items():
            s[f"game/proposer_trajs/{kind}"] = sum(c.values())
            s[f"game/valid_questions/{kind}"] = c[None]
            for reason in FILTER_REASONS + ("rag_failed",):
                s[f"game/filter/{kind}/{reason}"] = c[reason]
    s.update(signal_counts(sols))
    return s
