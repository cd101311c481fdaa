"""The critic under ZeRO-3 over gloo, against plain torch on the whole batch (tests/training/critic_worker.py
under torchrun at 1 and 2 ranks), and a positive control: a constant reward per prompt is learned."""

from __future__ import annotations

import math

import pytest


@pytest.mark.parametrize("world", [1, 2])
def test_one_ppo_step_moves_actor_and_critic_by_minus_lr_times_the_whole_batch_gradient(torchrun_worker, world):
    res = torchrun_worker("critic_worker", world)
    assert res["values_err"] < 1e-4, res          # the packed critic forward equals plain eager runs per sequence
    assert res["adv_err"] < 1e-3, res             # GAE (solver) and REINFORCE++ (proposer) against the by-hand ones
    assert res["actor_steps"] == 1 and res["critic_steps"] == 1 and res["critic_lr"] == pytest.approx(0.02), res
    assert res["critic_moved"] > 1e-4 and res["critic_backbone_moved"] > 1e-6, res
    # Δw is a difference of fp32 weights much larger than it (test_update.py measured 1.8e-5 for the actor)
    assert res["actor_rel_err"] < 1e-4, res
    assert res["critic_rel_err"] < 1e-4, res


def test_the_check_catches_a_critic_forward_that_bypasses_the_engine(torchrun_worker):
    """Negative control: through engine.module, ZeRO-3 keeps only the last micro-batch's gradient."""
    res = torchrun_worker("critic_worker", 2, "--bypass=critic_forward")
    assert res["critic_rel_err"] > 0.1, res
    assert res["actor_rel_err"] < 1e-4, res


def test_positive_control_values_converge_to_a_constant_reward(torchrun_worker):
    res = torchrun_worker("critic_worker", 1, "--phase=control")
    ev, gap = res["ev"], res["gap"]
    assert gap[-1] < 0.1 < gap[0], gap                  # each prompt's values reach its reward (1.0 / -0.5)
    assert math.isfinite(ev[0]) and ev[0] < 0.5 and ev[-1] > 0.9, ev
