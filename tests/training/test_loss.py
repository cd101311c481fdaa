"""The policy loss against a per-sequence naive reference, plus the invariances the trainer relies on."""

from __future__ import annotations

import math
import random

import pytest
import torch

from training.algorithm.loss import count_normaliser, kl_penalty, policy_loss, reduce_metrics

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _seqs(seed: int, n: int | None = None):
    """Random per-sequence float64 tensors; index 0 of each sequence is a prompt token (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    n = n or rnd.randint(2, 6)
    out = []
    for _ in range(n):
        t = rnd.randint(2, 9)
        mask = (torch.rand(t, generator=g) < 0.7).long()
        mask[0] = 0
        old = -torch.rand(t, generator=g, dtype=torch.float64) * 3
        out.append({
            "mask": mask,
            "old": old,
            "lp": old + 0.6 * torch.randn(t, generator=g, dtype=torch.float64),
            "adv": torch.randn(t, generator=g, dtype=torch.float64),
            "ref": old + 0.3 * torch.randn(t, generator=g, dtype=torch.float64),
            "ent": torch.rand(t, generator=g, dtype=torch.float64) * 2,
            "roll": old + 0.2 * torch.randn(t, generator=g, dtype=torch.float64),
        })
    return out


def _pack(seqs, keys=("mask", "old", "lp", "adv", "ref", "ent", "roll")):
    cu = torch.tensor([0] + [len(s["mask"]) for s in seqs]).cumsum(0).to(torch.int32)
    return {k: torch.cat([s[k] for s in seqs]) for k in keys}, cu


def _naive(seqs, agg, normaliser, c):
    total = 0.0
    for s in seqs:
        terms = []
        for j in range(len(s["mask"])):
            if not s["mask"][j]:
                continue
            lp, old, a = float(s["lp"][j]), float(s["old"][j]), float(s["adv"][j])
            ratio = math.exp(lp - old)
            pg = max(-a * ratio, -a * min(max(ratio, 1 - c["clip_low"]), 1 + c["clip_high"]))
            if c["dual_clip"] is not None and a < 0:
                pg = min(pg, -a * c["dual_clip"])
            if c["tis_cap"] is not None:
                pg *= min(math.exp(old - float(s["roll"][j])), c["tis_cap"])
            d = float(s["ref"][j]) - lp
            kl = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[c["kl_estimator"]]
            terms.append(pg + c["kl_coef"] * kl - c["entropy_coef"] * float(s["ent"][j]))
        if agg == "seq-mean-token-mean":
            total += sum(terms) / len(terms) if terms else 0.0
        else:
            total += sum(terms)
    return total / normaliser


def _config(seed):
    rnd = random.Random(seed)
    return {"clip_low": rnd.choice([0.1, 0.2]), "clip_high": rnd.choice([0.2, 0.28]),
            "dual_clip": rnd.choice([None, 3.0]), "tis_cap": rnd.choice([None, 2.0]),
            "kl_coef": rnd.choice([0.0, 0.05]), "kl_estimator": rnd.choice(["k1", "k2", "k3"]),
            "entropy_coef": rnd.choice([0.0, 0.01])}


def _call(packed, cu, agg, normaliser, c, **over):
    kw = dict(normaliser=normaliser, agg=agg, cu_seqlens=cu, ref_logprobs=packed["ref"], entropy=packed["ent"],
              rollout_logprobs=packed["roll"], **c)
    kw.update(over)
    return policy_loss(packed["lp"], packed["old"], packed["adv"], packed["mask"], **kw)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", range(5))
def test_matches_naive_per_sequence_reference(agg, seed):
    seqs = _seqs(seed)
    c = _config(seed)
    packed, cu = _pack(seqs)
    norm = count_normaliser(packed["mask"], agg, cu) + 3          # "global": other ranks hold more
    loss, metrics = _call(packed, cu, agg, norm, c)
    assert float(loss) == pytest.approx(_naive(seqs, agg, norm, c), rel=1e-9, abs=1e-12)
    # The same numbers from 2-D padded input (one row per sequence).
    t = max(len(s["mask"]) for s in seqs)
    pad = {k: torch.stack([torch.nn.functional.pad(s[k], (0, t - len(s[k]))) for s in seqs]) for k in packed}
    loss2, _ = _call(pad, None, agg, norm, c)
    assert float(loss2) == pytest.approx(float(loss), rel=1e-12, abs=1e-14)


def test_metrics_against_loops():
    seqs = _seqs(7, n=6)
    packed, cu = _pack(seqs)
    c = dict(_config(0), clip_low=0.2, clip_high=0.28, dual_clip=2.0, tis_cap=1.5)
    _, m = _call(packed, cu, "token-mean", 10, c)
    sel = packed["mask"].bool()
    ratio = (packed["lp"] - packed["old"]).exp()[sel]
    adv = packed["adv"][sel]
    n = int(sel.sum())
    assert float(m["actor/num_tokens"]) == n
    assert min(float(m[f"actor/clipfrac_{k}"]) for k in ("high", "low", "dual")) > 0   # every branch is hit
    assert float(m["actor/clipfrac_high"]) == pytest.approx(float(((ratio > 1.28) & (adv > 0)).sum()) / n)
    assert float(m["actor/clipfrac_low"]) == pytest.approx(float(((ratio < 0.8) & (adv < 0)).sum()) / n)
    assert float(m["actor/clipfrac_dual"]) == pytest.approx(float(((ratio > 2.0) & (adv < 0)).sum()) / n)
    assert float(m["actor/ratio_max"]) == pytest.approx(float(ratio.max()))
    assert float(m["actor/ratio_min"]) == pytest.approx(float(ratio.min()))
    assert float(m["actor/ratio_mean"]) == pytest.approx(float(ratio.mean()))
    gap = (packed["roll"] - packed["old"]).abs()[sel].mean()
    assert float(m["actor/rollout_lp_gap"]) == pytest.approx(float(gap))
    assert float(m["actor/entropy"]) == pytest.approx(float(packed["ent"][sel].mean()))
    lr = (packed["lp"] - packed["old"])[sel]
    assert float(m["actor/approx_kl"]) == pytest.approx(float((lr.exp() - 1 - lr).mean()))


@pytest.mark.parametrize("agg", AGGS)
def test_shards_and_accumulation_sum_to_the_whole_batch(agg):
    """Two half-batches (two ranks, or two accumulation steps) with the global normaliser == whole batch."""
    seqs = _seqs(11, n=6)
    c = _config(3)
    whole, cu = _pack(seqs)
    norm = count_normaliser(whole["mask"], agg, cu)
    parts = [_pack(seqs[:2]), _pack(seqs[2:])]
    assert sum(count_normaliser(p["mask"], agg, pcu) for p, pcu in parts) == norm

    def loss_and_grad(packed, cu_):
        lp = packed["lp"].clone().requires_grad_(True)
        ent = packed["ent"].clone().requires_grad_(True)
        loss, _ = _call(dict(packed, lp=lp, ent=ent), cu_, agg, norm, c)
        loss.backward()
        return loss.detach(), lp.grad, ent.grad

    l_all, g_all, e_all = loss_and_grad(whole, cu)
    outs = [loss_and_grad(p, pcu) for p, pcu in parts]
    torch.testing.assert_close(outs[0][0] + outs[1][0], l_all, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat([outs[0][1], outs[1][1]]), g_all, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat([outs[0][2], outs[1][2]]), e_all, rtol=1e-12, atol=1e-14)


def test_masked_tokens_get_exactly_zero_gradient_even_with_garbage():
    seqs = _seqs(5, n=4)
    packed, cu = _pack(seqs)
    off = ~packed["mask"].bool()
    for k in ("old", "adv", "ref", "roll"):                         # garbage where the mask is 0
        packed[k] = torch.where(off, torch.tensor(float("nan"), dtype=torch.float64), packed[k])
    lp = torch.where(off, torch.tensor(float("inf"), dtype=torch.float64), packed["lp"]).requires_grad_(True)
    ent = packed["ent"].clone().requires_grad_(True)
    for agg in AGGS:
        lp.grad = ent.grad = None
        loss, m = _call(dict(packed, lp=lp, ent=ent), cu, agg, 7, dict(_config(1), kl_coef=0.1, entropy_coef=0.1))
        assert torch.isfinite(loss)
        loss.backward()
        assert (lp.grad[off] == 0).all() and (ent.grad[off] == 0).all()
        assert (lp.grad[~off] != 0).any()
        assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("key", ["lp", "old", "adv", "ref", "ent", "roll"])
def test_nonfinite_raises_or_skips(key):
    seqs = _seqs(2, n=3)
    packed, cu = _pack(seqs)
    j = int(torch.nonzero(packed["mask"])[0])
    packed[key] = packed[key].clone()
    packed[key][j] = float("nan") if key != "adv" else float("inf")
    name = {"lp": "logprobs", "old": "old_logprobs", "adv": "advantages", "ref": "ref_logprobs",
            "ent": "entropy", "roll": "rollout_logprobs"}[key]
    c = _config(0)
    with pytest.raises(ValueError, match=rf"non-finite.*'{name}'"):
        _call(packed, cu, "token-mean", 5, c)
    lp = packed["lp"].clone().requires_grad_(True)
    loss, m = _call(dict(packed, lp=lp), cu, "token-mean", 5, c, on_nonfinite="skip")
    assert float(m["actor/nonfinite"]) == 1.0 and float(loss.detach()) == 0.0
    loss.backward()                                             # still connected (ZeRO-3 needs the backward)
    assert (lp.grad == 0).all()


def test_argument_errors():
    x = torch.zeros(3, dtype=torch.float64)
    mask = torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match="unknown agg"):
        policy_loss(x, x, x, mask, normaliser=2, agg="mean")
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        policy_loss(x, x, x, mask, normaliser=2, agg="seq-mean-token-mean")
    with pytest.raises(ValueError, match="normaliser"):
        policy_loss(x, x, x, mask, normaliser=0)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(x, x, x, mask, normaliser=2, kl_coef=0.1)
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss(x, x, x, mask, normaliser=2, tis_cap=2.0)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(x, x, x, mask, normaliser=2, dual_clip=0.5)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(x, x, x[:2], mask, normaliser=2)


def test_kl_estimators_and_reduce_metrics():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), lp - ref)
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), (ref - lp).exp() - (ref - lp) - 1)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    a = {"actor/pg_loss": torch.tensor(1.0), "actor/num_tokens": torch.tensor(1.0), "actor/entropy": torch.tensor(2.0),
         "actor/ratio_max": torch.tensor(1.5), "actor/ratio_min": torch.tensor(0.5)}
    b = {"actor/pg_loss": torch.tensor(0.5), "actor/num_tokens": torch.tensor(3.0), "actor/entropy": torch.tensor(1.0),
         "actor/ratio_max": torch.tensor(1.2), "actor/ratio_min": torch.tensor(0.9)}
    dummy = {"actor/pg_loss": torch.tensor(0.0), "actor/num_tokens": torch.tensor(0.0),
             "actor/entropy": torch.tensor(0.0), "actor/ratio_max": torch.tensor(1.0),
             "actor/ratio_min": torch.tensor(1.0)}
    r = reduce_metrics([a, b, dummy])
    assert r["actor/pg_loss"] == 1.5 and r["actor/num_tokens"] == 4.0
    assert r["actor/entropy"] == pytest.approx(1.25)
    assert r["actor/ratio_max"] == 1.5 and r["actor/ratio_min"] == 0.5
