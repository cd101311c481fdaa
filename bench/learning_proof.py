"""Summarise scripts/learning_proof_cpu.sh: plot, markdown table, learning.* keys.

    python bench/learning_proof.py --out runs/learning_proof --seeds 1 2 3 --steps 20

Reads <out>/eval_sft/results.json (the shared SFT start), <out>/seed<S>/metrics.jsonl
(per-step game metrics) and <out>/seed<S>/eval_final/results.json, <out>/timings.tsv.
Writes bench/learning_proof.png, the "learning" section of bench/RESULTS.md and
learning.* keys in bench/results.json:
  learning.solver_acc_gain   held-out EM after RL minus after SFT, points, mean over seeds
  learning.seed_std          sample standard deviation (ddof=1) of that gain over seeds, points
  learning.minutes_per_seed  minutes one seed takes end to end on its own: SFT + SFT eval
                             (shared here, counted in full for every seed) + RL + final eval
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--png", type=Path, default=BENCH_DIR / "learning_proof.png")
    a = ap.parse_args(argv)

    sft = json.loads((a.out / "eval_sft" / "results.json").read_text())
    sources = list(sft["per_source"])
    runs = {}
    for s in a.seeds:
        final = a.out / f"seed{s}" / "eval_final" / "results.json"
        if not final.exists():
            sys.exit(f"learning_proof.py: {final} is missing; run scripts/learning_proof_cpu.sh for seed {s} first")
        runs[s] = {"metrics": read_metrics(a.out / f"seed{s}" / "metrics.jsonl"), "final": json.loads(final.read_text())}
    t = read_timings(a.out / "timings.tsv")

    em0 = 100 * sft["overall"]["em"]
    gains = [100 * runs[s]["final"]["overall"]["em"] - em0 for s in a.seeds]
    mean_gain = statistics.mean(gains)
    std = statistics.stdev(gains) if len(gains) > 1 else float("nan")
    shared = t.get(("sft", "-"), 0.0) + t.get(("eval_sft", "-"), 0.0)
    per_seed = {s: (t.get(("rl", s), 0.0) + t.get(("eval_final", s), 0.0)) / 60 for s in a.seeds}
    minutes = statistics.mean(shared / 60 + m for m in per_seed.values())

    # ---- plot: three training curves and held-out EM, one line per seed
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for s in a.seeds:
            m = runs[s]["metrics"]
            ax.plot([r["step"] for r in m], [r.get(key, float("nan")) for r in m], marker=".", label=f"seed {s}")
        ax.set_title(title)
        ax.set_xlabel("SSP step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for s in a.seeds:
        ax.plot([0, a.steps], [em0, 100 * runs[s]["final"]["overall"]["em"]], marker="o", label=f"seed {s}")
    ax.set_title(f"held-out EM, % ({sft['overall']['n']} questions: {', '.join(sources)})")
    ax.set_xlabel("SSP step (0 = SFT cold start)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"SSP learning proof on CPU: SmolLM2-135M-Instruct, SFT then {a.steps} self-play steps")
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)

    # ---- tables
    rows = [["SFT (start)", "-", f"{em0:.1f}"] + [f"{100 * sft['per_source'][k]['em']:.1f}" for k in sources]
            + ["-", "-", "-"]]
    for s, g in zip(a.seeds, gains):
        f = runs[s]["final"]
        m = runs[s]["metrics"]
        first, last = m[:5], m[-5:]
        def avg(rs, k):
            return statistics.mean(r.get(k, 0.0) for r in rs) if rs else float("nan")
        rows.append([f"seed {s}, step {a.steps}", f"{g:+.1f}", f"{100 * f['overall']['em']:.1f}"]
                    + [f"{100 * f['per_source'].get(k, {}).get('em', float('nan')):.1f}" for k in sources]
                    + [f"{avg(first, 'solver/reward_mean'):.2f} -> {avg(last, 'solver/reward_mean'):.2f}",
                       f"{avg(first, 'game/valid_rate'):.2f} -> {avg(last, 'game/valid_rate'):.2f}",
                       f"{per_seed[s]:.1f}"])
    table = md_table(["run", "gain (pts)", "EM overall %"] + [f"EM {k} %" for k in sources]
                     + ["solver reward (first 5 -> last 5 steps)", "valid rate (first 5 -> last 5)", "RL + eval min"], rows)
    target = mean_gain > 2 * std
    md = (f"`scripts/learning_proof_cpu.sh`: SFT cold start once (shared start, {shared / 60:.1f} min incl. its eval), "
          f"then per seed {a.steps} SSP steps (both roles) and a greedy held-out eval, same protocol as the SFT eval.\n\n"
          f"{table}\n\n"
          f"- **solver_acc_gain = {mean_gain:+.2f} points** (mean over {len(gains)} seeds), seed std {std:.2f} points: "
          f"target gain > 2 x std **{'met' if target else 'NOT met'}**.\n"
          f"- minutes per seed, end to end as if run alone (SFT + evals + RL): {minutes:.1f} "
          f"(RL + final eval alone: {statistics.mean(per_seed.values()):.1f}); target < 60.\n"
          f"- plot: `bench/learning_proof.png`.\n")
    keys = {"learning.solver_acc_gain": round(mean_gain, 3), "learning.seed_std": round(std, 3),
            "learning.minutes_per_seed": round(minutes, 2), "learning.sft_em": round(em0, 2),
            "learning.final_em": {s: round(100 * runs[s]["final"]["overall"]["em"], 2) for s in a.seeds},
            "learning.steps": a.steps, "learning.seeds": len(gains)}
    write_results("learning", keys, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
