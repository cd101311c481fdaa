"""The solver's self-distillation teacher (issue 22): privileged prompts, their log-probs, the dense term.

    ctx   = teacher_context(answer, the proposer's queries and documents)   # inference/prompts.py
    seq   = build_teacher_prompt(question, ctx) + the student's response tokens, unchanged
    q_T   = log-probs of seq under the teacher (the actor, or the frozen reference), one forward, no grad
    A'_t  = A_t + beta_t * (log q_T(y_t) - log p_S(y_t))      on the student's sampled tokens

The response part of a teacher sequence is the student's token for token, its <information> blocks
included, with the student's loss mask: retrieved and template tokens carry no term, as they carry
no loss, KL or entropy. A solver trajectory gets a teacher when its question came with a construction
path (a fresh proposer question, or a pool question stored with one), or, with --distill_hint, the
golden answer alone; otherwise none, and distill/coverage counts it out.

Metrics (distill/*, summed over ranks before the ratios): kl = mean of log p_S - log q_T over covered
sampled tokens (the sampled estimate of KL(p_S || q_T)), logp_gap = its negative, coverage = covered
sampled tokens / all solver sampled tokens, with_teacher = solver trajectories that had one, beta.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from inference.prompts import build_teacher_prompt, teacher_context
from inference.trajectory import Trajectory


def privileged_block(t: Trajectory, tokenizer: Any, max_tokens: int, hint: bool) -> str | None:
    """The teacher's privileged block for solver trajectory `t`, or None when it gets no teacher."""
    qcp = (t.info.get("meta") or {}).get("qcp")
    if qcp:
        return teacher_context(tokenizer, t.answer, qcp.get("queries"), qcp.get("docs"), max_tokens)
    if hint and t.answer:
        return teacher_context(tokenizer, t.answer, None, None, max_tokens)
    return None


def teacher_trajectory(t: Trajectory, prompt_ids: list[int]) -> Trajectory:
    """`t` with its prompt replaced by the teacher's: the response tokens and their mask stay as sampled."""
    resp = slice(t.prompt_len, None)
    n = len(prompt_ids)
    return replace(t, token_ids=list(prompt_ids) + list(t.token_ids[resp]), prompt_len=n,
                   loss_mask=[0] * n + list(t.loss_mask[resp]), logprobs=[0.0] * n + list(t.logprobs[resp]),
                   info={})


def teacher_logprobs(trajs: Sequence[Trajectory], tokenizer: Any, template: str, max_tokens: int, hint: bool,
                     forward: Callable[[list[Trajectory]], list[torch.Tensor]]) -> tuple[list, list[str | None]]:
    """Per trajectory, the teacher's log-prob of each of its tokens (aligned to `t.token_ids`, 0 on the prompt),
    or None without a teacher; and the privileged blocks. `forward` is the trainer's forward_logprobs on the
    teacher engine: collective, so every rank calls it, with an empty list where it has no teacher."""
    blocks = [privileged_block(t, tokenizer, max_tokens, hint) if t.role == "solver" else None for t in trajs]
    idx = [i for i, b in enumerate(blocks) if b is not None]
    seqs = [teacher_trajectory(trajs[i], build_teacher_prompt(tokenizer, trajs[i].question, blocks[i], template))
            for i in idx]
    out: list[torch.Tensor | None] = [None] * len(trajs)
    for i, s, lp in zip(idx, seqs, forward(seqs)):
        t = trajs[i]
        out[i] = torch.cat([torch.zeros(t.prompt_len), lp[s.prompt_len:].float()])
    return out, blocks


def apply_sampled(trajs: Sequence[Trajectory], adv: list[torch.Tensor], student: list[torch.Tensor],
                  teacher: list[torch.Tensor | None], beta: float) -> tuple[list[torch.Tensor], dict[str, float]]:
    """A'_t = A_t + beta (log q_T - log p_S) on each covered trajectory's sampled tokens (training/distill.py);
    returns the new advantages and this rank's sums for the metrics (see `finish_metrics`)."""
    from training.distill import sampled_token_advantage

    new = list(adv)
    sums = {"gap_sum": 0.0, "covered": 0.0, "solver_tokens": 0.0, "with_teacher": 0.0}
    for i, t in enumerate(trajs):
        if t.role != "solver":
            continue
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        sums["solver_tokens"] += float(m.sum())
        if teacher[i] is None:
            continue
        s_lp = student[i].float()
        new[i] = sampled_token_advantage(adv[i], teacher[i], s_lp, m, beta, None)
        sums["gap_sum"] += float((teacher[i] - s_lp)[m].sum())
        sums["covered"] += float(m.sum())
        sums["with_teacher"] += 1.0
    return new, sums


def finish_metrics(sums: dict[str, float], beta: float) -> dict[str, float]:
    """The distill/* metrics from the sums of `apply_sampled` added over ranks."""
    cov = sums["covered"]
    gap = sums["gap_sum"] / cov if cov else float("nan")
    return {"distill/logp_gap": gap, "distill/kl": -gap, "distill/beta": beta,
            "distill/coverage": cov / sums["solver_tokens"] if sums["solver_tokens"] else 0.0,
            "distill/with_teacher": sums["with_teacher"]}
