"""bench/peer_trl_loss.py: our packed loss against TRL's GRPOTrainer loss on one fixed batch, for real.

TRL lives in an overlay folder (bench/peer_trl_env.py), installed here through scripts/setup_trl.sh, the documented
install, from PyPI when it is missing (about 20 s the first time, then a stamp check). Where PyPI cannot be reached the test is skipped and says why.
The comparison runs in a child process with the overlay on PYTHONPATH, so this process never imports TRL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.peer_trl_env import is_installed, overlay_dir, overlay_env  # noqa: E402

TOL = 1e-5   # bench/peer_trl_loss.py's docstring derives it from fp32 rounding


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    venv = Path(sys.executable).parent.parent   # the script's own python, this one
    s = subprocess.run(["bash", "scripts/setup_trl.sh"], cwd=REPO, env={**os.environ, "VENV": str(venv)},
                       capture_output=True, text=True, timeout=900)
    if s.returncode != 0:
        pytest.skip(f"TRL could not be installed into its overlay (PyPI unreachable?): {s.stderr[-1500:]}")
    overlay = overlay_dir()
    assert is_installed(overlay) and "peer_trl_env: trl==1.16.0" in s.stdout, s.stdout + s.stderr
    p = subprocess.run([sys.executable, "bench/peer_trl_loss.py", "--kl"], cwd=REPO, env=overlay_env(overlay),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert out[0]["versions"]["trl"] == "1.16.0"
    return {r["loss_type"]: r for r in out[1:]}


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "grpo", "dr_grpo", "grpo+kl"])
def test_our_loss_and_gradients_equal_trls(rows, loss_type):
    r = rows[loss_type]
    assert r["matched"] and r["micro_batches"] > 1    # ours accumulated over several packed micro-batches
    assert r["loss_rel_diff"] <= TOL, r
    assert r["grad_rel_diff"] <= TOL, r


def test_the_comparison_sees_a_real_difference(rows):
    """TRL's default KL is weighted by the ratio (ours is not): the same check must report it, far above TOL."""
    r = rows["grpo+kl(ratio-weighted)"]
    assert not r["matched"]
    assert r["loss_rel_diff"] > 100 * TOL and r["grad_rel_diff"] > 100 * TOL, r


REPORT = r'''
import argparse, json, sys
from bench import bench_peer_trl as B
a = argparse.Namespace(model="m", prompts_per_step=2, group=4, max_tokens=64, lr=1e-6, threads=2, steps=4)
trl = [{"step_s": 30.0, "rollout_s": 15.0, "update_s": 15.0, "sampled_tokens": 512, "reward_mean": 0.0},
       *({"step_s": s, "rollout_s": 14.0, "update_s": s - 14.0, "sampled_tokens": 490, "reward_mean": 0.25}
         for s in (26.0, 27.0, 28.0))]
ours = [{"step_s": 20.0, "rollout_s": 6.0, "update_s": 14.0, "sampled_tokens": 100, "reward_mean": 0.0},
        *({"step_s": s, "rollout_s": 5.0, "update_s": s - 5.0, "sampled_tokens": 100, "reward_mean": 0.5}
          for s in (16.0, 18.0, 17.0))]
steps = {("trl", "hf"): {"peak_rss_gib": 6.0, **B.summarise(trl)}, ("ours", "hf"): {"peak_rss_gib": 9.0, **B.summarise(ours)},
         ("trl", "vllm"): {"peak_rss_gib": 3.0, "error": "exit 1, no step rows: RuntimeError: load_weights"}}
loss = [{"loss_type": "dapo", "our_agg": "token-mean", "our_normaliser": "count", "loss_rel_diff": 2e-7,
         "grad_rel_diff": 9e-7, "matched": True}]
B.report(a, {"trl": "1.16.0", "transformers": "t", "torch": "t", "cpu": "c"}, loss, steps)
'''


def test_the_step_report_computes_the_ratios_and_says_when_the_work_differs(tmp_path):
    """bench_peer_trl.report on hand-made step rows (no TRL run): medians after the warm-up step, the three ratios
    against their targets, the sampled tokens a step beside them, and the note that the step ratio is not at
    matched work when one side sampled far fewer tokens (ours stops at </search>; TRL's generate does not)."""
    r = subprocess.run([sys.executable, "-c", REPORT], cwd=REPO, env={**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    keys = json.loads((tmp_path / "results.json").read_text())
    assert keys["peer_trl.step_speedup"] == pytest.approx(27.0 / 17.0)          # TRL's median s/step over ours
    assert keys["peer_trl.tokens_per_s_ratio"] == pytest.approx(20.0 / 35.0)    # 100/5 over 490/14
    assert keys["peer_trl.peak_rss_ratio"] == pytest.approx(1.5)
    assert keys["peer_trl.hf.tokens_per_step_ratio"] == pytest.approx(100 / 490)
    md = (tmp_path / "RESULTS.md").read_text()
    assert "step_speedup 1.59 (met, target >= 1.5); tokens_per_s_ratio 0.57 (MISSED" in md
    assert "peak_rss_ratio 1.50 (MISSED, target <= 1.0)" in md
    assert "did not sample the same work: ours 100 tokens a step, TRL's 490 (0.20x)" in md
    assert "every step's mean reward was 0" not in md   # the hand-made rows carry rewards
    assert "| trl | vllm | - |" in md and "load_weights" in md                 # a failed side shows its error
    assert "peer_trl.vllm.step_speedup" not in keys
