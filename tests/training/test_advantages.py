"""Advantage estimators: vectorised versions against plain loops, over random shapes and seeds."""

from __future__ import annotations

import json
import math
import random
import statistics
import warnings

import pytest
import torch

from training.algorithm.advantages import ADVANTAGE_ESTIMATORS, compute_advantages

SEEDS = range(6)


def _batch(seed: int, singletons: bool = False):
    """Random rewards, right-padded masks with a prompt prefix and masked-out gaps, and group ids."""
    g = random.Random(seed)
    n_groups = g.randint(1, 5)
    gids, roles = [], []
    for k in range(n_groups):
        size = 1 if singletons and k % 2 == 0 else g.randint(2, 5)
        gids += [f"g{k}"] * size
        roles += [g.choice(["proposer", "solver"])] * size
    order = list(range(len(gids)))
    g.shuffle(order)                                    # groups are not contiguous
    gids = [gids[i] for i in order]
    roles = [roles[i] for i in order]
    n, t = len(gids), g.randint(4, 12)
    mask = torch.zeros(n, t)
    for i in range(n):
        length = g.randint(2, t)
        for j in range(1, length):
            mask[i, j] = float(g.random() < 0.7)
    rewards = torch.tensor([g.choice([0.0, 1.0, 0.25, g.random()]) for _ in range(n)])
    return rewards, mask, gids, roles


def _naive_group(rewards, gids):
    groups: dict[str, list[float]] = {}
    for r, gi in zip(rewards.tolist(), gids):
        groups.setdefault(gi, []).append(r)
    return groups


def _broadcast(seq, mask):
    return torch.tensor([[seq[i] * float(mask[i, j]) for j in range(mask.shape[1])] for i in range(len(seq))])


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_family_and_rloo_match_loops(seed):
    rewards, mask, gids, _ = _batch(seed, singletons=seed % 2 == 1)
    groups = _naive_group(rewards, gids)
    exp = {"grpo": [], "grpo_no_std": [], "rloo": []}
    for r, gi in zip(rewards.tolist(), gids):
        xs = groups[gi]
        n = len(xs)
        mean = sum(xs) / n
        std = statistics.stdev(xs) if n > 1 else 0.0
        exp["grpo"].append((r - mean) / (std + 1e-6) if n > 1 else 0.0)
        exp["grpo_no_std"].append(r - mean if n > 1 else 0.0)
        exp["rloo"].append(r - (sum(xs) - r) / (n - 1) if n > 1 else 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, want in exp.items():
            out = compute_advantages(name, rewards=rewards, loss_mask=mask, group_ids=gids)
            torch.testing.assert_close(out.advantages, _broadcast(want, mask), atol=1e-5, rtol=1e-5)
            assert (out.advantages[mask == 0] == 0).all()


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "rloo"])
def test_singleton_groups_get_zero_and_warn(name):
    rewards = torch.tensor([1.0, 0.0, 1.0])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1]], dtype=torch.float32)
    with pytest.warns(UserWarning, match="group"):
        out = compute_advantages(name, rewards=rewards, loss_mask=mask, group_ids=["a", "b", "c"])
    assert torch.count_nonzero(out.advantages) == 0


def _naive_whiten(values, mask):
    xs = [values[i][j] for i in range(len(values)) for j in range(len(values[i])) if mask[i, j] > 0]
    mean = sum(xs) / len(xs)
    std = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return [[(values[i][j] - mean) / (std + 1e-6) * float(mask[i, j]) for j in range(len(values[i]))]
            for i in range(len(values))]


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_matches_loop(seed):
    rewards, mask, gids, _ = _batch(seed, singletons=True)
    t = mask.shape[1]
    want = _naive_whiten([[r] * t for r in rewards.tolist()], mask)
    out = compute_advantages("reinforce++", rewards=rewards, loss_mask=mask)
    torch.testing.assert_close(out.advantages, torch.tensor(want), atol=1e-5, rtol=1e-5)
    groups = _naive_group(rewards, gids)
    centred = [[r - sum(groups[gi]) / len(groups[gi])] * t for r, gi in zip(rewards.tolist(), gids)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compute_advantages("reinforce++_baseline", rewards=rewards, loss_mask=mask, group_ids=gids)
    torch.testing.assert_close(out.advantages, torch.tensor(_naive_whiten(centred, mask)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_reinforce_pp_sharded_equals_global(seed):
    """Two ranks simulated in one process: each all-reduce adds the other shard's statistics."""
    rewards, mask, _, _ = _batch(seed)
    n = len(rewards)
    if n < 2:
        pytest.skip("need two shards")
    cut = n // 2
    shards = [(rewards[:cut], mask[:cut]), (rewards[cut:], mask[cut:])]
    local = []
    for r, m in shards:                                   # capture each shard's local statistics
        compute_advantages("reinforce++", rewards=r, loss_mask=m, all_reduce=lambda x: local.append(x.clone()))
    parts = []
    for k, (r, m) in enumerate(shards):
        other = local[1 - k]
        parts.append(compute_advantages("reinforce++", rewards=r, loss_mask=m,
                                        all_reduce=lambda x, o=other: x.add_(o)).advantages)
    whole = compute_advantages("reinforce++", rewards=rewards, loss_mask=mask).advantages
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-6, rtol=1e-6)


def test_ema_baseline_matches_loop_and_serialises():
    decay = 0.9
    state = None
    naive: dict[str, float] = {}
    for step in range(5):
        rewards, mask, _, roles = _batch(100 + step)
        out = compute_advantages("ema", rewards=rewards, loss_mask=mask, roles=roles, state=state, decay=decay)
        for role in set(roles):
            rs = [r for r, ro in zip(rewards.tolist(), roles) if ro == role]
            m = sum(rs) / len(rs)
            naive[role] = m if role not in naive else decay * naive[role] + (1 - decay) * m
        want = [r - naive[ro] for r, ro in zip(rewards.tolist(), roles)]
        torch.testing.assert_close(out.advantages, _broadcast(want, mask), atol=1e-5, rtol=1e-5)
        state = json.loads(json.dumps(out.state))          # checkpoint round trip
        for role, b in naive.items():
            assert math.isclose(state[role]["baseline"], b, rel_tol=1e-9, abs_tol=1e-12)


def test_ema_single_sample_per_prompt_learns():
    """The proposer case (G_p = 1): the baseline is over steps, so advantages are not all zero."""
    state = {"proposer": {"baseline": 0.5, "count": 3}}
    out = compute_advantages("ema", rewards=torch.tensor([1.0]), loss_mask=torch.tensor([[0.0, 1.0]]),
                             roles=["proposer"], state=state, decay=0.5)
    assert out.advantages[0, 1] == pytest.approx(1.0 - 0.75)
    assert state["proposer"]["baseline"] == 0.5                 # input not modified


def _naive_gae(rew, val, mask, gamma, lam):
    n, t = mask.shape
    adv = [[0.0] * t for _ in range(n)]
    ret = [[0.0] * t for _ in range(n)]
    for i in range(n):
        steps = [j for j in range(t) if mask[i, j] > 0]          # only sampled tokens are time steps
        last = 0.0
        for k in reversed(range(len(steps))):
            j = steps[k]
            nv = float(val[i, steps[k + 1]]) if k + 1 < len(steps) else 0.0
            delta = float(rew[i, j]) + gamma * nv - float(val[i, j])
            last = delta + gamma * lam * last
            adv[i][j] = last
            ret[i][j] = last + float(val[i, j])
    return torch.tensor(adv), torch.tensor(ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_loop(seed):
    _, mask, _, _ = _batch(seed)
    g = torch.Generator().manual_seed(seed)
    rew = torch.randn(mask.shape, generator=g) * mask
    val = torch.randn(mask.shape, generator=g)
    gamma, lam = [(1.0, 0.95), (0.99, 1.0), (0.9, 0.5)][seed % 3]
    want_adv, want_ret = _naive_gae(rew, val, mask, gamma, lam)
    out = compute_advantages("gae", token_rewards=rew, values=val, loss_mask=mask, gamma=gamma, lam=lam,
                             whiten=False)
    torch.testing.assert_close(out.advantages, want_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.returns, want_ret, atol=1e-5, rtol=1e-5)
    white = compute_advantages("gae", token_rewards=rew, values=val, loss_mask=mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(white.advantages, torch.tensor(_naive_whiten(want_adv.tolist(), mask)),
                               atol=1e-4, rtol=1e-4)


def test_registry_and_errors():
    assert {"grpo", "grpo_no_std", "rloo", "reinforce++", "reinforce++_baseline", "ema", "gae"} <= set(
        ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'"):
        compute_advantages("ppo2", rewards=torch.zeros(1), loss_mask=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="non-finite rewards"):
        compute_advantages("reinforce++", rewards=torch.tensor([float("nan")]), loss_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="role_names"):
        compute_advantages("ema", rewards=torch.zeros(1), loss_mask=torch.ones(1, 2), roles=["critic"])


# ----------------------------------------------------------------------------- flat groups (issue 19)

GROUP_ESTIMATORS = ["grpo", "grpo_no_std", "rloo", "reinforce++_baseline"]
FLAT = [(n, v) for n in (8, 16) for v in (0.1, 0.9, 0.64)]


def _loop64(name: str, rewards: list[float], gids: list[str], eps: float = 1e-6) -> list[float]:
    """Per-sequence advantage of a group estimator by a plain float64 loop (one token per sequence)."""
    groups: dict[str, list[float]] = {}
    for r, g in zip(rewards, gids):
        groups.setdefault(g, []).append(r)
    out = []
    for r, g in zip(rewards, gids):
        xs = groups[g]
        n, mean = len(xs), sum(xs) / len(xs)
        if n == 1:
            out.append(0.0)
        elif name == "grpo":
            out.append((r - mean) / (statistics.stdev(xs) + eps))
        elif name in ("grpo_no_std", "reinforce++_baseline"):
            out.append(r - mean)
        elif name == "rloo":
            out.append(r - (sum(xs) - r) / (n - 1))
    if name == "reinforce++_baseline":                   # then whitened over the batch
        mean = sum(out) / len(out)
        std = statistics.stdev(out) if len(out) > 1 else 0.0
        out = [(x - mean) / (std + eps) for x in out]
    return out


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("n,value", FLAT)
def test_flat_group_gets_exactly_zero(name, n, value):
    """A group whose rewards are all equal carries no signal: advantage exactly 0 (float32 group means
    once gave 16 x 0.9 an advantage of +0.106 under GRPO, and 8 x 0.9 one of -0.056)."""
    rewards = torch.full((n,), value)
    gids = ["q"] * n
    mask = torch.ones(n, 3)
    out = compute_advantages(name, rewards=rewards, loss_mask=mask, group_ids=gids)
    want = _loop64(name, rewards.tolist(), gids)
    assert want == [0.0] * n
    assert out.advantages.dtype == torch.float32
    assert torch.count_nonzero(out.advantages) == 0, out.advantages[:, 0].tolist()


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "rloo"])
def test_flat_groups_beside_informative_ones_stay_zero(name):
    g = torch.Generator().manual_seed(0)
    rewards, gids = [], []
    for k, (n, v) in enumerate(FLAT):
        rewards += [v] * n + torch.rand(n, generator=g).tolist()
        gids += [f"flat{k}"] * n + [f"mixed{k}"] * n
    rewards = torch.tensor(rewards)
    mask = torch.ones(len(gids), 2)
    out = compute_advantages(name, rewards=rewards, loss_mask=mask, group_ids=gids)
    flat = torch.tensor([gi.startswith("flat") for gi in gids])
    assert torch.count_nonzero(out.advantages[flat]) == 0
    want = torch.tensor(_loop64(name, rewards.tolist(), gids))
    torch.testing.assert_close(out.advantages[:, 0], want.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n,value", FLAT)
def test_reinforce_pp_flat_batch_is_zero(n, value):
    """REINFORCE++'s docstring: a batch whose rewards are all equal gives 0 (its float32 batch sums
    once gave 16 x 0.9 an advantage of 0.119)."""
    out = compute_advantages("reinforce++", rewards=torch.full((n,), value), loss_mask=torch.ones(n, 3))
    assert torch.count_nonzero(out.advantages) == 0, out.advantages[:, 0].tolist()


def test_reinforce_pp_baseline_batch_of_flat_groups_is_zero():
    """Every group flat (at different values): every centred reward is 0, so whitening has nothing to scale."""
    rewards, gids = [], []
    for k, (n, v) in enumerate(FLAT):
        rewards += [v] * n
        gids += [f"g{k}"] * n
    out = compute_advantages("reinforce++_baseline", rewards=torch.tensor(rewards),
                             loss_mask=torch.ones(len(gids), 3), group_ids=gids)
    assert torch.count_nonzero(out.advantages) == 0, out.advantages[:, 0].tolist()


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("seed", range(4))
def test_group_estimators_match_float64_loop(name, seed):
    """Random groups of 8 and 16 (shuffled, some flat) against the float64 loop, to float32 precision."""
    g = random.Random(seed)
    rewards, gids = [], []
    for k in range(6):
        n = g.choice([8, 16])
        kind = g.choice(["rand", "binary", "flat"])
        v = g.choice([0.1, 0.9, 0.64])
        rewards += [g.random() if kind == "rand" else float(g.random() < 0.5) if kind == "binary" else v
                    for _ in range(n)]
        gids += [f"g{k}"] * n
    order = list(range(len(gids)))
    g.shuffle(order)
    rewards = torch.tensor([rewards[i] for i in order])
    gids = [gids[i] for i in order]
    out = compute_advantages(name, rewards=rewards, loss_mask=torch.ones(len(gids), 1), group_ids=gids)
    want = torch.tensor(_loop64(name, rewards.tolist(), gids), dtype=torch.float64)
    torch.testing.assert_close(out.advantages[:, 0].double(), want, atol=1e-6, rtol=1e-5)
