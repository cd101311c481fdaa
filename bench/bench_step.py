"""Step-time breakdown of the SSP trainer: 2 ranks over gloo, SmolLM2-135M, the demo's settings.

    .venv/bin/python bench/bench_step.py                           # two fresh 3-step runs: all layers, top 8
    .venv/bin/python bench/bench_step.py --estimator gae           # the same with PPO's critic (its share shows)
    .venv/bin/python bench/bench_step.py --train_top_layers 8 --dtype bf16
    .venv/bin/python bench/bench_step.py --run runs/demo_cpu       # or read existing runs' metrics.jsonl

Reports the median over steps of each phase (timing_s/* are per-step maxima over ranks):
sync, generate (the whole game: rollouts of both roles, search and judge inside), of which
search time is shown apart, log-probs (old/ref recompute), the critic (its values and its
update, with --estimator gae), update, of which the step batch's packing (timing_s/pack, inside the
log-prob, critic and update times; 0 for runs before it was logged; bench/bench_pack.py compares it
with the old pack-per-phase sequence), what the step spends elsewhere, and the whole step.
The first step is dropped when there are more than two (warm-up). One column pair per run;
the launched runs go one after another, in the order of --train_top_layers. Writes section
"step breakdown" of bench/RESULTS.md, or "step breakdown gae" when a run has the critic (so
each keeps its table), and `step.[gae.][topN.]*` to bench/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import md_table, write_results  # noqa: E402
from utils.dist import free_port  # noqa: E402

# The code whose speed this measures (bench/report.py --check flags the section when it changes).
MEASURES = ["bench/bench_step.py", "inference", "retrieval", "train.py", "training"]
PHASES = [("sync", "timing_s/sync"), ("generate (game)", "timing_s/generate"),
          ("  of which search, proposer", "timing_s/search_proposer"), ("  of which search, solver", "timing_s/search_solver"),
          ("log-probs (old/ref)", "timing_s/logprobs"), ("critic (values + update)", "timing_s/critic"),
          ("update", "timing_s/update"), ("  of which packing (in the three above)", "timing_s/pack"), ("other (advantages, metrics, ...)", "other"), ("step", "timing_s/step")]
# the phases that do not overlap: the step's time outside them is "other"
_TOP_LEVEL = ("timing_s/sync", "timing_s/generate", "timing_s/logprobs", "timing_s/critic", "timing_s/update")


def train_command(out: Path, steps: int, *, dtype: str = "fp32", train_top_layers: int = 0, estimator: str = "",
                  model: str = "", port: int = 29500) -> list[str]:
    """The torchrun command line of one launched run (the demo's settings, a few steps)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "train.py", *(["--model_path", model] if model else []), "--dtype", dtype, "--gradient_checkpointing", "false",
           "--index", "data/indexes/bm25",
           "--pool_init", "data/train/solver_qa.jsonl", "--prompts_per_step", "2", "--solver_n", "4",
           "--max_turns", "3", "--max_tokens_per_turn", "128", "--max_total_tokens", "1536", "--max_model_len", "2048",
           "--max_info_tokens", "256", "--micro_token_budget", "4096", "--lr", "1e-6", "--total_steps", str(steps),
           "--save_every", "0", "--export_hf", "false", "--train_top_layers", str(train_top_layers),
           "--output_dir", str(out)]
    if estimator == "gae":
        # Both roles take GAE (the proposer's group of one needs no group baseline). The critic trains the
        # same top layers as the actor and without recompute, as the actor here, so its share compares.
        cmd += ["--solver_estimator", "gae", "--proposer_estimator", "gae",
                "--critic_train_top_layers", str(train_top_layers), "--critic_gradient_checkpointing", "false"]
    return cmd


def launch(out: Path, steps: int, **kw) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    subprocess.run(train_command(out, steps, port=free_port(), **kw), cwd=REPO, env=env, check=True)


def resolve_dtype(dtype: str) -> str:
    """'auto': what utils.cpu_dtype picks on this machine at one thread a rank (as the CPU scripts pick it)."""
    if dtype != "auto":
        return dtype
    p = subprocess.run([sys.executable, "-m", "utils.cpu_dtype", "--verbose"], cwd=REPO, check=True, text=True,
                       capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    print(p.stderr.strip(), file=sys.stderr)
    return p.stdout.strip()


def read_run(run: Path) -> dict:
    """A run folder's per-phase medians and what it ran: {"label", "steps", "of", "med", "cfg", "rows"}."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open() if line.strip()]
    cfg = json.loads((run / "config.json").read_text())
    steps = rows[1:] if len(rows) > 2 else rows
    for r in steps:
        r["other"] = max(0.0, r.get("timing_s/step", 0.0) - sum(r.get(k, 0.0) for k in _TOP_LEVEL))
    med = {key: statistics.median(r.get(key, 0.0) for r in steps) for _, key in PHASES}
    m, a = cfg["model"], cfg["algorithm"]
    top = m.get("train_top_layers", 0)
    gae = "gae" in (a.get("solver_estimator"), a.get("proposer_estimator"))
    label = f"{m['dtype']}, {'all layers' if not top else f'top {top} layers'}" + (", GAE critic" if gae else "")
    return {"label": label, "top": top, "gae": gae, "steps": steps, "of": len(rows), "med": med, "cfg": cfg}


def section_name(runs: list[dict]) -> str:
    """Runs with the critic get a section of their own, so measuring them keeps the plain table."""
    return "step breakdown" + (" gae" if any(r["gae"] for r in runs) else "")


def report(runs: list[dict]) -> tuple[dict, str]:
    """(results.json keys, markdown): one (median s, share) column pair per run."""
    header = ["phase"] + [h for r in runs for h in (f"{r['label']}: median s", "share of step")]
    table = []
    for name, key in PHASES:
        row = [name]
        for r in runs:
            total = r["med"]["timing_s/step"]
            row += [r["med"][key], f"{100 * r['med'][key] / total:.0f}%" if total else "-"]
        table.append(row)
    cfg = runs[0]["cfg"]
    sp, ro = cfg["selfplay"], cfg["rollout"]
    per_run = "; ".join(
        f"{r['label']}: median over {len(r['steps'])} steps (of {r['of']}), solver trajectories/step/rank "
        f"{statistics.median(s.get('rollout/solver_trajs', 0) for s in r['steps']):.0f}, sampled tokens trained/step "
        f"(global) {statistics.median(s.get('actor/num_tokens', 0) for s in r['steps']):.0f}" for r in runs)
    md = (f"2 ranks (gloo), `{Path(cfg['model']['model_path']).name}`, {sp['prompts_per_step']} proposer prompts/step, "
          f"G_s={sp['solver_n']}, max {ro['max_turns']} turns x {ro['max_tokens_per_turn']} tokens, BM25 "
          f"top-{cfg['search']['topk']}. {per_run}.\n\n{md_table(header, table)}\n\n'other' is the step's time outside "
          f"the named phases (advantages, metrics, logging), per step. The runs went one after another and the machine "
          f"runs other work too; read the shares, not the absolute seconds.\n")
    keys = {}
    for r in runs:
        # all layers without a critic keeps the keys' old names; GAE and top N layers get their own prefixes
        pre = "step." + ("gae." if r["gae"] else "") + (f"top{r['top']}." if r["top"] else "")
        keys[f"{pre}seconds"] = round(r["med"]["timing_s/step"], 2)
        keys.update({f"{pre}{k.split('/')[-1]}_s": round(v, 3) for k, v in r["med"].items() if k != "timing_s/step"})
    return keys, md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # read instead of launching
    ap.add_argument("--run", nargs="+", default=[], help="existing run folder(s) to read instead of launching runs")
    # the launched runs
    ap.add_argument("--steps", type=int, default=3, help="steps of each launched run")
    ap.add_argument("--model", default="", help="train.py's --model_path (empty = its default, the demo's SmolLM2-135M)")
    ap.add_argument("--train_top_layers", nargs="+", type=int, default=[0, 8],
                    help="one launched run per value, passed to train.py's --train_top_layers (0 = all layers)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="train.py's --dtype; auto = what `python -m utils.cpu_dtype` picks here (bf16 on AMX CPUs)")
    ap.add_argument("--estimator", default="", choices=["", "gae"],
                    help="gae: both roles use PPO's critic and GAE (--solver_estimator gae --proposer_estimator gae), "
                         "so the table shows the critic's share; empty = train.py's default estimators")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as d:
        folders = [Path(p) for p in args.run]
        if not folders:
            dtype = resolve_dtype(args.dtype)
            for top in args.train_top_layers:
                folders.append(Path(d) / f"run_top{top}")
                launch(folders[-1], args.steps, dtype=dtype, train_top_layers=top, estimator=args.estimator,
                       model=args.model)
        runs = [read_run(f) for f in folders]
    keys, md = report(runs)
    write_results(section_name(runs), keys, md, measures=MEASURES)
    print(md)


if __name__ == "__main__":
    main()
