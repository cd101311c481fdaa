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
  <name>.informative_share      self-play rungs (2, 3): the share of solver groups whose rewards are not all equal
                                (the only ones a group baseline draws a gradient from), over every training step
                                to the last milestone, mean over seeds (issue 31: >= 0.30)
  <name>.informative_share_fresh the same over the groups of the round's own fresh questions only (the rest are
                                pool questions, admitted for a solve rate strictly between 0 and 1)
  <name>.informative_per_slot   the trainer's game/informative_per_slot over those steps: informative groups of the
                                fresh questions per proposer slot, the slots that held no solver group in the
                                denominator (informative_share leaves them out and counts pool replays; issue 41)
  <name>.solver_slots / .empty_slots  proposer slots over those steps, and those with no solver group (totals,
                                mean over seeds)
  <name>.valid_rate             mean of game/valid_rate over those steps and seeds (issue 31: >= 0.5)
  <name>.fresh_acc              solver accuracy on the round's own fresh questions, count-weighted (issue 31: 0.15-0.85)
  <name>.ood_gain, .ood_ci95_seed, .ood_p_seed, .ood_ci95_question   (issue 41, bench/learning_compare.arm_vs_sft) the
                                rung against SFT on the protocol's primary metric (capitals + FanOutQA EM), points, at
                                its decision step: the two-level bootstrap's 95% interval, the exact sign-flip test
                                over seeds, the question-level interval; .reading_* and .wiki_desc_* alike;
                                .decision_step, .pre_registered (the step is bench/learning_protocol.json's),
                                .run_commits ({seed: commits} from each run's run_meta.jsonl), .protocol_commit
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
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.learning_common import (GAME_COLUMNS, NAN, READING_SOURCES, doc1_title_share, fmt_num, fresh_acc,  # noqa: E402
                                   informative_per_slot, informative_share, informative_share_fresh, read_json,
                                   total_of,
                                   mean_of, json_number, em, hist_str, load_rung, mean_hist, pooled, pooled_hist, read_metrics,
                                   read_timings, searches, twohop_set, verdict)
from bench.learning_compare import (COMPARISONS, LADDER_MEASURES, answer_habits, arm_vs_sft,  # noqa: E402
                                    compare_section, equal_wall_milestone, paired_bootstrap, question_em, rl_seconds)
from bench.report import BENCH_DIR, md_table, write_results  # noqa: E402
from training.settings.config import upgrade_saved_config  # noqa: E402

__all__ = ["answer_habits", "equal_wall_milestone", "paired_bootstrap", "question_em", "rl_seconds", "read_metrics",
           "doc1_title_share", "fresh_acc", "mean_of"]  # read by tests and by bench/learning_compare.py's users


RUNGS = {
    "qa": ("qa_seed",
           [("solver accuracy, training questions", mean_of("solver/acc")),
            ("solver searches per question", mean_of("solver/searches_mean")),
            ("share of stored trained weights changed per step", mean_of("actor/weights_changed_frac"))],
           [("solver acc", mean_of("solver/acc")), ("weights changed", mean_of("actor/weights_changed_frac"))]),
    "ssp": ("seed",
            [("valid-question rate", mean_of("game/valid_rate")),
             ("solver accuracy on fresh proposer questions (curriculum)", fresh_acc),
             ("informative solver groups (rewards not all equal)", informative_share)],
            [("solver reward", mean_of("solver/reward_mean")), ("proposer reward", mean_of("proposer/reward_mean")),
             ("valid rate", mean_of("game/valid_rate")), ("fresh-question acc", fresh_acc),
             ("valid Q answer = proposer's Doc 1 title", doc1_title_share)] + GAME_COLUMNS),
    "qa_gae": ("qa_gae_seed",
               [("solver accuracy, training questions", mean_of("solver/acc")),
                ("critic explained variance", mean_of("critic/explained_variance")),
                ("critic value loss", mean_of("critic/value_loss"))],
               [("solver acc", mean_of("solver/acc")), ("weights changed", mean_of("actor/weights_changed_frac")),
                ("critic EV", mean_of("critic/explained_variance")), ("critic value loss", mean_of("critic/value_loss")),
                ("critic s/step", mean_of("timing_s/critic"))]),
    "distill": ("distill_seed",
                [("valid-question rate", mean_of("game/valid_rate")),
                 ("solver accuracy on fresh proposer questions (curriculum)", fresh_acc),
                 ("distill/kl: teacher-student reverse KL, solver tokens", mean_of("distill/kl"))],
                [("solver reward", mean_of("solver/reward_mean")), ("proposer reward", mean_of("proposer/reward_mean")),
                 ("valid rate", mean_of("game/valid_rate")), ("fresh-question acc", fresh_acc),
                 ("valid Q answer = proposer's Doc 1 title", doc1_title_share), ("distill/kl", mean_of("distill/kl")),
                 ("distill/coverage", mean_of("distill/coverage")), ("teacher s/step", mean_of("timing_s/teacher"))]
                + GAME_COLUMNS),
}
# per rung: (its number, timings.tsv RL stage, timings.tsv eval stage prefix, what it trains)
RUNG_META = {"qa": (1, "rl_qa", "eval_qa_step", "solver-only RL on fixed QA rows from the corpus (self-play off)"),
             "qa_gae": ("1gae", "rl_qa_gae", "eval_qa_gae_step",
                        "rung 1's solver-only RL with PPO's critic and GAE in place of GRPO's group baseline "
                        "(--solver_estimator gae)"),
             "ssp": (2, "rl", "eval_step", "SSP self-play, both roles trained"),
             "distill": (3, "rl_distill", "eval_distill_step",
                         "SSP self-play with self-distillation of the solver (the proposer's search path as the "
                         "teacher's privileged context; the --distill form, sampled or contrast, is in the recipe)")}
TRAILING = 5  # trailing mean over 5 steps on the curves: one step holds only a few games


def recipe_line(cfg_file: Path, rung: str) -> str:
    if not cfg_file.exists():
        return "recipe unknown"
    c = upgrade_saved_config(json.loads(cfg_file.read_text()))  # a folder from before the distill group reads too
    o, sp, al, dl = c["optimisation"], c["selfplay"], c["algorithm"], c.get("distill", {})
    what = (f"{sp['prompts_per_step']} fixed QA questions x {sp['solver_n']} solver samples per step" if rung.startswith("qa")
            else f"{sp['prompts_per_step']} proposer prompts x {sp['proposer_n']} and {sp['solver_n']} solver samples "
                 f"per question per step, proposer reward {sp['proposer_reward']}, format penalty {sp['format_penalty']}")
    if dl.get("distill", "off") != "off":
        what += (f", distillation {dl['distill']} beta {dl['distill_coef']:g} ({dl['distill_schedule']}), teacher "
                 f"{dl['distill_teacher']}, privileged block <= {dl['distill_context_tokens']} tokens")
    if "gae" in (al.get("solver_estimator"), al.get("proposer_estimator")) and "critic" in c:
        cr = c["critic"]
        what += (f", critic lr {cr['critic_lr']:g} (top {cr['critic_train_top_layers'] or 'all'} layers), value clip "
                 f"{cr['value_clip']:g}, GAE gamma {cr['gae_gamma']:g} lambda {cr['gae_lambda']:g}, critic warm-up "
                 f"{cr['critic_warmup']} step(s)")
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
        return [fmt_num(pooled(res)), fmt_num(pooled(res, "title_baseline_em")), fmt_num(pooled(res, "title_copy_at.1")),
                fmt_num(searches(res, hop)[0], ".2f"), f"{em(res):.1f}"]

    rows = [["SFT (start)", "0", "-"] + cells(sft) + ["-"] + [f"{em(sft, k):.1f}" for k in sources] + ["-"] * len(columns)]
    for s in seeds:
        mets, prev = runs[s]["metrics"], 0
        for m in steps:
            seg = [r for r in mets if prev < r["step"] <= m]  # training steps since the previous milestone
            res = runs[s]["evals"][m]
            rows.append([f"seed {s}", str(m), fmt_num(pooled(res) - read0, "+.1f")] + cells(res) + [f"{em(res) - em0:+.1f}"]
                        + [f"{em(res, k):.1f}" for k in sources] + [f"{fn(seg):.2f}" if seg else "-" for _, fn in columns])
            prev = m
    table = md_table(["run", "step", "reading gain (pts)", "reading %", "reading title baseline %", "copy@1 %",
                      f"searches/q {hop or '(no two-hop set)'}", "EM overall %", "overall gain (pts)"]
                     + [f"EM {k} %" for k in sources] + [c for c, _ in columns], rows)
    by_step = "; ".join(f"step {m}: {statistics.mean(g):+.2f} (seeds {', '.join(f'{x:+.1f}' for x in g)})"
                        for m, g in gains.items())
    rby_step = "; ".join(f"step {m}: {fmt_num(statistics.mean(g), '+.2f')} (seeds {', '.join(fmt_num(x, '+.1f') for x in g)})"
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
          f"- **reading_gain = {fmt_num(rgain, '+.2f')} points** at step {last} (mean over {len(seeds)} seeds), seed std "
          f"{fmt_num(rstd, '.2f')} points: target (b) gain > 2 x std **"
          f"{verdict(None if math.isnan(rgain) or math.isnan(rstd) else rgain > 2 * rstd)}**.\n"
          f"- reading gain by milestone: {rby_step}.\n"
          f"- title heuristic, reading sets pooled: title baseline {fmt_num(tb0)}% at SFT, {fmt_num(tb)}% at step {last}; "
          f"copy@1 {fmt_num(cp0)}% at SFT, {fmt_num(cp)}% at step {last}.\n"
          f"- searches per question on {hop or 'no two-hop set'}: SFT {fmt_num(sq0, '.2f')} ({hist_str(sh0)}), step {last} "
          f"{fmt_num(sq, '.2f')} (mean over seeds): target (c) rises from SFT **{verdict(rises)}** in this rung.\n"
          f"- secondary, overall EM: solver_acc_gain = {mean_gain:+.2f} points, seed std {std:.2f} points "
          f"(gain > 2 x std: {'met' if mean_gain > 2 * std else 'NOT met'}); by milestone: {by_step}.\n"
          f"- minutes per seed, end to end as if run alone (SFT + its eval + RL + evals): {minutes:.1f} "
          f"(RL + evals alone: {statistics.mean(per_seed.values()):.1f}); target < 60.\n")
    keys = {"solver_acc_gain": round(mean_gain, 3), "seed_std": round(std, 3), "minutes_per_seed": round(minutes, 2),
            "sft_em": round(em0, 2), "final_em": {s: round(em(runs[s]["evals"][last]), 2) for s in seeds},
            "gain_by_step": {str(m): round(statistics.mean(g), 3) for m, g in gains.items()},
            "steps": last, "seeds": len(seeds),
            "reading_gain": json_number(rgain, 3), "reading_seed_std": json_number(rstd, 3), "sft_reading_score": json_number(read0),
            "reading_score": {s: json_number(pooled(r)) for s, r in zip(seeds, finals)},
            "reading_gain_by_step": {str(m): json_number(statistics.mean(g), 3) for m, g in rgains.items()},
            "reading_title_baseline": {"sft": json_number(tb0), "final": json_number(tb)},
            "title_copy_share": {"sft": json_number(cp0), "final": json_number(cp)},
            "searches_per_question": {"set": hop, "sft": {"mean": json_number(sq0, 3), "hist": sh0},
                                      "final": {"mean": json_number(sq, 3), "hist": mean_hist([h for _, h in sqs])}}}
    if rung in ("ssp", "distill"):   # the game's signal over every training step up to the last milestone
        game = {k: statistics.mean(fn([r for r in runs[s]["metrics"] if r["step"] <= last]) for s in seeds)
                for k, fn in (("informative_share", informative_share),
                              ("informative_share_fresh", informative_share_fresh),
                              ("informative_per_slot", informative_per_slot),
                              ("solver_slots", total_of("game/solver_slots")),
                              ("empty_slots", total_of("game/empty_slots")),
                              ("valid_rate", mean_of("game/valid_rate")), ("fresh_acc", fresh_acc))}
        keys.update({k: json_number(v, 3) for k, v in game.items()})
        md += (f"- the game, mean over training steps and seeds: informative solver groups {fmt_num(game['informative_share'], '.2f')} "
               f"({fmt_num(game['informative_share_fresh'], '.2f')} of the fresh questions' groups; the rest are pool questions), "
               f"fresh informative groups per proposer slot {fmt_num(game['informative_per_slot'], '.2f')} "
               f"(empty slots {fmt_num(game['empty_slots'], '.0f')} of "
               f"{fmt_num(game['solver_slots'], '.0f')} per seed), "
               f"valid-question rate {fmt_num(game['valid_rate'], '.2f')}, fresh-question solver accuracy "
               f"{fmt_num(game['fresh_acc'], '.2f')}.\n")
    return {f"{name}.{k}": v for k, v in keys.items()}, md, runs


def baseline_section(sft: dict, rises: list[tuple[str, float, float]]) -> tuple[dict, str]:
    """The SFT eval against the title heuristic, and targets (a) and (c). rises: (rung title, SFT, final
    two-hop searches per question) of each RL rung reported in this run."""
    per = sft["per_source"]
    keys = {f"learning_baseline.{k}": {"overall": json_number(pooled(sft, f, None)),
                                       **{src: json_number(100 * g[f]) if g.get(f) is not None else None for src, g in per.items()}}
            for k, f in (("title_em", "question_title_em"), ("title_em_own", "title_baseline_em"))}
    rows = []
    for label, srcs in [(src, (src,)) for src in per] + [("**reading (pooled)**", READING_SOURCES), ("**overall**", None)]:
        n = sum(g["n"] for src, g in per.items() if srcs is None or src in srcs)
        rows.append([label, n] + [fmt_num(pooled(sft, f, srcs)) for f in ("em", "title_baseline_em", "question_title_em",
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
          f"- target (a): SFT reading score {fmt_num(read0)}% > its title baseline {fmt_num(tb0)}% (question-title baseline "
          f"{fmt_num(qt0)}%): **{verdict(a_ok)}**.\n"
          f"- target (c): two-hop searches per question rise from SFT in at least one RL rung ("
          + ("; ".join(f"{r}: {fmt_num(a, '.2f')} -> {fmt_num(b, '.2f')}" for r, a, b in rises) or "no RL rung reported")
          + f"): **{verdict(any(c_ok) if c_ok else None)}**.\n")
    return keys, md


def headroom(out: Path, k: int) -> tuple[dict, str]:
    """Rung 0: the SFT model's greedy EM against its pass@K, on the dev split and on a held-out slice."""
    hint = f"run scripts/learning_proof_cpu.sh with rung 0 (RUNGS=\"0 ...\", PASSK={k}) first"
    rows, keys, gaps = [], {}, {}
    for split, greedy_dir, passk_dir, key in (("dev split (training distribution)", "eval_sft_dev", "passk_dev",
                                               "sft_passk_gap"),
                                              ("held-out slice", "eval_sft_slice", "passk_slice", "sft_passk_gap_heldout")):
        g, p = read_json(out / greedy_dir / "results.json", hint), read_json(out / passk_dir / "results.json", hint)
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
    ap.add_argument("--qa_gae_steps", type=int, nargs="*", default=[],
                    help="rung 1gae (rung 1 with a critic and GAE) milestones evaluated; with --qa_steps, the "
                         "equal-wall-time comparison (section learning_qa_gae_vs_qa)")
    ap.add_argument("--distill_steps", type=int, nargs="*", default=[],
                    help="rung 3 (SSP with self-distillation) milestones evaluated; with --steps, the equal-wall-time "
                         "comparison (section learning_distill_vs_ssp)")
    ap.add_argument("--passk", type=int, default=0, help="rung 0: the K of the SFT headroom evals (0 = no rung 0)")
    ap.add_argument("--png", type=Path, default=BENCH_DIR / "learning_proof.png")
    ap.add_argument("--name", default="learning",
                    help="rung 2's RESULTS.md section and results.json key prefix (another recipe: e.g. learning_lr1e-4)")
    a = ap.parse_args(argv)
    rl_rungs = a.steps or a.qa_steps or a.qa_gae_steps or a.distill_steps
    if not (rl_rungs or a.passk):
        ap.error("nothing to report: give --steps (rung 2), --qa_steps (rung 1), --qa_gae_steps (rung 1gae), "
                 "--distill_steps (rung 3) and/or --passk (rung 0)")

    printed = []
    if a.passk:
        keys, md = headroom(a.out, a.passk)
        write_results("learning_headroom", keys, md, measures=LADDER_MEASURES)
        printed.append(md)
    sft = read_json(a.out / "eval_sft" / "results.json", "run scripts/learning_proof_cpu.sh first") \
        if rl_rungs else None
    t = read_timings(a.out / "timings.tsv")
    panels, rises, reported = [], [], {}
    for rung, steps, name, title in (("qa", a.qa_steps, "learning_qa", "rung 1, QA-only RL"),
                                     ("qa_gae", a.qa_gae_steps, "learning_qa_gae", "rung 1gae, QA-only RL with a critic"),
                                     ("ssp", a.steps, a.name, "rung 2, SSP"),
                                     ("distill", a.distill_steps, "learning_distill", "rung 3, SSP + self-distillation")):
        if not steps:
            continue
        steps = sorted(steps)
        keys, md, runs = summarise_rung(rung, name, a.out, a.seeds, steps, sft, t)
        vs_keys, vs_md = arm_vs_sft(rung, name, a.out, RUNGS[rung][0], a.seeds, steps, title)  # issue 41
        keys.update(vs_keys)
        md += vs_md
        md += f"- plot: `{os.path.relpath(a.png.resolve(), BENCH_DIR.parent)}` (row: {title}).\n"
        write_results(name, keys, md, measures=LADDER_MEASURES)
        printed.append(md)
        panels.append((rung, title, runs, steps, sft))
        reported[rung] = (runs, steps)
        hop = twohop_set(sft)
        rises.append((title, searches(sft, hop)[0], statistics.mean(searches(r["evals"][steps[-1]], hop)[0]
                                                                    for r in runs.values())))
    for c in COMPARISONS:
        if c.new in reported and c.base in reported:
            keys, md = compare_section(c, a.out, a.seeds, sft, reported)
            write_results(f"{c.key}_vs_{c.base}", keys, md, measures=LADDER_MEASURES)
            printed.append(md)
    if panels:
        keys, md = baseline_section(sft, rises)
        write_results("learning_baseline", keys, md, measures=LADDER_MEASURES)
        printed.append(md)
        plot(a.png, panels)
    print("\n".join(printed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
