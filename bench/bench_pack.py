"""Time a step spends packing: the pack-per-phase sequence of main at 00d7210 against the step batch packed once.

    .venv/bin/python bench/bench_pack.py                                  # runs/lp/seed1's dumped rollouts
    .venv/bin/python bench/bench_pack.py --rollouts runs/lp/seed2/rollouts --repeats 30

The trajectories are real ones: each `step_*.rank*.jsonl` that --dump_rollouts wrote (one rank's step of a
SmolLM2-135M learning-proof run) is rebuilt as the trainer held it, the role's prompt (inference/prompts.py)
followed by the response text re-tokenised, with the retrieved <information> blocks masked; the trajectories
that carry loss (sampled tokens, not excluded) form the step. Both sequences run in one process on the same
steps, alternating, and report the median over repeats of the whole step's packing time:

- before (the trainer at 00d7210): pack_equal for the old log-probs, the reference's, the critic's values
  (each followed by unpack_to_sequences of the forward's packed output), then pack_equal again for the
  actor's mini-batch (advantages, old and reference log-probs packed in) and the critic's (values, returns);
- after (training/algorithm/step_batch.py): one StepBatch packing; put_packed + column for the old, reference and
  value outputs, put for the advantages and returns (what the trainer and ppo_update/critic_update do).

Scenarios: "default" (--old_logprobs recompute, no reference, no critic: old + update), and "full" (a
reference and PPO's critic on both roles: the five packings the issue counts; the teacher keeps its own).
The forwards are left out (their outputs are zeros of the right length), so this is the packing's cost
alone; without a process group the equalising all-reduce is a no-op, so each saved packing would also
save one all-reduce of one integer on a multi-rank run (counted in the table, not timed). Writes section
"pack" of bench/RESULTS.md and `pack.*` to bench/results.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.report import RESULTS_JSON, md_table, write_results  # noqa: E402
from inference.prompts import build_proposer_prompt, build_solver_prompt  # noqa: E402
from inference.trajectory import Trajectory  # noqa: E402
from training.algorithm.packing import unpack_to_sequences  # noqa: E402
from training.algorithm.step_batch import ADV, OLD, REF, RETURNS, VALUES, StepBatch, put_missing  # noqa: E402
from training.algorithm.micro_batches import pack_equal  # noqa: E402

MEASURES = ["bench/bench_pack.py", "training/algorithm/micro_batches.py", "training/algorithm/packing.py", "training/algorithm/step_batch.py", "training/algorithm/update.py"]
INFO = re.compile(r"(<information>.*?</information>)", re.S)


def load_steps(folder: Path, tokenizer) -> list[list[Trajectory]]:
    """One list of trajectories per dumped (step, rank) file, rebuilt as token ids and a loss mask."""
    steps = []
    for f in sorted(glob.glob(str(folder / "step_*.rank*.jsonl")), key=lambda p: (len(p), p)):
        trajs = []
        for line in open(f):
            r = json.loads(line)
            if not r.get("sampled_tokens") or r.get("excluded"):
                continue
            prompt = (build_solver_prompt(tokenizer, r["question"] or "") if r["role"] == "solver"
                      else build_proposer_prompt(tokenizer, r["answer"], max(1, int(r.get("searches") or 1))))
            ids, mask = list(prompt), [0] * len(prompt)
            for piece in INFO.split(r["response"] or ""):
                if piece:
                    t = tokenizer(piece, add_special_tokens=False)["input_ids"]
                    ids += t
                    mask += [0 if piece.startswith("<information>") else 1] * len(t)
            trajs.append(Trajectory(role=r["role"], group_id=r["group_id"], token_ids=ids, loss_mask=mask,
                                    logprobs=[0.0] * len(ids), reward=float(r["reward"])))
        if trajs:
            steps.append(trajs)
    return steps


def columns(trajs) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(len(trajs))
    return {k: [torch.randn(len(t.token_ids), generator=g) for t in trajs] for k in (ADV, RETURNS)}


def before(trajs, budget: int, full: bool, cols) -> int:
    """The trainer's packings at 00d7210; returns how many it made (one all-reduce each)."""
    n = 0
    per_seq = {}
    for name in (OLD, REF, VALUES) if full else (OLD,):
        mbs, n_real = pack_equal(trajs, budget)
        outs = [torch.zeros(mb.num_tokens) for mb in mbs]
        per_seq[name] = unpack_to_sequences(mbs[:n_real], outs[:n_real], len(trajs))
        n += 1
    per_token = {"advantages": cols[ADV], "old_logprobs": per_seq[OLD]}
    if full:
        per_token["ref_logprobs"] = per_seq[REF]
    pack_equal(trajs, budget, per_token)
    n += 1
    if full:
        pack_equal(trajs, budget, {"old_values": per_seq[VALUES], "returns": cols[RETURNS]})
        n += 1
    return n


def after(trajs, budget: int, full: bool, cols) -> int:
    """The step batch: one packing, the forwards' outputs written into it, the advantages and returns scattered."""
    batch = StepBatch(trajs, budget)
    per_seq = {}
    for name in (OLD, REF, VALUES) if full else (OLD,):
        batch.put_packed(name, [torch.zeros(mb.num_tokens) for mb in batch.micro_batches])
        per_seq[name] = batch.column(name)
    sub = range(len(trajs))
    put_missing(batch, {ADV: cols[ADV], OLD: per_seq[OLD], REF: per_seq.get(REF)}, sub)
    if full:
        put_missing(batch, {VALUES: per_seq[VALUES], RETURNS: cols[RETURNS]}, sub)
    return 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", default="runs/lp/seed1/rollouts", help="a run's --dump_rollouts folder (read only)")
    ap.add_argument("--tokenizer", default="data/models/SmolLM2-135M-Instruct")
    ap.add_argument("--budget", type=int, default=4096, help="--micro_token_budget (the run's)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no_write", action="store_true")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(REPO / a.tokenizer if not Path(a.tokenizer).is_absolute() else a.tokenizer)
    folder = Path(a.rollouts) if Path(a.rollouts).is_absolute() else REPO / a.rollouts
    steps = load_steps(folder, tok)
    cols = [columns(s) for s in steps]
    torch.set_num_threads(1)
    keys, rows = {}, []
    lens = [len(t.token_ids) for s in steps for t in s]
    for scenario, full in (("default", False), ("full", True)):
        t = {"before": [], "after": []}
        counts = {}
        for _ in range(a.repeats):
            for name, fn in (("before", before), ("after", after)):   # alternating, so drift hits both alike
                t0 = time.perf_counter()
                counts[name] = sum(fn(s, a.budget, full, c) for s, c in zip(steps, cols)) / len(steps)
                t[name].append((time.perf_counter() - t0) / len(steps))
        b, f = statistics.median(t["before"]), statistics.median(t["after"])
        rows.append([scenario, b * 1e3, f * 1e3, b / f, counts["before"], counts["after"]])
        keys.update({f"pack.{scenario}.before_ms_per_step": b * 1e3, f"pack.{scenario}.after_ms_per_step": f * 1e3,
                     f"pack.{scenario}.ratio": b / f, f"pack.{scenario}.packings_before": counts["before"],
                     f"pack.{scenario}.packings_after": counts["after"]})
    keys.update({"pack.steps": len(steps), "pack.trajs_per_step": len(lens) / len(steps),
                 "pack.tokens_per_step": sum(lens) / len(steps)})
    md = (f"{len(steps)} steps of one rank each from `{a.rollouts}` ({len(lens) / len(steps):.1f} trajectories, "
          f"{sum(lens) / len(steps):.0f} tokens a step, longest {max(lens)}), --micro_token_budget {a.budget}, "
          f"1 thread; median over {a.repeats} repeats of each step's packing time, forwards left out. The two "
          "sequences alternate in one process on a machine that runs other work too: the absolute milliseconds move "
          "between runs (by 2x), the ratio does not.\n\n"
          + md_table(["scenario", "before: ms/step", "after: ms/step", "before / after", "packings (all-reduces) before",
                      "after"], rows)
          + "\n\n'default': --old_logprobs recompute, no reference, no critic; 'full': with a reference and a critic on "
            "both roles (the teacher keeps its own packing in both). Before = the trainer at 00d7210 (pack_equal per "
            "phase); after = training/algorithm/step_batch.py. The trainer logs the in-step time as timing_s/pack; see "
            "'step breakdown' for the step it sits in.")
    # its size in a step: the step breakdown's measured steps (bench/bench_step.py), when results.json has them
    known = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    shares = [(name, known[k]) for name, k in (("default", "step.top8.seconds"), ("full", "step.gae.top8.seconds"))
              if k in known]
    if shares:
        md += ("\n\nAgainst a whole step (bench/RESULTS.md 'step breakdown', 'step breakdown gae': 2 ranks, top 8 "
               "layers, fewer and shorter trajectories than these): packing saved "
               + "; ".join(f"{name} {keys[f'pack.{name}.before_ms_per_step'] - keys[f'pack.{name}.after_ms_per_step']:.0f}"
                           f" ms of a {sec:.1f} s step ({(keys[f'pack.{name}.before_ms_per_step'] - keys[f'pack.{name}.after_ms_per_step']) / 10 / sec:.2f}%)"
                           for name, sec in shares)
               + ". Packing was never a large part of the step; what it buys is one packing, one all-reduce and "
                 "one set of micro-batches per step, not speed.")
    print(md)
    if not a.no_write:
        write_results("pack", keys, md, measures=MEASURES)


if __name__ == "__main__":
    main()
