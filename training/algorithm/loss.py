"""The policy loss: a pure function of tensors returning (loss, metrics).

Modelled on OpenRLHF's models/loss.py and verl's core_algos.compute_policy_loss.
Inputs are per token, either packed 1-D (T,) with `cu_seqlens` marking the
sequences, or padded 2-D (B, T) with one sequence per row. `loss_mask` is 1 on
tokens the policy sampled; every other token carries exactly zero loss and
gradient, whatever its values (NaN included: masked-out values are replaced
with 0 before any arithmetic, so they cannot leak through 0 * NaN).

The normaliser is *global*: the number of masked tokens (token-mean) or of
sequences with at least one masked token (seq-mean-*) in the whole optimiser
step, summed over micro-batches and data-parallel ranks. Each micro-batch's loss
is then its share of the global loss, so summing the gradients of all
micro-batches on all ranks gives the same update however the batch is sharded or
accumulated. `count_normaliser` gives the local count to sum.

Aggregation modes (`agg`):
  token-mean            sum_t l_t / N_tokens
  seq-mean-token-mean   sum_s (mean_{t in s} l_t) / N_seqs
  seq-mean-token-sum    sum_s (sum_{t in s} l_t) / N_seqs   (Dr. GRPO,
                        https://arxiv.org/abs/2503.20783; for the paper's constant
                        normaliser pass N_seqs * max_response_tokens)

Distributed caveat: with on_nonfinite="skip" the returned flag
metrics["actor/nonfinite"] is local; the trainer must all-reduce it (max) and skip
the optimiser step on every rank, and still run backward (ZeRO-3 is collective).
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (http://joschu.net/blog/kl-approx.html).

    k1 = log r^-1 (unbiased, high variance), k2 = 0.5 (log r)^2, k3 = r - 1 - log r with
    r = pi_ref / pi (unbiased, low variance, >= 0; "low_var_kl" in verl, clamped to
    [-10, 10] as verl does so one wild token cannot dominate).
    """
    diff = logprobs - ref_logprobs                          # log pi - log pi_ref
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator in ("k3", "low_var_kl"):
        neg = -diff.clamp(-20.0, 20.0)                      # exp() stays finite
        return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def token_segments(mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Sequence index of every token (flattened) and the number of sequences."""
    if mask.ndim == 2:
        b, t = mask.shape
        return torch.arange(b, device=mask.device).repeat_interleave(t), b
    if cu_seqlens is None:
        raise ValueError("seq-mean-* aggregation of 1-D packed inputs needs cu_seqlens (the packed sequence bounds)")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(mask.device).long()
    if int(lens.sum()) != mask.numel():
        raise ValueError(f"cu_seqlens covers {int(lens.sum())} tokens but the inputs have {mask.numel()}")
    return torch.arange(len(lens), device=mask.device).repeat_interleave(lens), len(lens)


def aggregate_tokens(x: torch.Tensor, m: torch.Tensor, agg: str, normaliser, seg) -> torch.Tensor:
    """Sum of x over masked tokens (x is already 0 off the mask), shaped by `agg`, over the global normaliser."""
    x, m = x.reshape(-1), m.reshape(-1)
    if agg == "token-mean":
        return x.sum() / normaliser
    seg_ids, n_seq = seg
    seq_sum = torch.zeros(n_seq, dtype=x.dtype, device=x.device).index_add(0, seg_ids, x)
    if agg == "seq-mean-token-sum":
        return seq_sum.sum() / normaliser
    count = torch.zeros(n_seq, dtype=x.dtype, device=x.device).index_add(0, seg_ids, m.to(x.dtype))
    return (seq_sum / count.clamp(min=1)).sum() / normaliser


def count_normaliser(loss_mask: torch.Tensor, agg: str = "token-mean",
                     cu_seqlens: torch.Tensor | None = None) -> int:
    """This micro-batch's share of the global normaliser; sum it over micro-batches and ranks.

    token-mean: masked tokens; seq-mean-*: sequences with at least one masked token.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; choose one of {AGG_MODES}")
    m = loss_mask.bool()
    if agg == "token-mean":
        return int(m.sum())
    seg_ids, n_seq = token_segments(m, cu_seqlens)
    per_seq = torch.zeros(n_seq, dtype=torch.long, device=m.device).index_add(0, seg_ids, m.reshape(-1).long())
    return int((per_seq > 0).sum())


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    normaliser: float | torch.Tensor,
    agg: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    on_nonfinite: str = "raise",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate + KL + entropy for one micro-batch; returns (loss, metrics).

    logprobs: current policy log-prob of each token (carries the gradient).
    old_logprobs: log-probs of the policy that collected the data, recomputed by the
      trainer (the PPO ratio's denominator). rollout_logprobs: the inference engine's
      log-probs of the same tokens; used for the TIS weight and the staleness metric.
    clip_low / clip_high: ratio clipped to [1 - clip_low, 1 + clip_high]; clip_high >
      clip_low is DAPO's clip-higher (https://arxiv.org/abs/2503.14476), default 0.28.
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at -A * c
      (https://arxiv.org/abs/1912.09729); None disables it.
    ref_logprobs / kl_coef / kl_estimator: KL(pi || pi_ref) penalty added to the loss.
    entropy / entropy_coef: loss -= entropy_coef * entropy (entropy carries gradient).
    tis_cap: truncated importance sampling between the rollout engine and the trainer,
      w = min(exp(old_lp - rollout_lp), tis_cap), detached, multiplies the surrogate
      (https://fengyao.notion.site/off-policy-rl). Needs rollout_logprobs.
    on_nonfinite: "raise" (ValueError naming the inputs) or "skip" (a zero loss
      still connected to the graph, metrics["actor/nonfinite"] = 1).

    Metrics are detached 0-d tensors. "actor/*_loss" are this micro-batch's share of
    the global loss (sum them); the others are means over this micro-batch's masked
    tokens, weighted by "actor/num_tokens" (use `reduce_metrics`).
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; choose one of {AGG_MODES}")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; choose one of {KL_ESTIMATORS}")
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the ratio for negative advantages), got {dual_clip}")
    if tis_cap is not None and (rollout_logprobs is None or tis_cap <= 0):
        raise ValueError(f"tis_cap={tis_cap} needs rollout_logprobs and a positive cap")
    if kl_coef and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    if entropy_coef and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs the entropy tensor")
    if float(normaliser) <= 0:
        raise ValueError(f"normaliser must be the positive global count for agg={agg!r}, got {normaliser}")

    m = loss_mask.bool()
    named = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages,
             "ref_logprobs": ref_logprobs, "entropy": entropy, "rollout_logprobs": rollout_logprobs}
    for name, x in named.items():
        if x is not None and x.shape != m.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, loss_mask has {tuple(m.shape)}")
    present = {k: v for k, v in named.items() if v is not None}
    # One device sync for all finiteness checks; only masked tokens count.
    finite = torch.stack([(torch.isfinite(v.detach()) | ~m).all() for v in present.values()])
    if not bool(finite.all()):
        bad = [k for k, ok in zip(present, finite.tolist()) if not ok]
        if on_nonfinite == "raise":
            raise ValueError(f"non-finite values (NaN/inf) on loss-masked tokens in {bad}; "
                             "pass on_nonfinite='skip' to skip this step instead of stopping")
        zero = sum(torch.where(torch.zeros_like(m), v, 0.0).sum() for v in present.values() if v.requires_grad)
        zero = zero if isinstance(zero, torch.Tensor) else logprobs.new_zeros(())
        return zero, {"actor/nonfinite": torch.ones(()), "actor/num_tokens": torch.zeros(())}

    z = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    mf = m.to(logprobs.dtype)

    def clean(x):                                 # masked-out values never enter the arithmetic
        return torch.where(m, x, z)

    lp, old, adv = clean(logprobs), clean(old_logprobs.detach()), clean(advantages.detach())
    seg = token_segments(m, cu_seqlens) if agg != "token-mean" else None

    # Clamp before exp as verl does, so a stale token cannot overflow the ratio.
    log_ratio = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    dual_hit = torch.zeros_like(m)
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        dual_hit = (adv < 0) & (pg3 < pg) & m
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    tis_w = None
    if tis_cap is not None:
        rollout = clean(rollout_logprobs.detach())
        tis_w = torch.exp((old - rollout).clamp(max=20.0)).clamp(max=tis_cap)
        pg = pg * tis_w
    pg = pg * mf
    pg_loss = aggregate_tokens(pg, mf, agg, normaliser, seg)
    loss = pg_loss

    metrics: dict[str, torch.Tensor] = {"actor/pg_loss": pg_loss.detach()}
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(lp, clean(ref_logprobs.detach()), kl_estimator) * mf
        kl_loss = aggregate_tokens(kl, mf, agg, normaliser, seg) * kl_coef
        loss = loss + kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
    if entropy is not None:
        ent = clean(entropy) * mf
        ent_loss = -entropy_coef * aggregate_tokens(ent, mf, agg, normaliser, seg)
        loss = loss + ent_loss
        metrics["actor/entropy_loss"] = ent_loss.detach()

    with torch.no_grad():
        n = mf.sum()
        denom = n.clamp(min=1)

        def mean(x):
            return (x * mf).sum() / denom

        metrics["actor/num_tokens"] = n
        metrics["actor/nonfinite"] = torch.zeros(())
        metrics["actor/clipfrac_high"] = mean(((ratio > 1 + clip_high) & (adv > 0)).to(mf.dtype))
        metrics["actor/clipfrac_low"] = mean(((ratio < 1 - clip_low) & (adv < 0)).to(mf.dtype))
        metrics["actor/clipfrac_dual"] = mean(dual_hit.to(mf.dtype))
        metrics["actor/approx_kl"] = mean(torch.expm1(log_ratio) - log_ratio)   # k3 of KL(old || new)
        metrics["actor/ratio_mean"] = mean(ratio)
        metrics["actor/ratio_max"] = torch.where(m, ratio, -torch.inf).max() if n > 0 else torch.ones(())
        metrics["actor/ratio_min"] = torch.where(m, ratio, torch.inf).min() if n > 0 else torch.ones(())
        if kl is not None:
            metrics["actor/ref_kl"] = mean(kl)
        if entropy is not None:
            metrics["actor/entropy"] = mean(clean(entropy))
        if rollout_logprobs is not None:
            metrics["actor/rollout_lp_gap"] = mean((clean(rollout_logprobs) - old).abs())
        if tis_w is not None:
            metrics["actor/tis_weight_mean"] = mean(tis_w)
            metrics["actor/tis_clipfrac"] = mean((tis_w >= tis_cap).to(mf.dtype))
    return loss, {k: v.detach().float() for k, v in metrics.items()}


def reduce_metrics(per_micro_batch: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Combine the metrics of several micro-batches on one rank.

    *_loss and num_tokens/nonfinite are summed/maxed, *_max / *_min take the max / min
    over micro-batches that had tokens, other keys are token-weighted means; a key with no tokens is left out.
    """
    out: dict[str, float] = {}
    keys = sorted({k for d in per_micro_batch for k in d})
    weights = [float(d.get("actor/num_tokens", 0.0)) for d in per_micro_batch]
    total = sum(weights)
    for k in keys:
        vals = [(float(d[k]), w) for d, w in zip(per_micro_batch, weights) if k in d]
        if k.endswith("_loss") or k == "actor/num_tokens":
            out[k] = sum(v for v, _ in vals)
        elif k == "actor/nonfinite":
            out[k] = max(v for v, _ in vals)
        elif k.endswith("_max"):
            live = [v for v, w in vals if w > 0]
            if live:
                out[k] = max(live)
        elif k.endswith("_min"):
            live = [v for v, w in vals if w > 0]
            if live:
                out[k] = min(live)
        elif total > 0:
            out[k] = sum(v * w for v, w in vals) / total
    # Without tokens a mean has nothing to average: the key is left out (not NaN), so the mean over ranks
    # (utils/metrics.reduce_over_ranks) reads only the ranks that had tokens: the uneven refill's case.
    return out
