"""Dense self-distillation for the solver (issue 22): pure tensor functions.

The teacher is the same LLM given privileged context; it scores the tokens the
student (solver) sampled. Three forms, chosen by one flag (DISTILL_MODES):

  "sampled"  per-token reward r_t = log q_T(y_t) - log p_S(y_t) (both detached),
             added with weight beta to the outcome advantage of each sampled token:
             A'_t = A_t + beta * r_t   (`sampled_token_advantage`).
  "contrast" r_t = log q_T(y_t | right path) - log q_T(y_t | wrong path): the teacher under the
             question's own privileged block minus under another question's (issue 32; RLCSD),
             added like "sampled"   (`contrast_token_advantage`; training/algorithm/contrast.py).
  "topk"     reverse KL of the student from the teacher on the teacher's top-K set,
             KL_t = sum_{k in TopK_T(t)} p~_S(k) (log p~_S(k) - log q~_T(k)),
             p~, q~ = softmax renormalised over TopK_T(t)   (`teacher_topk`,
             `topk_reverse_kl`, `distill_kl_loss`). With K = V it is KL(p_S || q_T).

Masking follows training/algorithm/loss.py: only tokens with loss_mask 1 whose sequence has a
teacher count; other values (NaN included) are replaced by `torch.where` before any
arithmetic. `has_teacher` is None (all), per token (loss_mask's shape) or per
sequence ((B,) for padded (B, T) inputs, (S,) with cu_seqlens for packed ones).
"""

from __future__ import annotations

import math

import torch

from training.algorithm.logprobs import chunk_logits, auto_chunk_size
from training.algorithm.loss import AGG_MODES, aggregate_tokens, token_segments

DISTILL_MODES = ("sampled", "contrast", "topk")
BETA_SCHEDULES = ("constant", "linear", "cosine")


def beta_at(step: int, total_steps: int, beta: float, schedule: str = "constant", floor: float = 0.0) -> float:
    """Distillation weight at `step`: constant beta, or a decay from beta (step 0) to floor (step >= total_steps).

    linear: floor + (beta - floor) (1 - f);  cosine: floor + (beta - floor) (1 + cos(pi f)) / 2;
    f = min(step / total_steps, 1).
    """
    if schedule not in BETA_SCHEDULES:
        raise ValueError(f"unknown beta schedule {schedule!r}; choose one of {BETA_SCHEDULES}")
    if not (beta >= 0 and floor >= 0):
        raise ValueError(f"beta and floor must be >= 0, got beta={beta}, floor={floor}")
    if floor > beta:
        raise ValueError(f"floor={floor} must not exceed beta={beta} (the schedule decays from beta to floor)")
    if schedule == "constant":
        return float(beta)
    if total_steps <= 0 or step < 0:
        raise ValueError(f"{schedule} schedule needs total_steps > 0 and step >= 0, got {total_steps}, {step}")
    f = min(step / total_steps, 1.0)
    decay = 1.0 - f if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * f))
    return float(floor + (beta - floor) * decay)


def _teacher_tokens(has_teacher, m: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """Per-token bool: the token's sequence has a teacher."""
    if has_teacher is None:
        return torch.ones_like(m)
    ht = torch.as_tensor(has_teacher, device=m.device).bool()
    if ht.shape == m.shape:
        return ht
    if ht.ndim == 1 and (m.ndim == 2 or cu_seqlens is not None):
        seg_ids, n_seq = token_segments(m, cu_seqlens)
        if ht.numel() == n_seq:
            return ht[seg_ids].reshape(m.shape)
    raise ValueError(f"has_teacher has shape {tuple(ht.shape)}; need loss_mask's {tuple(m.shape)} or one flag "
                     "per sequence ((B,) for padded inputs, (S,) with cu_seqlens for packed ones)")


def _check_shapes(m, **named):
    for name, x in named.items():
        if x.shape != m.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, loss_mask has {tuple(m.shape)}")


def sampled_token_advantage(advantages, teacher_logprobs, student_logprobs, loss_mask, beta, has_teacher,
                            *, cu_seqlens=None) -> torch.Tensor:
    """A'_t = A_t + beta * (log q_T(y_t) - log p_S(y_t)) on masked teacher tokens, A_t elsewhere.

    All inputs per token, detached. Tokens off loss_mask or without a teacher keep
    exactly their advantage (whatever it is); beta == 0 returns `advantages` bitwise.
    Raises ValueError on non-finite log-probs of masked teacher tokens.
    """
    return _add_log_ratio(advantages, {"teacher_logprobs": teacher_logprobs, "student_logprobs": student_logprobs},
                          loss_mask, beta, has_teacher, cu_seqlens)


def _add_log_ratio(advantages, named, loss_mask, beta, has_teacher, cu_seqlens):
    """A_t + beta * (first - second of `named`) on masked teacher tokens; the checks of both callers."""
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta}")
    m = loss_mask.bool()
    _check_shapes(m, advantages=advantages, **named)
    use = m & _teacher_tokens(has_teacher, m, cu_seqlens)
    adv = advantages.detach()
    if beta == 0:
        return adv                                   # adv + 0 * r would turn -0.0 into +0.0
    a_lp, b_lp = (x.detach() for x in named.values())
    bad = [n for n, x in zip(named, (a_lp, b_lp)) if not bool((torch.isfinite(x) | ~use).all())]
    if bad:
        raise ValueError(f"non-finite values (NaN/inf) on loss-masked teacher tokens in {bad}")
    zero = torch.zeros((), dtype=a_lp.dtype, device=a_lp.device)
    r = torch.where(use, a_lp, zero) - torch.where(use, b_lp, zero)
    return torch.where(use, adv + beta * r, adv).to(adv.dtype)


def contrast_token_advantage(advantages, right_logprobs, wrong_logprobs, loss_mask, beta, has_both,
                             *, cu_seqlens=None) -> torch.Tensor:
    """A'_t = A_t + beta * (log q_T(y_t | right) - log q_T(y_t | wrong)) on masked tokens with both teachers.

    RLCSD's contrast (arXiv 2606.11709): text both teachers score alike gets exactly 0. It is
    `sampled_token_advantage` with the wrong-path teacher in the student's place: the student's own
    log-prob cancels, (log q_R - log p_S) - (log q_W - log p_S). Same masking, beta == 0 and
    non-finite rules; has_both as has_teacher (None: every token has both teachers).
    """
    return _add_log_ratio(advantages, {"right_logprobs": right_logprobs, "wrong_logprobs": wrong_logprobs},
                          loss_mask, beta, has_both, cu_seqlens)


def _check_head(hidden, weight, temperature, chunk_size):
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (T, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError("lm_head weight is empty (ZeRO-3 partitioned?): call under the head's forward or "
                         "GatheredParameters, as training.algorithm.logprobs.sequence_logprobs does")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    return chunk_size or auto_chunk_size(weight.shape[0], hidden.shape[0])


@torch.no_grad()
def teacher_topk(hidden, weight, k, bias=None, temperature=1.0, chunk_size=None):
    """Teacher's top-k token ids (T, k) long and their FULL-softmax log-probs (T, k) fp32, no grad.

    log q_T(v) = z_v - logsumexp_{V} z, z = (hidden @ weight.T + bias) / temperature, one
    chunk of rows at a time, so the fp32 (T, V) logits never exist at once.
    """
    c = _check_head(hidden, weight, temperature, chunk_size)
    if not 1 <= k <= weight.shape[0]:
        raise ValueError(f"k must be in [1, V={weight.shape[0]}], got {k}")
    n = hidden.shape[0]
    ids = torch.empty(n, k, dtype=torch.long, device=hidden.device)
    lps = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    for s in range(0, n, c):
        z = chunk_logits(hidden[s:s + c], weight, bias, float(temperature))
        top, ids[s:s + c] = z.topk(k, dim=-1)
        lps[s:s + c] = top - torch.logsumexp(z, dim=-1, keepdim=True)
        del z
    return ids, lps


def _renormalise(x):
    """x - logsumexp(x): on CPU it was 10x more accurate than fp32 log_softmax at V = 151,936."""
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


class _TopKReverseKL(torch.autograd.Function):
    """Chunked forward; the backward rebuilds each chunk's gradient without recomputing logits.

    A custom Function, not torch.utils.checkpoint per chunk: only the K gathered logits
    matter, so forward saves the renormalised student log-probs log p~ (T, K), the size
    of the teacher's inputs, never (T, V), and backward needs no (chunk, V) logit recompute.
    With a = log p~, b = log q~: dKL/dz_k = p~_k (a_k - b_k - KL), zero off the top-K
    set. Backward scatters that into one (chunk, V) fp32 buffer and multiplies by the
    weight, so peak extra memory is a (chunk, V) buffer, as in training/algorithm/logprobs.py.
    Rows whose incoming gradient is 0 (masked tokens) get exactly zero gradient, even
    when their teacher values are NaN.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, log_q, temperature, chunk_size):
        n = hidden.shape[0]
        log_p = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        kl = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = chunk_logits(hidden[s:e], weight, bias, temperature).gather(1, ids[s:e])   # (c, K)
            log_p[s:e] = _renormalise(z)
            kl[s:e] = (log_p[s:e].exp() * (log_p[s:e] - log_q[s:e])).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, ids, log_p, log_q, kl)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return kl

    @staticmethod
    def backward(ctx, g):
        hidden, weight, bias, ids, log_p, log_q, kl = ctx.saved_tensors
        t, c, n = ctx.temperature, ctx.chunk_size, hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        g = g.float()
        for s in range(0, n, c):
            e = min(s + c, n)
            a, gc = log_p[s:e], g[s:e, None]
            dzk = torch.where(gc != 0, a.exp() * (a - log_q[s:e] - kl[s:e, None]) * gc, 0.0)
            dz = torch.zeros(e - s, weight.shape[0], dtype=torch.float32, device=hidden.device)
            dz.scatter_add_(1, ids[s:e], dzk / t)                 # z = logits / t
            h = hidden[s:e]
            if need_h:
                grad_h[s:e] = torch.matmul(dz.to(weight.dtype), weight).to(hidden.dtype)
            if need_w and h.dtype == torch.float32:
                grad_w.addmm_(dz.t(), h)                            # no (V, H) temporary
            elif need_w:
                grad_w += torch.matmul(dz.t().to(h.dtype), h).float()
            if need_b:
                grad_b += dz.sum(0)
            del dz
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None)


def topk_reverse_kl(hidden, weight, topk_ids, teacher_topk_logprobs, bias=None, temperature=1.0, chunk_size=None):
    """Per-token KL(p~_S || q~_T) over the teacher's top-K set, (T,) fp32, differentiable wrt hidden/weight/bias.

    hidden (T, H): the student's states predicting each token; weight (V, H), bias (V,)
    or None: its lm_head; topk_ids (T, K) and teacher_topk_logprobs (T, K) from
    `teacher_topk` (treated as constants; renormalised here, so log-probs of any
    normalisation work). log p~_S(k) = z_k - logsumexp_{j in K} z_j with the student's
    logits z at the same temperature. Memory: see _TopKReverseKL.
    """
    c = _check_head(hidden, weight, temperature, chunk_size)
    n, v = hidden.shape[0], weight.shape[0]
    if topk_ids.ndim != 2 or topk_ids.shape[0] != n or teacher_topk_logprobs.shape != topk_ids.shape:
        raise ValueError(f"need topk_ids and teacher_topk_logprobs of shape (T={n}, K); got "
                         f"{tuple(topk_ids.shape)} and {tuple(teacher_topk_logprobs.shape)}")
    ids = topk_ids.long().to(hidden.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise ValueError(f"topk_ids must be in [0, {v}), got range [{int(ids.min())}, {int(ids.max())}]")
    log_q = _renormalise(teacher_topk_logprobs.detach().float().to(hidden.device))
    return _TopKReverseKL.apply(hidden, weight, bias, ids, log_q, float(temperature), c)


def distill_kl_loss(per_token_kl, loss_mask, normaliser, agg="token-mean", cu_seqlens=None, has_teacher=None):
    """(loss, metrics): per-token KL aggregated like training/algorithm/loss.py over masked teacher tokens.

    loss = aggregate_tokens(KL_t on masked tokens whose sequence has a teacher, agg) / normaliser,
    with the global normaliser of loss.py (e.g. count_normaliser(loss_mask & teacher, agg,
    cu_seqlens) summed over micro-batches and ranks). Other tokens carry zero loss and
    gradient whatever their values. Metrics (detached): "distill/kl" (token mean of KL over
    those tokens), "distill/num_tokens", "distill/kl_loss" (this micro-batch's share).
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; choose one of {AGG_MODES}")
    if float(normaliser) <= 0:
        raise ValueError(f"normaliser must be the positive global count for agg={agg!r}, got {normaliser}")
    m = loss_mask.bool()
    _check_shapes(m, per_token_kl=per_token_kl)
    use = m & _teacher_tokens(has_teacher, m, cu_seqlens)
    if not bool((torch.isfinite(per_token_kl.detach()) | ~use).all()):
        raise ValueError("non-finite values (NaN/inf) in per_token_kl on loss-masked teacher tokens")
    uf = use.to(per_token_kl.dtype)
    kl = torch.where(use, per_token_kl, torch.zeros((), dtype=per_token_kl.dtype, device=per_token_kl.device))
    seg = token_segments(m, cu_seqlens) if agg != "token-mean" else None
    loss = aggregate_tokens(kl, uf, agg, normaliser, seg)
    with torch.no_grad():
        n = uf.sum()
        metrics = {"distill/kl": kl.sum() / n.clamp(min=1), "distill/num_tokens": n, "distill/kl_loss": loss}
    return loss, {k: v.detach().float() for k, v in metrics.items()}
