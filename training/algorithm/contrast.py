"""--distill contrast (issue 32; RLCSD, arXiv 2606.11709): the teacher under the question's own privileged
block minus the teacher under another question's, on the student's own sampled tokens.

    right = privileged_block(t)                      # the answer, the proposer's searches and documents
    wrong = another question's block from the step   # wrong_paths
    r_t   = log q_T(y_t | right, question) - log q_T(y_t | wrong, question)
    A'_t  = A_t + beta_t * r_t                       on sampled tokens whose trajectory has both teachers

Why: under `sampled` the teacher sees the answer, so it scores answer-stating text highly before any
document is read, and the student learned that style (rung 3, bench/RESULTS.md learning_distill_vs_ssp).
A token both teachers score alike (stating *some* answer, the format, a repeated thought) gets exactly 0;
what is left is the credit the right path gives over a wrong one. The student's own log-prob is not in
the term: r_t is `sampled`'s reward under the right path minus its reward under the wrong one,
(log q_R - log p_S) - (log q_W - log p_S), so log p_S cancels. Both teachers read the student's question;
only the block differs.

The wrong path of a question is the block of another question played this step on this rank: a different
question (normalised text) with no golden answer in common (a path to the same answer states the right
answer too), of the same kind (a construction path, or --distill_hint's answer alone, never one against
the other). A rank with no such question takes one from its question pool (checkpointed, so a resumed
run draws the same); with none there either, the trajectory's tokens get no term and are counted out of
distill/contrast_coverage. The pick is a seeded draw among the candidates sorted by question, seeded by
(--seed, step, the question): every trajectory of a group gets the same wrong path, and neither the
order of the trajectories nor any RNG state changes it.

Cost: a second teacher sequence per covered solver trajectory, scored in the same forward call as the
first (timing_s/teacher). Metrics: sampled's, against the right-path teacher (distill/kl, logp_gap,
coverage, with_teacher, beta), plus distill/contrast_gap (mean r_t over sampled tokens with both
teachers), distill/contrast_coverage (their share of all solver sampled tokens) and
distill/with_contrast (trajectories with both).
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable, Sequence

import torch

from inference.trajectory import Trajectory
from training.algorithm.teacher import apply_sampled, path_block, privileged_block, teacher_logprobs
from utils.text import normalize_answer


def _answers(answer: Any) -> set[str]:
    xs = answer if isinstance(answer, (list, tuple)) else [answer]
    return {k for k in (normalize_answer(str(x)) for x in xs if x is not None) if k}


def _path(question: str, answer: Any, qcp: dict | None) -> dict:
    return {"question": question, "answer": answer, "qcp": qcp or None}


def _sort_key(p: dict) -> tuple[str, str]:
    return normalize_answer(str(p["question"])), json.dumps([p["answer"], p["qcp"]], sort_keys=True, default=str)


def _fits(own: dict, other: dict) -> bool:
    """`other` can be `own`'s wrong path: another question, no answer in common, a block of the same kind."""
    return (normalize_answer(str(other["question"])) != normalize_answer(str(own["question"]))
            and not (_answers(other["answer"]) & _answers(own["answer"]))
            and bool(other["qcp"]) == bool(own["qcp"]))


def wrong_paths(trajs: Sequence[Trajectory], hint: bool, pool_items: Sequence[dict] = (), seed: int = 0,
                step: int = 0, played: Sequence[Trajectory] | None = None) -> list[dict | None]:
    """Per trajectory, the path ({"question", "answer", "qcp"}) whose block is its wrong teacher's, or None:
    not a solver, no block of its own, or no other question to take one from (see the module docstring).
    Candidates: the solver questions of `played` (the step's trajectories on this rank, those that carry no
    loss included: --drop_flat_solver_groups leaves groups out; None: `trajs`), then `pool_items`."""
    def usable(p: dict) -> bool:
        return bool(p["qcp"]) or (hint and bool(_answers(p["answer"])))

    def own(t: Trajectory) -> dict:
        return _path(t.question, t.answer, t.meta.qcp)

    step_paths: dict[str, dict] = {}             # one path per question, whatever the trajectories' order
    for p in sorted((own(t) for t in (trajs if played is None else played) if t.role == "solver"), key=_sort_key):
        if usable(p):
            step_paths.setdefault(normalize_answer(str(p["question"])), p)
    pool = sorted((p for p in (_path(it["question"], it["answer"], it.get("qcp")) for it in pool_items) if usable(p)),
                  key=_sort_key)
    chosen: dict[str, dict | None] = {}
    out: list[dict | None] = []
    for t in trajs:
        p = own(t) if t.role == "solver" else None
        if p is None or not usable(p):
            out.append(None)
            continue
        key = normalize_answer(str(p["question"]))
        if key not in chosen:
            chosen[key] = None
            for source in (list(step_paths.values()), pool):
                cands = [c for c in source if _fits(p, c)]
                if cands:
                    rng = random.Random(f"contrast/{seed}/{step}/{key}")   # str seeds hash the same in every process
                    chosen[key] = cands[rng.randrange(len(cands))]
                    break
        out.append(chosen[key])
    return out


def contrast_logprobs(trajs: Sequence[Trajectory], tokenizer: Any, template: str, max_tokens: int, hint: bool,
                      forward: Callable, wrong: Sequence[dict | None]) -> tuple[list, list, list, list]:
    """(right, wrong log-probs, right blocks, wrong blocks), each per trajectory: log-probs aligned to
    `t.token_ids` (0 on the prompt) as teacher_logprobs gives them, None without that teacher. A wrong
    teacher exists only beside a right one. Both sets of sequences go through ONE `forward` call (collective)."""
    n = len(trajs)
    right_blocks = [privileged_block(t, tokenizer, max_tokens, hint) if t.role == "solver" else None for t in trajs]
    wrong_blocks = [path_block(w["answer"], w["qcp"], tokenizer, max_tokens, hint) if w is not None and b is not None
                    else None for b, w in zip(right_blocks, wrong)]
    lps, _ = teacher_logprobs(list(trajs) * 2, tokenizer, template, max_tokens, hint, forward,
                              blocks=right_blocks + wrong_blocks)
    return lps[:n], lps[n:], right_blocks, wrong_blocks


def apply_contrast(trajs: Sequence[Trajectory], adv: list[torch.Tensor], student: list[torch.Tensor],
                   right: list[torch.Tensor | None], wrong: list[torch.Tensor | None],
                   beta: float) -> tuple[list[torch.Tensor], dict[str, float]]:
    """A'_t = A_t + beta (log q_R - log q_W) on the sampled tokens of each trajectory with both teachers
    (distill.contrast_token_advantage); returns the new advantages and this rank's sums for finish_metrics:
    apply_sampled's against the right teacher (its advantages unused) and contrast_sum, both, with_contrast."""
    from training.algorithm.distill import contrast_token_advantage

    _, sums = apply_sampled(trajs, adv, student, right, 0.0)   # beta 0: the metrics' sums, advantages as they are
    sums.update(contrast_sum=0.0, both=0.0, with_contrast=0.0)
    new = list(adv)
    for i, t in enumerate(trajs):
        if t.role != "solver" or right[i] is None or wrong[i] is None:
            continue
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        new[i] = contrast_token_advantage(adv[i], right[i], wrong[i], m, beta, None)
        sums["contrast_sum"] += float((right[i] - wrong[i])[m].sum())
        sums["both"] += float(m.sum())
        sums["with_contrast"] += 1.0
    return new, sums
