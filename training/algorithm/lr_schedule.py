"""The learning-rate schedules of the actor and the critic: linear warm-up, then constant, linear or cosine decay,
each a pure function of the step (so resume needs no scheduler state). The trainers (training/loop/trainer.py,
training/loop/sft.py) and the critic's update (training/algorithm/critic.py) set the LR with them once per step; DeepSpeed runs
no scheduler (training/engine/engine_builder.py). Imports no torch."""

from __future__ import annotations

import math

from training.settings.config import Config


def lr_lambda(cfg: Config, critic: bool = False):
    o, c = cfg.optimisation, cfg.critic
    warmup, schedule = (c.critic_lr_warmup_steps, c.critic_lr_schedule) if critic else (o.warmup_steps, o.lr_schedule)

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        t = (step - warmup) / max(1, o.total_steps - warmup)
        t = min(max(t, 0.0), 1.0)
        return 0.5 * (1 + math.cos(math.pi * t)) if schedule == "cosine" else 1.0 - t
    return f


def set_critic_lr(engine, cfg: Config, step: int) -> float:
    """The critic's LR at `step`: --critic_lr shaped by its own warm-up and schedule (a pure function of the step)."""
    lr = cfg.critic.critic_lr * lr_lambda(cfg, critic=True)(step)
    for g in engine.optimizer.param_groups:
        g["lr"] = lr
    return lr


def set_lr(engine, cfg: Config, step: int) -> float:
    """Set the LR of (SSP or SFT) step `step` on every param group and return it. The schedule
    counts steps, not optimizer steps: a step may take several optimizer steps (sequential
    roles, PPO epochs and mini-batches), and a scheduler stepped by DeepSpeed on each of them
    ran warm-up and decay that many times too fast. A pure function of the step, so resume
    needs no scheduler state."""
    lr = cfg.optimisation.lr * lr_lambda(cfg)(step)
    for g in engine.optimizer.param_groups:
        g["lr"] = lr
    return lr
