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

--distill topk: the same teacher pass returns, per covered token, the teacher's top-K ids and log-probs
(`forward_topk`, the lm_head's forward swapped for distill.teacher_topk, so ZeRO-3 gathers its weight);
the advantages stay as they are, and `TopKTerm` adds beta x KL(p~_S || q~_T) over that top-K set
(distill.topk_reverse_kl, computed in the student's update forward inside the same swapped lm_head call
as its log-probs) to the loss of the solver's sampled tokens with a teacher, aggregated like the policy
loss with its normaliser (distill.distill_kl_loss).

--distill contrast (training/algorithm/contrast.py): a second teacher sequence per covered trajectory, the block of
another question's path in place of its own; the advantages gain beta x (log q_T right - log q_T wrong).
`dense_term` (training/algorithm/self_distill.py) is the trainer's entry point for all three forms.

Metrics (distill/*, summed over ranks before the ratios): kl = mean of log p_S - log q_T over covered
sampled tokens (the sampled estimate of KL(p_S || q_T)); in topk mode the top-K KL itself, its mean over
the covered tokens of every update micro-batch (TopKTerm.metrics); logp_gap (not topk) = its
negative, coverage = covered sampled tokens / all solver sampled tokens, with_teacher = solver
trajectories that had one, beta; contrast adds its own three (training/algorithm/contrast.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from inference.prompts import build_teacher_prompt, teacher_context
from inference.trajectory import Trajectory
from utils import dist as D


def path_block(answer: Any, qcp: dict | None, tokenizer: Any, max_tokens: int, hint: bool) -> str | None:
    """The privileged block of a question with golden `answer` and construction path `qcp` (None: none)."""
    if qcp:
        return teacher_context(tokenizer, answer, qcp.get("queries"), qcp.get("docs"), max_tokens)
    if hint and answer:
        return teacher_context(tokenizer, answer, None, None, max_tokens)
    return None


def privileged_block(t: Trajectory, tokenizer: Any, max_tokens: int, hint: bool) -> str | None:
    """The teacher's privileged block for solver trajectory `t`, or None when it gets no teacher."""
    return path_block(t.answer, t.meta.qcp, tokenizer, max_tokens, hint)


def teacher_trajectory(t: Trajectory, prompt_ids: list[int]) -> Trajectory:
    """`t` with its prompt replaced by the teacher's: the response tokens and their mask stay as sampled."""
    resp = slice(t.prompt_len, None)
    n = len(prompt_ids)
    return replace(t, token_ids=list(prompt_ids) + list(t.token_ids[resp]), prompt_len=n,
                   loss_mask=[0] * n + list(t.loss_mask[resp]), logprobs=[0.0] * n + list(t.logprobs[resp]))


def teacher_logprobs(trajs: Sequence[Trajectory], tokenizer: Any, template: str, max_tokens: int, hint: bool,
                     forward: Callable[[list[Trajectory]], list[torch.Tensor]],
                     blocks: Sequence[str | None] | None = None) -> tuple[list, list[str | None]]:
    """Per trajectory, the teacher's log-prob of each of its tokens (aligned to `t.token_ids`, 0 on the prompt),
    or None without a teacher; and the privileged blocks. `forward` is the trainer's forward_logprobs on the
    teacher engine: collective, so every rank calls it, with an empty list where it has no teacher. A
    `forward` that returns a tuple per sequence (forward_topk: ids, log-probs, each (L, K)) gets each
    member aligned the same way, zero rows on the student's prompt. `blocks` (one per trajectory, None: no
    teacher) replaces each solver's own privileged block (--distill contrast's wrong paths)."""
    if blocks is None:
        blocks = [privileged_block(t, tokenizer, max_tokens, hint) if t.role == "solver" else None for t in trajs]
    blocks = list(blocks)
    idx = [i for i, b in enumerate(blocks) if b is not None]
    seqs = [teacher_trajectory(trajs[i], build_teacher_prompt(tokenizer, trajs[i].question, blocks[i], template))
            for i in idx]
    out: list[torch.Tensor | None] = [None] * len(trajs)
    for i, s, lp in zip(idx, seqs, forward(seqs)):
        t = trajs[i]
        if isinstance(lp, tuple):
            out[i] = tuple(torch.cat([x.new_zeros((t.prompt_len, *x.shape[1:])), x[s.prompt_len:]]) for x in lp)
        else:
            out[i] = torch.cat([torch.zeros(t.prompt_len), lp[s.prompt_len:].float()])
    return out, blocks


def apply_sampled(trajs: Sequence[Trajectory], adv: list[torch.Tensor], student: list[torch.Tensor],
                  teacher: list[torch.Tensor | None], beta: float) -> tuple[list[torch.Tensor], dict[str, float]]:
    """A'_t = A_t + beta (log q_T - log p_S) on each covered trajectory's sampled tokens (training/algorithm/distill.py);
    returns the new advantages and this rank's sums for the metrics (see `finish_metrics`)."""
    from training.algorithm.distill import sampled_token_advantage

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


def coverage_sums(trajs: Sequence[Trajectory], teacher: list) -> dict[str, float]:
    """This rank's coverage sums (no advantage change): the top-K form's `apply_sampled` without the gap."""
    sums = {"covered": 0.0, "solver_tokens": 0.0, "with_teacher": 0.0}
    for t, tt in zip(trajs, teacher):
        if t.role == "solver":
            n = float(sum(t.loss_mask))
            sums["solver_tokens"] += n
            if tt is not None:
                sums["covered"] += n
                sums["with_teacher"] += 1.0
    return sums


def finish_metrics(sums: dict[str, float], beta: float) -> dict[str, float]:
    """The distill/* metrics from the sums of `apply_sampled` (or `coverage_sums`: no kl, the update
    reports it) added over ranks."""
    cov = sums["covered"]
    out = {"distill/beta": beta, "distill/with_teacher": sums["with_teacher"],
           "distill/coverage": cov / sums["solver_tokens"] if sums["solver_tokens"] else 0.0}
    if "gap_sum" in sums:
        gap = sums["gap_sum"] / cov if cov else float("nan")
        out.update({"distill/logp_gap": gap, "distill/kl": -gap})
    if "contrast_sum" in sums:   # --distill contrast (training/algorithm/contrast.py)
        both = sums["both"]
        out.update({"distill/contrast_gap": sums["contrast_sum"] / both if both else float("nan"),
                    "distill/contrast_coverage": both / sums["solver_tokens"] if sums["solver_tokens"] else 0.0,
                    "distill/with_contrast": sums["with_contrast"]})
    return out


# ----------------------------------------------------------------------------- the top-K form

def _sequence_topk(model, mb, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids (T, k) and log-probs (T, k) at mb's loss-masked positions (zero rows
    elsewhere), the lm_head module's forward swapped for distill.teacher_topk so its hooks fire."""
    from training.algorithm.distill import teacher_topk
    from training.algorithm.logprobs import backbone_rows, forward_swapped

    rows, pos, valid = backbone_rows(model, mb)
    head = model.get_output_embeddings()
    with forward_swapped(head, lambda x: teacher_topk(x, head.weight, k, getattr(head, "bias", None), temperature)):
        ids, lps = head(rows)
    keep = pos[valid]
    out_ids = torch.zeros(mb.num_tokens, k, dtype=torch.long, device=ids.device)
    out_lps = torch.zeros(mb.num_tokens, k, dtype=torch.float32, device=lps.device)
    out_ids[keep], out_lps[keep] = ids[valid], lps[valid]
    return out_ids, out_lps


@torch.no_grad()
def forward_topk(engine, trajs: Sequence[Trajectory], k: int, temperature: float, micro_token_budget: int) -> list:
    """forward_logprobs's twin for --distill topk: per trajectory (ids (L, k) long, log q_T (L, k) fp32) of
    the teacher's top-k tokens at each of its loss-masked positions, through DeepSpeedEngine.forward (one
    call per micro-batch, the same count on every rank: collective)."""
    from training.algorithm.logprobs import forward_swapped
    from training.algorithm.packing import unpack_to_sequences
    from training.algorithm.micro_batches import pack_equal

    model = engine.module
    vocab = model.get_output_embeddings().out_features
    if not 1 <= k <= vocab:     # the same on every rank: all raise
        raise ValueError(f"--distill_topk {k} must be in [1, {vocab}] (the lm_head's vocabulary; K = {vocab} is the "
                         f"exact full-vocabulary reverse KL)")
    was_training = model.training
    model.eval()
    mbs, n_real = pack_equal(trajs, micro_token_budget)
    outs = []
    for mb in mbs:
        mb = mb.to(engine.device)
        with forward_swapped(model, lambda: _sequence_topk(model, mb, k, temperature)):
            outs.append(tuple(x.cpu() for x in engine()))
    model.train(was_training)
    if not trajs:
        return []
    ids, lps = (unpack_to_sequences(mbs[:n_real], [o[j] for o in outs[:n_real]], len(trajs)) for j in (0, 1))
    return list(zip(ids, lps))


class TopKTerm:
    """--distill topk inside ppo_update: beta x KL(p~_S || q~_T) over the teacher's top-K set, per solver
    sampled token whose trajectory has a teacher, added to the policy loss.

    teacher: per trajectory None or (ids (L, K), log q_T (L, K)) aligned to its token_ids (teacher_logprobs
    with forward_topk). The KL is computed by `head_extra` inside the student's swapped lm_head forward
    (gradients to its hidden states and lm_head weight, never (T, V) logits), on loss-masked rows only, so
    <information> and template tokens carry no term; `add_loss` aggregates it with distill_kl_loss and the
    policy loss's normaliser."""

    def __init__(self, trajs: Sequence[Trajectory], teacher: list, beta: float, temperature: float):
        self.lengths = [len(t.token_ids) for t in trajs]
        self.teacher, self.beta, self.temperature = teacher, float(beta), float(temperature)
        self.k = next((x[0].shape[1] for x in teacher if x is not None), 1)
        self.kl_sum = self.n = 0.0

    def per_token(self, sub: list[int]) -> dict[str, list[torch.Tensor]]:
        """The packed flag "distill_teacher" (1 on every token of a trajectory with a teacher)."""
        return {"distill_teacher": [torch.full((self.lengths[i],), float(self.teacher[i] is not None)) for i in sub]}

    def head_extra(self, mb, sub: list[int]):
        """For sequence_logprobs: the per-token top-K KL (T,) of micro-batch `mb` (packed from trajs[sub])."""
        from training.algorithm.distill import topk_reverse_kl

        def fn(x, weight, bias, pos, valid):
            ids = torch.zeros(mb.num_tokens, self.k, dtype=torch.long)
            lq = torch.zeros(mb.num_tokens, self.k)
            for j, s, e in zip(mb.seq_indices, mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()):
                if self.teacher[sub[j]] is not None:
                    ids[s:e], lq[s:e] = self.teacher[sub[j]]
            use = valid & mb.tensors["distill_teacher"].to(pos.device)[pos].bool()
            sel = torch.nonzero(use).flatten()
            p = pos[sel]
            kl = topk_reverse_kl(x[sel], weight, ids[p.cpu()].to(x.device), lq[p.cpu()].to(x.device), bias,
                                 self.temperature)
            return torch.zeros(mb.num_tokens, dtype=kl.dtype, device=x.device).index_add(0, p, kl)
        return fn

    def add_loss(self, out, mb, kl, normaliser, agg: str):
        """policy_loss's (loss, metrics) plus beta x this micro-batch's share of the top-K KL term."""
        from training.algorithm.distill import distill_kl_loss

        loss, m = out
        use = mb.tensors["loss_mask"].bool() & mb.tensors["distill_teacher"].bool()
        if float(m.get("actor/nonfinite", 0.0)):
            return out
        if not bool((torch.isfinite(kl.detach()) | ~use).all()):     # as policy_loss's on_nonfinite="skip"
            return loss + torch.where(torch.zeros_like(use), kl, 0.0).sum(), {**m, "actor/nonfinite": torch.ones(())}
        d_loss, _ = distill_kl_loss(kl, mb.tensors["loss_mask"], normaliser, agg, mb.cu_seqlens, use)
        self.kl_sum += float(kl.detach()[use].sum())
        self.n += float(use.sum())
        return loss + self.beta * d_loss, {**m, "distill/kl_loss": (self.beta * d_loss).detach().float()}

    def metrics(self) -> dict[str, float]:
        """distill/kl: the top-K KL's mean over the covered tokens of every update micro-batch, all ranks
        (collective)."""
        s, n = D.all_reduce_sum([self.kl_sum, self.n])
        return {"distill/kl": s / n if n else float("nan")}
