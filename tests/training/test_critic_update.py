"""The critic under ZeRO-3 over gloo, against plain torch on the whole batch, and a positive control: a
constant reward per prompt is learned. tests/training/critic_worker.py runs under torchrun twice, shared by
the tests of this module (torchrun_worker_once): 1 rank runs the sgd phase then the positive control, 2
ranks the sgd phase, a NaN value target on one rank at ZeRO 3, 2 and 0, then the negative control (the sgd
phase again, the critic's forward bypassing the engine)."""

from __future__ import annotations

import math

import pytest

# one launch per world size: the phases it runs, in order (critic_worker.py's docstring)
LAUNCH = {1: ("--phases=sgd,control",), 2: ("--phases=sgd,nan,bypass",)}


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


@pytest.mark.parametrize("stage", [3, 2, 0])
def test_a_nan_gradient_on_one_rank_skips_the_critic_step_on_every_rank_and_counts_it(launch, stage):
    """At ZeRO-0 a bare AdamW would take the NaN step (DeepSpeed checks nothing there); at 2 and 3 DeepSpeed
    skips it but critic/optimizer_steps counted it. The next, clean step trains: nothing stale was left."""
    per_rank = launch(2)["nan"][f"stage{stage}"]
    assert len(per_rank) == 2, per_rank
    for r in per_rank:
        assert r["nan"] == {"finite": True, "moved": 0.0, "optimizer_steps": 0.0, "skipped_steps": 1.0}, per_rank
        assert r["after"]["finite"] and r["after"]["moved"] > 1e-6, per_rank
        assert r["after"]["optimizer_steps"] == 1.0 and r["after"]["skipped_steps"] == 0.0, per_rank


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
