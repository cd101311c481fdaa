"""Put a scripts/gpu_check.sh report (JSON) into bench/RESULTS.md, section gpu_check.

    python bench/gpu_check_report.py bench/gpu_check_h100.json [--note "what the run found"]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import md_table, write_results  # noqa: E402


def render(rep: dict, note: str = "") -> tuple[dict, str]:
    s = rep["steps"]
    env, train = s["env"], s.get("train", {})
    lines = [f"Device: {env.get('gpu', 'CPU')} ({env.get('gpu_memory_gib', '-')} GiB), torch {env['torch']}, "
             f"transformers {env['transformers']}, DeepSpeed {env.get('deepspeed')}, Triton {env.get('triton')}, "
             f"vLLM {env.get('vllm')}, flash-attn {env.get('flash-attn', env.get('flash_attn'))}. "
             f"Model: {s.get('model', {}).get('model', '-')}, {s.get('model', {}).get('params', 0) / 1e6:.1f}M parameters."]
    if note:
        lines += ["", note]
    rows = [[name, st["status"], st.get("seconds", "-")] for name, st in s.items()]
    lines += ["", md_table(["step", "status", "seconds"], rows)]
    if "pytest" in s:
        lines += ["", f"GPU-marked tests: {s['pytest']['summary']}."]
    keys = {"gpu_check.ok": bool(rep.get("ok"))}
    if train.get("steps"):
        lines += ["", "Training run (`" + train["command"].split("train.py ", 1)[-1] + "`):", ""]
        cols = ["step", "actor/rollout_lp_gap", "actor/grad_norm", "actor/num_tokens", "timing_s/generate",
                "timing_s/logprobs", "timing_s/update", "timing_s/step", "sync/seconds"]
        lines.append(md_table(cols, [[m.get(c, "-") for c in cols] for m in train["steps"]]))
        keys["gpu_check.max_rollout_lp_gap"] = train.get("max_rollout_lp_gap")
    if "logprobs" in s:
        lp = s["logprobs"]
        lines += ["", f"Packed log-probs on {lp['device']} (Triton kernel: {lp.get('triton_kernel', False)}) against "
                  f"unpacked fp32 torch on the CPU, {lp['sequences']} sequences, {lp['tokens']} tokens: max abs diff "
                  f"{lp['fp32_max_abs_diff']:.3g} in fp32, {lp['bf16_max_abs_diff']:.3g} in bf16."]
        keys.update({"gpu_check.logprobs_fp32_max_abs_diff": lp["fp32_max_abs_diff"],
                     "gpu_check.logprobs_bf16_max_abs_diff": lp["bf16_max_abs_diff"]})
    if "export" in s:
        ex = s["export"]
        lines += ["", f"HF export ({', '.join(ex['dtypes'])}, {ex['tensors']} tensors) against DeepSpeed's fp32 "
                  f"reconstruction of the ZeRO-3 checkpoint: max abs diff {ex['max_abs_diff']:.3g} "
                  f"(bf16 rounding bound {ex['tolerance']:.3g})."]
        keys["gpu_check.export_max_abs_diff"] = ex["max_abs_diff"]
    return keys, "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("report", help="the JSON scripts/gpu_check.sh wrote")
    p.add_argument("--note", default="", help="a paragraph placed above the tables")
    a = p.parse_args()
    keys, md = render(json.loads(Path(a.report).read_text()), a.note)
    write_results("gpu_check", keys, md)


if __name__ == "__main__":
    main()
