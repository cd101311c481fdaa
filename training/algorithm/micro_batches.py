"""Micro-batches through a DeepSpeed engine: the one forward-and-backward path of RL, SFT and the critic.

    mbs = pack_equal(trajs, budget)          # pack + equalise (same count on every rank)
    for mb in mbs:  lp = engine_logprobs(engine, mb); loss = loss_fn(mb, lp); engine.backward(loss)
    # (the caller steps the optimizer: training/algorithm/update.py ppo_update, training/loop/sft.py, training/algorithm/critic.py)

Two facts this module exists for, each measured with DeepSpeed 0.19.8 (docs/PLATFORM_NOTES.md,
DeepSpeed gradient accumulation and DeepSpeed ZeRO-3 rules):
- **The forward must go through DeepSpeedEngine.forward.** Under ZeRO-3 that is where
  `optimizer.clear_backward_seen_flag()` advances `micro_step_id`; while it stays 0,
  `partition_grads` *copies* each micro-batch's gradient instead of adding it. A forward through
  `engine.module` therefore kept only the last micro-batch's gradient of every step.
  `engine_logprobs` runs `sequence_logprobs` *as* the engine's forward (the same forward swap
  `logprobs._call_head` uses for the lm_head), so every DeepSpeed forward prologue runs.
- **DeepSpeed averages gradients over data-parallel ranks.** Our losses are each micro-batch's
  share of a *global* sum (normalised by the global count, training/algorithm/loss.py), whose gradient is
  the sum over ranks. `accumulate` multiplies each loss by the data-parallel world size, so the
  step's gradient is exactly the gradient of the whole batch (and gradient clipping sees it).

Both are checked against plain torch on the whole batch (tests/training/test_update.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from utils import dist as D


def engine_logprobs(engine, micro_batch, temperature: float = 1.0, compute_entropy: bool = False,
                    **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sequence_logprobs` of `engine.module` on a packed micro-batch, run through `engine(...)`.
    Every training (and log-prob) forward of the trainer and of SFT goes through here."""
    from training.algorithm.logprobs import forward_swapped, sequence_logprobs

    model = engine.module
    # Packed on the CPU; the model may sit on a GPU (found by scripts/gpu_check.sh on an H100). No-op on a CPU.
    micro_batch = micro_batch.to(engine.device)
    with forward_swapped(model, lambda: sequence_logprobs(model, micro_batch, temperature, compute_entropy, **kw)):
        return engine()


def dp_world_size(engine) -> int:
    """The data-parallel world DeepSpeed averages gradients over (the whole world for ZeRO here)."""
    return int(getattr(engine, "dp_world_size", None) or D.world_size())


def pack_equal(trajs, micro_token_budget: int, per_token: dict | None = None):
    """Pack trajectories into one-row micro-batches and pad every rank to the same count
    (ZeRO-3 forwards are collective). Returns (micro_batches, number of real ones)."""
    from training.algorithm.packing import equalise_micro_batches, pack_trajectories

    mbs = pack_trajectories(trajs, micro_token_budget, per_token=per_token) if trajs else []
    keys = ["loss_mask", "rollout_logprobs", *(per_token or {})]
    return equalise_micro_batches(mbs, lambda v: int(D.all_reduce_max(v)), per_token_keys=keys), len(mbs)


def accumulate(engine, micro_batches: Sequence, loss_fn: Callable, *, temperature: float = 1.0,
               compute_entropy: bool = False, forward: Callable | None = None,
               head_extra: Callable | None = None) -> list[dict]:
    """Forward and backward every micro-batch into one accumulated gradient; no optimizer step.

    loss_fn(mb, logprobs, entropy) -> (loss, metrics), the loss being `mb`'s share of the global
    loss of the whole step (across micro-batches and ranks). Collective: every rank must pass the
    same number of micro-batches (pack_equal). `forward(engine, mb)` replaces the log-prob forward
    (the critic's values, training/critic.engine_values; it must run through engine(...) too) and
    its output reaches loss_fn as `logprobs`, with entropy None. head_extra(mb), if given, returns the
    function sequence_logprobs runs inside the lm_head's forward; its result is loss_fn's fourth argument."""
    scale = dp_world_size(engine)
    metrics = []
    for k, mb in enumerate(micro_batches):
        engine.set_gradient_accumulation_boundary(k == len(micro_batches) - 1)
        mb = mb.to(engine.device)  # loss_fn reads its advantages and old log-probs beside the log-probs
        if forward is not None:
            loss, m = loss_fn(mb, forward(engine, mb), None)
        else:
            kw = {} if head_extra is None else {"head_extra": head_extra(mb)}
            loss, m = loss_fn(mb, *engine_logprobs(engine, mb, temperature, compute_entropy, **kw))
        engine.backward(loss * scale)
        metrics.append(m)
    return metrics
