"""scripts/gpu_check.sh, the check a lent GPU runs, run here at tiny scale on the CPU so it cannot rot:
the same steps (GPU tests, an NCCL-or-gloo training run with the HF rollout engine, log-probs against an
independent CPU reference, the HF export against DeepSpeed's own fp32 reconstruction)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_cpu_part(tmp_path, tiny_model_dir):  # tiny_model_dir: data/ holds the SmolLM2 tokenizer
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, GPU_CHECK_ARGS=f"--tiny --work {tmp_path / 'work'}", CARRY=str(tmp_path / "no_carry"))
    r = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=850)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    steps = rep["steps"]
    assert rep["ok"] and list(steps) == ["env", "pytest", "model", "train", "logprobs", "export"]
    assert steps["env"]["cuda"] is False
    # on a CPU every GPU test is collected and skipped; none may be missing from the selection
    assert steps["pytest"]["counts"].get("skipped", 0) >= 5 and not steps["pytest"]["failures"]
    train = steps["train"]
    assert [s["step"] for s in train["steps"]] == [1, 2, 3]
    assert train["max_rollout_lp_gap"] < 1e-4          # fp32: the HF rollout engine holds the actor's weights
    assert all(s["actor/grad_norm"] > 0 for s in train["steps"])
    assert "level 2" in train["hybrid_line"]
    assert steps["logprobs"]["fp32_max_abs_diff"] < 1e-4 and steps["logprobs"]["bf16_entropy_finite"]
    assert steps["export"]["max_abs_diff"] == 0.0 and not steps["export"]["missing"]
