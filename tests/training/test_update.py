"""The update path under ZeRO-3 over gloo, against plain torch on the whole batch.

tests/training/update_worker.py runs under torchrun twice, shared by the tests of this module
(torchrun_worker_once): 1 rank runs the main phases then the PPO-epochs one, 2 ranks the main phases, the
uneven one (unequal informative groups per rank, as refill leaves them) and then the negative control (the
bypassed forward, installed after them). The reference is an independent computation: eager attention on
each unpacked sequence, full-vocabulary log-softmax and the published clipped-surrogate formula, not our
packing, chunked head or loss function. So a bug that two runs of our own code share (the lost micro-batch
gradients that rank-invariance and exact-resume tests passed over) shows here.
"""

from __future__ import annotations

import pytest

# one launch per world size: the phases it runs, in order (update_worker.py's docstring)
LAUNCH = {1: ("--phases=main,epochs",), 2: ("--phases=main,uneven,bypass", "--bypass=forward")}


@pytest.fixture
def launch(torchrun_worker_once):
    """launch(world) -> {phase: results}: update_worker.py at `world` ranks, launched once per module."""
    return lambda world: torchrun_worker_once("update_worker", world, *LAUNCH[world])


@pytest.mark.parametrize("world", [1, 2])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(launch, world):
    res = launch(world)["main"]
    assert res["world"] == world and res["bypass"] == "", res
    assert res["rank0_micro_batches"] >= 3                 # several micro-batches per step, so accumulation matters
    assert 0.1 < res["clip_frac"] < 0.9                     # the clip range acts on a good share of tokens
    if world == 2:
        assert res["rank1_last_is_pad"], res                # a rank whose last micro-batch is an equalising pad
    assert res["grad_rl_rel_err"] < 3e-6, res               # measured 7.5e-7 (fp32)
    assert res["grad_sft_rel_err"] < 3e-6, res              # measured 3.6e-7
    # one ppo_update with plain SGD moves the weights by -lr * g; Δw is a difference of fp32 weights
    # about 20x its size, hence the looser bound (measured 1.8e-5)
    assert res["sgd_optimizer_steps"] == 1 and res["sgd_moved"] > 1e-4
    assert res["sgd_rel_err"] < 1e-4, res
    # a non-finite loss on one rank: the step is skipped on every rank (no weight moved anywhere,
    # gathered weights are the same on all ranks by construction), and training goes on afterwards
    assert res["nan_skipped"] == 1 and res["nan_moved"] == 0.0, res
    # ... and the next step is exactly the whole batch's SGD step: the dropped gradient did not leak into it
    assert res["after_nan_skipped"] == 0 and res["after_nan_moved"] > 1e-4, res
    assert res["after_nan_rel_err"] < 1e-4, res


def test_ranks_with_unequal_informative_groups_train_on_the_whole_batch_without_a_hang(launch):
    """Dynamic sampling with refill (training/loop/rounds.py) leaves ranks with unequal informative solver groups once
    the flat ones are dropped: rank 0 3 of 5, rank 1 1 of 5, then none. The trainer's path (drop, GRPO
    advantages, ppo_update under ZeRO-3) must still call the same collectives on both ranks (the launch would
    hang otherwise) and move the weights by exactly the SGD step of the whole batch of informative groups."""
    res = launch(2)["uneven"]
    one, none = res["3+1"], res["3+0"]
    assert (one["rank0"]["informative"], one["rank0"]["flat"], one["rank1"]["informative"], one["rank1"]["flat"]) \
        == (3, 2, 1, 4), one
    assert (none["rank1"]["informative"], none["rank1"]["real_micro_batches"], none["batch_groups"]) == (0, 0, 3), none
    for case in (one, none):
        r0, r1 = case["rank0"], case["rank1"]
        assert r0["micro_batches"] == r1["micro_batches"] and r1["real_micro_batches"] < r0["real_micro_batches"], case
        assert case["optimizer_steps"] == 1 and case["skipped"] == 0, case
        assert case["sgd_rel_err"] < 1e-4, case                # main's sgd bound (measured 2.8e-5, 2.3e-5)


def test_the_check_catches_a_forward_that_bypasses_the_engine(launch):
    """Negative control: the code before the fix (forward through engine.module) kept only the last
    micro-batch's gradient; the same assertions must fail on it. In the 2-rank launch, after the main
    phases, which the bypass then re-runs from the engine's current weights."""
    res = launch(2)["bypass"]
    assert res["world"] == 2 and res["bypass"] == "forward", res
    assert res["grad_rl_rel_err"] > 0.1 and res["grad_sft_rel_err"] > 0.1 and res["sgd_rel_err"] > 0.1, res


def test_ppo_epochs_log_the_mean_loss_per_optimizer_step(launch):
    """2 epochs x 2 mini-batches (4 optimizer steps; in sequential mode one per role present in a
    mini-batch) at lr 0, where every optimizer step's loss equals that of one combined step: the
    logged losses are the per-step mean (they were the sum over steps) and num_tokens counts the
    step's tokens once (it was counted once per epoch). In the 1-rank launch, after the main phases."""
    res = launch(1)["epochs"]
    assert res["moved"] == 0.0, res
    one = res["single"]
    assert one["actor/optimizer_steps"] == 1 and one["actor/pg_loss"] != 0 and one["actor/kl_loss"] > 0, one
    assert res["epochs"]["actor/optimizer_steps"] == 4 and res["sequential"]["actor/optimizer_steps"] > 4, res
    for name in ("epochs", "sequential"):
        m = res[name]
        assert m["actor/num_tokens"] == one["actor/num_tokens"], (name, m["actor/num_tokens"], one["actor/num_tokens"])
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss"):
            assert m[k] == pytest.approx(one[k], rel=1e-5, abs=1e-7), (name, k, m[k], one[k])
