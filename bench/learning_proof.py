"""Summarise scripts/learning_proof_cpu.sh, the learning ladder: plot, markdown tables, learning*.* keys.

    python bench/learning_proof.py --out runs/learning_proof --seeds 1 2 3 --qa_steps 20 --steps 20 --passk 8

Rungs, each read from the run folder <out> and reported only when asked for:
  rung 0, headroom (--passk K): the SFT model's greedy EM against its pass@K at temperature 1, on a
      dev split of the training distribution (<out>/eval_sft_dev, <out>/passk_dev) and on a slice of
      the held-out sets (<out>/eval_sft_slice, <out>/passk_slice). RL mostly turns pass@k into pass@1,
      so the gap bounds what RL can buy. Section learning_headroom; keys learning.sft_passk_gap
      (dev split, points) and learning.sft_passk_gap_heldout.
  rung 1, the RL core (--qa_steps M..): solver-only RL on fixed QA rows (self-play off), run folders
      <out>/qa_seed<S>. Section learning_qa; keys learning_qa.*.
  rung 2, SSP (--steps M..): both roles trained, run folders <out>/seed<S>. Section --name
      (default learning); keys learning.*.

The primary metric is the reading score: EM pooled (n-weighted) over the held-out sets that need the
retrieved text read, READING_SOURCES, in %. The policy was found answering with the title of the first
retrieved document (issue 21), which wiki_desc_heldout rewards, so that set stays in the tables but no
longer decides, and every number is set against the title heuristic (eval.py's title_* fields).
Per RL rung, from <out>/eval_sft/results.json (the shared SFT start), <prefix><S>/metrics.jsonl (the
training games), <prefix><S>/eval_step<M>/results.json per milestone and <out>/timings.tsv:
  <name>.reading_gain           reading score at the last milestone minus after SFT, points, mean over seeds
                                (the primary metric)
  <name>.reading_seed_std       sample standard deviation (ddof=1) of that gain over seeds, points
  <name>.reading_score          {seed: reading score at the last milestone, %}; .sft_reading_score: at SFT
  <name>.reading_gain_by_step   {milestone: mean reading gain}
  <name>.reading_title_baseline {"sft", "final"}: Doc 1's title of the model's own first search as the
                                answer, pooled like the reading score, % ("final": mean over seeds)
  <name>.title_copy_share       {"sft", "final"}: answers equal to Doc 1's title of the last search, pooled, %
  <name>.searches_per_question  {"set", "sft": {"mean", "hist"}, "final": {"mean", "hist"}} on the two-hop
                                set (twohop_heldout, else fanoutqa); "final" averaged over seeds
  <name>.solver_acc_gain        overall held-out EM (every set) gain, points, mean over seeds (secondary)
  <name>.seed_std               its sample standard deviation over seeds, points
  <name>.minutes_per_seed       minutes one seed takes end to end on its own: SFT + SFT eval (shared here,
                                counted in full for every seed) + RL + its evals
The SFT eval against the title heuristic (section learning_baseline, written with any RL rung):
  learning_baseline.title_em     {"overall", <data_source>..}: question-title baseline, % (the question
                                 searched once, Doc 1's title as the answer; policy-free)
  learning_baseline.title_em_own the same for Doc 1's title of SFT's own first search
Targets, each reported met / NOT met: (a) SFT reading score > its own title baseline; (b) per rung,
reading gain > 2 x seed std; (c) two-hop searches per question rise from SFT in at least one RL rung.
One PNG (--png) shows every RL rung asked for, a row each: three training curves, then over milestones
(step 0 = SFT; mean over seeds, seeds faint) the reading score against the title baselines, the title-copy
share and the two-hop searches per question.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import BENCH_DIR, md_table, write_results  # noqa: E402


def _mean_of(key):
    """Mean of `key` over the rows that hold a finite value of it (metrics.jsonl writes an undefined metric,
    e.g. distill/kl on a step without a teacher, as the string "nan")."""
    def f(rows):
        vals = [float(r[key]) for r in rows if key in r]
        vals = [v for v in vals if not math.isnan(v)]
        return statistics.mean(vals) if vals else float("nan")
    return f


def _doc1_title_share(rows):
    """Share of valid proposer questions whose answer is Doc 1's title of the proposer's first search."""
    n = sum(r.get("game/valid_questions", 0.0) for r in rows)
    return sum(r.get("game/valid_doc1_title", 0.0) for r in rows) / n if n else float("nan")


def _fresh_acc(rows):
    """Solver accuracy on the proposer's own fresh questions, weighted by how many there were."""
    n = sum(r.get("solver/fresh_trajs", 0.0) for r in rows)
    return sum(r.get("solver/fresh_correct", 0.0) for r in rows) / n if n else float("nan")


# per rung: (run-folder prefix, training curves (title, fn over a window of step rows), table columns)
RUNGS = {
    "qa": ("qa_seed",
           [("solver accuracy, training questions", _mean_of("solver/acc")),
            ("solver searches per question", _mean_of("solver/searches_mean")),
            ("share of stored trained weights changed per step", _mean_of("actor/weights_changed_frac"))],
           [("solver acc", _mean_of("solver/acc")), ("weights changed", _mean_of("actor/weights_changed_frac"))]),
    "ssp": ("seed",
            [("valid-question rate", _mean_of("game/valid_rate")),
             ("solver accuracy on fresh proposer questions (curriculum)", _fresh_acc),
             ("proposer reward", _mean_of("proposer/reward_mean"))],
            [("solver reward", _mean_of("solver/reward_mean")), ("proposer reward", _mean_of("proposer/reward_mean")),
             ("valid rate", _mean_of("game/valid_rate")), ("fresh-question acc", _fresh_acc),
             ("valid Q answer = proposer's Doc 1 title", _doc1_title_share)]),
    "distill": ("distill_seed",
                [("valid-question rate", _mean_of("game/valid_rate")),
                 ("solver accuracy on fresh proposer questions (curriculum)", _fresh_acc),
                 ("distill/kl: teacher-student reverse KL, solver tokens", _mean_of("distill/kl"))],
                [("solver reward", _mean_of("solver/reward_mean")), ("proposer reward", _mean_of("proposer/reward_mean")),
                 ("valid rate", _mean_of("game/valid_rate")), ("fresh-question acc", _fresh_acc),
                 ("valid Q answer = proposer's Doc 1 title", _doc1_title_share), ("distill/kl", _mean_of("distill/kl")),
                 ("distill/coverage", _mean_of("distill/coverage")), ("teacher s/step", _mean_of("timing_s/teacher"))]),
}
# per rung: (its number, timings.tsv RL stage, timings.tsv eval stage prefix, what it trains)
RUNG_META = {"qa": (1, "rl_qa", "eval_qa_step", "solver-only RL on fixed QA rows from the corpus (self-play off)"),
             "ssp": (2, "rl", "eval_step", "SSP self-play, both roles trained"),
             "distill": (3, "rl_distill", "eval_distill_step",
                         "SSP self-play with self-distillation of the solver (the proposer's search path as the "
                         "teacher's privileged context, --distill sampled)")}
TRAILING = 5  # trailing mean over 5 steps on the curves: one step holds only a few games


def read_metrics(path: Path) -> list[dict]:
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "game/valid_rate" in row:  # training-step lines (eval lines carry eval/* only)
                by_step[row["step"]] = row  # a resumed step overwrites the crashed attempt's line
    return [by_step[k] for k in sorted(by_step)]


def read_timings(path: Path) -> dict:
    out: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            stage, secs, seed = line.split("\t")
            out.setdefault((stage, seed), 0.0)
            out[(stage, seed)] += float(secs)
    return out


def _json(path: Path, hint: str) -> dict:
    if not path.exists():
        sys.exit(f"learning_proof.py: {path} is missing; {hint}")
    return json.loads(path.read_text())


def em(res: dict, src: str | None = None) -> float:
    g = res["overall"] if src is None else res["per_source"].get(src)
    return 100 * g["em"] if g else float("nan")


# data_source values whose questions need the retrieved text read (fanoutqa: multi-hop FanOutQA, fanoutqa_single:
# single-hop); the reading score pools EM over those present. wiki_desc_heldout is answered by a title: not here.
READING_SOURCES = ("reading_heldout", "twohop_heldout", "capitals", "fanoutqa", "fanoutqa_single")
TWOHOP_SOURCES = ("twohop_heldout", "fanoutqa")  # searches per question is read on the first one present
NAN = float("nan")


def field(g: dict, key: str) -> float | None:
    """g[key], or g["title_copy_at"]["1"] for "title_copy_at.1"; None where the eval predates the field."""
    head, _, sub = key.partition(".")
    v = g.get(head)
    return (v or {}).get(sub) if sub else v


def pooled(res: dict, key: str = "em", sources: tuple | None = READING_SOURCES) -> float:
    """key pooled over the data sources present (all with sources=None), n-weighted, in %; nan if none has it."""
    pairs = [(g["n"], field(g, key)) for src, g in res["per_source"].items() if sources is None or src in sources]
    pairs = [(n, v) for n, v in pairs if v is not None]
    n = sum(n for n, _ in pairs)
    return 100 * sum(n * v for n, v in pairs) / n if n else NAN


def pooled_hist(res: dict, sources: tuple | None = READING_SOURCES) -> dict:
    """searches_hist pooled like pooled()."""
    groups = [g for src, g in res["per_source"].items() if (sources is None or src in sources) and g.get("searches_hist")]
    n = sum(g["n"] for g in groups)
    return mean_hist([g["searches_hist"] for g in groups], [g["n"] / n for g in groups]) if n else {}


def mean_hist(hists: list[dict], weights: list[float] | None = None) -> dict:
    """Weighted (default: plain) mean of {"searches": share} dicts, a missing key counting 0."""
    w = weights or [1 / len(hists)] * len(hists)
    keys = sorted({k for h in hists for k in h}, key=int)
    return {k: round(sum(wi * h.get(k, 0.0) for wi, h in zip(w, hists)), 4) for k in keys}


def hist_str(hist: dict) -> str:
    return " ".join(f"{k}:{v:.2f}" for k, v in hist.items()) or "-"


def twohop_set(res: dict) -> str | None:
    return next((s for s in TWOHOP_SOURCES if s in res["per_source"]), None)


def searches(res: dict, src: str | None) -> tuple[float, dict]:
    """(searches per question, their distribution) on one data source; nan / {} where it is missing."""
    g = res["per_source"].get(src) or {}
    return (NAN if g.get("searches_mean") is None else g["searches_mean"]), g.get("searches_hist") or {}


def _num(x: float, nd: int = 2) -> float | None:
    """A JSON-safe rounded number: None for nan (not measured)."""
    return None if x is None or math.isnan(x) else round(x, nd)


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def verdict(ok: bool | None) -> str:
    return "n/a (not measured)" if ok is None else ("met" if ok else "NOT met")


def load_rung(out: Path, prefix: str, seeds: list[str], steps: list[int]) -> dict:
    runs = {}
    for s in seeds:
        hint = (f"run scripts/learning_proof_cpu.sh for {prefix}{s} (milestones {' '.join(map(str, steps))}) first")
        evals = {m: _json(out / f"{prefix}{s}" / f"eval_step{m}" / "results.json", hint) for m in steps}
        runs[s] = {"metrics": read_metrics(out / f"{prefix}{s}" / "metrics.jsonl"), "evals": evals}
    return runs


def recipe_line(cfg_file: Path, rung: str) -> str:
    if not cfg_file.exists():
        return "recipe unknown"
    c = json.loads(cfg_file.read_text())
    o, sp, al = c["optimisation"], c["selfplay"], c["algorithm"]
    what = (f"{sp['prompts_per_step']} fixed QA questions x {sp['solver_n']} solver samples per step" if rung == "qa"
            else f"{sp['prompts_per_step']} proposer prompts x {sp['proposer_n']} and {sp['solver_n']} solver samples "
                 f"per question per step, proposer reward {sp['proposer_reward']}, format penalty {sp['format_penalty']}")
    if al.get("distill", "off") != "off":
        what += (f", distillation {al['distill']} beta {al['distill_coef']:g} ({al['distill_schedule']}), teacher "
                 f"{al['distill_teacher']}, privileged block <= {al['distill_context_tokens']} tokens")
    return (f"{c['model']['dtype']}, lr {o['lr']:g}, top {c['model']['train_top_layers']} layers trained, {what}, "
            f"{al.get('ppo_epochs', 1)} epoch(s) x {al.get('ppo_mini_batches', 1)} mini-batch(es) per step")


def summarise_rung(rung: str, name: str, out: Path, seeds: list[str], steps: list[int], sft: dict, t: dict):
    """-> (results.json keys, markdown, runs) of one RL rung."""
    prefix, _, columns = RUNGS[rung]
    runs = load_rung(out, prefix, seeds, steps)
    last, em0, sources = steps[-1], em(sft), list(sft["per_source"])
    gains = {m: [em(runs[s]["evals"][m]) - em0 for s in seeds] for m in steps}
    mean_gain = statistics.mean(gains[last])
    std = statistics.stdev(gains[last]) if len(seeds) > 1 else float("nan")
    # the primary metric: the reading score, EM pooled over READING_SOURCES
    read0 = pooled(sft)
    rgains = {m: [pooled(runs[s]["evals"][m]) - read0 for s in seeds] for m in steps}
    rgain = statistics.mean(rgains[last])
    rstd = statistics.stdev(rgains[last]) if len(seeds) > 1 and not math.isnan(rgain) else NAN
    finals = [runs[s]["evals"][last] for s in seeds]
    tb0, tb = pooled(sft, "title_baseline_em"), statistics.mean(pooled(r, "title_baseline_em") for r in finals)
    cp0, cp = pooled(sft, "title_copy_at.1"), statistics.mean(pooled(r, "title_copy_at.1") for r in finals)
    hop = twohop_set(sft)
    (sq0, sh0), sqs = searches(sft, hop), [searches(r, hop) for r in finals]
    sq = statistics.mean(x for x, _ in sqs)
    shared = t.get(("sft", "-"), 0.0) + t.get(("eval_sft", "-"), 0.0)
    number, stage, ev, what = RUNG_META[rung]  # timings.tsv stages: <stage> and <ev><M> per seed
    per_seed = {s: (t.get((stage, s), 0.0) + sum(t.get((f"{ev}{m}", s), 0.0) for m in steps)) / 60 for s in seeds}
    minutes = statistics.mean(shared / 60 + m for m in per_seed.values())

    def cells(res: dict) -> list[str]:
        return [_f(pooled(res)), _f(pooled(res, "title_baseline_em")), _f(pooled(res, "title_copy_at.1")),
                _f(searches(res, hop)[0], ".2f"), f"{em(res):.1f}"]

    rows = [["SFT (start)", "0", "-"] + cells(sft) + ["-"] + [f"{em(sft, k):.1f}" for k in sources] + ["-"] * len(columns)]
    for s in seeds:
        mets, prev = runs[s]["metrics"], 0
        for m in steps:
            seg = [r for r in mets if prev < r["step"] <= m]  # training steps since the previous milestone
            res = runs[s]["evals"][m]
            rows.append([f"seed {s}", str(m), _f(pooled(res) - read0, "+.1f")] + cells(res) + [f"{em(res) - em0:+.1f}"]
                        + [f"{em(res, k):.1f}" for k in sources] + [f"{fn(seg):.2f}" if seg else "-" for _, fn in columns])
            prev = m
    table = md_table(["run", "step", "reading gain (pts)", "reading %", "reading title baseline %", "copy@1 %",
                      f"searches/q {hop or '(no two-hop set)'}", "EM overall %", "overall gain (pts)"]
                     + [f"EM {k} %" for k in sources] + [c for c, _ in columns], rows)
    by_step = "; ".join(f"step {m}: {statistics.mean(g):+.2f} (seeds {', '.join(f'{x:+.1f}' for x in g)})"
                        for m, g in gains.items())
    rby_step = "; ".join(f"step {m}: {_f(statistics.mean(g), '+.2f')} (seeds {', '.join(_f(x, '+.1f') for x in g)})"
                         for m, g in rgains.items())
    reading = [k for k in sources if k in READING_SOURCES]
    n_read = sum(sft["per_source"][k]["n"] for k in reading)
    rises = None if math.isnan(sq0) or math.isnan(sq) else sq > sq0
    md = (f"Rung {number}: {what}; {recipe_line(out / f'{prefix}{seeds[0]}' / 'config.json', rung)}. "
          f"From the shared SFT start ({shared / 60:.1f} min with its eval), a greedy held-out eval at steps "
          f"{', '.join(map(str, steps))}, same protocol as the SFT eval. Primary metric: the reading score, EM pooled "
          f"(n-weighted) over the sets that need the documents read ({', '.join(reading) or 'none in this eval'}; "
          f"{n_read} questions) at step {last}, minus SFT's. Overall EM over all {sft['overall']['n']} held-out "
          f"questions (wiki_desc_heldout, answered by a title, included) is kept as a secondary column. Reading title "
          f"baseline: Doc 1's title of the model's own first search taken as the answer, pooled the same way; copy@1: "
          f"answers equal to Doc 1's title of the last search; searches/q: searches per question on the two-hop set. "
          f"The last columns are means over the training steps since the previous milestone (training games, not "
          f"held-out).\n\n"
          f"{table}\n\n"
          f"- **reading_gain = {_f(rgain, '+.2f')} points** at step {last} (mean over {len(seeds)} seeds), seed std "
          f"{_f(rstd, '.2f')} points: target (b) gain > 2 x std **"
          f"{verdict(None if math.isnan(rgain) or math.isnan(rstd) else rgain > 2 * rstd)}**.\n"
          f"- reading gain by milestone: {rby_step}.\n"
          f"- title heuristic, reading sets pooled: title baseline {_f(tb0)}% at SFT, {_f(tb)}% at step {last}; "
          f"copy@1 {_f(cp0)}% at SFT, {_f(cp)}% at step {last}.\n"
          f"- searches per question on {hop or 'no two-hop set'}: SFT {_f(sq0, '.2f')} ({hist_str(sh0)}), step {last} "
          f"{_f(sq, '.2f')} (mean over seeds): target (c) rises from SFT **{verdict(rises)}** in this rung.\n"
          f"- secondary, overall EM: solver_acc_gain = {mean_gain:+.2f} points, seed std {std:.2f} points "
          f"(gain > 2 x std: {'met' if mean_gain > 2 * std else 'NOT met'}); by milestone: {by_step}.\n"
          f"- minutes per seed, end to end as if run alone (SFT + its eval + RL + evals): {minutes:.1f} "
          f"(RL + evals alone: {statistics.mean(per_seed.values()):.1f}); target < 60.\n")
    keys = {"solver_acc_gain": round(mean_gain, 3), "seed_std": round(std, 3), "minutes_per_seed": round(minutes, 2),
            "sft_em": round(em0, 2), "final_em": {s: round(em(runs[s]["evals"][last]), 2) for s in seeds},
            "gain_by_step": {str(m): round(statistics.mean(g), 3) for m, g in gains.items()},
            "steps": last, "seeds": len(seeds),
            "reading_gain": _num(rgain, 3), "reading_seed_std": _num(rstd, 3), "sft_reading_score": _num(read0),
            "reading_score": {s: _num(pooled(r)) for s, r in zip(seeds, finals)},
            "reading_gain_by_step": {str(m): _num(statistics.mean(g), 3) for m, g in rgains.items()},
            "reading_title_baseline": {"sft": _num(tb0), "final": _num(tb)},
            "title_copy_share": {"sft": _num(cp0), "final": _num(cp)},
            "searches_per_question": {"set": hop, "sft": {"mean": _num(sq0, 3), "hist": sh0},
                                      "final": {"mean": _num(sq, 3), "hist": mean_hist([h for _, h in sqs])}}}
    return {f"{name}.{k}": v for k, v in keys.items()}, md, runs


def baseline_section(sft: dict, rises: list[tuple[str, float, float]]) -> tuple[dict, str]:
    """The SFT eval against the title heuristic, and targets (a) and (c). rises: (rung title, SFT, final
    two-hop searches per question) of each RL rung reported in this run."""
    per = sft["per_source"]
    keys = {f"learning_baseline.{k}": {"overall": _num(pooled(sft, f, None)),
                                       **{src: _num(100 * g[f]) if g.get(f) is not None else None for src, g in per.items()}}
            for k, f in (("title_em", "question_title_em"), ("title_em_own", "title_baseline_em"))}
    rows = []
    for label, srcs in [(src, (src,)) for src in per] + [("**reading (pooled)**", READING_SOURCES), ("**overall**", None)]:
        n = sum(g["n"] for src, g in per.items() if srcs is None or src in srcs)
        rows.append([label, n] + [_f(pooled(sft, f, srcs)) for f in ("em", "title_baseline_em", "question_title_em",
                                                                      "title_copy_at.1", "title_copy_any", "title_ceiling")]
                    + [hist_str(pooled_hist(sft, srcs))])
    table = md_table(["set", "n", "SFT EM %", "title baseline (own 1st search) %", "question-title baseline %",
                      "copy@1 %", "copy any %", "title ceiling %", "searches distribution"], rows)
    read0, tb0, qt0 = pooled(sft), pooled(sft, "title_baseline_em"), pooled(sft, "question_title_em")
    a_ok = None if math.isnan(read0) or math.isnan(tb0) else read0 > tb0
    c_ok = [sq > sq0 for _, sq0, sq in rises if not (math.isnan(sq0) or math.isnan(sq))]
    md = (f"The SFT start (<out>/eval_sft) against the title heuristic the policy was found to converge on (issue 21). "
          f"Title baseline: Doc 1's title of SFT's own first search taken as the answer; question-title baseline: the "
          f"question itself searched once with the same backend and topk, Doc 1's title as the answer (policy-free); "
          f"copy@1 / copy any: answers equal to Doc 1's title of the last search / to any retrieved title; title "
          f"ceiling: some retrieved title is a golden answer; reading = {', '.join(READING_SOURCES)} pooled.\n\n"
          f"{table}\n\n"
          f"- target (a): SFT reading score {_f(read0)}% > its title baseline {_f(tb0)}% (question-title baseline "
          f"{_f(qt0)}%): **{verdict(a_ok)}**.\n"
          f"- target (c): two-hop searches per question rise from SFT in at least one RL rung ("
          + ("; ".join(f"{r}: {_f(a, '.2f')} -> {_f(b, '.2f')}" for r, a, b in rises) or "no RL rung reported")
          + f"): **{verdict(any(c_ok) if c_ok else None)}**.\n")
    return keys, md


OOD_SOURCES = ("capitals", "fanoutqa", "fanoutqa_single")  # held-out sets nothing in training is built like


def rl_seconds(metrics: list[dict], upto: int) -> float:
    """Training wall time up to step `upto`: the sum of timing_s/step (start-up, checkpoints and evals excluded,
    the same for every rung)."""
    return sum(r.get("timing_s/step", 0.0) for r in metrics if r["step"] <= upto)


def equal_wall_milestone(distill: dict, last3: int, ssp_steps: list[int]) -> tuple[int, int, float]:
    """-> (the rung-2 milestone nearest n_equal, n_equal, the teacher's share of rung 3's training time).
    n_equal: the rung-2 steps that rung 3's training wall time buys, last3 x W3 / (W3 - T3), with W3 the
    summed timing_s/step and T3 the summed timing_s/teacher of rung 3 to step last3 (medians over seeds): a
    rung-3 step without its teacher forward is a rung-2 step. Measured inside rung 3's own runs, so it holds
    when rung 2 ran on another day or beside other load, where comparing the two rungs' clocks would not."""
    w3 = statistics.median(rl_seconds(r["metrics"], last3) for r in distill.values())
    t3 = statistics.median(sum(q.get("timing_s/teacher", 0.0) for q in r["metrics"] if q["step"] <= last3)
                           for r in distill.values())
    n_equal = max(1, round(last3 * w3 / (w3 - t3))) if w3 > t3 else last3
    return min(ssp_steps, key=lambda m: (abs(m - n_equal), -m)), n_equal, (t3 / w3 if w3 else NAN)


def question_em(examples: Path, sources: tuple) -> dict[str, float]:
    """{question id: EM} over the given data sources, from eval.py's examples.jsonl."""
    if not examples.exists():
        sys.exit(f"learning_proof.py: {examples} is missing (eval.py writes it beside results.json); re-run that eval")
    rows = (json.loads(x) for x in examples.read_text().splitlines() if x.strip())
    return {r["id"]: float(r["em"]) for r in rows if r["data_source"] in sources}


_YEAR = re.compile(r"\b1\d{3}\b|\b20\d{2}\b")
_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def answer_habits(examples: Path) -> dict[str, float]:
    """Shares, in %, read off eval.py's examples.jsonl on the reading and two-hop held-out sets:
    year_before_docs: "what year" reading questions whose response names a year (not in the question) before its
        first <information> block, i.e. states an answer before reading any evidence;
    repeated_think: responses with two identical consecutive <think> blocks (a loop);
    cut_at_max_tokens: responses that ran out of tokens before an answer."""
    rows = [json.loads(x) for x in examples.read_text().splitlines() if x.strip()]
    for r in rows:
        r.setdefault("question", ""), r.setdefault("response", "")
    years = [r for r in rows if r["data_source"] == "reading_heldout" and "what year" in r["question"].lower()]
    pre = sum(any(y not in r["question"] for y in _YEAR.findall(r["response"].split("<information>")[0])) for r in years)
    rt = [r for r in rows if r["data_source"] in ("reading_heldout", "twohop_heldout")]
    loops = sum(any(a.strip() == b.strip() for a, b in zip(th, th[1:])) for th in (_THINK.findall(r["response"]) for r in rt))
    cut = sum(r.get("stop_reason") == "max_tokens" for r in rt)
    pct = (lambda k, n: 100 * k / n if n else NAN)
    return {"year_before_docs": pct(pre, len(years)), "repeated_think": pct(loops, len(rt)),
            "cut_at_max_tokens": pct(cut, len(rt))}


def paired_bootstrap(a: list[dict[str, float]], b: list[dict[str, float]], n_boot: int = 10000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Paired bootstrap over questions of mean(a) - mean(b), in points: a and b hold one {id: EM} per seed, each
    question's EM averaged over seeds first, questions resampled with replacement. -> (mean, 2.5%, 97.5%)."""
    import numpy as np
    ids = sorted(set.intersection(*(set(x) for x in a + b)))
    if not ids:
        raise ValueError("paired_bootstrap: the two rungs share no question ids")
    d = np.array([statistics.mean(x[i] for x in a) - statistics.mean(x[i] for x in b) for i in ids]) * 100
    means = d[np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def distill_section(out: Path, seeds: list[str], sft: dict, rungs: dict) -> tuple[dict, str]:
    """Rung 3 against rung 2 at equal training wall time. rungs: {rung: (runs, steps)} of those reported, with
    "distill" and "ssp" present."""
    (d_runs, d_steps), (s_runs, s_steps) = rungs["distill"], rungs["ssp"]
    last3 = d_steps[-1]
    walls3 = {s: rl_seconds(r["metrics"], last3) for s, r in d_runs.items()}
    wall3 = statistics.median(walls3.values())
    m2, n_equal, teacher_share = equal_wall_milestone(d_runs, last3, s_steps)
    wall2 = statistics.median(rl_seconds(r["metrics"], m2) for r in s_runs.values())
    fin3 = [d_runs[s]["evals"][last3] for s in seeds]
    fin2 = [s_runs[s]["evals"][m2] for s in seeds]
    read0, ood0 = pooled(sft), pooled(sft, sources=OOD_SOURCES)
    g3 = [pooled(r) - read0 for r in fin3]
    g2 = [pooled(r) - read0 for r in fin2]
    o3 = [pooled(r, sources=OOD_SOURCES) - ood0 for r in fin3]
    sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else NAN)
    over = statistics.mean(g3) - statistics.mean(g2)
    pooled_std = math.sqrt((sd(g3) ** 2 + sd(g2) ** 2) / 2) if len(seeds) > 1 else NAN
    ex3 = [question_em(out / f"distill_seed{s}" / f"eval_step{last3}" / "examples.jsonl", READING_SOURCES) for s in seeds]
    ex2 = [question_em(out / f"seed{s}" / f"eval_step{m2}" / "examples.jsonl", READING_SOURCES) for s in seeds]
    boot, lo, hi = paired_bootstrap(ex3, ex2)
    ood_gain, ood_std = statistics.mean(o3), sd(o3)
    # the rungs side by side: per held-out source EM beside its title baseline, then the game and search columns
    cols = [("SFT", [sft])] + [(f"rung 1 (step {st[-1]})", [r["evals"][st[-1]] for r in ru.values()])
                               for k, (ru, st) in rungs.items() if k == "qa"]
    cols += [(f"rung 2 (step {m2})", fin2), (f"rung 3 (step {last3})", fin3)]

    def cell(results: list[dict], key: str, sources) -> str:
        return _f(statistics.mean(pooled(r, key, sources) for r in results))

    rows = []
    for label, srcs in ([(src, (src,)) for src in sft["per_source"]]
                        + [("**reading (pooled)**", READING_SOURCES), ("**capitals + FanOutQA (pooled)**", OOD_SOURCES),
                           ("**overall**", None)]):
        rows.append([label] + [f"{cell(res, 'em', srcs)} / {cell(res, 'title_baseline_em', srcs)}" for _, res in cols])
    rows.append(["copy@1 %, reading sets"] + [cell(res, "title_copy_at.1", READING_SOURCES) for _, res in cols])
    hop = twohop_set(sft)
    rows.append([f"searches/q, {hop}"] + [_f(statistics.mean(searches(r, hop)[0] for r in res), ".2f") for _, res in cols])
    game = {"ssp": (s_runs, m2), "distill": (d_runs, last3)}
    for label, fn in (("valid-question rate (training)", _mean_of("game/valid_rate")),
                      ("fresh-question solver acc (training)", _fresh_acc), ("distill/kl (training)", _mean_of("distill/kl"))):
        vals = ["-"] * (len(cols) - 2)
        for k in ("ssp", "distill"):
            ru, m = game[k]
            v = [fn([q for q in r["metrics"] if q["step"] <= m]) for r in ru.values()]
            v = [x for x in v if not math.isnan(x)]
            vals.append(_f(statistics.mean(v), ".3f") if v else "-")
        rows.append([label] + vals)
    folders = {"SFT": [out / "eval_sft"], "rung 2": [out / f"seed{s}" / f"eval_step{m2}" for s in seeds],
               "rung 3": [out / f"distill_seed{s}" / f"eval_step{last3}" for s in seeds]}
    habits = {k: [answer_habits(f / "examples.jsonl") for f in v if (f / "examples.jsonl").exists()]
              for k, v in folders.items()}
    for key, label in (("year_before_docs", "year stated before any document, % ('what year' reading questions)"),
                       ("repeated_think", "repeated <think> loop, % (reading + two-hop)"),
                       ("cut_at_max_tokens", "cut at max tokens, % (reading + two-hop)")):
        vals = {k: _f(statistics.mean(h[key] for h in v)) if v else "-" for k, v in habits.items()}
        rows.append([label, vals["SFT"]] + ["-"] * (len(cols) - 3) + [vals["rung 2"], vals["rung 3"]])
    rows.append(["training minutes (median over seeds)"] + ["-"] * (len(cols) - 2) + [f"{wall2 / 60:.1f}", f"{wall3 / 60:.1f}"])
    table = md_table(["held-out set: EM % / title baseline %"] + [c for c, _ in cols], rows)
    a_ok = None if math.isnan(pooled_std) else over > 2 * pooled_std
    ood_ok = None if math.isnan(ood_std) else ood_gain > 2 * ood_std
    md = (f"Rung 3 against rung 2 at equal training wall time. The teacher forward makes a rung-3 step dearer; "
          f"it took {_f(100 * teacher_share)}% of rung 3's training time (timing_s/teacher over timing_s/step, median "
          f"over seeds), so rung 3's {last3} steps cost what {n_equal} rung-2 steps cost, and rung 2 is read at its "
          f"milestone nearest that, step {m2}"
          f"{'' if n_equal == m2 else f' (step {n_equal} was not run: re-run rung 2 with STEPS ending in {n_equal})'}. "
          f"Training clocks as measured (the sum of timing_s/step, median over seeds; they compare only where both "
          f"rungs ran on one quiet machine): rung 3 {wall3 / 60:.1f} min to step {last3} "
          f"({', '.join(f'seed {s} {w / 60:.1f}' for s, w in walls3.items())}), rung 2 {wall2 / 60:.1f} min to step "
          f"{m2}. "
          f"Means over seeds {', '.join(seeds)}; each cell is EM % / that model's own title baseline %.\n\n{table}\n\n"
          f"- reading gain from SFT: rung 3 {_f(statistics.mean(g3), '+.2f')} (seed std {_f(sd(g3), '.2f')}), rung 2 at "
          f"step {m2} {_f(statistics.mean(g2), '+.2f')} (seed std {_f(sd(g2), '.2f')}).\n"
          f"- **gain_over_ssp = {_f(over, '+.2f')} points** on the reading score; pooled seed std {_f(pooled_std, '.2f')}: "
          f"target gain over rung 2 > 2 x pooled std **{verdict(a_ok)}**.\n"
          f"- paired bootstrap over the {len(ex3[0])} reading-score questions (EM averaged over seeds per question, "
          f"10,000 resamples): {boot:+.2f} points, 95% interval [{lo:+.2f}, {hi:+.2f}].\n"
          f"- **ood_gain = {_f(ood_gain, '+.2f')} points** (rung 3 against SFT on capitals and FanOutQA single- and "
          f"multi-hop pooled; seeds {', '.join(_f(x, '+.1f') for x in o3)}), seed std {_f(ood_std, '.2f')}: target "
          f"gain > 2 x std **{verdict(ood_ok)}**.\n")
    keys = {"learning_distill.gain_over_ssp": _num(over, 3),
            "learning_distill.gain_over_ssp_ci95": [round(lo, 3), round(hi, 3)],
            "learning_distill.gain_over_ssp_pooled_std": _num(pooled_std, 3),
            "learning_distill.ssp_equal_wall_step": m2, "learning_distill.ssp_equal_wall_step_needed": n_equal,
            "learning_distill.teacher_time_share": _num(teacher_share, 3),
            "learning_distill.wall_minutes": {"distill": round(wall3 / 60, 2), "ssp": round(wall2 / 60, 2)},
            "learning_distill.ood_gain": _num(ood_gain, 3), "learning_distill.ood_seed_std": _num(ood_std, 3),
            "learning_distill.answer_habits": {k: {h: _num(statistics.mean(x[h] for x in v)) for h in v[0]}
                                               for k, v in habits.items() if v}}
    return keys, md


def headroom(out: Path, k: int) -> tuple[dict, str]:
    """Rung 0: the SFT model's greedy EM against its pass@K, on the dev split and on a held-out slice."""
    hint = f"run scripts/learning_proof_cpu.sh with rung 0 (RUNGS=\"0 ...\", PASSK={k}) first"
    rows, keys, gaps = [], {}, {}
    for split, greedy_dir, passk_dir, key in (("dev split (training distribution)", "eval_sft_dev", "passk_dev",
                                               "sft_passk_gap"),
                                              ("held-out slice", "eval_sft_slice", "passk_slice", "sft_passk_gap_heldout")):
        g, p = _json(out / greedy_dir / "results.json", hint), _json(out / passk_dir / "results.json", hint)
        for src in ["overall"] + list(p["per_source"]):
            gg = g["overall"] if src == "overall" else g["per_source"][src]
            pp = p["overall"] if src == "overall" else p["per_source"][src]
            pk = pp[f"pass@{k}"] * 100
            rows.append([split if src == "overall" else f"  {src}", pp["n"], f"{100 * gg['em']:.1f}",
                         f"{100 * pp[f'mean@{k}']:.1f}", f"{pk:.1f}", f"{pk - 100 * gg['em']:+.1f}"])
            if src == "overall":
                gaps[key] = pk - 100 * gg["em"]
                keys[f"learning.{key}"] = round(gaps[key], 2)
    table = md_table(["set", "questions", "greedy EM %", f"mean@{k} %", f"pass@{k} %", f"pass@{k} - greedy (pts)"], rows)
    md = (f"Rung 0: headroom of the SFT start. RL on a sampled policy mostly turns pass@k into pass@1, so pass@{k} "
          f"(temperature 1, each sample its own multi-turn rollout with search) against greedy EM bounds what the RL "
          f"rungs can gain. The dev split holds QA rows of the training distribution that no RL run trains on; the "
          f"held-out slice is the first rows of each held-out file.\n\n{table}\n\n"
          f"- **sft_passk_gap = {gaps['sft_passk_gap']:+.1f} points** on the dev split, "
          f"{gaps['sft_passk_gap_heldout']:+.1f} on the held-out slice.\n")
    return keys, md


def _over_milestones(ax, runs: dict, steps: list[int], sft: dict, fn) -> None:
    """fn(results.json) from SFT (step 0) over the milestones: one faint line per seed, the mean over seeds bold."""
    x = [0] + steps
    ys = {s: [fn(sft)] + [fn(r["evals"][m]) for m in steps] for s, r in runs.items()}
    for s, y in ys.items():
        ax.plot(x, y, lw=0.8, alpha=0.4, marker=".", label=f"seed {s}")
    ax.plot(x, [statistics.mean(col) for col in zip(*ys.values())], lw=2.2, color="k", marker="o", label="mean over seeds")
    ax.set_xlabel("RL step (0 = SFT cold start)")
    ax.grid(alpha=0.3)


def plot(png: Path, panels: list[tuple[str, str, dict, list[int], dict]]) -> None:
    """panels: (rung, title, runs, steps, SFT results.json) per row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(panels), 6, figsize=(26, 4.2 * len(panels)), squeeze=False)
    for row, (rung, title, runs, steps, sft) in zip(axes, panels):
        for ax, (label, fn) in zip(row, RUNGS[rung][1]):
            for s, r in runs.items():
                m = r["metrics"]
                x = [q["step"] for q in m]
                raw, = ax.plot(x, [fn([q]) for q in m], lw=0.6, alpha=0.35)
                ax.plot(x, [fn(m[max(0, i - TRAILING + 1):i + 1]) for i in range(len(m))], lw=2,
                        color=raw.get_color(), label=f"seed {s} ({TRAILING}-step mean)")
            ax.set_title(f"{title}: {label}", fontsize=9)
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        ax = row[3]
        _over_milestones(ax, runs, steps, sft, pooled)
        for key, ls, what in (("title_baseline_em", "--", "title baseline (SFT, own 1st search)"),
                              ("question_title_em", ":", "question-title baseline")):
            if not math.isnan(v := pooled(sft, key)):
                ax.axhline(v, ls=ls, color="tab:red", label=what)
        ax.set_title(f"{title}: reading score, % (held-out, greedy)", fontsize=9)
        ax.legend(fontsize=7)
        ax = row[4]
        _over_milestones(ax, runs, steps, sft, lambda r: pooled(r, "title_copy_at.1"))
        ax.set_title(f"{title}: title copy (copy@1), % (reading sets)", fontsize=9)
        ax.legend(fontsize=7)
        ax = row[5]
        hop = twohop_set(sft)
        _over_milestones(ax, runs, steps, sft, lambda r: searches(r, hop)[0])
        ax.set_title(f"{title}: searches per question on {hop or 'no two-hop set'}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Learning ladder on CPU: SmolLM2-135M-Instruct from one SFT cold start")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the learning_proof_cpu.sh output folder")
    ap.add_argument("--seeds", nargs="+", required=True)
    ap.add_argument("--steps", type=int, nargs="*", default=[], help="rung 2 (SSP) milestones evaluated, e.g. 12 40")
    ap.add_argument("--qa_steps", type=int, nargs="*", default=[], help="rung 1 (QA-only RL) milestones evaluated")
    ap.add_argument("--distill_steps", type=int, nargs="*", default=[],
                    help="rung 3 (SSP with self-distillation) milestones evaluated; with --steps, the equal-wall-time "
                         "comparison (section learning_distill_vs_ssp)")
    ap.add_argument("--passk", type=int, default=0, help="rung 0: the K of the SFT headroom evals (0 = no rung 0)")
    ap.add_argument("--png", type=Path, default=BENCH_DIR / "learning_proof.png")
    ap.add_argument("--name", default="learning",
                    help="rung 2's RESULTS.md section and results.json key prefix (another recipe: e.g. learning_lr1e-4)")
    a = ap.parse_args(argv)
    if not (a.steps or a.qa_steps or a.distill_steps or a.passk):
        ap.error("nothing to report: give --steps (rung 2), --qa_steps (rung 1), --distill_steps (rung 3) and/or "
                 "--passk (rung 0)")

    printed = []
    if a.passk:
        keys, md = headroom(a.out, a.passk)
        write_results("learning_headroom", keys, md)
        printed.append(md)
    sft = _json(a.out / "eval_sft" / "results.json", "run scripts/learning_proof_cpu.sh first") \
        if (a.steps or a.qa_steps or a.distill_steps) else None
    t = read_timings(a.out / "timings.tsv")
    panels, rises, reported = [], [], {}
    for rung, steps, name, title in (("qa", a.qa_steps, "learning_qa", "rung 1, QA-only RL"),
                                     ("ssp", a.steps, a.name, "rung 2, SSP"),
                                     ("distill", a.distill_steps, "learning_distill", "rung 3, SSP + self-distillation")):
        if not steps:
            continue
        steps = sorted(steps)
        keys, md, runs = summarise_rung(rung, name, a.out, a.seeds, steps, sft, t)
        md += f"- plot: `{os.path.relpath(a.png.resolve(), BENCH_DIR.parent)}` (row: {title}).\n"
        write_results(name, keys, md)
        printed.append(md)
        panels.append((rung, title, runs, steps, sft))
        reported[rung] = (runs, steps)
        hop = twohop_set(sft)
        rises.append((title, searches(sft, hop)[0], statistics.mean(searches(r["evals"][steps[-1]], hop)[0]
                                                                    for r in runs.values())))
    if "distill" in reported and "ssp" in reported:
        keys, md = distill_section(a.out, a.seeds, sft, reported)
        write_results("learning_distill_vs_ssp", keys, md)
        printed.append(md)
    if panels:
        keys, md = baseline_section(sft, rises)
        write_results("learning_baseline", keys, md)
        printed.append(md)
        plot(a.png, panels)
    print("\n".join(printed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
