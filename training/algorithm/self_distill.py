"""--distill's entry point, the trainer's teacher pass of one step: `dense_term` picks the form.

    sampled   A'_t = A_t + beta_t * (log q_T(y_t) - log p_S(y_t))            training/algorithm/teacher.py
    topk      a beta x top-K reverse KL term joins the loss (TopKTerm)       training/algorithm/teacher.py, training/algorithm/distill.py
    contrast  A'_t = A_t + beta_t * (log q_T right - log q_T wrong)          training/algorithm/contrast.py

Kept apart from training/algorithm/teacher.py, whose teacher prompts and log-probs contrast builds on, so that neither
of the two imports the other's caller.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from inference.trajectory import Trajectory
from training.algorithm.contrast import apply_contrast, contrast_logprobs, wrong_paths
from training.algorithm.teacher import TopKTerm, apply_sampled, coverage_sums, teacher_logprobs


def dense_term(trajs: Sequence[Trajectory], adv: list[torch.Tensor], old: list[torch.Tensor], beta: float,
               forward: Callable, tokenizer: Any, cfg: Any, pool_items: Sequence[dict] = (), step: int = 0,
               played: Sequence[Trajectory] | None = None
               ) -> tuple[list[torch.Tensor], dict[str, float], "TopKTerm | None"]:
    """The trainer's teacher pass for cfg.distill.distill: (advantages, this rank's sums for `finish_metrics`,
    the top-K loss term or None). sampled and contrast change the advantages; topk leaves them and returns
    the term. `forward` scores teacher sequences (forward_logprobs, or forward_topk for topk); contrast
    draws its wrong paths from the questions of `played` (every trajectory the rank played this step, trained
    or not; None: `trajs`), else from `pool_items` (the rank's question pool).
    Each trajectory with a teacher gets teacher_context, which samples/ shows."""
    a = cfg.distill
    args = (tokenizer, cfg.model.template, a.distill_context_tokens, a.distill_hint)
    term = None
    if a.distill == "contrast":
        wrong = wrong_paths(trajs, a.distill_hint, pool_items, cfg.optimisation.seed, step, played)
        teacher, wrong_lp, blocks, wrong_blocks = contrast_logprobs(trajs, *args, forward, wrong)
        adv, sums = apply_contrast(trajs, adv, old, teacher, wrong_lp, beta)
        blocks = [b if w is None else f"{b}\n--- contrast: another question's path (the wrong one) ---\n{w}"
                  for b, w in zip(blocks, wrong_blocks)]
    else:
        teacher, blocks = teacher_logprobs(trajs, *args, forward)
        term = TopKTerm(trajs, teacher, beta, cfg.rollout.temperature) if a.distill == "topk" else None
        adv, sums = (adv, coverage_sums(trajs, teacher)) if term else apply_sampled(trajs, adv, old, teacher, beta)
    for t, b in zip(trajs, blocks):
        if b is not None:
            t.teacher_context = b   # samples/ shows it beside the trajectory
    return adv, sums, term
