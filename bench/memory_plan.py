"""Memory plan of every per-size launch script (scripts/train_*.sh) on 8 x 80 GB, plus its checks.

    .venv/bin/python bench/memory_plan.py              # RESULTS.md section, results.json, memory_plan.json, docs/gpu.md
    .venv/bin/python bench/memory_plan.py --no-readme  # leave docs/gpu.md alone

No GPU and no model download: each script's train.py flags are taken from the script itself (bash
runs it with DRY_RUN=1 and a stand-in `deepspeed` first on PATH that prints its arguments), and the
architecture comes from training/engine/memory_plan.py's built-in table. Checks against independent figures:
  (a) DeepSpeed's own ZeRO-3 estimator for the same model and world, beside our model-states term;
  (b) a configuration a published run fits: Search-R1's PPO of Qwen2.5-7B on one node of 8 x H100
      80GB (its train_ppo.sh) must come out under 80 GB here.
Writes section "memory-plan" of bench/RESULTS.md, memory_plan.* keys of bench/results.json, the full
plans to bench/memory_plan.json, and the table between the memory-plan markers of docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import RESULTS_DIR, md_table, write_results  # noqa: E402
from training.engine import memory_plan as mp  # noqa: E402
from training.settings.config import GROUPS, Config, build_parser, resolve_defaults  # noqa: E402

# The code this section measures (bench/report.py --check flags the section when it changes).
MEASURES = ["bench/memory_plan.py", "scripts/train_*.sh", "training/settings/config.py", "training/settings/settings_play.py",
            "training/settings/settings_learn.py", "training/engine/memory_plan.py"]

MODEL_SCRIPTS = sorted(p for p in (REPO / "scripts").glob("train_*.sh") if p.name != "train_common.sh")
# Variables the scripts read from the environment: cleared so each script's own defaults apply.
SCRIPT_VARS = ("MODEL", "TEMPLATE", "VLLM_TP", "PROMPTS_PER_STEP", "OFFLOAD", "GPU_MEM", "MICRO_TOKENS", "LR", "STEPS",
               "SOLVER_N", "RUN_NAME", "OUT", "RETRIEVER_URL", "JUDGE_URL", "JUDGE_MODEL", "TRAIN_DATA",
               "LAUNCHER_ARGS", "DRY_RUN", "WORLD_SIZE", "RANK", "LOCAL_RANK")
WORLD, GPUS_PER_NODE, GPU_GB = 8, 8, 80.0
# Search-R1 (PeterGriffinJin/Search-R1, train_ppo.sh): veRL PPO, 1 node x 8 GPUs, gradient checkpointing,
# actor param/grad/optimizer offload, reference param offload, vLLM TP 1 at gpu_memory_utilization 0.6,
# kl_coef 0.001, ppo_micro_batch_size 64 over 8 GPUs = 8 packed sequences (use_remove_padding) of at
# most max_prompt_length 4096 + max_response_length 500 tokens.
SEARCH_R1_ARGV = ["--model_path", "Qwen/Qwen2.5-7B", "--dtype", "bf16", "--gradient_checkpointing", "true",
                  "--offload_optimizer", "true", "--offload_param", "true", "--kl_coef", "0.001", "--ref_offload", "true",
                  "--vllm_tp", "1", "--gpu_memory_utilization", "0.6", "--max_model_len", "4596",
                  "--max_total_tokens", "4596", "--micro_token_budget", str(8 * 4596)]


def script_argv(script: Path) -> list[str]:
    """The train.py flags `script` passes, exactly as bash expands them."""
    with tempfile.TemporaryDirectory() as d:
        fake = Path(d) / "deepspeed"
        fake.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@"\n')
        fake.chmod(0o755)
        (Path(d) / "hostfile").write_text("localhost slots=8\n")
        env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}
        env.update(PATH=f"{d}{os.pathsep}{os.environ['PATH']}", DRY_RUN="1")
        r = subprocess.run(["bash", str(script), str(Path(d) / "hostfile")], capture_output=True, env=env,
                           timeout=60, cwd=d)
    if r.returncode != 0:
        raise RuntimeError(f"{script.name}: exit {r.returncode}\n{r.stderr.decode()[-2000:]}")
    args = r.stdout.decode().split("\0")[:-1]
    return [a for a in args[args.index("train.py") + 1:] if a != "--dry_run"]


def config_from_argv(argv: list[str]):
    """The resolved Config of a command line, without validate_args (paths are not on this machine)."""
    ns = build_parser().parse_args(argv)
    return resolve_defaults(Config(**{g: cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
                                      for g, cls in GROUPS.items()}))


def gib(x) -> float:
    return round(x / (1 << 30), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-readme", action="store_true", help="do not rewrite docs/gpu.md's memory-plan table")
    args = ap.parse_args()

    plans, rows, keys = {}, [], {}
    for script in MODEL_SCRIPTS:
        cfg = config_from_argv(script_argv(script))
        cfg.deepspeed.gpu_memory_gb = GPU_GB
        pl = mp.plan(cfg, WORLD, GPUS_PER_NODE)
        plans[script.name] = pl
        tr, ge = pl["train"]["peak"], pl["generate"]["peak"]
        fits = "yes" if not pl["warnings"] else "NO: " + "; ".join(w.split(":")[0] for w in pl["warnings"])
        rows.append([f"`{script.name}`", cfg.model.model_path, cfg.rollout.vllm_tp, cfg.rollout.gpu_memory_utilization,
                     "optimizer" if cfg.deepspeed.offload_optimizer else "none", gib(tr), gib(ge), pl["peak_phase"],
                     gib(pl["sync_bytes_per_step"]), gib(pl["host_per_gpu"]["total"]), fits])
        stem = script.stem.removeprefix("train_")
        keys.update({f"memory_plan.{stem}.train_peak_gib": gib(tr), f"memory_plan.{stem}.generate_peak_gib": gib(ge),
                     f"memory_plan.{stem}.sync_gib_per_step": gib(pl["sync_bytes_per_step"])})
    table = md_table(["script", "model", "vLLM TP", "gpu_mem_util", "offload", "train peak GiB", "generate peak GiB",
                      "peak phase", "weight sync GiB/step", "host RAM GiB/GPU", f"fits {GPU_GB:g} GiB"], rows)

    # (a) DeepSpeed's estimator vs ours, same model and world, every weight trainable (what it assumes).
    ds_rows = []
    seen = {}
    for name, pl in plans.items():
        seen.setdefault(pl["model"].split("/")[-1].lower().removesuffix("-instruct"), pl["model"])
    for model in seen.values():
        for off_o, off_p in ((False, False), (True, False), (True, True)):
            cfg = config_from_argv(["--model_path", model, "--offload_optimizer", str(off_o).lower(),
                                    "--offload_param", str(off_p).lower()])
            pl = mp.plan(cfg, WORLD, GPUS_PER_NODE)
            ours, ds = pl["model_states"]["ours"], pl["model_states"]["deepspeed"]
            ds_rows.append([model, {(False, False): "none", (True, False): "optimizer", (True, True): "optimizer+params"}
                            [(off_o, off_p)], gib(ours), gib(ds), gib(ds - ours), gib(2 * pl["params"] / WORLD)
                            if not off_o else 0.0])
            keys[f"memory_plan.deepspeed_check.{model.split('/')[-1]}.offload_{int(off_o)}{int(off_p)}"] = \
                [gib(ours), gib(ds)]
    ds_table = md_table(["model", "offload", "ours GiB", "DeepSpeed GiB", "DeepSpeed - ours", "2 B x P / N"], ds_rows)

    # (b) Search-R1's published 8 x H100 80GB configuration.
    sr = mp.plan(config_from_argv(SEARCH_R1_ARGV), WORLD, GPUS_PER_NODE)
    sr_tr, sr_ge = gib(sr["train"]["peak"]), gib(sr["generate"]["peak"])
    sr_ok = max(sr_tr, sr_ge) < GPU_GB
    keys.update({"memory_plan.search_r1.train_peak_gib": sr_tr, "memory_plan.search_r1.generate_peak_gib": sr_ge,
                 "memory_plan.search_r1.under_80": sr_ok})

    md = (f"Per-GPU estimate of each `scripts/train_*.sh` as shipped, on {WORLD} GPUs of {GPU_GB:g} GiB "
          f"(one node), from `training/engine/memory_plan.py` (the formulas are in its docstring; the architectures "
          f"from its built-in table). Train peak: ZeRO-3 partitions + the larger of (activations of one "
          f"`--micro_token_budget` micro-batch with gradient checkpointing + the backward's larger moment: the "
          f"chunked log-prob head or one recomputed layer) and the optimizer step's fp32 transient + 2 GiB runtime; generate peak: what training leaves resident + vLLM's `--gpu_memory_utilization` share. "
          f"Weight sync: bytes each rank gathers and loads into vLLM per step. Estimates, not measurements: "
          f"the train-phase formulas were checked against `torch.cuda.max_memory_allocated` on an H100 at world "
          f"size 1 (section memory-plan-gpu: 0-8% above); the generate phase (vLLM) was not measured. Allow 5-10% "
          f"for allocator fragmentation.\n\n{table}\n\n"
          f"**Check (a): DeepSpeed's estimator.** `estimate_zero3_model_states_mem_needs` (behind "
          f"`estimate_zero3_model_states_mem_needs_all_cold`), {WORLD} GPUs, every weight trainable, against our "
          f"model-states term (partitions + largest module and its gradient). Without offload DeepSpeed counts "
          f"18 B/param where we count the 16 that `stage3.py` allocates (bf16 param 2 + bf16 grad 2 + fp32 master "
          f"4 + Adam 8); the difference is exactly 2 B x P / N. With offload the two agree to the byte.\n\n{ds_table}\n\n"
          f"**Check (b): a published run that fits.** Search-R1 trains Qwen2.5-7B with PPO on 8 x H100 80GB "
          f"(`train_ppo.sh`: FSDP with actor param/grad/optimizer offload, reference offload, gradient "
          f"checkpointing, vLLM TP 1 at `gpu_memory_utilization` 0.6, micro-batch of 8 packed sequences of at most "
          f"4,596 tokens). Our plan for that configuration: train peak {sr_tr} GiB, generate peak {sr_ge} GiB, "
          f"so {'under' if sr_ok else 'OVER'} 80 GB, consistent with the run fitting. This is a one-sided check: "
          f"it would catch a plan that overestimates, not one that underestimates. Our plan models DeepSpeed "
          f"ZeRO-3 and this trainer's chunked log-prob head, not veRL's FSDP; and it has no critic, which Search-R1's "
          f"PPO adds (offloaded like the actor, on the GPU only during its own update).\n")
    write_results("memory-plan", keys, md, measures=MEASURES)
    (RESULTS_DIR / "memory_plan.json").write_text(json.dumps(
        {"world": WORLD, "gpu_memory_gb": GPU_GB, "scripts": plans, "search_r1": sr}, indent=2) + "\n")
    if not args.no_readme:
        readme = REPO / "docs/gpu.md"
        text = readme.read_text()
        block = (f"<!-- begin memory-plan (bench/memory_plan.py writes this table) -->\n{table}\n"
                 f"<!-- end memory-plan -->")
        pat = re.compile(r"<!-- begin memory-plan.*?<!-- end memory-plan -->", re.S)
        if pat.search(text):
            readme.write_text(pat.sub(lambda _: block, text))
        else:
            print("docs/gpu.md has no memory-plan markers: table not written there", file=sys.stderr)
    print(md)


if __name__ == "__main__":
    main()
