"""TRL's GRPOTrainer beside ours on one machine, in one run: the loss on a fixed batch, then the training step.

    bash scripts/setup_trl.sh                                         # optional: the bench installs TRL itself
    .venv/bin/python bench/bench_peer_trl.py --model runs/demo_cpu/sft/hf            # both engines, 4 steps each
    .venv/bin/python bench/bench_peer_trl.py --model M --engines vllm --steps 3 --max_tokens 64
    .venv/bin/python bench/bench_peer_trl.py --loss-only                             # the loss comparison alone

The start model defaults to the demo's SFT export (runs/demo_cpu/sft/hf, made by `bash scripts/sft_coldstart.sh`;
zero-shot SmolLM2 gets no reward). TRL 1.16.0 lives in an overlay (bench/peer_trl_env.py), installed here when
missing; every TRL process gets it on PYTHONPATH, ours never do.

1. The loss (bench/peer_trl_loss.py, a child process): TRL's `_compute_loss` against our packed loss on one
   fixed fp32 batch, per matched loss type; largest relative difference of the loss and of the gradients.
2. The step: for each engine (hf = HF generate, TRL's use_vllm=False; vllm = vLLM in the trainer's process, TRL's
   vllm_mode="colocate"), TRL (bench/peer_trl_run.py) and our train.py, one after the other, each one process with
   the same threads, on the same start model, QA rows (--qa_data), prompt (ours, through the chat template), reward
   (EM of the last <answer>, /4 when spammed), group size, token cap, lr (constant), fp32, clip 0.2/0.28,
   token-mean loss (TRL's dapo), group-normalised advantages, no KL, grad-norm clip 1.0, optimizer steps.
   **Single-turn**: --max_turns 1 for ours, so a <search> ends the trajectory on both sides. TRL's tool loop
   parses JSON tool calls in the chat template's tool-call format; our protocol (<search>q</search> answered by
   <information>) is not one of those, so the multi-turn row is not measured.
   Measured, median over the steps after the first (warm-up): seconds per step, rollout and update apart (TRL's
   rollout is `_generate_and_score_completions`, ours timing_s/generate; TRL's rest of the step is its update, ours
   is the step less generate, which holds the weight sync and the old-log-prob forward TRL skips at one iteration),
   sampled tokens per second of rollout, peak RSS of the process tree (psutil, every 0.2 s), reward per step.
Writes section "peer_trl" of bench/RESULTS.md and peer_trl.* keys of bench/results.json, with the targets:
step_speedup (TRL's s/step over ours) >= 1.5, tokens_per_s_ratio (ours over TRL's) >= 1.5, peak_rss_ratio (ours
over TRL's) <= 1.0, loss_max_rel_diff.<type> and grad_max_rel_diff.<type> <= 1e-5. The ratios are for the first
engine both sides ran; each engine's are keyed peer_trl.<engine>.*.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.peer_trl_env import PACKAGES, ensure_trl, overlay_env  # noqa: E402
from bench.report import md_table, write_results  # noqa: E402
from utils.dist import free_port  # noqa: E402

MEASURES = ["bench/bench_peer_trl.py", "bench/peer_trl_loss.py", "bench/peer_trl_run.py", "bench/peer_trl_env.py",
            "training/algorithm/loss.py", "training/algorithm/logprobs.py", "training/algorithm/packing.py", "train.py", "training", "inference"]
TARGETS = {"step_speedup": 1.5, "tokens_per_s_ratio": 1.5, "peak_rss_ratio": 1.0, "loss_max_rel_diff": 1e-5}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    # workload
    p.add_argument("--model", default="runs/demo_cpu/sft/hf", help="HF folder of the start model (the demo's SFT export)")
    p.add_argument("--qa_data", default="data/train/solver_qa.jsonl", help="QA rows both sides train on")
    p.add_argument("--engines", default="hf,vllm", help="generation back-ends, in order: hf, vllm")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is warm-up)")
    p.add_argument("--prompts_per_step", type=int, default=2, help="questions per step")
    p.add_argument("--group", type=int, default=4, help="completions per question")
    p.add_argument("--max_tokens", type=int, default=64, help="sampled tokens per completion at most")
    p.add_argument("--lr", type=float, default=1e-6, help="constant learning rate")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each side's one process")
    p.add_argument("--out", default="runs/peer_trl", help="where both sides' runs go")
    p.add_argument("--loss-only", action="store_true", help="only the loss comparison")
    return p.parse_args()


# ----------------------------------------------------------------------------- measuring a child

def run_measured(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[int, float, float]:
    """(exit code, wall seconds, peak RSS in GiB of the process tree) of `cmd`, its output in `log`."""
    import psutil

    peak = [0]
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        done = threading.Event()

        def watch():
            root = psutil.Process(proc.pid)
            while not done.is_set():
                try:
                    procs = [root, *root.children(recursive=True)]
                    peak[0] = max(peak[0], sum(q.memory_info().rss for q in procs if q.is_running()))
                except psutil.Error:
                    pass
                done.wait(0.2)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        done.set()
        t.join()
    return rc, time.perf_counter() - t0, peak[0] / 2**30


def child_env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                VLLM_CPU_KVCACHE_SPACE="1", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))


def ours_command(a, engine: str, out: Path) -> list[str]:
    return [sys.executable, "train.py", "--model_path", a.model, "--dtype", "fp32", "--gradient_checkpointing", "false",
            "--index", "data/indexes/bm25", "--self_play_enable", "false", "--proposer_enable", "false",
            "--qa_data", a.qa_data, "--prompts_per_step", str(a.prompts_per_step), "--solver_n", str(a.group),
            "--max_turns", "1", "--max_tokens_per_turn", str(a.max_tokens), "--max_total_tokens", "2048",
            "--max_model_len", "2048",
            "--lr", str(a.lr), "--lr_schedule", "constant", "--max_grad_norm", "1.0", "--loss_agg", "token-mean",
            "--solver_estimator", "grpo", "--clip_low", "0.2", "--clip_high", "0.28", "--kl_coef", "0",
            "--temperature", "1.0", "--top_p", "1.0", "--rollout_engine", engine, "--total_steps", str(a.steps),
            "--save_every", "0", "--export_hf", "false", "--output_dir", str(out)]


def trl_command(a, engine: str, out: Path) -> list[str]:
    return [sys.executable, "bench/peer_trl_run.py", "--model", a.model, "--qa_data", a.qa_data, "--out", str(out),
            "--steps", str(a.steps), "--prompts_per_step", str(a.prompts_per_step), "--group", str(a.group),
            "--max_tokens", str(a.max_tokens), "--lr", str(a.lr), "--engine", engine, "--threads", str(a.threads)]


def read_ours(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{"step_s": r["timing_s/step"], "rollout_s": r["timing_s/generate"],
             "update_s": r["timing_s/step"] - r["timing_s/generate"], "sampled_tokens": r.get("train/solver_tokens", 0),
             "reward_mean": r.get("solver/reward_mean", float("nan"))} for r in rows if "timing_s/step" in r]


def read_trl(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines() if x.strip()]


def summarise(rows: list[dict]) -> dict:
    after = rows[1:] if len(rows) > 1 else rows   # the first step warms up (compiles, caches)
    med = {k: statistics.median(r[k] for r in after) for k in ("step_s", "rollout_s", "update_s")}
    med["tokens_per_s"] = statistics.median(r["sampled_tokens"] / r["rollout_s"] for r in after if r["rollout_s"] > 0)
    med["tokens_per_step"] = statistics.median(r["sampled_tokens"] for r in after)
    med["rewards"] = [round(float(r.get("reward_mean", float("nan"))), 3) for r in rows]
    med["steps_measured"] = len(after)
    return med


# ----------------------------------------------------------------------------- the two parts

def loss_part(overlay: Path) -> tuple[dict, list[dict], dict]:
    p = subprocess.run([sys.executable, "bench/peer_trl_loss.py", "--kl"], cwd=REPO, env=overlay_env(overlay),
                       capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise RuntimeError(f"bench/peer_trl_loss.py failed:\n{p.stderr[-3000:]}")
    out = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    return out[0]["versions"], out[1:], {}


def last_error(log: Path) -> str:
    """The last line of a failed child's log that names an error (what the table shows)."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if "Error" in x or "error:" in x]
    return lines[-1][-200:] if lines else ""


def step_part(a, overlay: Path, on_result=None) -> dict:
    """Both sides on each engine; on_result(results) after each run (the section is rewritten as rows come)."""
    results = {}
    base = Path(a.out)
    for engine in [e for e in a.engines.split(",") if e]:
        for side in ("trl", "ours"):
            out = base / f"{side}_{engine}"
            cmd = trl_command(a, engine, out) if side == "trl" else ours_command(a, engine, out)
            env = child_env(a.threads)
            if side == "trl":
                env = overlay_env(overlay, env)
            else:   # one process, world size 1 (docs/PLATFORM_NOTES.md: plain python needs the rank variables)
                env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            # a fresh folder: train.py would resume an earlier run's last checkpoint there and report its old steps
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            print(f"peer_trl: {side} / {engine}: {' '.join(cmd)}", flush=True)
            rc, wall, rss = run_measured(cmd, env, base / f"{side}_{engine}.log", timeout=3600)
            entry = {"rc": rc, "wall_s": wall, "peak_rss_gib": rss}
            try:
                entry.update(summarise(read_trl(out) if side == "trl" else read_ours(out)))
            except (OSError, KeyError, ValueError, statistics.StatisticsError) as e:
                entry["error"] = (f"exit {rc}, no step rows: {last_error(base / f'{side}_{engine}.log')} "
                                  f"({base / f'{side}_{engine}.log'}; {type(e).__name__})")
            print(f"peer_trl: {side} / {engine}: {json.dumps(entry)}", flush=True)
            results[(side, engine)] = entry
            if on_result is not None:
                on_result(results)
    return results


def report(a, versions: dict, loss_rows: list[dict], steps: dict) -> None:
    keys: dict = {}
    matched = [r for r in loss_rows if r["matched"]]
    for r in matched:
        keys[f"peer_trl.loss_max_rel_diff.{r['loss_type']}"] = r["loss_rel_diff"]
        keys[f"peer_trl.grad_max_rel_diff.{r['loss_type']}"] = r["grad_rel_diff"]
    worst = max(max(r["loss_rel_diff"], r["grad_rel_diff"]) for r in matched)
    keys["peer_trl.loss_target_met"] = worst <= TARGETS["loss_max_rel_diff"]
    md = [f"TRL {versions['trl']} (overlay: {' '.join(PACKAGES)}) beside ours, one run of `bench/bench_peer_trl.py` "
          f"on one machine (transformers {versions['transformers']}, torch {versions['torch']}, CPU kernels "
          f"{versions['cpu']}).", "", "### The loss on one fixed batch (fp32, tiny random Llama)", "",
          "TRL's `GRPOTrainer._compute_loss` on the padded batch against our `sequence_logprobs` + `policy_loss` on "
          "the same sequences packed into several micro-batches (bench/peer_trl_loss.py). Target: <= 1e-5 relative, "
          "loss and gradients, for every matched type.", ""]
    md.append(md_table(["TRL loss_type", "ours (--loss_agg, normaliser)", "loss rel. diff", "grad rel. diff",
                        "matched"],
                       [[r["loss_type"], f"{r['our_agg']}, {r['our_normaliser']}", f"{r['loss_rel_diff']:.2e}",
                         f"{r['grad_rel_diff']:.2e}", "yes" if r["matched"] else "no"] for r in loss_rows]))
    md += ["", f"Largest matched difference {worst:.2e}: target {'met' if keys['peer_trl.loss_target_met'] else 'MISSED'}. "
           "Our default, token-mean over the global count, is TRL's bnpo / dapo. TRL's dr_grpo divides by "
           "sequences x max_completion_length; train.py's seq-mean-token-sum divides by sequences only (a constant "
           "factor max_completion_length apart, no flag for TRL's constant): that row calls policy_loss with TRL's "
           "normaliser. TRL's default KL is weighted by the ratio (use_bias_correction_kl=True); ours is not, so the "
           "matched KL row sets it False and the unmatched row shows the real difference."]
    first = None
    if steps:
        md += ["", "### The training step (single-turn solver task)", "",
               f"Start model `{a.model}`, {a.prompts_per_step} questions x {a.group} completions, <= {a.max_tokens} "
               f"sampled tokens each, lr {a.lr:g} constant, fp32, {a.threads} threads, one process a side, "
               f"{a.steps} optimizer steps (median over the steps after the first). Single-turn on both sides: TRL's "
               "tool loop expects JSON tool calls in a chat template's format, not our <search> protocol.", ""]
        rows = []
        for (side, engine), e in steps.items():
            if "error" in e or "step_s" not in e:
                rows.append([side, engine, "-", "-", "-", "-", "-", f"{e['peak_rss_gib']:.2f}", e.get("error", "")])
                continue
            rows.append([side, engine, f"{e['step_s']:.1f}", f"{e['rollout_s']:.1f}", f"{e['update_s']:.1f}",
                         f"{e['tokens_per_step']:.0f}", f"{e['tokens_per_s']:.2f}", f"{e['peak_rss_gib']:.2f}",
                         " ".join(map(str, e["rewards"]))])
        md.append(md_table(["side", "engine", "s/step", "rollout s", "update s", "sampled tokens/step",
                            "sampled tok/s (rollout)", "peak RSS GiB", "reward per step"], rows))
        for engine in dict.fromkeys(e for _, e in steps):
            t, o = steps.get(("trl", engine), {}), steps.get(("ours", engine), {})
            if "step_s" not in t or "step_s" not in o:
                continue
            ratios = {"step_speedup": t["step_s"] / o["step_s"], "tokens_per_s_ratio": o["tokens_per_s"] / t["tokens_per_s"],
                      "peak_rss_ratio": o["peak_rss_gib"] / t["peak_rss_gib"]}
            for k, v in ratios.items():
                keys[f"peer_trl.{engine}.{k}"] = v
            if first is None:
                first = engine
                keys.update({f"peer_trl.{k}": v for k, v in ratios.items()})
            met = [f"{k} {v:.2f} ({'met' if (v <= TARGETS[k] if k == 'peak_rss_ratio' else v >= TARGETS[k]) else 'MISSED'}"
                   f", target {'<=' if k == 'peak_rss_ratio' else '>='} {TARGETS[k]})" for k, v in ratios.items()]
            md += ["", f"{engine}: " + "; ".join(met) + "."]
            work = o["tokens_per_step"] / t["tokens_per_step"] if t.get("tokens_per_step") else float("nan")
            keys[f"peer_trl.{engine}.tokens_per_step_ratio"] = work
            if not 0.9 <= work <= 1.1:   # the s/step ratio is then not at matched work: say so beside it
                md += ["", f"{engine}: the sides did not sample the same work: ours {o['tokens_per_step']:.0f} tokens a "
                       f"step, TRL's {t['tokens_per_step']:.0f} ({work:.2f}x). Ours ends a completion at its first "
                       "</search> or </answer> (the protocol's stop strings; single-turn, so that ends the trajectory); "
                       "TRL's generate has no stop strings (transformers needs the tokenizer passed to generate() for "
                       "them, which GRPOTrainer does not do), so its completions run to EOS or the token cap. Neither "
                       "ratio is like-for-like then: both sides prefill the same prompts, so the step_speedup credits "
                       "ours with the tokens it did not sample, and the sampled tok/s charges ours that prefill over "
                       "fewer tokens."]
            if not any(t["rewards"]) and not any(o["rewards"]):
                md += ["", f"{engine}: every step's mean reward was 0 on both sides, so no step carried a learning "
                       "signal (a start model that searches before it answers ends its single turn at the search); "
                       "both sides still ran their whole update."]
    if first is None:
        md += ["", "Step ratios: not measured in this run (no engine where both sides finished)."]
    write_results("peer_trl", keys, "\n".join(md), measures=MEASURES)


def main() -> None:
    a = parse_args()
    overlay = ensure_trl()
    print(f"peer_trl: TRL overlay {overlay}: {' '.join(PACKAGES)}", flush=True)
    versions, loss_rows, _ = loss_part(overlay)
    print(f"peer_trl: versions {json.dumps(versions)}", flush=True)
    for r in loss_rows:
        print(f"peer_trl: loss {r['loss_type']}: loss {r['loss_rel_diff']:.2e} grad {r['grad_rel_diff']:.2e}", flush=True)
    steps = {}
    if not a.loss_only:
        if not (REPO / a.model).exists() and not Path(a.model).exists():
            sys.exit(f"--model {a.model} does not exist: make the demo's SFT export with `bash scripts/sft_coldstart.sh` "
                     "or pass another HF folder")
        print("peer_trl: settings that differ: single-turn only; TRL's rollout includes its reward and advantage "
              "computation, ours adds a weight sync (vLLM) and recomputes old log-probs", flush=True)
        steps = step_part(a, overlay, on_result=lambda res: report(a, versions, loss_rows, res))
    report(a, versions, loss_rows, steps)


if __name__ == "__main__":
    main()
