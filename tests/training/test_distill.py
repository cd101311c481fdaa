"""Dense self-distillation (training/algorithm/distill.py) against plain-torch formulas written out independently."""

from __future__ import annotations

import math

import pytest
import torch

from training.algorithm.distill import (beta_at, contrast_token_advantage, distill_kl_loss,
                              sampled_token_advantage, teacher_topk, topk_reverse_kl)

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
QWEN_VOCAB = 151_936


def _err(ref, got):
    """Max abs error relative to max(|ref|, 1), as in test_logprobs."""
    return float((ref.double() - got.double()).abs().max() / ref.double().abs().max().clamp(min=1))


def _packed(seed, lens=(5, 3, 7, 4)):
    """Packed per-token tensors; prompt tokens (mask 0) hold NaN in every teacher/student/kl slot."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    cu = torch.tensor((0,) + lens).cumsum(0).to(torch.int32)
    mask = (torch.rand(t, generator=g) < 0.7).long()
    mask[cu[:-1].long() + 1] = 1                              # every sequence has a sampled token
    mask[cu[:-1].long()] = 0
    seq_teacher = torch.tensor([True, False, True, True])[: len(lens)]
    off = ~mask.bool()
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    t_lp = torch.where(off, nan, -torch.rand(t, generator=g, dtype=torch.float64) * 3)
    s_lp = torch.where(off, nan, -torch.rand(t, generator=g, dtype=torch.float64) * 3)
    kl = torch.where(off, nan, torch.rand(t, generator=g, dtype=torch.float64))
    adv = torch.randn(t, generator=g, dtype=torch.float64)
    return dict(mask=mask, cu=cu, lens=lens, seq_teacher=seq_teacher, t_lp=t_lp, s_lp=s_lp, kl=kl, adv=adv)


def _per_token_teacher(d):
    return torch.cat([torch.full((n,), bool(h)) for n, h in zip(d["lens"], d["seq_teacher"])])


# ----------------------------------------------------------------------------- sampled-token form

@pytest.mark.parametrize("per_sequence_flag", [True, False])
def test_sampled_token_advantage_matches_loop(per_sequence_flag):
    d = _packed(0)
    d["adv"][0] = float("nan")                                  # off-mask NaN advantage is returned as is
    teacher = d["seq_teacher"] if per_sequence_flag else _per_token_teacher(d)
    out = sampled_token_advantage(d["adv"], d["t_lp"], d["s_lp"], d["mask"], 0.3, teacher, cu_seqlens=d["cu"])
    ref, tok_teacher = d["adv"].clone(), _per_token_teacher(d)
    for i in range(len(ref)):
        if d["mask"][i] and tok_teacher[i]:
            ref[i] = float(d["adv"][i]) + 0.3 * (float(d["t_lp"][i]) - float(d["s_lp"][i]))
    assert out.dtype == d["adv"].dtype
    assert torch.isnan(out).sum() == 1                        # only the original NaN advantage
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15, equal_nan=True)
    # Padded 2-D input with one (B,) flag per row gives the same numbers.
    t = max(d["lens"])
    rows = lambda x: torch.stack([torch.nn.functional.pad(s, (0, t - len(s))) for s in x.split(list(d["lens"]))])
    out2 = sampled_token_advantage(rows(d["adv"]), rows(d["t_lp"]), rows(d["s_lp"]), rows(d["mask"]), 0.3,
                                   d["seq_teacher"])
    torch.testing.assert_close(out2, rows(ref), rtol=0, atol=1e-15, equal_nan=True)


def test_beta_zero_returns_advantages_bitwise():
    d = _packed(1)
    adv = d["adv"].clone()
    adv[2] = -0.0                                              # adv + 0 * r would give +0.0
    adv[3] = 0.0
    out = sampled_token_advantage(adv, d["t_lp"], d["s_lp"], d["mask"], 0.0, None)
    assert torch.equal(out.view(torch.int64), adv.view(torch.int64))
    assert str(float(out[2])) == "-0.0"


def test_sampled_token_advantage_rejects_bad_inputs():
    d = _packed(2)
    args = (d["adv"], d["t_lp"], d["s_lp"], d["mask"])
    with pytest.raises(ValueError, match="beta"):
        sampled_token_advantage(*args, -0.1, None)
    with pytest.raises(ValueError, match="teacher_logprobs has shape"):
        sampled_token_advantage(d["adv"], d["t_lp"][:-1], d["s_lp"], d["mask"], 0.1, None)
    with pytest.raises(ValueError, match="has_teacher has shape"):
        sampled_token_advantage(*args, 0.1, torch.ones(3, dtype=torch.bool), cu_seqlens=d["cu"])
    bad = d["t_lp"].clone()
    bad[int(torch.nonzero(d["mask"])[0])] = float("nan")         # NaN on a masked teacher token
    with pytest.raises(ValueError, match=r"\['teacher_logprobs'\]"):
        sampled_token_advantage(d["adv"], bad, d["s_lp"], d["mask"], 0.1, None)


def test_contrast_token_advantage_matches_loop():
    """--distill contrast: A + beta (lp_right - lp_wrong) on masked tokens with both teachers; the student's
    log-prob plays no part; equal teacher values give exactly A."""
    d = _packed(4)
    wrong = d["s_lp"].clone()
    alike = torch.zeros_like(d["mask"], dtype=torch.bool)
    alike[::3] = True
    wrong[alike] = d["t_lp"][alike]                              # both teachers score these tokens alike
    out = contrast_token_advantage(d["adv"], d["t_lp"], wrong, d["mask"], 0.3, d["seq_teacher"], cu_seqlens=d["cu"])
    ref, both = d["adv"].clone(), _per_token_teacher(d)
    for i in range(len(ref)):
        if d["mask"][i] and both[i]:
            ref[i] = float(d["adv"][i]) + 0.3 * (float(d["t_lp"][i]) - float(wrong[i]))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)
    assert torch.equal(out[alike], d["adv"][alike])              # exactly 0 where they agree
    assert torch.equal(contrast_token_advantage(d["adv"], d["t_lp"], wrong, d["mask"], 0.0, None), d["adv"])
    bad = wrong.clone()
    bad[int(torch.nonzero(d["mask"])[0])] = float("nan")
    with pytest.raises(ValueError, match=r"\['wrong_logprobs'\]"):
        contrast_token_advantage(d["adv"], d["t_lp"], bad, d["mask"], 0.1, None)


def _head(seed, n=11, h=16, v=301, bias=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g, dtype=dtype)                   # student states
    ht = hs + 0.7 * torch.randn(n, h, generator=g, dtype=dtype)        # teacher states (privileged context)
    w = torch.randn(v, h, generator=g, dtype=dtype) * 0.5
    b = torch.randn(v, generator=g, dtype=dtype) if bias else None
    gk = torch.randn(n, generator=g, dtype=dtype)                      # upstream gradient of the per-token KL
    return hs, ht, w, b, gk


def _logits(h, w, b, temperature):
    z = h @ w.t()
    return (z + b if b is not None else z) / temperature


def _ref_topk_kl(hs, w, b, ids, t_lp, temperature):
    """Plain torch: gather the K student logits, log_softmax over them, KL against renormalised teacher."""
    a = torch.log_softmax(_logits(hs, w, b, temperature).gather(1, ids), dim=-1)
    q = torch.log_softmax(t_lp, dim=-1)
    return (a.exp() * (a - q)).sum(-1)


def _ref_full_kl(hs, ht, w, b, temperature):
    """Plain torch KL(p_S || q_T) over the whole vocabulary; the teacher is a constant."""
    a = torch.log_softmax(_logits(hs, w, b, temperature), dim=-1)
    q = torch.log_softmax(_logits(ht, w.detach(), None if b is None else b.detach(), temperature), dim=-1)
    return (a.exp() * (a - q)).sum(-1)


def _value_and_grads(fn, hs, w, b, gk, dtype):
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (hs, w) + ((b,) if b is not None else ())]
    kl = fn(leaves[0], leaves[1], leaves[2] if b is not None else None)
    return [kl.detach()] + list(torch.autograd.grad((kl * gk.to(dtype)).sum(), leaves))


@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("temperature,bias", [(1.0, True), (0.7, False)])
def test_teacher_topk_matches_full_log_softmax(chunk, temperature, bias):
    _, ht, w, b, _ = _head(4, bias=bias)
    ids, lps = teacher_topk(ht.requires_grad_(True), w, 17, b, temperature, chunk)
    full = torch.log_softmax(_logits(ht.detach().double(), w.double(), None if b is None else b.double(),
                                     temperature), dim=-1)
    ref_lp, ref_ids = full.topk(17, dim=-1)
    assert ids.dtype == torch.long and lps.dtype == torch.float32 and not lps.requires_grad
    assert torch.equal(ids, ref_ids)
    assert _err(ref_lp, lps) < 1e-5


@pytest.mark.parametrize("k", [1, 5, 40])
@pytest.mark.parametrize("temperature,bias", [(1.0, True), (0.7, False)])
def test_topk_kl_value_and_grads_match_renormalised_autograd(k, temperature, bias):
    hs, ht, w, b, gk = _head(5 + k, bias=bias)
    ids, t_lp = teacher_topk(ht, w, k, b, temperature)
    ref = _value_and_grads(lambda h, ww, bb: _ref_topk_kl(h, ww, bb, ids, t_lp.double(), temperature),
                           hs, w, b, gk, torch.float64)                              # fp64 ground truth
    results = []
    for chunk in (1, 3, None):
        got = _value_and_grads(lambda h, ww, bb: topk_reverse_kl(h, ww, ids, t_lp, bb, temperature, chunk),
                               hs, w, b, gk, torch.float32)
        for name, r, x in zip(["kl", "d_hidden", "d_weight", "d_bias"], ref, got):
            assert _err(r, x) < 1e-5, f"chunk={chunk} {name}: {_err(r, x)}"
        results.append(got)
    if k == 1:
        assert float(ref[0].abs().max()) == 0                 # one token renormalises to probability 1
    else:
        assert float(ref[0].min()) > 1e-4                     # the test would see a wrong KL
    # Chunk sizes 1 / 3 / all agree to what fp32 rounding allows. The chunks change only the order of
    # the reductions, and a sum of m products in fp32 is within gamma_m = m*u/(1 - m*u) (u = 2^-24) of
    # exact, relative to its magnitude (Higham, Accuracy and Stability, 3.1). Here a value chains three
    # reductions: logits over h, the top-K softmax over k, the weight gradient over n tokens; two results
    # each within gamma_m of exact differ by at most 2 * gamma_m. A fixed 1e-6 held on AMX Xeons and gave
    # 1.09e-6 on an AVX-512 EPYC (k=5: m = 32, bound 3.8e-6), whose fp32 kernels sum in another order.
    n, h = hs.shape
    m, u = h + k + n, 2.0 ** -24
    bound = 2 * m * u / (1 - m * u)
    for other in results[1:]:
        for name, r, x in zip(["kl", "d_hidden", "d_weight", "d_bias"], results[0], other):
            assert _err(r, x) < bound, f"{name}: chunked results differ by {_err(r, x):.3g} > fp32 bound {bound:.3g}"


@pytest.mark.parametrize("v,chunk", [(301, 4), (QWEN_VOCAB, None)])
def test_topk_kl_with_k_equal_v_is_the_full_kl(v, chunk):
    hs, ht, w, b, gk = _head(6, n=3, h=8, v=v)
    ids, t_lp = teacher_topk(ht, w, v, b, 1.0, chunk)
    ref = _value_and_grads(lambda h, ww, bb: _ref_full_kl(h, ht.double(), ww, bb, 1.0), hs, w, b, gk, torch.float64)
    got = _value_and_grads(lambda h, ww, bb: topk_reverse_kl(h, ww, ids, t_lp, bb, 1.0, chunk),
                           hs, w, b, gk, torch.float32)
    assert float(ref[0].min()) > 0.05
    for name, r, x in zip(["kl", "d_hidden", "d_weight", "d_bias"], ref, got):
        assert _err(r, x) < 1e-5, f"{name}: {_err(r, x)}"


def test_masked_rows_get_zero_gradient_even_with_nan_teacher():
    hs, ht, w, b, _ = _head(7, n=9)
    ids, t_lp = teacher_topk(ht, w, 6, b)
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1])
    teacher = torch.tensor([1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    t_lp[mask == 0] = float("nan")                             # garbage where nothing is trained
    t_lp[4] = float("nan")                                     # and on a token without a teacher
    h, ww = hs.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, metrics = distill_kl_loss(topk_reverse_kl(h, ww, ids, t_lp, b, 1.0, 2), mask, 6.0, has_teacher=teacher)
    loss.backward()
    live = mask.bool() & teacher
    assert torch.isfinite(loss) and torch.isfinite(ww.grad).all() and torch.isfinite(h.grad).all()
    assert torch.equal(h.grad[~live], torch.zeros_like(h.grad[~live]))
    assert bool((h.grad[live].abs().sum(-1) > 0).all())
    # The same loss and weight gradient from the live rows alone, in plain torch.
    w2 = w.clone().requires_grad_(True)
    ref = _ref_topk_kl(hs[live], w2, b, ids[live], t_lp[live], 1.0).sum() / 6.0
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert _err(w2.grad, ww.grad) < 1e-5
    assert float(metrics["distill/num_tokens"]) == int(live.sum())


def test_topk_rejects_bad_inputs():
    hs, ht, w, b, _ = _head(8)
    with pytest.raises(ValueError, match="k must be in"):
        teacher_topk(ht, w, w.shape[0] + 1)
    ids, t_lp = teacher_topk(ht, w, 4)
    with pytest.raises(ValueError, match="topk_ids must be in"):
        topk_reverse_kl(hs, w, ids + w.shape[0], t_lp)
    with pytest.raises(ValueError, match="shape"):
        topk_reverse_kl(hs, w, ids[:, :3], t_lp)
    with pytest.raises(ValueError, match="temperature"):
        topk_reverse_kl(hs, w, ids, t_lp, temperature=0.0)
    with pytest.raises(ValueError, match="hidden"):
        teacher_topk(ht, w[:, :3], 4)


# ----------------------------------------------------------------------------- aggregation

def _naive_kl_loss(d, agg, normaliser):
    tok_teacher, total, start = _per_token_teacher(d), 0.0, 0
    for n in d["lens"]:
        terms = [float(d["kl"][i]) for i in range(start, start + n) if d["mask"][i] and tok_teacher[i]]
        start += n
        if agg == "seq-mean-token-mean":
            total += sum(terms) / len(terms) if terms else 0.0
        else:
            total += sum(terms)
    return total / normaliser


@pytest.mark.parametrize("agg", AGGS)
def test_distill_kl_loss_matches_per_sequence_loop(agg):
    d = _packed(9)
    kl = d["kl"].clone().requires_grad_(True)
    loss, metrics = distill_kl_loss(kl, d["mask"], 7.0, agg, d["cu"], d["seq_teacher"])
    assert float(loss.detach()) == pytest.approx(_naive_kl_loss(d, agg, 7.0), rel=1e-12)
    loss.backward()
    live = d["mask"].bool() & _per_token_teacher(d)
    assert torch.equal(kl.grad[~live], torch.zeros(int((~live).sum()), dtype=kl.dtype))   # NaN never leaks
    assert bool((kl.grad[live] > 0).all())
    assert float(metrics["distill/kl"]) == pytest.approx(float(d["kl"][live].mean()), rel=1e-6)
    assert float(metrics["distill/num_tokens"]) == int(live.sum())
    assert float(metrics["distill/kl_loss"]) == pytest.approx(float(loss.detach()))
    # Padded (B, T) rows with a (B,) teacher flag give the same loss.
    t = max(d["lens"])
    rows = lambda x: torch.stack([torch.nn.functional.pad(s, (0, t - len(s))) for s in x.split(list(d["lens"]))])
    loss2, _ = distill_kl_loss(rows(d["kl"]), rows(d["mask"]), 7.0, agg, None, d["seq_teacher"])
    assert float(loss2) == pytest.approx(float(loss.detach()), rel=1e-12)


def test_distill_kl_loss_rejects_bad_inputs():
    d = _packed(10)
    with pytest.raises(ValueError, match="unknown agg"):
        distill_kl_loss(d["kl"], d["mask"], 1.0, "sum")
    with pytest.raises(ValueError, match="normaliser"):
        distill_kl_loss(d["kl"], d["mask"], 0, "token-mean")
    bad = d["kl"].clone()
    bad[int(torch.nonzero(d["mask"])[0])] = float("inf")
    with pytest.raises(ValueError, match="per_token_kl"):
        distill_kl_loss(bad, d["mask"], 1.0)


# ----------------------------------------------------------------------------- beta schedule

@pytest.mark.parametrize("step,linear,cosine", [
    (0, 0.5, 0.5), (25, 0.4, 0.1 + 0.4 * (2 + math.sqrt(2)) / 4), (50, 0.3, 0.3),
    (75, 0.2, 0.1 + 0.4 * (2 - math.sqrt(2)) / 4), (100, 0.1, 0.1), (150, 0.1, 0.1)])
def test_beta_schedules_closed_form(step, linear, cosine):
    assert beta_at(step, 100, 0.5, "constant", 0.1) == 0.5
    assert beta_at(step, 100, 0.5, "linear", 0.1) == pytest.approx(linear, abs=1e-12)
    assert beta_at(step, 100, 0.5, "cosine", 0.1) == pytest.approx(cosine, abs=1e-12)


def test_beta_schedule_rejects_bad_values():
    with pytest.raises(ValueError, match="'exp'"):
        beta_at(0, 10, 0.5, "exp")
    with pytest.raises(ValueError, match="beta=-0.1"):
        beta_at(0, 10, -0.1)
    with pytest.raises(ValueError, match="floor=-0.1"):
        beta_at(0, 10, 0.5, "linear", -0.1)
    with pytest.raises(ValueError, match="floor=0.6"):
        beta_at(0, 10, 0.5, "cosine", 0.6)
    with pytest.raises(ValueError, match="total_steps"):
        beta_at(0, 0, 0.5, "linear")
