"""The evaluation loop: roll out the solver on QA rows, score each answer, report per data source.

    cfg = EvalConfig(rollout=RolloutConfig(max_turns=4, temperature=0.0), judge=Judge())
    result = evaluate(engine, rows, search_fn, cfg)     # {"overall", "per_source", "examples", "samples"}
    write_outputs(out_dir, protocol, result, settings)  # results.json, results.md, examples.jsonl
    # results.json / results.md also hold one row per benchmark in SSP's Table 1 order (inference/benchmarks.py)

eval.py is the command line over it (the run's protocol, the engine, the search backend, the judge)
and its docstring says what every metric means: EM, F1, sub-EM, judge accuracy, the title heuristic
(issue 21) and, with K samples per question, pass@K / mean@K / pass@k_unbiased. The trainer calls
evaluate() for its periodic held-out eval (training/loop/trainer.py SSPTrainer.evaluate), so both measure
the policy through the same multi-turn rollout loop (inference/rollout.py).
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from inference.benchmarks import benchmark_markdown, benchmark_table
from inference.data import EvalRow
from inference.engine_api import TokenGenerator
from inference.judge import Judge, JudgeItem
from inference.prompts import build_solver_prompt, doc_title
from inference.self_search import build_self_search_prompt
from inference.rewards import extract_answer
from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts, token_limit
from utils.errors import InputError
from utils.text import exact_match, f1_score, normalize_answer, substring_match

METRICS = ("em", "f1", "sub_em", "judge_acc", "turns_mean", "searches_mean", "no_answer_rate")
log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(temperature=0.0))
    """Greedy by default: eval numbers should not depend on a sampling seed."""
    template: str = "auto"
    judge: Judge = field(default_factory=Judge)
    """Judge() = exact match only; Judge(url) adds the LLM judge for answers EM misses."""
    batch_size: int = 64
    """Rollouts per run_rollouts call (bounds memory; vLLM batches inside a call): batch_size // samples questions."""
    progress: bool = True
    samples: int = 1
    """Rollouts per question. 1 = today's metrics; K > 1 adds pass@K / mean@K and needs temperature > 0."""

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"EvalConfig.samples must be >= 1, got {self.samples}")
        if self.samples > 1 and self.rollout.temperature <= 0:
            raise ValueError(f"EvalConfig.samples={self.samples} with greedy rollouts (temperature 0) gives K "
                             "identical answers; set rollout.temperature > 0")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1): 1 - C(n-c,k)/C(n,k),
    the chance that k of the n samples drawn without replacement hold at least one correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(samples: int) -> list[int]:
    """The k reported by pass@k_unbiased: 1, 2, 4, .. below K, and K. With n = K samples the estimator at
    k = 1 is mean@K and at k = K is pass@K; the k between sketch the curve RL climbs."""
    return sorted({2 ** i for i in range(samples.bit_length()) if 2 ** i < samples} | {samples})


SAMPLE_FIELDS = ("pred", "em", "f1", "sub_em", "judge_correct", "judge_source", "judge_failed", "turns", "searches",
                 "stop_reason", "queries", "response", "doc_titles")
COPY_KS = 3  # title_copy_at reports k = 1..max(COPY_KS, most docs one search returned), so tables keep their columns


def _sample_record(golden: list[str], t: Any, p: str | None, v: Any) -> dict:
    """One rollout's SAMPLE_FIELDS: its answer, scores and verdict."""
    return {
        "pred": p, "em": exact_match(p, golden), "f1": round(f1_score(p, golden), 4),
        "sub_em": substring_match(p, golden), "judge_correct": bool(v.correct), "judge_source": v.source,
        "judge_failed": v.judge_failed, "turns": t.num_turns, "searches": t.num_searches,
        "stop_reason": t.stop_reason, "queries": t.queries, "response": t.response_text,
        "doc_titles": [[doc_title(d) for d in docs] for docs in t.docs],
    }


def _title_stats(r: dict, ks: int) -> dict:
    """One sample against the "answer with a retrieved title" heuristic the policy converged on (issue 21):
    its own first search's Doc 1 title scored as the answer, whether its prediction copies a title, and
    whether any title it saw was right."""
    titles, golden = r.get("doc_titles") or [], r.get("golden_answers") or []
    pred = None if r.get("pred") is None else normalize_answer(r["pred"])
    seen = [t for docs in titles for t in docs if normalize_answer(t)]
    last = titles[-1] if titles else []
    return {
        "baseline": bool(titles and titles[0] and exact_match(titles[0][0], golden)),
        "copy_at": [bool(pred) and k < len(last) and pred == normalize_answer(last[k]) for k in range(ks)],
        "copy_any": bool(pred) and any(pred == normalize_answer(t) for t in seen),
        "ceiling": any(exact_match(t, golden) for t in seen),
    }


def _group_metrics(recs: list[dict], samples: int = 1) -> dict:
    """Means over questions; with samples K > 1 each per-sample field is a list of K, and the means run
    over all n*K samples, plus pass@K, mean@K and pass@k_unbiased from the judge verdicts."""
    n = len(recs)
    flat = recs if samples == 1 else [{**{key: r[key][j] for key in SAMPLE_FIELDS}, "golden_answers": r.get("golden_answers")}
                                      for r in recs for j in range(samples)]
    m = len(flat)

    def mean(key: str) -> float:
        return round(sum(float(r[key]) for r in flat) / m, 4) if m else 0.0

    out = {
        "n": n, "em": mean("em"), "f1": mean("f1"), "sub_em": mean("sub_em"), "judge_acc": mean("judge_correct"),
        "turns_mean": mean("turns"), "searches_mean": mean("searches"),
        "no_answer_rate": round(sum(r["pred"] is None for r in flat) / m, 4) if m else 0.0,
        "judge_failed": sum(bool(r["judge_failed"]) for r in flat),
    }
    # the title heuristic (issue 21): shares over all samples, like the means above
    ks = max([COPY_KS] + [len(docs) for r in flat for docs in (r.get("doc_titles") or [])])
    stats = [_title_stats(r, ks) for r in flat]

    def share(flags: Sequence[bool]) -> float:
        return round(sum(map(bool, flags)) / m, 4) if m else 0.0

    searches = [int(r["searches"] or 0) for r in flat]
    qt = [r["question_title_em"] for r in recs if r.get("question_title_em") is not None]
    out.update({
        "title_baseline_em": share([s["baseline"] for s in stats]),
        "question_title_em": round(sum(map(float, qt)) / len(qt), 4) if qt else None,
        "title_copy_at": {str(k + 1): share([s["copy_at"][k] for s in stats]) for k in range(ks)},
        "title_copy_any": share([s["copy_any"] for s in stats]),
        "title_ceiling": share([s["ceiling"] for s in stats]),
        "searches_hist": {str(k): share([x == k for x in searches]) for k in sorted(set(searches))},
    })
    if samples > 1:
        correct = [sum(map(bool, r["judge_correct"])) for r in recs]
        out[f"pass@{samples}"] = round(sum(c > 0 for c in correct) / n, 4) if n else 0.0
        out[f"mean@{samples}"] = out["judge_acc"]
        out["pass@k_unbiased"] = {str(k): round(sum(pass_at_k(samples, c, k) for c in correct) / n, 4) if n else 0.0
                                  for k in pass_ks(samples)}
    return out


def _question_title_em(search_fn: Callable | None, rows: Sequence[EvalRow], topk: int) -> list[bool | None]:
    """The policy-free baseline: search each question's own text once (same backend and topk as the rollouts)
    and answer Doc 1's title. None per row without a search tool, or when the backend fails (logged)."""
    if search_fn is None:
        return [None] * len(rows)
    try:
        results = search_fn([r.question for r in rows], topk)
        if not isinstance(results, list) or len(results) != len(rows):
            raise ValueError(f"search_fn returned {len(results) if isinstance(results, list) else results!r} "
                             f"result lists for {len(rows)} questions")
    except Exception as e:  # noqa: BLE001 - a baseline must not kill the eval
        log.warning("question-title baseline: search failed for %d questions: %s: %s", len(rows), type(e).__name__, e)
        return [None] * len(rows)
    return [bool(docs) and bool(exact_match(doc_title(docs[0]), r.golden_answers)) for r, docs in zip(rows, results)]


CHARS_PER_TOKEN_CAP = 16   # a question longer than this many characters per budget token is first tried cut there
MAX_LISTED = 5             # over-budget rows named in one message; the rest are counted


def solver_prompt(tokenizer: Any, question: str, cfg: EvalConfig) -> list[int]:
    """The first prompt's token ids for `question`, as evaluate() rolls it out."""
    build = build_self_search_prompt if cfg.rollout.self_search else build_solver_prompt
    return build(tokenizer, question, cfg.template)


def prompt_budget_error(tokenizer: Any, rows: Sequence[EvalRow], cfg: EvalConfig, max_model_len: int) -> InputError | None:
    """The rows whose first prompt has as many tokens as the budget, min(cfg.rollout.max_total_tokens, max_model_len)
    as rollout.token_limit, or more (no room is left to answer; the rollout loop would refuse it with a bare
    ValueError), as one message (budget_error); None when all fit. A very long question is first measured cut to
    CHARS_PER_TOKEN_CAP characters per budget token: past the budget already, it is refused without tokenizing
    megabytes."""
    limit, bad = min(cfg.rollout.max_total_tokens, max_model_len), []
    for r in rows:
        cut = CHARS_PER_TOKEN_CAP * limit
        n, exact = len(solver_prompt(tokenizer, r.question[:cut], cfg)), len(r.question) <= cut
        if n < limit and not exact:
            n, exact = len(solver_prompt(tokenizer, r.question, cfg)), True
        if n >= limit:
            bad.append((r, n, exact))
    return budget_error(bad, cfg, max_model_len) if bad else None


def budget_error(bad: Sequence[tuple[EvalRow, int, bool]], cfg: EvalConfig, max_model_len: int) -> InputError:
    """One message naming each (row, prompt tokens, whether counted whole) by its file and line (up to MAX_LISTED),
    the budget, and the fixes."""
    lines = [f"{r.where or f'row id {r.id} of {r.data_source}'}: the question is {len(r.question):,} characters and its "
             f"prompt has {'' if exact else 'at least '}{n:,} tokens" for r, n, exact in bad[:MAX_LISTED]]
    more = f" (the first {MAX_LISTED} shown)" if len(bad) > MAX_LISTED else ""
    total = cfg.rollout.max_total_tokens
    return InputError(
        f"{len(bad)} question{'s' if len(bad) > 1 else ''} too long{more}: a prompt at or over the budget of "
        f"{min(total, max_model_len)} tokens (the smaller of --max_total_tokens {total} and --max_model_len "
        f"{max_model_len}) leaves no room to answer:\n    " + "\n    ".join(lines) + "\n  Fix: shorten the question or drop the row, or raise "
        "--max_total_tokens and --max_model_len (within the model's context length)")


def evaluate(engine: TokenGenerator, rows: Sequence[EvalRow], search_fn: Callable | None, cfg: EvalConfig) -> dict:
    """Roll out the solver cfg.samples times per row; returns {"overall", "per_source", "examples", "samples",
    "llm_judge"} (llm_judge: whether an LLM judge gave the judge column; inference/benchmarks.py reads it).

    overall / per_source[src]: n, em, f1, sub_em, judge_acc, turns_mean, searches_mean,
    no_answer_rate, judge_failed, the title heuristic (title_baseline_em, question_title_em,
    title_copy_at, title_copy_any, title_ceiling, searches_hist; see markdown_report) (+ pass@K,
    mean@K, pass@k_unbiased when K > 1). examples: one dict per row, in order; with K > 1 its
    SAMPLE_FIELDS are lists of K, in sample order; question_title_em is per row (None without search).
    """
    K = cfg.samples
    limit = token_limit(engine, cfg.rollout)
    max_model_len = int(getattr(engine, "max_model_len", cfg.rollout.max_total_tokens))
    examples: list[dict] = []
    per_chunk = max(1, cfg.batch_size // K)
    chunks = [rows[i: i + per_chunk] for i in range(0, len(rows), per_chunk)]
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(rows), desc="eval" if K == 1 else f"eval ({K} samples/q)", unit="q")
    for chunk in chunks:
        # K copies of each question, side by side: run_rollouts seeds trajectory i with (seed, i, turn),
        # so every sample of a question draws with its own seed, and each runs its own search loop.
        reqs = [RolloutRequest("solver", f"eval-{r.id}", solver_prompt(engine.tokenizer, r.question, cfg),
                               question=r.question, answer=r.golden_answers) for r in chunk for _ in range(K)]
        bad = [(r, len(q.prompt_ids), True) for r, q in zip(chunk, reqs[::K]) if len(q.prompt_ids) >= limit]
        if bad:   # the rows named, not the rollout loop's bare ValueError (eval.py checks every row before loading)
            raise budget_error(bad, cfg, max_model_len)
        trajs = run_rollouts(engine, reqs, search_fn, cfg.rollout)
        preds = [extract_answer(t.response_text) for t in trajs]
        verdicts = cfg.judge.judge_many([JudgeItem(q.question, q.answer, p) for q, p in zip(reqs, preds)])
        recs = [_sample_record(q.answer, t, p, v) for q, t, p, v in zip(reqs, trajs, preds, verdicts)]
        qt = _question_title_em(search_fn, chunk, cfg.rollout.topk)
        for i, r in enumerate(chunk):
            mine = recs[i * K: (i + 1) * K]
            fields = mine[0] if K == 1 else {key: [s[key] for s in mine] for key in SAMPLE_FIELDS}
            examples.append({"id": r.id, "data_source": r.data_source, "question": r.question,
                             "golden_answers": r.golden_answers, **fields, "question_title_em": qt[i]})
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    by_src: dict[str, list[dict]] = defaultdict(list)
    for e in examples:
        by_src[e["data_source"]].append(e)
    return {
        "overall": _group_metrics(examples, K),
        "per_source": {src: _group_metrics(recs, K) for src, recs in sorted(by_src.items())},
        "examples": examples,
        "samples": K,
        "llm_judge": cfg.judge.mode == "llm",
    }


# ---- reports ---------------------------------------------------------------------------------

def protocol_lines(protocol: dict) -> list[str]:
    return [f"- {k}: {v}" for k, v in protocol.items()]


def markdown_report(protocol: dict, result: dict, settings: dict | None = None) -> str:
    K = result.get("samples", 1)
    extra_head, note = "", []
    if K > 1:
        ks = "/".join(result["overall"]["pass@k_unbiased"])
        extra_head = f" pass@{K} | mean@{K} | pass@k unbiased (k={ks}) |"
        note = [f"{K} samples per question; pass@{K} = any sample correct (judge column), mean@{K} = accuracy "
                "over all samples; EM .. no answer are means over all samples.", ""]
    head = f"| data_source | n |{extra_head} EM | F1 | sub-EM | judge acc | turns | searches | no answer |"
    rows = ["|---|---|" + "---|" * (3 * (K > 1)) + "---|---|---|---|---|---|---|"]
    for name, m in list(result["per_source"].items()) + [("**overall**", result["overall"])]:
        extra = "" if K == 1 else (f" {m[f'pass@{K}']:.3f} | {m[f'mean@{K}']:.3f} | "
                                   + "/".join(f"{v:.3f}" for v in m["pass@k_unbiased"].values()) + " |")
        rows.append(f"| {name} | {m['n']} |{extra} {m['em']:.3f} | {m['f1']:.3f} | {m['sub_em']:.3f} | {m['judge_acc']:.3f} "
                    f"| {m['turns_mean']:.2f} | {m['searches_mean']:.2f} | {m['no_answer_rate']:.3f} |")
    table = [] if not settings else ["", "| setting | value | source |", "|---|---|---|",
                                     *(f"| {k} | {s['value']} | {s['source']} |" for k, s in settings.items())]
    return "\n".join(["# Evaluation", "", "## Protocol", "", *protocol_lines(protocol), *table, "", "## Results", "",
                      *note, head, *rows, "", *benchmark_markdown(benchmark_table(result)), "", *title_table(result), ""])


def hist_str(hist: dict) -> str:
    """{"0": 0.01, "1": 0.85} -> "0:0.01 1:0.85"."""
    return " ".join(f"{k}:{v:.2f}" for k, v in hist.items()) or "-"


def title_table(result: dict) -> list[str]:
    """The "## Title heuristic" section: the policy against answering with a retrieved document's title (issue 21)."""
    groups = list(result["per_source"].items()) + [("**overall**", result["overall"])]
    ks = list(result["overall"]["title_copy_at"])
    rows = ["| data_source | n | EM | title baseline (own 1st search) | question-title baseline | "
            + " | ".join(f"copy@{k}" for k in ks) + " | copy any | title ceiling | searches |",
            "|---|---|---|---|---|" + "---|" * len(ks) + "---|---|---|"]
    for name, m in groups:
        qt = "-" if m.get("question_title_em") is None else f"{m['question_title_em']:.3f}"
        rows.append(f"| {name} | {m['n']} | {m['em']:.3f} | {m['title_baseline_em']:.3f} | {qt} | "
                    + " | ".join(f"{m['title_copy_at'].get(k, 0.0):.3f}" for k in ks)
                    + f" | {m['title_copy_any']:.3f} | {m['title_ceiling']:.3f} | {hist_str(m['searches_hist'])} |")
    return ["## Title heuristic", "", *rows, "",
            "Title baseline: Doc 1's title of the rollout's own first search taken as the answer (EM); question-title "
            "baseline: the question itself searched once with the same backend and topk, Doc 1's title as the answer "
            "(- without a search tool); copy@k: the prediction equals the title of Doc k of the last search; copy any: "
            "it equals any retrieved title; title ceiling: some retrieved title is a golden answer; searches: share of "
            "rollouts per number of searches."]


def write_outputs(out_dir: Path, protocol: dict, result: dict, settings: dict | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"protocol": protocol, **({"settings": settings} if settings else {}), "overall": result["overall"],
               "per_source": result["per_source"], "benchmarks": benchmark_table(result)}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "results.md").write_text(markdown_report(protocol, result, settings))
    with open(out_dir / "examples.jsonl", "w", encoding="utf-8") as f:
        for e in result["examples"]:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
