"""Summarise scripts/learning_proof_cpu.sh: plot, markdown table, learning.* keys.

    python bench/learning_proof.py --out runs/learning_proof --seeds 1 2 3 --steps 12 40

Reads <out>/eval_sft/results.json (the shared SFT start), <out>/seed<S>/metrics.jsonl
(per-step game metrics), <out>/seed<S>/eval_step<M>/results.json for each milestone M of
--steps, and <out>/timings.tsv.
Writes bench/learning_proof.png, the "learning" section of bench/RESULTS.md and
learning.* keys in bench/results.json:
  learning.solver_acc_gain   held-out EM at the last milestone minus after SFT, points, mean over seeds
                             (the primary metric: overall EM over every held-out question)
  learning.seed_std          sample standard deviation (ddof=1) of that gain over seeds, points
  learning.minutes_per_seed  minutes one seed takes end to end on its own: SFT + SFT eval
                             (shared here, counted in full for every seed) + RL + its evals
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

CURVES = [("proposer/reward_mean", "proposer reward"), ("solver/reward_mean", "solver reward"),
          ("game/valid_rate", "valid-question rate")]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the learning_proof_cpu.sh output folder")
    ap.add_argument("--seeds", nargs="+", required=True)
    ap.add_argument("--steps", type=int, nargs="+", required=True, help="the milestones evaluated, e.g. 12 40")
    ap.add_argument("--png", type=Path, default=BENCH_DIR / "learning_proof.png")
    ap.add_argument("--name", default="learning",
                    help="RESULTS.md section and results.json key prefix (another configuration: e.g. learning_lr1e-4)")
    a = ap.parse_args(argv)
    steps = sorted(a.steps)
    last = steps[-1]

    sft = json.loads((a.out / "eval_sft" / "results.json").read_text())
    sources = list(sft["per_source"])
    runs = {}
    for s in a.seeds:
        evals = {}
        for m in steps:
            f = a.out / f"seed{s}" / f"eval_step{m}" / "results.json"
            if not f.exists():
                sys.exit(f"learning_proof.py: {f} is missing; run scripts/learning_proof_cpu.sh for seed{s} "
                         f"(STEPS=\"{' '.join(map(str, steps))}\") first")
            evals[m] = json.loads(f.read_text())
        runs[s] = {"metrics": read_metrics(a.out / f"seed{s}" / "metrics.jsonl"), "evals": evals}
    t = read_timings(a.out / "timings.tsv")
    cfg_file = a.out / f"seed{a.seeds[0]}" / "config.json"
    c = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    recipe = (f"lr {c['optimisation']['lr']:g}, top {c['model']['train_top_layers']} layers trained, "
              f"{c['selfplay']['prompts_per_step']} proposer prompts x {c['selfplay']['proposer_n']} "
              f"and {c['selfplay']['solver_n']} solver samples per question per step" if c else "recipe unknown")

    def em(res, src=None):
        g = res["overall"] if src is None else res["per_source"].get(src)
        return 100 * g["em"] if g else float("nan")

    em0 = em(sft)
    gains = {m: [em(runs[s]["evals"][m]) - em0 for s in a.seeds] for m in steps}
    mean_gain = statistics.mean(gains[last])
    std = statistics.stdev(gains[last]) if len(a.seeds) > 1 else float("nan")
    shared = t.get(("sft", "-"), 0.0) + t.get(("eval_sft", "-"), 0.0)
    per_seed = {s: (t.get(("rl", s), 0.0) + sum(t.get((f"eval_step{m}", s), 0.0) for m in steps)) / 60
                for s in a.seeds}
    minutes = statistics.mean(shared / 60 + m for m in per_seed.values())

    # ---- plot: three training curves and held-out EM, one line per seed
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for s in a.seeds:
            m = runs[s]["metrics"]
            x, y = [r["step"] for r in m], [r.get(key, float("nan")) for r in m]
            raw, = ax.plot(x, y, lw=0.6, alpha=0.35)
            k = 5  # trailing mean over 5 steps: one step holds only 8 games
            ax.plot(x, [statistics.mean(y[max(0, i - k + 1):i + 1]) for i in range(len(y))], lw=2,
                    color=raw.get_color(), label=f"seed {s} ({k}-step mean)")
        ax.set_title(title)
        ax.set_xlabel("SSP step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for s in a.seeds:
        ax.plot([0] + steps, [em0] + [em(runs[s]["evals"][m]) for m in steps], marker="o", label=f"seed {s}")
    ax.set_title(f"held-out EM, % ({sft['overall']['n']} questions, greedy)")
    ax.set_xlabel("SSP step (0 = SFT cold start)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"SSP learning proof on CPU ({a.name}): SmolLM2-135M-Instruct, SFT then {last} self-play steps, "
                 f"{len(a.seeds)} seeds")
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)

    # ---- tables
    def window(rs, k):
        return f"{statistics.mean(r.get(k, 0.0) for r in rs):.2f}" if rs else "-"

    rows = [["SFT (start)", "0", "-", f"{em0:.1f}"] + [f"{em(sft, k):.1f}" for k in sources] + ["-", "-", "-"]]
    for s in a.seeds:
        mets = runs[s]["metrics"]
        prev = 0
        for m in steps:
            seg = [r for r in mets if prev < r["step"] <= m]  # training steps since the previous milestone
            res = runs[s]["evals"][m]
            rows.append([f"seed {s}", str(m), f"{em(res) - em0:+.1f}", f"{em(res):.1f}"]
                        + [f"{em(res, k):.1f}" for k in sources]
                        + [window(seg, "solver/reward_mean"), window(seg, "proposer/reward_mean"),
                           window(seg, "game/valid_rate")])
            prev = m
    table = md_table(["run", "step", "gain (pts)", "EM overall %"] + [f"EM {k} %" for k in sources]
                     + ["solver reward", "proposer reward", "valid rate"], rows)
    by_step = "; ".join(f"step {m}: {statistics.mean(g):+.2f} (seeds {', '.join(f'{x:+.1f}' for x in g)})"
                        for m, g in gains.items())
    target = mean_gain > 2 * std
    md = (f"`scripts/learning_proof_cpu.sh`: SFT cold start once (the shared start; {shared / 60:.1f} min with its eval), "
          f"then per seed SSP self-play (both roles trained; {recipe}) with a greedy held-out eval at steps "
          f"{', '.join(map(str, steps))}, same protocol as the SFT eval. Primary metric, fixed before the runs: "
          f"overall EM over all {sft['overall']['n']} held-out questions at step {last}. Reward and valid-rate "
          f"columns are means over the training steps since the previous milestone (training games, not held-out).\n\n"
          f"{table}\n\n"
          f"- **solver_acc_gain = {mean_gain:+.2f} points** at step {last} (mean over {len(a.seeds)} seeds), "
          f"seed std {std:.2f} points: target gain > 2 x std **{'met' if target else 'NOT met'}**.\n"
          f"- gain by milestone: {by_step}.\n"
          f"- minutes per seed, end to end as if run alone (SFT + its eval + RL + evals): {minutes:.1f} "
          f"(RL + evals alone: {statistics.mean(per_seed.values()):.1f}); target < 60.\n"
          f"- plot: `{os.path.relpath(a.png.resolve(), BENCH_DIR.parent)}`.\n")
    keys = {"solver_acc_gain": round(mean_gain, 3), "seed_std": round(std, 3),
            "minutes_per_seed": round(minutes, 2), "sft_em": round(em0, 2),
            "final_em": {s: round(em(runs[s]["evals"][last]), 2) for s in a.seeds},
            "gain_by_step": {str(m): round(statistics.mean(g), 3) for m, g in gains.items()},
            "steps": last, "seeds": len(a.seeds)}
    write_results(a.name, {f"{a.name}.{k}": v for k, v in keys.items()}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
