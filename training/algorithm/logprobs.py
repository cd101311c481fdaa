"""Per-token log-probs and entropy without materialising the fp32 (T, V) logits.

`chunked_logprobs_entropy(hidden, weight, targets)` computes, for each row t,
    z_t = (hidden_t @ weight.T + bias) / temperature          # (V,)
    logprob_t = z_t[target_t] - logsumexp(z_t),  entropy_t = logsumexp(z_t) - sum(softmax(z_t) * z_t)
a chunk of rows at a time, keeping only (T,) statistics; the backward pass
recomputes each chunk's logits. Peak extra memory is a few (chunk, V) buffers
instead of several (T, V) ones. Temperature divides the logits exactly as the
rollout sampler did, so the log-probs are those of the sampled distribution.

Dispatch: on CUDA the Triton kernel (training/algorithm/logprobs_triton.py) does the
softmax statistics and the gradient in place on each chunk; elsewhere the torch
reference below runs.

`sequence_logprobs(model, micro_batch, ...)` runs the HF backbone on a packed row
and then this function with the lm_head weight, so full logits never exist.

Convention: returned arrays are per token, aligned to `micro_batch.input_ids[0]`:
out[i] = log p(token_i | tokens before i in its sequence), predicted from hidden
state i-1. The first token of every sequence has no prediction and gets 0; so do
tokens not computed (loss_mask 0 when only_masked=True). Mask them out.
"""

from __future__ import annotations

from contextlib import contextmanager

import math
import os

import torch

_CHUNK_ELEMENTS = 1 << 26     # auto chunk: about 64M logits (256 MB in fp32) per chunk


def auto_chunk_size(vocab_size: int, num_rows: int) -> int:
    """Largest power-of-two chunk whose (chunk, V) fp32 logits stay within ~256 MB, in [16, 4096]."""
    c = 2 ** int(math.floor(math.log2(max(1, _CHUNK_ELEMENTS // max(1, vocab_size)))))
    return max(1, min(max(16, min(c, 4096)), max(1, num_rows)))


def chunk_logits(h, weight, bias, temperature):
    """fp32 logits of one chunk of rows, divided by the temperature (a fresh buffer, safe to modify)."""
    z = torch.matmul(h, weight.t())
    if bias is not None:
        z += bias
    z = z.float()
    if temperature != 1.0:
        z /= temperature
    return z


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """Torch reference: exact to fp32 rounding; the GPU path in logprobs_triton.py mirrors it.

    In-place arithmetic keeps at most two (chunk, V) fp32 buffers alive at a time.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, compute_entropy):
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if compute_entropy else None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = chunk_logits(hidden[s:e], weight, bias, temperature)        # (c, V) fp32
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logp = z.sub_(lse[s:e, None])                                    # in place: log-softmax
            lp[s:e] = logp.gather(1, targets[s:e, None]).squeeze(1)
            if compute_entropy:
                ent[s:e] = -(logp.exp().mul_(logp)).sum(-1)
            del z, logp
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.compute_entropy = temperature, chunk_size, compute_entropy
        if compute_entropy:
            return lp, ent
        return lp, torch.zeros_like(lp)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulation across chunks, cast to the weight's dtype at the end.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        g_lp = g_lp.float()
        has_ent = ctx.compute_entropy and g_ent is not None
        n = hidden.shape[0]
        for s in range(0, n, c):
            e = min(s + c, n)
            logp = chunk_logits(hidden[s:e], weight, bias, t).sub_(lse[s:e, None])
            p = logp.exp()
            # dL/dz = g_lp (onehot - p) - g_ent p (log p + H)   [d lp/dz = onehot - p, d H/dz = -p (log p + H)]
            if has_ent:
                coef = logp.add_(ent[s:e, None]).mul_(-g_ent[s:e, None].float()).sub_(g_lp[s:e, None])
            else:
                coef = -g_lp[s:e, None]
            dz = p.mul_(coef)
            del logp, coef
            dz.scatter_add_(1, targets[s:e, None], g_lp[s:e, None])
            if t != 1.0:
                dz /= t
            h = hidden[s:e]
            if need_h:
                grad_h[s:e] = torch.matmul(dz.to(weight.dtype), weight).to(hidden.dtype)
            if need_w:
                if h.dtype == torch.float32:
                    grad_w.addmm_(dz.t(), h)
                else:
                    grad_w += torch.matmul(dz.t().to(h.dtype), h).float()
            if need_b:
                grad_b += dz.sum(0)
            del dz, p
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None)


def use_triton_kernel(hidden: torch.Tensor) -> bool:
    if os.environ.get("SSP_LOGPROB_BACKEND") == "torch":
        return False
    if os.environ.get("SSP_LOGPROB_BACKEND") == "triton":
        return True
    return hidden.is_cuda


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` and entropy per row, from hidden states and the lm_head weight.

    hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) long in [0, V).
    Returns (logprobs (N,), entropy (N,) or None), fp32, differentiable w.r.t.
    hidden, weight and bias. backend: None (Triton on CUDA, torch otherwise),
    "torch" or "triton" (env SSP_LOGPROB_BACKEND overrides None the same way).
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (N, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be (N,)={tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {temperature}")
    if weight.numel() == 0:
        raise ValueError("lm_head weight is empty: under ZeRO-3 it is partitioned; call this inside the "
                         "lm_head module's forward (sequence_logprobs does) or under GatheredParameters")
    targets = targets.long()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(f"target ids must be in [0, {weight.shape[0]}), got range "
                         f"[{int(targets.min())}, {int(targets.max())}]")
    chunk = chunk_size or auto_chunk_size(weight.shape[0], hidden.shape[0])
    use_triton = use_triton_kernel(hidden) if backend is None else backend == "triton"
    if use_triton:
        from training.algorithm.logprobs_triton import triton_logprobs_entropy
        lp, ent = triton_logprobs_entropy(hidden, weight, targets, bias, float(temperature), chunk, compute_entropy)
    else:
        lp, ent = _ChunkedLogprobEntropy.apply(hidden, weight, bias, targets, float(temperature), chunk,
                                               compute_entropy)
    return lp, (ent if compute_entropy else None)


def full_logprobs_entropy(hidden, weight, targets, bias=None, temperature: float = 1.0, compute_entropy=True):
    """Plain reference: fp32 (N, V) logits and log_softmax. For tests and the memory benchmark."""
    z = torch.matmul(hidden, weight.t())
    if bias is not None:
        z = z + bias
    logp = torch.log_softmax(z.float() / temperature, dim=-1)
    lp = logp.gather(1, targets.long()[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1) if compute_entropy else None
    return lp, ent


# ----------------------------------------------------------------------------- model level

def _target_positions(mb, only_masked: bool) -> torch.Tensor:
    """Token positions i whose log-prob we compute: not a sequence start (and loss-masked if asked)."""
    t = mb.num_tokens
    device = mb.input_ids.device
    keep = torch.ones(t, dtype=torch.bool, device=device)
    keep[mb.cu_seqlens[:-1].long().to(device)] = False
    if only_masked and "loss_mask" in mb.tensors:
        keep &= mb.tensors["loss_mask"].to(device).bool()
    pos = torch.nonzero(keep).flatten()
    if pos.numel() == 0:
        # Still run the head on one row (discarded): under ZeRO-3 every rank must call it.
        pos = torch.zeros(1, dtype=torch.long, device=device)
    return pos


def sequence_logprobs(
    model: torch.nn.Module,
    micro_batch,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    *,
    only_masked: bool = True,
    chunk_size: int | None = None,
    varlen_sdpa: bool = True,
    head_extra=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of a packed micro-batch under an HF causal LM.

    model: the HF *ForCausalLM module (under DeepSpeed pass `engine.module`).
      Runs `model.base_model` (the decoder with its final norm) on the packed row,
      then the lm_head through the chunked function, so (T, V) logits never exist.
      Final-logit softcapping or logit scaling (Gemma2, Cohere) is not supported.
    micro_batch: a training.algorithm.packing.MicroBatch.
    only_masked: compute only where tensors["loss_mask"] is 1 (the lm_head on prompt
      and retrieved tokens is wasted work); other positions return 0.
    varlen_sdpa: for a model on "sdpa", switch it (permanently, see
      training.algorithm.packing.enable_varlen_sdpa) to one causal SDPA call per sequence, which
      costs sum(L_i^2) instead of T^2; False keeps the explicit 4D block mask.
    head_extra: optional fn(rows, weight, bias, pos, valid) run inside the same swapped
      lm_head forward (one ZeRO-3 gather), on the rows that predict token positions `pos`
      (`valid`: not the keep-alive row); its result is returned third, as it is (the
      top-K distillation term, training/algorithm/teacher.py).
    Returns (logprobs (T,), entropy (T,) or None[, head_extra's result]), fp32, aligned to
    input_ids[0] (see the module docstring), with the graph attached when grad is enabled.

    ZeRO-3: the lm_head weight is partitioned outside its module's forward. We
    therefore call the lm_head *module* with its forward swapped for the chunked
    function for the duration of the call, so DeepSpeed's module hooks gather the
    weight for the forward and again for the backward, like any nn.Linear. Every
    rank must call this the same number of times (dummy micro-batches included).
    """
    rows, pos, valid = backbone_rows(model, micro_batch, only_masked=only_masked, varlen_sdpa=varlen_sdpa)
    head = model.get_output_embeddings()
    ids = micro_batch.input_ids[0]
    extra = None if head_extra is None else (lambda x, w, b: head_extra(x, w, b, pos, valid))
    out = _call_head(head, rows, ids.index_select(0, pos), temperature, chunk_size, compute_entropy, extra)
    lp_sel, ent_sel = out[0], out[1]
    # Positions that are sequence starts (only the ZeRO-3 keep-alive row) are zeroed by `valid`.
    t = micro_batch.num_tokens
    zero = torch.zeros((), device=lp_sel.device)
    lp = torch.zeros(t, device=lp_sel.device).index_add(0, pos, torch.where(valid, lp_sel, zero))
    ent = None
    if compute_entropy:
        ent = torch.zeros(t, device=lp_sel.device).index_add(0, pos, torch.where(valid, ent_sel, zero))
    return (lp, ent) if head_extra is None else (lp, ent, out[2])


def backbone_rows(model: torch.nn.Module, micro_batch, *, only_masked: bool = True, varlen_sdpa: bool = True):
    """The decoder's part of `sequence_logprobs`: (rows (P, H), pos (P,), valid (P,)), rows[j] being the
    hidden state that predicts token position pos[j]; valid is False only on the keep-alive row (a
    sequence start, computed so every ZeRO-3 rank calls the head). See sequence_logprobs."""
    cfg = model.config
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise ValueError(f"model config has {attr}={getattr(cfg, attr)}; sequence_logprobs does not apply it")
    from training.algorithm.packing import enable_varlen_sdpa, model_inputs

    if varlen_sdpa:
        enable_varlen_sdpa(model)
    backbone = model.base_model
    weight_dtype = next(backbone.parameters()).dtype
    kwargs = model_inputs(micro_batch, cfg._attn_implementation, weight_dtype)
    hidden = backbone(**kwargs).last_hidden_state[0]                          # (T, H)
    pos = _target_positions(micro_batch, only_masked)                         # token positions i
    rows = hidden.index_select(0, (pos - 1).clamp(min=0))                     # state i-1 predicts token i
    valid = ~torch.isin(pos, micro_batch.cu_seqlens[:-1].long().to(pos.device))
    return rows, pos, valid


def _call_head(head: torch.nn.Module, rows, targets, temperature, chunk_size, compute_entropy, extra=None):
    """Run the chunked function *as* head's forward, so module hooks (ZeRO-3 gathering) fire.
    `extra(x, weight, bias)`, if given, runs in the same forward; its result is returned third."""
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"output embedding {type(head).__name__} has no weight tensor; expected an nn.Linear lm_head")

    def fused_forward(x):
        bias = getattr(head, "bias", None)
        out = chunked_logprobs_entropy(x, head.weight, targets, bias, temperature, chunk_size, compute_entropy)
        return out if extra is None else (*out, extra(x, head.weight, bias))

    with forward_swapped(head, fused_forward):
        return head(rows)


@contextmanager
def forward_swapped(module: torch.nn.Module, fn):
    """Make `fn` the module's forward for the duration, so calling the module runs `fn` inside
    the module's hooks (ZeRO-3 gathering; for a DeepSpeed engine, its forward prologue)."""
    original = module.__dict__.get("forward")
    module.forward = fn
    try:
        yield module
    finally:
        if original is None:
            del module.forward
        else:
            module.forward = original
