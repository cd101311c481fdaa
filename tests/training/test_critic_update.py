"""The critic under ZeRO-3 over gloo, against plain torch on the whole batch (tests/training/critic_worker.py
under torchrun at 1 and 2 ranks), and a positive control: a constant reward per prompt is learned."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from utils.dist import free_port

REPO = Path(__file__).resolve().parents[2]


def _run(model_dir: Path, tmp_path: Path, world: int, *extra: str) -> dict:
    out = tmp_path / f"critic_{world}{'_'.join(extra)}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), str(REPO / "tests/training/critic_worker.py"), str(model_dir), str(out), *extra]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", [1, 2])
def test_one_ppo_step_moves_actor_and_critic_by_minus_lr_times_the_whole_batch_gradient(tiny_model_dir, tmp_path, world):
    res = _run(tiny_model_dir, tmp_path, world)
    assert res["values_err"] < 1e-4, res          # the packed critic forward equals plain eager runs per sequence
    assert res["adv_err"] < 1e-3, res             # GAE (solver) and REINFORCE++ (proposer) against the by-hand ones
    assert res["actor_steps"] == 1 and res["critic_steps"] == 1 and res["critic_lr"] == pytest.approx(0.02), res
    assert res["critic_moved"] > 1e-4 and res["critic_backbone_moved"] > 1e-6, res
    # Δw is a difference of fp32 weights much larger than it (test_update.py measured 1.8e-5 for the actor)
    assert res["actor_rel_err"] < 1e-4, res
    assert res["critic_rel_err"] < 1e-4, res


def test_the_check_catches_a_critic_forward_that_bypasses_the_engine(tiny_model_dir, tmp_path):
    """Negative control: through engine.module, ZeRO-3 keeps only the last micro-batch's gradient."""
    res = _run(tiny_model_dir, tmp_path, 2, "--bypass=critic_forward")
    assert res["critic_rel_err"] > 0.1, res
    assert res["actor_rel_err"] < 1e-4, res


def test_positive_control_values_converge_to_a_constant_reward(tiny_model_dir, tmp_path):
    res = _run(tiny_model_dir, tmp_path, 1, "--phase=control")
    ev, gap = res["ev"], res["gap"]
    assert gap[-1] < 0.1 < gap[0], gap                  # each prompt's values reach its reward (1.0 / -0.5)
    assert math.isfinite(ev[0]) and ev[0] < 0.5 and ev[-1] > 0.9, ev
