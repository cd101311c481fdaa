"""Triton kernels for log-prob + entropy over the vocabulary, forward and backward (GPU path).

Same maths and chunking as the torch reference in training/algorithm/logprobs.py, split as
Liger-Kernel's fused linear cross-entropy does: the (chunk, H) x (H, V) matmuls stay
on cuBLAS, and Triton does what torch would need several (chunk, V) fp32
temporaries for:
  forward   one pass over each row of the chunk's logits (kept in the matmul's
            dtype, e.g. bf16): online max / sum-exp / sum-exp*z in fp32 registers
            -> logsumexp, target log-prob and entropy;
  backward  recompute the chunk's logits with one matmul, then overwrite them in
            place with dL/dlogits (one read and one write per element); cuBLAS gives
            grad_hidden = dz @ W and grad_W += dz^T @ h.
So the extra memory is one (chunk, V) buffer in the model's dtype.

Tested on CPU under TRITON_INTERPRET=1 against the torch reference
(tests/training/test_logprobs.py, in a subprocess, since the variable must be set
before triton is imported). Never run on a real GPU in this repo.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lp_ent_fwd_kernel(z_ptr, stride_z, tgt_ptr, lp_ptr, lse_ptr, ent_ptr, V, inv_temp,
                       BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    m = tl.full([BLOCK_V], -1e30, tl.float32)       # per-lane running max (finite: no inf - inf)
    s = tl.zeros([BLOCK_V], tl.float32)             # per-lane sum exp(z - m)
    w = tl.zeros([BLOCK_V], tl.float32)             # per-lane sum exp(z - m) * z
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        inside = cols < V
        x = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32) * inv_temp
        x = tl.where(inside, x, -1e30)
        m_new = tl.maximum(m, x)
        alpha = tl.exp(m - m_new)
        e = tl.where(inside, tl.exp(x - m_new), 0.0)
        s = s * alpha + e
        w = w * alpha + e * tl.where(inside, x, 0.0)
        m = m_new
    big_m = tl.max(m, axis=0)
    scale = tl.exp(m - big_m)
    total = tl.sum(s * scale, axis=0)
    lse = big_m + tl.log(total)
    tgt = tl.load(tgt_ptr + row)
    z_t = tl.load(z_row + tgt).to(tl.float32) * inv_temp
    tl.store(lp_ptr + row, z_t - lse)
    tl.store(lse_ptr + row, lse)
    tl.store(ent_ptr + row, lse - tl.sum(w * scale, axis=0) / total)


@triton.jit
def _lp_ent_bwd_kernel(z_ptr, stride_z, tgt_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, V, inv_temp,
                       HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Overwrite row `row` of the logits with dL/d(raw logits) (temperature included)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    lse = tl.load(lse_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    tgt = tl.load(tgt_ptr + row)
    if HAS_ENT:
        ent = tl.load(ent_ptr + row)
        g_ent = tl.load(g_ent_ptr + row)
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        inside = cols < V
        x = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(x - lse)
        d = -g_lp * p                                   # d logprob / dz = onehot - p
        if HAS_ENT:
            d -= g_ent * p * (x - lse + ent)            # d entropy / dz = -p (z - lse + H)
        d += tl.where(cols == tgt, g_lp, 0.0)
        tl.store(z_row + cols, (d * inv_temp).to(z_ptr.dtype.element_ty), mask=inside)


def _block_v(v: int) -> int:
    return min(triton.next_power_of_2(v), 4096)


def _logits(h, weight, bias):
    z = torch.matmul(h, weight.t())
    if bias is not None:
        z += bias                 # in place: no second (chunk, V) buffer
    return z


class _TritonLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, compute_entropy):
        n, v = hidden.shape[0], weight.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp)
        targets = targets.contiguous()
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = _logits(hidden[s:e], weight, bias).contiguous()                 # (c, V), model dtype
            _lp_ent_fwd_kernel[(e - s,)](z, z.stride(0), targets[s:e], lp[s:e], lse[s:e], ent[s:e], v,
                                         1.0 / temperature, BLOCK_V=_block_v(v))
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.compute_entropy = temperature, chunk_size, compute_entropy
        return lp, (ent if compute_entropy else torch.zeros_like(lp))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, v = hidden.shape[0], weight.shape[0]
        g_lp = g_lp.float().contiguous()
        has_ent = bool(ctx.compute_entropy and g_ent is not None)
        g_ent = g_ent.float().contiguous() if has_ent else g_lp
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=weight.device) if need_b else None
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h = hidden[s:e]
            dz = _logits(h, weight, bias).contiguous()                          # recompute, then in place
            _lp_ent_bwd_kernel[(e - s,)](dz, dz.stride(0), targets[s:e], lse[s:e], ent[s:e], g_lp[s:e],
                                         g_ent[s:e], v, 1.0 / ctx.temperature, HAS_ENT=has_ent,
                                         BLOCK_V=_block_v(v))
            if need_h:
                grad_h[s:e] = torch.matmul(dz, weight).to(hidden.dtype)
            if need_w:
                if dz.dtype == torch.float32 and h.dtype == torch.float32:
                    grad_w.addmm_(dz.t(), h)
                else:
                    grad_w += torch.matmul(dz.t(), h).float()
            if need_b:
                grad_b += dz.float().sum(0)
            del dz
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None)


def triton_logprobs_entropy(hidden, weight, targets, bias, temperature: float, chunk_size: int,
                            compute_entropy: bool):
    """(logprobs (N,), entropy (N,)) fp32; see training.algorithm.logprobs.chunked_logprobs_entropy."""
    return _TritonLogprobEntropy.apply(hidden, weight, bias, targets, temperature, chunk_size, compute_entropy)
