"""Two rungs of the learning ladder at equal training wall time: a rung whose step carries an extra cost (rung 3's
teacher forward, rung 1gae's critic) against the rung it extends, read at the milestone that cost buys.

Each comparison is a Comparison: the new rung, its base, the timing_s/* key of the extra cost, the results.json key
prefix and the training-game rows. compare_section() writes its table, the OOD gain, the answer habits and, beside
every difference, its seed-level interval and exact test over seeds (bench/learning_stats.py), with the paired
bootstrap over questions only as a second column. Used by bench/learning_proof.py.

Issue 41's protocol (bench/learning_protocol.json, fixed before the runs): where it names a milestone for both
rungs of a comparison and the runs were evaluated there, the rungs are read at those steps and the comparison is
marked pre-registered; otherwise the old rule (the base rung's milestone nearest the dearer rung's wall time, chosen
from the runs' clocks) reads them and the section says it was not pre-registered. arm_vs_sft() is one rung against
the SFT start on the protocol's metrics, with the runs' commits (run_meta.jsonl, written per launch by
scripts/learning_proof_cpu.sh) and the protocol commit."""

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
from bench.learning_stats import (align, question_bootstrap, seed_permutation_test, sign_flip_test, smallest_p,
                                  two_level_bootstrap)
from bench.report import REPO, commit_stamp, md_table

PROTOCOL_FILE = Path(__file__).resolve().parent / "learning_protocol.json"
# the code whose behaviour the ladder's numbers measure: write_results(measures=...) so `bench/report.py --check`
# flags the ladder's sections once any of it changes (the runs' own meta lists the same paths)
LADDER_MEASURES = ("eval.py", "inference", "scripts/learning_proof_cpu.sh", "train.py", "training")


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
    _, A, B = align(a, b)
    return tuple(100 * x for x in question_bootstrap(A, B, n_boot, seed))


# ----------------------------------------------------------------------------- issue 41: protocol and seed-level

def load_protocol(path: Path | None = None) -> dict:
    """bench/learning_protocol.json ({} where there is none)."""
    path = PROTOCOL_FILE if path is None else path
    return json.loads(path.read_text()) if path.exists() else {}


def metric_sources(proto: dict) -> list[tuple[str, str, tuple]]:
    """(key, label, data sources) of the protocol's primary metric, then its secondary ones; the ladder's own sets
    where the protocol names none."""
    prim = proto.get("primary_metric", {})
    out = [("ood", "primary: capitals + FanOutQA EM", tuple(prim.get("sources", OOD_SOURCES)))]
    sec = {m["name"]: m for m in proto.get("secondary_metrics", [])}
    out.append(("reading", "secondary: reading score (in distribution for rung 1)",
                tuple(sec.get("reading_score", {}).get("sources", READING_SOURCES))))
    out.append(("wiki_desc", "secondary: wiki_desc_heldout EM (answered by a title)",
                tuple(sec.get("wiki_desc", {}).get("sources", ("wiki_desc_heldout",)))))
    return out


def boot_settings(proto: dict) -> dict:
    """The protocol's bootstrap replicates and seed, as seed_stats' keywords (10,000 and 0 where it names none)."""
    iv = proto.get("statistic", {}).get("interval", {})
    return {"n_boot": int(iv.get("n_boot", 10000)), "boot_seed": int(iv.get("bootstrap_seed", 0))}


def decision_step(proto: dict, rung: str, steps: list[int]) -> tuple[int, bool]:
    """(the step a rung is read at, whether the protocol fixed it): the protocol's milestone where the rung was
    evaluated there, else its last milestone."""
    m = proto.get("milestones", {}).get(rung)
    return (m, True) if m in steps else (steps[-1], False)


def _git(*args: str) -> str | None:
    import subprocess
    try:
        p = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def protocol_commit(path: Path | None = None) -> str | None:
    """The last commit that changed the protocol file (None where it was never committed, or without git)."""
    path = PROTOCOL_FILE if path is None else path
    try:
        rel = str(path.resolve().relative_to(REPO))
    except ValueError:
        return None
    return _git("log", "-1", "--format=%H", "--", rel) or None


def run_meta(folder: Path) -> list[dict]:
    """The launches recorded in folder/run_meta.jsonl (scripts/learning_proof_cpu.sh): commit, dirty, argv,
    started, cores, load1. [] for a run from before the records."""
    f = folder / "run_meta.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def records(out: Path, prefix: str, seeds: list[str]) -> tuple[dict, str]:
    """The training runs' commits and launch loads: ({"run_commits": {seed: [commits]}, "protocol_commit": ..}, a
    markdown line). Warns where a run is not on the report's HEAD (the section's stamp) in the measured code, where a
    run had uncommitted changes, and where the protocol commit is not an ancestor of a run's commit."""
    metas = {s: run_meta(out / f"{prefix}{s}") for s in seeds}
    commits = {s: sorted({m.get("commit", "unknown") for m in ms}) for s, ms in metas.items()}
    every = sorted({c for cs in commits.values() for c in cs})
    pc = protocol_commit()
    keys = {"run_commits": commits if every else None, "protocol_commit": pc}
    if not every:
        return keys, (f"- records: the runs {', '.join(prefix + s for s in seeds)} hold no run_meta.jsonl (made before "
                      f"scripts/learning_proof_cpu.sh recorded each launch's commit), so their commit is unknown; the "
                      f"section is stamped with the report's commit only.\n")
    head = commit_stamp(LADDER_MEASURES)
    notes = []
    for c in every:
        if c == "unknown":
            notes.append("a launch recorded no commit")
            continue
        if _git("cat-file", "-e", f"{c}^{{commit}}") is None:
            notes.append(f"run commit {c[:10]} is not in this repository")
            continue
        changed = _git("diff", "--name-only", c, head.split("+")[0], "--", *LADDER_MEASURES) if head != "unknown" else None
        if changed:
            notes.append(f"the measured code changed between run commit {c[:10]} and this report's "
                         f"{head[:10]} ({', '.join(changed.split()[:3])}): the section's stamp does not describe the runs")
    if any(m.get("dirty") for ms in metas.values() for m in ms):
        notes.append("some launches had uncommitted changes to the measured code")
    if pc:
        bad = [c[:10] for c in every if c != "unknown" and _git("merge-base", "--is-ancestor", pc, c) is None]
        if bad:
            notes.append(f"the protocol commit {pc[:10]} is not an ancestor of run commit(s) {', '.join(bad)}")
    loads = [m["load1"] for ms in metas.values() for m in ms if isinstance(m.get("load1"), (int, float))]
    load = f"; 1-minute load at launch {min(loads):.2f}-{max(loads):.2f}" if loads else ""
    md = (f"- records: training runs at commit(s) {', '.join(c[:10] for c in every)} (command lines in each run's "
          f"run_meta.jsonl{load}); protocol commit {pc[:10] if pc else 'none (bench/learning_protocol.json not committed)'}"
          + (f". **Warning:** {'; '.join(notes)}" if notes else "") + ".\n")
    return keys, md


def dev_curve(out: Path, prefix: str, seeds: list[str]) -> dict[int, list[float]]:
    """{step: [dev-split EM %, one per seed that read it]} from the eval/em lines train.py writes into metrics.jsonl
    with --eval_data (the script's DEV_EVERY); a resumed step's later line replaces the earlier one."""
    curve: dict[int, dict[str, float]] = {}
    for s in seeds:
        f = out / f"{prefix}{s}" / "metrics.jsonl"
        for line in (f.read_text().splitlines() if f.exists() else []):
            row = json.loads(line) if line.strip() else {}
            if "eval/em" in row and "game/valid_rate" not in row:
                curve.setdefault(int(row["step"]), {})[s] = 100 * float(row["eval/em"])
    return {k: list(v.values()) for k, v in sorted(curve.items())}


def seed_stats(new: list[dict], base: list[dict], fixed_base: bool = False, n_boot: int = 10000,
               boot_seed: int = 0) -> dict:
    """One difference new - base in points on the questions both answered: the two-level bootstrap's 95% interval,
    the exact test over seeds (the permutation test between two arms; the sign-flip test of the per-seed gains where
    the base is one fixed model, fixed_base) and the question-level interval (second column)."""
    ids, A, B = align(new, base)
    two = two_level_bootstrap(A, B, n_boot, boot_seed)
    one = question_bootstrap(A, B, n_boot, boot_seed)
    sa, sb = A.mean(1), B.mean(1)
    if fixed_base:
        p, floor = sign_flip_test(sa - sb.mean()), smallest_p(len(sa))
    else:
        p, floor = seed_permutation_test(sa, sb), smallest_p(len(sa), len(sb))
    return {"n": len(ids), "diff": 100 * two.diff, "ci_seed": [100 * two.lo, 100 * two.hi], "p": p, "p_floor": floor,
            "test": "sign flip" if fixed_base else "permutation", "ci_question": [100 * one.lo, 100 * one.hi],
            "seeds": (len(sa), len(sb))}


def _ci(ci: list[float]) -> str:
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def stats_table(rows: list[tuple[str, str, dict | None]]) -> str:
    """(comparison, metric, seed_stats or None) -> the markdown table every comparison is written in."""
    body = []
    for what, metric, st in rows:
        if st is None:
            body.append([what, metric, "-", "-", "-", "-"])
            continue
        seeds = (f"{st['seeds'][0]} seeds' gains" if st["test"] == "sign flip" else
                 f"{st['seeds'][0]} vs {st['seeds'][1]} seeds")
        body.append([what, f"{metric} ({st['n']} questions)", f"{st['diff']:+.2f}", _ci(st["ci_seed"]),
                     f"{st['p']:.3f} ({st['test']}, {seeds}; smallest possible {st['p_floor']:.3f})",
                     _ci(st["ci_question"])])
    return md_table(["comparison", "metric", "difference (pts)", "seed-level 95% interval (two-level bootstrap: seeds, "
                     "then questions)", "exact test over seeds, two-sided p", "question-level 95% interval (seeds held "
                     "fixed; second column)"], body)


def _stat_keys(prefix: str, metric: str, st: dict | None) -> dict:
    if st is None:
        return {}
    # <prefix>.<metric>_gain, _ci95_seed, _p_seed, _ci95_question; the reading score's gain has its own keys already
    return {f"{prefix}.{metric}_ci95_seed": [round(x, 3) for x in st["ci_seed"]],
            f"{prefix}.{metric}_p_seed": round(st["p"], 4),
            f"{prefix}.{metric}_ci95_question": [round(x, 3) for x in st["ci_question"]],
            **({f"{prefix}.{metric}_gain": round(st["diff"], 3)} if metric != "reading" else {})}


def _examples_or_none(folders: list[Path], sources: tuple) -> list[dict] | None:
    """Per-folder {id: EM} over `sources`, or None where a folder has no examples.jsonl or no such question."""
    if not all((f / "examples.jsonl").exists() for f in folders):
        return None
    ex = [question_em(f / "examples.jsonl", sources) for f in folders]
    return ex if all(ex) else None


def arm_vs_sft(rung: str, name: str, out: Path, prefix: str, seeds: list[str], steps: list[int],
               label: str) -> tuple[dict, str]:
    """One rung against the SFT start at its decision step, on the protocol's metrics, each difference beside its
    seed-level interval and sign-flip test; and the runs' records. -> (results.json keys under name, markdown)."""
    proto = load_protocol()
    step, fixed = decision_step(proto, rung, steps)
    keys, md = records(out, prefix, seeds)
    keys = {f"{name}.{k}": v for k, v in keys.items()}
    keys.update({f"{name}.decision_step": step, f"{name}.pre_registered": fixed})
    dev = dev_curve(out, prefix, seeds)
    if dev:   # the dev split, read more often than the held-out sets (never decided on)
        keys[f"{name}.dev_em_by_step"] = {str(k): round(statistics.mean(v), 2) for k, v in dev.items()}
        md += ("- dev split EM in the runs (train.py --eval_data, mean over seeds): " + "; ".join(
            f"step {k}: {statistics.mean(v):.1f}% ({', '.join(f'{x:.1f}' for x in v)})" for k, v in dev.items()) + ".\n")
    rows = []
    for metric, mlabel, sources in metric_sources(proto):
        new = _examples_or_none([out / f"{prefix}{s}" / f"eval_step{step}" for s in seeds], sources)
        base = _examples_or_none([out / "eval_sft"], sources)
        st = seed_stats(new, base, fixed_base=True, **boot_settings(proto)) if new and base else None
        rows.append((f"{label} (step {step}) - SFT", mlabel, st))
        keys.update(_stat_keys(name, metric, st))
    how = (f"step {step}, the protocol's milestone (bench/learning_protocol.json)" if fixed else
           f"step {step}, its last milestone: **not pre-registered** (the protocol's milestone for this rung, "
           f"{proto.get('milestones', {}).get(rung, 'none')}, was not evaluated)")
    if all(st is None for _, _, st in rows):
        return keys, md + (f"- seed-level intervals against SFT: none (the evals hold no examples.jsonl to pair "
                           f"questions on); read at {how}.\n")
    return keys, md + (f"- against the SFT start at {how}; each difference beside its seed-level interval (issue 41) "
                       f"and the exact sign-flip test of the per-seed gains:\n\n{stats_table(rows)}\n\n")


def compare_section(c: Comparison, out: Path, seeds: list[str], sft: dict, rungs: dict) -> tuple[dict, str]:
    """The dearer rung c.new against c.base at equal training wall time. rungs: {rung: (runs, steps)} of those
    reported, with c.new and c.base present. Where the protocol (bench/learning_protocol.json) fixes a milestone for
    both rungs and they were evaluated there, the rungs are read at those steps (pre-registered); the step the runs'
    clocks would pick is still computed and reported, never used then."""
    (d_runs, d_steps), (s_runs, s_steps) = rungs[c.new], rungs[c.base]
    pm = load_protocol().get("milestones", {})
    fixed = pm.get(c.new) in d_steps and pm.get(c.base) in s_steps
    last3 = pm[c.new] if fixed else d_steps[-1]
    walls3 = {s: rl_seconds(r["metrics"], last3) for s, r in d_runs.items()}
    wall3 = statistics.median(walls3.values())
    m2, n_equal, share = equal_wall_milestone(d_runs, last3, s_steps, c.cost_key, s_runs)
    m2 = pm[c.base] if fixed else m2
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
    # issue 41: the seed-level interval and exact test beside every difference, on the protocol's metrics
    kk, vs = f"{c.key}_vs_{c.base}", f"{c.new_label} (step {last3}) - {c.base_label} (step {m2})"
    stat_rows, stat_keys, proto = [], {}, load_protocol()
    for metric, mlabel, sources in metric_sources(proto):
        a = ex3 if sources == READING_SOURCES else _examples_or_none(
            [out / f"{c.new_prefix}{s}" / f"eval_step{last3}" for s in seeds], sources)
        b = ex2 if sources == READING_SOURCES else _examples_or_none(
            [out / f"{c.base_prefix}{s}" / f"eval_step{m2}" for s in seeds], sources)
        st = seed_stats(a, b, **boot_settings(proto)) if a and b else None
        stat_rows.append((vs, mlabel, st))
        stat_keys.update(_stat_keys(kk, metric, st))
    rec = "".join(records(out, pre, seeds)[1].replace("- records:", f"- records, {lab}:", 1)
                  for pre, lab in ((c.new_prefix, c.new_label), (c.base_prefix, c.base_label)))
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
    if fixed:
        when = (f"Milestones pre-registered in bench/learning_protocol.json before the runs: {new} is read at step "
                f"{last3} and {base} at step {m2} ({m2 / last3:.3f} {base} steps per {new} step, fixed from clocks "
                f"measured earlier). {c.cost_what}; on these runs' own clocks {rate}, so {new}'s {last3} steps cost "
                f"what {n_equal} {base} steps cost: reported, never used to move a milestone. ")
    else:
        when = (f"**Not pre-registered:** the milestones were chosen from these runs' clocks, after they ran (the "
                f"protocol's steps were not evaluated). {c.cost_what}; {rate}, so {new}'s {last3} steps cost what "
                f"{n_equal} {base} steps cost, and {base} is read at its milestone nearest that, step {m2}"
                f"{'' if n_equal == m2 else f' (step {n_equal} was not run: re-run {base} with {c.steps_var} ending in {n_equal})'}. ")
    md = (f"{new.capitalize()} against {base} at equal training wall time. {when}"
          f"Training clocks as measured (the sum of timing_s/step, median over seeds; they compare only where both "
          f"rungs ran on one quiet machine): {new} {wall3 / 60:.1f} min to step {last3} "
          f"({', '.join(f'seed {s} {w / 60:.1f}' for s, w in walls3.items())}), {base} {wall2 / 60:.1f} min to step "
          f"{m2}. "
          f"Means over seeds {', '.join(seeds)}; each cell is EM % / that model's own title baseline %.\n\n{table}\n\n"
          f"- reading gain from SFT: {new} {fmt_num(statistics.mean(g3), '+.2f')} (seed std {fmt_num(sd(g3), '.2f')}), {base} at "
          f"step {m2} {fmt_num(statistics.mean(g2), '+.2f')} (seed std {fmt_num(sd(g2), '.2f')}).\n"
          f"- **gain_over_{c.base} = {fmt_num(over, '+.2f')} points** on the reading score; pooled seed std "
          f"{fmt_num(pooled_std, '.2f')}: target gain over {base} > 2 x pooled std **{verdict(a_ok)}**.\n"
          f"- second column only: paired bootstrap over the {len(ex3[0])} reading-score questions (EM averaged over "
          f"seeds per question, 10,000 resamples; it holds the seeds fixed, so it leaves out training noise): "
          f"{boot:+.2f} points, 95% interval [{lo:+.2f}, {hi:+.2f}].\n"
          f"- **ood_gain = {fmt_num(ood_gain, '+.2f')} points** ({new} against SFT on capitals and FanOutQA single- and "
          f"multi-hop pooled; seeds {', '.join(fmt_num(x, '+.1f') for x in o3)}), seed std {fmt_num(ood_std, '.2f')}: target "
          f"gain > 2 x std **{verdict(ood_ok)}**.\n"
          f"- every difference beside its seed-level interval (two-level bootstrap: each replicate draws the "
          f"questions once for both rungs, then each rung's seeds; it covers training-seed and question noise, and "
          f"runs narrow with few seeds) and the exact permutation test over the per-seed scores:\n\n"
          f"{stats_table(stat_rows)}\n\n{rec}")
    k = c.key
    keys = {f"{k}.gain_over_{c.base}": json_number(over, 3),
            f"{k}.gain_over_{c.base}_ci95": [round(lo, 3), round(hi, 3)],
            f"{k}.gain_over_{c.base}_pooled_std": json_number(pooled_std, 3),
            f"{k}.{c.base}_equal_wall_step": m2, f"{k}.{c.base}_equal_wall_step_needed": n_equal,
            f"{k}.{c.cost_name}_time_share": json_number(share, 3),
            f"{k}.wall_minutes": {c.new: round(wall3 / 60, 2), c.base: round(wall2 / 60, 2)},
            f"{k}.ood_gain": json_number(ood_gain, 3), f"{k}.ood_seed_std": json_number(ood_std, 3),
            f"{k}_vs_{c.base}.gain": json_number(boot, 3), f"{k}_vs_{c.base}.ci95": [round(lo, 3), round(hi, 3)],
            f"{kk}.pre_registered": fixed, f"{kk}.milestones": {c.new: last3, c.base: m2}, **stat_keys,
            f"{k}.answer_habits": {lab: {h: json_number(statistics.mean(x[h] for x in v)) for h in v[0]}
                                   for lab, v in habits.items() if v}}
    return keys, md


def protocol_shell(proto: dict) -> str:
    """The shell assignments scripts/learning_proof_cpu.sh takes from the protocol (PROTOCOL=<file>): seeds,
    milestones, dev reads, the SSP recipe and the contrast arm's setting. Refuses (ValueError) a protocol whose SSP
    recipe the sweep has not chosen, or that lacks a milestone of a primary arm."""
    import shlex
    arms, ms = proto.get("arms", {}), proto.get("milestones", {})
    flags = arms.get("ssp", {}).get("flags")
    if not flags:
        raise ValueError("the protocol's SSP recipe (arms.ssp.flags) is not chosen yet: run the sweep (its 'command') "
                         "and commit the chosen candidate's flags before the first primary run")
    if not proto.get("seeds") or any(k not in ms for k in ("qa", "ssp")):
        raise ValueError("the protocol needs seeds and the milestones of rung 1 (qa) and SSP (ssp)")
    dl = arms.get("distill", {}).get("distill", {})
    vals = {"SEEDS": " ".join(map(str, proto["seeds"])), "QA_STEPS": ms["qa"], "STEPS": ms["ssp"],
            "DISTILL_STEPS": ms.get("distill", ms["ssp"]), "DEV_EVERY": proto.get("dev_every", 0), "SSP_EXTRA": flags,
            "SSP_PREFIX": arms.get("ssp", {}).get("run_prefix", "seed"), "HELDOUT_EVAL": 1,
            "DISTILL": dl.get("form", "contrast"), "DISTILL_COEF": dl.get("coef", 0.1),
            "DISTILL_CONTEXT": dl.get("context_tokens", 512)}
    return "\n".join(f"{k}={shlex.quote(str(v))}" for k, v in vals.items())


if __name__ == "__main__":   # python -m bench.learning_compare --shell bench/learning_protocol.json
    import argparse
    ap = argparse.ArgumentParser(description="print the protocol's settings as shell assignments")
    ap.add_argument("--shell", type=Path, required=True, help="the protocol file")
    args = ap.parse_args()
    try:
        print(protocol_shell(load_protocol(args.shell) or sys.exit(f"learning_compare: {args.shell} is missing")))
    except ValueError as e:
        sys.exit(f"learning_compare: {args.shell}: {e}")
