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
