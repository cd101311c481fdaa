"""The critic under ZeRO-3 over gloo, against plain torch on the whole batch, and a positive control: a
constant reward per prompt is learned. tests/training/critic_worker.py runs under torchrun twice, shared by
the tests of this module (torchrun_worker_once): 1 rank runs the sgd phase then the positive control, 2
ranks the sgd phase then the negative control (the sgd phase again, the critic's forward bypassing the
engine)."""

from __future__ import annotations

import math

import pytest

# one launch per world size: the phases it runs, in order (critic_worker.py's docstring)
LAUNCH = {1: ("--phases=sgd,control",), 2: ("--phases=sgd,bypass",)}


@pytest.fixture
def launch(torchrun_worker_once):
    """launch(world) -> {phase: results}: critic_worker.py at `world` ranks, launched once per module."""
    return lambda world: torchrun_worker_once("critic_worker", world, *LAUNCH[world])


@pytest.mark.parametrize("world", [1, 2])
def test_one_ppo_step_moves_actor_and_critic_by_minus_lr_times_the_whole_batch_gradient(launch, world):
    res = launch(world)["sgd"]
    assert res["world"] == world and res["bypass"] == "", res
    assert res["values_err"] < 1e-4, res          # the packed critic forward equals plain eager runs per sequence
    assert res["adv_err"] < 1e-3, res             # GAE (solver) and REINFORCE++ (proposer) against the by-hand ones
    assert res["actor_steps"] == 1 and res["critic_steps"] == 1 and res["critic_lr"] == pytest.approx(0.02), res
    assert res["critic_moved"] > 1e-4 and res["critic_backbone_moved"] > 1e-6, res
    # Δw is a difference of fp32 weights much larger than it (test_update.py measured 1.8e-5 for the actor)
    assert res["actor_rel_err"] < 1e-4, res
    assert res["critic_rel_err"] < 1e-4, res


def test_the_check_catches_a_critic_forward_that_bypasses_the_engine(launch):
    """Negative control: through engine.module, ZeRO-3 keeps only the last micro-batch's gradient.
    In the 2-rank launch, after the sgd phase, on freshly built engines."""
    res = launch(2)["bypass"]
    assert res["world"] == 2 and res["bypass"] == "critic_forward", res
    assert res["critic_rel_err"] > 0.1, res
    assert res["actor_rel_err"] < 1e-4, res


def test_positive_control_values_converge_to_a_constant_reward(launch):
    res = launch(1)["control"]
    ev, gap = res["ev"], res["gap"]
    assert gap[-1] < 0.1 < gap[0], gap                  # each prompt's values reach its reward (1.0 / -0.5)
    assert math.isfinite(ev[0]) and ev[0] < 0.5 and ev[-1] > 0.9, ev
