"""The critic's pure functions against independent references: GAE over sampled tokens only (a plain
per-trajectory Python loop over the compressed list of sampled positions), token-level rewards and the
clipped value loss against their formulas, explained variance against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from training.algorithm.advantages import gae
from training.algorithm.critic import explained_variance, token_rewards, value_loss


def _random_batch(seed: int, n: int = 5, t: int = 40):
    """Trajectories with a prompt, sampled turns and retrieved spans in between (mask 0), right-padded."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, t)
    lens = []
    for i in range(n):
        length = int(torch.randint(12, t + 1, (1,), generator=g))
        lens.append(length)
        pos = int(torch.randint(2, 6, (1,), generator=g))           # prompt
        while pos < length:
            turn = int(torch.randint(1, 8, (1,), generator=g))
            mask[i, pos:min(pos + turn, length)] = 1
            pos += turn + int(torch.randint(0, 7, (1,), generator=g))   # a retrieved span (maybe empty)
    values = torch.randn(n, t, generator=g)
    rewards = torch.randn(n, generator=g)
    kl = 0.1 * torch.randn(n, t, generator=g)
    return mask, values, rewards, kl, lens


def _loop_gae(rew, val, mask, gamma, lam):
    """One trajectory, plain Python over its sampled positions only: retrieved text is not a time step."""
    pos = [k for k in range(len(mask)) if mask[k] > 0]
    adv = [0.0] * len(mask)
    last = 0.0
    for j in reversed(range(len(pos))):
        nxt = float(val[pos[j + 1]]) if j + 1 < len(pos) else 0.0
        delta = float(rew[pos[j]]) + gamma * nxt - float(val[pos[j]])
        last = delta + gamma * lam * last
        adv[pos[j]] = last
    ret = [adv[k] + float(val[k]) if mask[k] > 0 else 0.0 for k in range(len(mask))]
    return adv, ret


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_skips_retrieved_spans_like_a_plain_loop_over_sampled_tokens(seed, gamma, lam):
    mask, values, rewards, kl, _ = _random_batch(seed)
    kl_coef = 0.05 if seed % 2 else 0.0
    tok = torch.stack([token_rewards(float(r), m, k, kl_coef) for r, m, k in zip(rewards, mask, kl)])
    out = gae(token_rewards=tok, values=values, loss_mask=mask, gamma=gamma, lam=lam, whiten=False,
              all_reduce=lambda x: None)
    for i in range(mask.shape[0]):
        # token rewards by hand: -kl_coef * kl on sampled tokens, the outcome added on the last one
        m = mask[i]
        last = max(k for k in range(len(m)) if m[k] > 0)
        want_r = [(-kl_coef * float(kl[i, k]) if m[k] > 0 else 0.0) + (float(rewards[i]) if k == last else 0.0)
                  for k in range(len(m))]
        assert tok[i].tolist() == pytest.approx(want_r, abs=1e-6)
        adv, ret = _loop_gae(want_r, values[i], m, gamma, lam)
        assert out.advantages[i].tolist() == pytest.approx(adv, abs=1e-4)
        assert out.returns[i].tolist() == pytest.approx(ret, abs=1e-4)
    # the values of retrieved tokens never enter: scrambling them changes nothing
    noisy = torch.where(mask > 0, values, torch.randn_like(values) * 100)
    out2 = gae(token_rewards=tok, values=noisy, loss_mask=mask, gamma=gamma, lam=lam, whiten=False,
               all_reduce=lambda x: None)
    assert torch.allclose(out2.advantages, out.advantages) and torch.allclose(out2.returns, out.returns)


def test_gae_whitening_is_the_masked_token_mean_and_unbiased_std():
    mask, values, rewards, _, _ = _random_batch(7)
    tok = torch.stack([token_rewards(float(r), m) for r, m in zip(rewards, mask)])
    raw = gae(token_rewards=tok, values=values, loss_mask=mask, whiten=False, all_reduce=lambda x: None)
    w = gae(token_rewards=tok, values=values, loss_mask=mask, whiten=True, all_reduce=lambda x: None)
    a = raw.advantages[mask > 0].double().numpy()
    want = (a - a.mean()) / (a.std(ddof=1) + 1e-6)
    assert w.advantages[mask > 0].double().numpy() == pytest.approx(want, abs=1e-5)
    assert (w.advantages[mask == 0] == 0).all()
    assert torch.equal(w.returns, raw.returns)                 # the critic's targets are not whitened


def test_token_rewards_outcome_on_the_last_sampled_token_only():
    m = torch.tensor([0, 0, 1, 1, 0, 0, 1, 0, 0])
    r = token_rewards(2.5, m)
    assert r.tolist() == [0, 0, 0, 0, 0, 0, 2.5, 0, 0]
    assert token_rewards(1.0, torch.zeros(4)).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_value_loss_against_its_formula(clip):
    g = torch.Generator().manual_seed(5)
    t = 30
    v = torch.randn(t, generator=g, requires_grad=True)
    old = v.detach() + 0.4 * torch.randn(t, generator=g)
    ret = torch.randn(t, generator=g)
    mask = (torch.rand(t, generator=g) > 0.3).long()
    mask[0] = 1
    normaliser = 50.0
    loss, met = value_loss(v, old, ret, mask, normaliser=normaliser, clip=clip)
    total, clipped, n = 0.0, 0, 0
    for k in range(t):
        if not mask[k]:
            continue
        vk, ok, rk = float(v.detach()[k]), float(old[k]), float(ret[k])
        l1 = (vk - rk) ** 2
        vc = min(max(vk, ok - clip), ok + clip) if clip > 0 else vk
        l2 = (vc - rk) ** 2
        total += max(l1, l2)
        clipped += l2 > l1
        n += 1
    assert float(loss.detach()) == pytest.approx(0.5 * total / normaliser, rel=1e-5)
    assert float(met["critic/vf_clipfrac"]) == pytest.approx(clipped / n)
    if clip > 0:
        assert 0 < clipped < n                                    # the clip acts on some tokens, not all
    # masked tokens carry no gradient, even non-finite values there
    v2 = torch.where(mask.bool(), v, torch.full_like(v, float("nan")))
    loss2, _ = value_loss(v2, old, ret, mask, normaliser=normaliser, clip=clip)
    loss2.backward()
    assert torch.isfinite(v.grad).all() and (v.grad[mask == 0] == 0).all()
    assert float(loss2.detach()) == pytest.approx(float(loss.detach()))


def test_value_loss_of_two_halves_sums_to_the_whole():
    g = torch.Generator().manual_seed(9)
    v, old, ret = (torch.randn(40, generator=g) for _ in range(3))
    mask = torch.ones(40, dtype=torch.long)
    whole, _ = value_loss(v, old, ret, mask, normaliser=40, clip=0.3)
    a, _ = value_loss(v[:17], old[:17], ret[:17], mask[:17], normaliser=40, clip=0.3)
    b, _ = value_loss(v[17:], old[17:], ret[17:], mask[17:], normaliser=40, clip=0.3)
    assert float(a + b) == pytest.approx(float(whole), rel=1e-6)


def test_explained_variance_against_numpy():
    g = torch.Generator().manual_seed(3)
    rets = [torch.randn(10, generator=g) for _ in range(3)]
    vals = [r + 0.3 * torch.randn(10, generator=g) for r in rets]
    masks = [torch.ones(10), (torch.arange(10) > 3).float(), torch.ones(10)]
    r = np.concatenate([x[m > 0].numpy() for x, m in zip(rets, masks)]).astype(np.float64)
    v = np.concatenate([x[m > 0].numpy() for x, m in zip(vals, masks)]).astype(np.float64)
    assert explained_variance(vals, rets, masks) == pytest.approx(1 - np.var(r - v) / np.var(r), rel=1e-9)
    assert math.isnan(explained_variance([torch.zeros(5)], [torch.ones(5)], [torch.ones(5)]))


def _trajs(seed: int):
    from inference.trajectory import Trajectory
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(6):
        n = int(torch.randint(10, 20, (1,), generator=g))
        mask = [0] * 3 + [1] * (n - 3)
        mask[6:8] = [0, 0]
        out.append(Trajectory(role="proposer" if i < 2 else "solver", group_id=f"g{i % 2}", token_ids=list(range(n)),
                              loss_mask=mask, logprobs=[0.0] * n, reward=float(torch.randn((), generator=g))))
    return out


@pytest.mark.parametrize("kl_coef", [0.0, 0.2])
def test_role_advantages_mix_estimators_and_put_the_kl_in_gae_rewards(kl_coef):
    """Proposer gae, solver grpo: only the gae role reads values (the other gets None) and returns; with
    --kl_in_reward its token rewards are -coef * (old - ref) plus the outcome on the last sampled token."""
    from training.algorithm.advantages import compute_advantages, role_advantages
    from training.settings.config import AlgoArgs, CriticArgs

    trajs = _trajs(1)
    g = torch.Generator().manual_seed(2)
    old = [torch.randn(len(t.token_ids), generator=g) for t in trajs]
    ref = [o + 0.1 * torch.randn(o.shape, generator=g) for o in old]
    values = [torch.randn(len(t.token_ids), generator=g) if t.role == "proposer" else None for t in trajs]
    algo = AlgoArgs(proposer_estimator="gae", solver_estimator="grpo")
    critic = CriticArgs(gae_gamma=0.9, gae_lambda=0.8, kl_in_reward=kl_coef)
    adv, rets, _ = role_advantages(trajs, algo, critic, values=values, old=old, ref=ref, all_reduce=lambda x: None)
    pro = [i for i, t in enumerate(trajs) if t.role == "proposer"]
    raw = []
    for i in pro:
        m = trajs[i].loss_mask
        last = max(k for k in range(len(m)) if m[k])
        r = [(-kl_coef * float(old[i][k] - ref[i][k]) if m[k] else 0.0) + (trajs[i].reward if k == last else 0.0)
             for k in range(len(m))]
        a, ret = _loop_gae(r, values[i], m, 0.9, 0.8)
        raw.append(a)
        assert rets[i].tolist() == pytest.approx(ret, abs=1e-5)
    flat = np.concatenate([np.array(a)[np.array(trajs[i].loss_mask) > 0] for a, i in zip(raw, pro)])
    for a, i in zip(raw, pro):
        m = np.array(trajs[i].loss_mask) > 0
        want = np.where(m, (np.array(a) - flat.mean()) / (flat.std(ddof=1) + 1e-6), 0.0)
        assert adv[i].numpy() == pytest.approx(want, abs=1e-4)
    sol = [i for i, t in enumerate(trajs) if t.role == "solver"]
    assert all(rets[i] is None for i in sol)
    width = max(len(trajs[i].token_ids) for i in sol)
    mask = torch.zeros(len(sol), width)
    for j, i in enumerate(sol):
        mask[j, :len(trajs[i].loss_mask)] = torch.tensor(trajs[i].loss_mask, dtype=torch.float32)
    want = compute_advantages("grpo", rewards=torch.tensor([trajs[i].reward for i in sol]), loss_mask=mask,
                              group_ids=[trajs[i].group_id for i in sol])
    for j, i in enumerate(sol):
        assert torch.equal(adv[i], want.advantages[j, :len(trajs[i].token_ids)])


def test_non_finite_values_on_one_rank_raise_on_every_rank_before_the_whitening_collective():
    """Two ranks simulated through all_reduce: rank 0's critic gave a NaN on a sampled token, rank 1's values are
    finite. Both ranks must raise at the same collective (the flag all-reduce), so neither waits in whitening's."""
    torch.manual_seed(0)
    mask = torch.ones(2, 5)
    tok = torch.zeros(2, 5)
    tok[:, -1] = 1.0
    vals = [torch.rand(2, 5), torch.rand(2, 5)]
    vals[0][1, 2] = float("nan")
    flags = [None, None]
    for r in (0, 1):  # each rank's own flag, as it would all-reduce it (alone, only rank 0 raises)
        calls = []
        try:
            gae(token_rewards=tok, values=vals[r], loss_mask=mask, all_reduce=lambda x, c=calls: c.append(x.clone()))
        except ValueError:
            assert r == 0
        flags[r] = calls[0]
    total = flags[0] + flags[1]
    assert total.tolist() == [0.0, 1.0]
    for r in (0, 1):
        calls = []

        def summed(x, c=calls, r=r):  # the real sum over both ranks, then whatever follows is recorded
            c.append(x.clone())
            if len(c) == 1:
                x.add_(flags[1 - r])
        with pytest.raises(ValueError, match="non-finite values on sampled tokens of 1 rank"):
            gae(token_rewards=tok, values=vals[r], loss_mask=mask, all_reduce=summed)
        assert len(calls) == 1  # raised at the flag collective, never reached the whitening one
    # all finite: the flag collective is followed by whitening's, and the result is unchanged
    calls = []
    gae(token_rewards=tok, values=vals[1], loss_mask=mask, all_reduce=lambda x, c=calls: c.append(x.clone()))
    assert len(calls) == 2 and calls[0].tolist() == [0.0, 0.0]
