"""training.algorithm.update.optimizer_step, the one step rule of the actor, the critic and SFT, on one process with a
stand-in engine (the DeepSpeed engines at ZeRO 0, 2 and 3 over 2 ranks: tests/training/test_critic_update.py,
test_update.py)."""

from __future__ import annotations

import pytest
import torch

from training.algorithm.update import optimizer_step


class Engine:
    """DeepSpeedEngine as optimizer_step uses it. bare: engine.optimizer is the client's torch optimizer (ZeRO-0,
    fp32), which DeepSpeed steps unchecked; else a wrapper that, like ZeRO's, skips a non-finite step itself and
    reports an inf norm."""

    def __init__(self, bare: bool):
        self.module = torch.nn.Linear(3, 2)
        self.basic_optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.optimizer = self.basic_optimizer if bare else torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.steps, self.norm = 0, 0.0

    def step(self):
        self.steps += 1
        grads = [p.grad for p in self.module.parameters()]
        self.norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        if self.optimizer is self.basic_optimizer or self.norm == self.norm:
            self.optimizer.step()
        self.norm = self.norm if self.norm == self.norm else float("inf")
        self.optimizer.zero_grad()

    def get_global_grad_norm(self):
        return self.norm


def backward(engine, nan: bool):
    x = torch.ones(4, 3)
    if nan:
        x[0, 0] = float("nan")
    engine.module(x).sum().backward()


@pytest.mark.parametrize("bare", [True, False])
def test_a_non_finite_gradient_is_skipped_and_the_next_step_taken(bare, capsys):
    e = Engine(bare)
    w0 = [p.detach().clone() for p in e.module.parameters()]
    backward(e, nan=True)
    assert optimizer_step(e, "critic") is False
    assert all(torch.equal(p, w) for p, w in zip(e.module.parameters(), w0))
    assert e.steps == (0 if bare else 1)           # bare: never handed to the optimizer
    assert all(p.grad is None for p in e.module.parameters())
    assert "critic/skipped_steps" in capsys.readouterr().out
    backward(e, nan=False)
    assert optimizer_step(e, "critic") is True
    assert all(torch.isfinite(p).all() and not torch.equal(p, w) for p, w in zip(e.module.parameters(), w0))


def test_a_rank_flagged_bad_skips_with_finite_gradients():
    e = Engine(bare=False)
    backward(e, nan=False)
    assert optimizer_step(e, "actor", bad=True) is False and e.steps == 0
    assert all(p.grad is None for p in e.module.parameters())
