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
Per RL rung, from <out>/eval_sft/results.json (the shared SFT start), <prefix><S>/metrics.jsonl (the
training games), <prefix><S>/eval_step<M>/results.json per milestone and <out>/timings.tsv:
  <name>.solver_acc_gain   held-out EM at the last milestone minus after SFT, points, mean over seeds
                           (the primary metric: overall EM over every held-out question)
  <name>.seed_std          sample standard deviation (ddof=1) of that gain over seeds, points
  <name>.minutes_per_seed  minutes one seed takes end to end on its own: SFT + SFT eval (shared here,
                           counted in full for every seed) + RL + its evals
One PNG (--png) shows every RL rung asked for, a row each: three training curves and held-out EM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import BENCH_DIR, md_table, write_results  # noqa: E402


def _mean_of(key):
    def f(rows):
        vals = [r[key] for r in rows if key in r]
        return statistics.mean(vals) if vals else float("nan")
    return f


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
             ("valid rate", _mean_of("game/valid_rate")), ("fresh-question acc", _fresh_acc)]),
}
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
    shared = t.get(("sft", "-"), 0.0) + t.get(("eval_sft", "-"), 0.0)
    stage = "rl_qa" if rung == "qa" else "rl"  # timings.tsv stages: rl_qa + eval_qa_step<M>, rl + eval_step<M>
    ev = "eval_qa_step" if rung == "qa" else "eval_step"
    per_seed = {s: (t.get((stage, s), 0.0) + sum(t.get((f"{ev}{m}", s), 0.0) for m in steps)) / 60 for s in seeds}
    minutes = statistics.mean(shared / 60 + m for m in per_seed.values())

    rows = [["SFT (start)", "0", "-", f"{em0:.1f}"] + [f"{em(sft, k):.1f}" for k in sources] + ["-"] * len(columns)]
    for s in seeds:
        mets, prev = runs[s]["metrics"], 0
        for m in steps:
            seg = [r for r in mets if prev < r["step"] <= m]  # training steps since the previous milestone
            res = runs[s]["evals"][m]
            rows.append([f"seed {s}", str(m), f"{em(res) - em0:+.1f}", f"{em(res):.1f}"]
                        + [f"{em(res, k):.1f}" for k in sources] + [f"{fn(seg):.2f}" if seg else "-" for _, fn in columns])
            prev = m
    table = md_table(["run", "step", "gain (pts)", "EM overall %"] + [f"EM {k} %" for k in sources]
                     + [c for c, _ in columns], rows)
    by_step = "; ".join(f"step {m}: {statistics.mean(g):+.2f} (seeds {', '.join(f'{x:+.1f}' for x in g)})"
                        for m, g in gains.items())
    what = ("solver-only RL on fixed QA rows from the corpus (self-play off)" if rung == "qa"
            else "SSP self-play, both roles trained")
    md = (f"Rung {'1' if rung == 'qa' else '2'}: {what}; {recipe_line(out / f'{prefix}{seeds[0]}' / 'config.json', rung)}. "
          f"From the shared SFT start ({shared / 60:.1f} min with its eval), a greedy held-out eval at steps "
          f"{', '.join(map(str, steps))}, same protocol as the SFT eval. Primary metric, fixed before the runs: "
          f"overall EM over all {sft['overall']['n']} held-out questions at step {last}. The last columns are means "
          f"over the training steps since the previous milestone (training games, not held-out).\n\n"
          f"{table}\n\n"
          f"- **solver_acc_gain = {mean_gain:+.2f} points** at step {last} (mean over {len(seeds)} seeds), "
          f"seed std {std:.2f} points: target gain > 2 x std **{'met' if mean_gain > 2 * std else 'NOT met'}**.\n"
          f"- gain by milestone: {by_step}.\n"
          f"- minutes per seed, end to end as if run alone (SFT + its eval + RL + evals): {minutes:.1f} "
          f"(RL + evals alone: {statistics.mean(per_seed.values()):.1f}); target < 60.\n")
    keys = {"solver_acc_gain": round(mean_gain, 3), "seed_std": round(std, 3), "minutes_per_seed": round(minutes, 2),
            "sft_em": round(em0, 2), "final_em": {s: round(em(runs[s]["evals"][last]), 2) for s in seeds},
            "gain_by_step": {str(m): round(statistics.mean(g), 3) for m, g in gains.items()},
            "steps": last, "seeds": len(seeds)}
    return {f"{name}.{k}": v for k, v in keys.items()}, md, runs


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


def plot(png: Path, panels: list[tuple[str, str, dict, list[int], float, int]]) -> None:
    """panels: (rung, title, runs, steps, SFT EM, held-out n) per row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(panels), 4, figsize=(17, 4.2 * len(panels)), squeeze=False)
    for row, (rung, title, runs, steps, em0, n) in zip(axes, panels):
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
        for s, r in runs.items():
            ax.plot([0] + steps, [em0] + [em(r["evals"][m]) for m in steps], marker="o", label=f"seed {s}")
        ax.set_title(f"{title}: held-out EM, % ({n} questions, greedy)", fontsize=9)
        ax.set_xlabel("RL step (0 = SFT cold start)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Learning ladder on CPU: SmolLM2-135M-Instruct from one SFT cold start, one line per seed")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the learning_proof_cpu.sh output folder")
    ap.add_argument("--seeds", nargs="+", required=True)
    ap.add_argument("--steps", type=int, nargs="*", default=[], help="rung 2 (SSP) milestones evaluated, e.g. 12 40")
    ap.add_argument("--qa_steps", type=int, nargs="*", default=[], help="rung 1 (QA-only RL) milestones evaluated")
    ap.add_argument("--passk", type=int, default=0, help="rung 0: the K of the SFT headroom evals (0 = no rung 0)")
    ap.add_argument("--png", type=Path, default=BENCH_DIR / "learning_proof.png")
    ap.add_argument("--name", default="learning",
                    help="rung 2's RESULTS.md section and results.json key prefix (another recipe: e.g. learning_lr1e-4)")
    a = ap.parse_args(argv)
    if not (a.steps or a.qa_steps or a.passk):
        ap.error("nothing to report: give --steps (rung 2), --qa_steps (rung 1) and/or --passk (rung 0)")

    printed = []
    if a.passk:
        keys, md = headroom(a.out, a.passk)
        write_results("learning_headroom", keys, md)
        printed.append(md)
    sft = _json(a.out / "eval_sft" / "results.json", "run scripts/learning_proof_cpu.sh first") \
        if (a.steps or a.qa_steps) else None
    t = read_timings(a.out / "timings.tsv")
    panels = []
    for rung, steps, name, title in (("qa", a.qa_steps, "learning_qa", "rung 1, QA-only RL"),
                                     ("ssp", a.steps, a.name, "rung 2, SSP")):
        if not steps:
            continue
        steps = sorted(steps)
        keys, md, runs = summarise_rung(rung, name, a.out, a.seeds, steps, sft, t)
        md += f"- plot: `{os.path.relpath(a.png.resolve(), BENCH_DIR.parent)}` (row: {title}).\n"
        write_results(name, keys, md)
        printed.append(md)
        panels.append((rung, title, runs, steps, em(sft), sft["overall"]["n"]))
    if panels:
        plot(a.png, panels)
    print("\n".join(printed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
