"""Two rungs of the learning ladder at equal training wall time: a rung whose step carries an extra cost (rung 3's
teacher forward, rung 1gae's critic) against the rung it extends, read at the milestone that cost buys.

Each comparison is a Comparison: the new rung, its base, the timing_s/* key of the extra cost, the results.json key
prefix and the training-game rows. compare_section() writes its table, the paired bootstrap over the reading-score
questions, the OOD gain and the answer habits. Used by bench/learning_proof.py."""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.learning_common import (NAN, OOD_SOURCES, READING_SOURCES, fmt_num, fresh_acc, informative_share, mean_of,
                                   json_number, pooled, searches, twohop_set, verdict)
from bench.report import md_table


@dataclass(frozen=True)
class Comparison:
    new: str            # RUNGS key of the dearer rung, e.g. "distill"
    base: str           # RUNGS key of the rung it extends, e.g. "ssp"
    new_label: str      # "rung 3"
    base_label: str     # "rung 2"
    new_prefix: str     # run-folder prefix, e.g. "distill_seed"
    base_prefix: str
    cost_key: str | None  # the metrics.jsonl timing of the extra cost, e.g. "timing_s/teacher"; None: the two rungs
                          # share no cost key (rung 2's step plays a whole game), so the base rung's own step time
                          # sets the exchange rate (both rungs must then run on one quiet machine)
    cost_name: str      # "teacher" (keys: <cost_name>_time_share); prose: cost_what
    cost_what: str      # "The teacher forward makes a rung-3 step dearer"
    key: str            # results.json prefix, e.g. "learning_distill"
    steps_var: str      # the script's milestone variable of the base rung, e.g. "STEPS"
    game_rows: tuple    # ((label, fn over metric rows), ...) read from both rungs' training games


COMPARISONS = (
    Comparison("distill", "ssp", "rung 3", "rung 2", "distill_seed", "seed", "timing_s/teacher", "teacher",
               "The teacher forward makes a rung-3 step dearer", "learning_distill", "STEPS",
               (("valid-question rate (training)", mean_of("game/valid_rate")),
                ("fresh-question solver acc (training)", fresh_acc), ("distill/kl (training)", mean_of("distill/kl")))),
    Comparison("qa_gae", "qa", "rung 1gae", "rung 1", "qa_gae_seed", "qa_seed", "timing_s/critic", "critic",
               "The critic's value forward and its update make a rung-1gae step dearer", "learning_qa_gae", "QA_STEPS",
               (("solver acc (training)", mean_of("solver/acc")),
                ("critic explained variance (training)", mean_of("critic/explained_variance")),
                ("critic value loss (training)", mean_of("critic/value_loss")))),
    # issue 31: does self-play without labelled questions reach RL on labelled ones, for the same training time?
    Comparison("ssp", "qa", "rung 2", "rung 1", "seed", "qa_seed", None, "game",
               "A rung-2 step plays the proposer (and its RAG check) before the solver and trains both roles",
               "learning_ssp", "QA_STEPS",
               (("solver acc (training)", mean_of("solver/acc")),
                ("fresh-question solver acc (training)", fresh_acc),
                ("informative solver groups (training)", informative_share))),
)


def rl_seconds(metrics: list[dict], upto: int) -> float:
    """Training wall time up to step `upto`: the sum of timing_s/step (start-up, checkpoints and evals excluded,
    the same for every rung)."""
    return sum(r.get("timing_s/step", 0.0) for r in metrics if r["step"] <= upto)


def equal_wall_milestone(distill: dict, last3: int, ssp_steps: list[int],
                         cost_key: str | None = "timing_s/teacher", base_runs: dict | None = None) -> tuple[int, int, float]:
    """-> (the base rung's milestone nearest n_equal, n_equal, the extra cost's share of the dearer rung's training
    time). n_equal: the base-rung steps that the dearer rung's training wall time buys, last3 x W3 / (W3 - T3), with
    W3 the summed timing_s/step and T3 the summed `cost_key` (rung 3's teacher, rung 1gae's critic) of the dearer
    rung to step last3 (medians over seeds): a dearer step without its extra cost is a base step. Measured inside
    the dearer rung's own runs, so it holds when the base rung ran on another day or beside other load, where
    comparing the two rungs' clocks would not."""
    w3 = statistics.median(rl_seconds(r["metrics"], last3) for r in distill.values())
    if cost_key is None:   # no shared cost: the base rung's own median step time (base_runs) is the exchange rate
        steps = [[q["timing_s/step"] for q in r["metrics"] if "timing_s/step" in q] for r in (base_runs or {}).values()]
        per_step = statistics.median(statistics.median(x) for x in steps if x) if any(steps) else 0.0
        n_equal = max(1, round(w3 / per_step)) if per_step and w3 else last3   # no clock logged: step for step
        return min(ssp_steps, key=lambda m: (abs(m - n_equal), -m)), n_equal, NAN
    t3 = statistics.median(sum(q.get(cost_key, 0.0) for q in r["metrics"] if q["step"] <= last3)
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


def compare_section(c: Comparison, out: Path, seeds: list[str], sft: dict, rungs: dict) -> tuple[dict, str]:
    """The dearer rung c.new against c.base at equal training wall time. rungs: {rung: (runs, steps)} of those
    reported, with c.new and c.base present."""
    (d_runs, d_steps), (s_runs, s_steps) = rungs[c.new], rungs[c.base]
    last3 = d_steps[-1]
    walls3 = {s: rl_seconds(r["metrics"], last3) for s, r in d_runs.items()}
    wall3 = statistics.median(walls3.values())
    m2, n_equal, share = equal_wall_milestone(d_runs, last3, s_steps, c.cost_key, s_runs)
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
    ex3 = [question_em(out / f"{c.new_prefix}{s}" / f"eval_step{last3}" / "examples.jsonl", READING_SOURCES)
           for s in seeds]
    ex2 = [question_em(out / f"{c.base_prefix}{s}" / f"eval_step{m2}" / "examples.jsonl", READING_SOURCES) for s in seeds]
    boot, lo, hi = paired_bootstrap(ex3, ex2)
    ood_gain, ood_std = statistics.mean(o3), sd(o3)
    # the rungs side by side: per held-out source EM beside its title baseline, then the game and search columns
    cols = [("SFT", [sft])] + [(f"rung 1 (step {st[-1]})", [r["evals"][st[-1]] for r in ru.values()])
                               for k, (ru, st) in rungs.items() if k == "qa" and k not in (c.new, c.base)]
    cols += [(f"{c.base_label} (step {m2})", fin2), (f"{c.new_label} (step {last3})", fin3)]
    pad = ["-"] * (len(cols) - 3)

    def cell(results: list[dict], key: str, sources) -> str:
        return fmt_num(statistics.mean(pooled(r, key, sources) for r in results))

    rows = []
    for label, srcs in ([(src, (src,)) for src in sft["per_source"]]
                        + [("**reading (pooled)**", READING_SOURCES), ("**capitals + FanOutQA (pooled)**", OOD_SOURCES),
                           ("**overall**", None)]):
        rows.append([label] + [f"{cell(res, 'em', srcs)} / {cell(res, 'title_baseline_em', srcs)}" for _, res in cols])
    rows.append(["copy@1 %, reading sets"] + [cell(res, "title_copy_at.1", READING_SOURCES) for _, res in cols])
    hop = twohop_set(sft)
    rows.append([f"searches/q, {hop}"] + [fmt_num(statistics.mean(searches(r, hop)[0] for r in res), ".2f") for _, res in cols])
    for label, fn in c.game_rows:
        vals = ["-"] + pad
        for ru, m in ((s_runs, m2), (d_runs, last3)):
            v = [fn([q for q in r["metrics"] if q["step"] <= m]) for r in ru.values()]
            v = [x for x in v if not math.isnan(x)]
            vals.append(fmt_num(statistics.mean(v), ".3f") if v else "-")
        rows.append([label] + vals)
    folders = {"SFT": [out / "eval_sft"], c.base_label: [out / f"{c.base_prefix}{s}" / f"eval_step{m2}" for s in seeds],
               c.new_label: [out / f"{c.new_prefix}{s}" / f"eval_step{last3}" for s in seeds]}
    habits = {k: [answer_habits(f / "examples.jsonl") for f in v if (f / "examples.jsonl").exists()]
              for k, v in folders.items()}
    for key, label in (("year_before_docs", "year stated before any document, % ('what year' reading questions)"),
                       ("repeated_think", "repeated <think> loop, % (reading + two-hop)"),
                       ("cut_at_max_tokens", "cut at max tokens, % (reading + two-hop)")):
        vals = {k: fmt_num(statistics.mean(h[key] for h in v)) if v else "-" for k, v in habits.items()}
        rows.append([label, vals["SFT"]] + pad + [vals[c.base_label], vals[c.new_label]])
    rows.append(["training minutes (median over seeds)", "-"] + pad + [f"{wall2 / 60:.1f}", f"{wall3 / 60:.1f}"])
    table = md_table(["held-out set: EM % / title baseline %"] + [label for label, _ in cols], rows)
    a_ok = None if math.isnan(pooled_std) else over > 2 * pooled_std
    ood_ok = None if math.isnan(ood_std) else ood_gain > 2 * ood_std
    new, base = c.new_label, c.base_label
    rate = (f"it took {fmt_num(100 * share)}% of {new}'s training time ({c.cost_key} over timing_s/step, median over seeds)"
             if c.cost_key else f"{base}'s own median step (timing_s/step) sets the exchange rate")
    md = (f"{new.capitalize()} against {base} at equal training wall time. {c.cost_what}; "
          f"{rate}, so {new}'s {last3} steps cost what {n_equal} {base} steps cost, and {base} is read at its "
          f"milestone nearest that, step {m2}"
          f"{'' if n_equal == m2 else f' (step {n_equal} was not run: re-run {base} with {c.steps_var} ending in {n_equal})'}. "
          f"Training clocks as measured (the sum of timing_s/step, median over seeds; they compare only where both "
          f"rungs ran on one quiet machine): {new} {wall3 / 60:.1f} min to step {last3} "
          f"({', '.join(f'seed {s} {w / 60:.1f}' for s, w in walls3.items())}), {base} {wall2 / 60:.1f} min to step "
          f"{m2}. "
          f"Means over seeds {', '.join(seeds)}; each cell is EM % / that model's own title baseline %.\n\n{table}\n\n"
          f"- reading gain from SFT: {new} {fmt_num(statistics.mean(g3), '+.2f')} (seed std {fmt_num(sd(g3), '.2f')}), {base} at "
          f"step {m2} {fmt_num(statistics.mean(g2), '+.2f')} (seed std {fmt_num(sd(g2), '.2f')}).\n"
          f"- **gain_over_{c.base} = {fmt_num(over, '+.2f')} points** on the reading score; pooled seed std "
          f"{fmt_num(pooled_std, '.2f')}: target gain over {base} > 2 x pooled std **{verdict(a_ok)}**.\n"
          f"- paired bootstrap over the {len(ex3[0])} reading-score questions (EM averaged over seeds per question, "
          f"10,000 resamples): {boot:+.2f} points, 95% interval [{lo:+.2f}, {hi:+.2f}].\n"
          f"- **ood_gain = {fmt_num(ood_gain, '+.2f')} points** ({new} against SFT on capitals and FanOutQA single- and "
          f"multi-hop pooled; seeds {', '.join(fmt_num(x, '+.1f') for x in o3)}), seed std {fmt_num(ood_std, '.2f')}: target "
          f"gain > 2 x std **{verdict(ood_ok)}**.\n")
    k = c.key
    keys = {f"{k}.gain_over_{c.base}": json_number(over, 3),
            f"{k}.gain_over_{c.base}_ci95": [round(lo, 3), round(hi, 3)],
            f"{k}.gain_over_{c.base}_pooled_std": json_number(pooled_std, 3),
            f"{k}.{c.base}_equal_wall_step": m2, f"{k}.{c.base}_equal_wall_step_needed": n_equal,
            f"{k}.{c.cost_name}_time_share": json_number(share, 3),
            f"{k}.wall_minutes": {c.new: round(wall3 / 60, 2), c.base: round(wall2 / 60, 2)},
            f"{k}.ood_gain": json_number(ood_gain, 3), f"{k}.ood_seed_std": json_number(ood_std, 3),
            f"{k}_vs_{c.base}.gain": json_number(boot, 3), f"{k}_vs_{c.base}.ci95": [round(lo, 3), round(hi, 3)],
            f"{k}.answer_habits": {lab: {h: json_number(statistics.mean(x[h] for x in v)) for h in v[0]}
                                   for lab, v in habits.items() if v}}
    return keys, md
