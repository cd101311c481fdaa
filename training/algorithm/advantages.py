"""Advantage estimators: small pure functions in a name registry, chosen per role.

Every estimator takes keyword arguments and returns an `AdvantageOutput` whose
tensors are per token, shape (N, T) like `loss_mask` (N sequences, right-padded
to T), and exactly 0 where `loss_mask` is 0. Outcome rewards are one scalar per
sequence, (N,), broadcast to the sampled tokens by the mask.

    out = compute_advantages("grpo", rewards=r_N, loss_mask=mask_NT, group_ids=gids)
    out.advantages   # (N, T)

Batch-wide statistics (REINFORCE++, the EMA baseline, GAE whitening) are summed
across data-parallel ranks with `all_reduce` (a callable that sums a tensor in
place), or with torch.distributed when it is initialised and `all_reduce` is None.
Group statistics (GRPO, RLOO) stay local: a group's samples live on one rank.
All statistics are taken in float64 and a group whose rewards are all equal gets
exactly 0: float32 sums of 16 x 0.9 missed the mean by 1e-7, which GRPO's std
division blew up to an advantage of 0.1. Outputs are float32.

The single-sample case matters here: with one proposer rollout per prompt
(G_p = 1) a group has one member and group baselines carry no information. Each
docstring says what the estimator does then. Use "reinforce++" or "ema" for
such a role.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from utils import dist as D

AllReduce = Callable[[torch.Tensor], None]

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., "AdvantageOutput"]] = {}


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor          # (N, T) float32, 0 where loss_mask is 0
    returns: torch.Tensor             # (N, T) value targets (GAE) or the broadcast reward
    state: dict | None = None         # new estimator state (EMA baseline); store it in the checkpoint

    def __post_init__(self):          # statistics run in float64; callers get float32
        self.advantages = self.advantages.float()
        self.returns = self.returns.float()


def register(name: str):
    def deco(fn):
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} registered twice")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return deco


def compute_advantages(name: str, **kwargs) -> AdvantageOutput:
    """Run the estimator registered under `name` (see ADVANTAGE_ESTIMATORS for the choices)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name](**kwargs)


# ----------------------------------------------------------------------------- helpers

def _all_reduce_sum(x: torch.Tensor, all_reduce: AllReduce | None) -> torch.Tensor:
    """Sum `x` over data-parallel ranks (in place); a no-op on a single process."""
    if all_reduce is not None:
        all_reduce(x)
    else:
        D.all_reduce_tensor(x, "sum")
    return x


def _check(rewards: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    mask = torch.as_tensor(loss_mask)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be one scalar per sequence, shape (N,), got {tuple(rewards.shape)}")
    if mask.ndim != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"loss_mask must be (N, T) with N={rewards.shape[0]}, got {tuple(mask.shape)}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"non-finite rewards at sequences {bad[:10]}; fix the reward function before training")
    return rewards, mask.to(rewards.device).float()


def _group_index(group_ids: Sequence[Hashable], n: int) -> tuple[torch.Tensor, int]:
    if len(group_ids) != n:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {n} sequences")
    index: dict[Hashable, int] = {}
    idx = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    return idx, len(index)


def _group_stats(rewards: torch.Tensor, group_ids: Sequence[Hashable]):
    """Per-sequence group mean, unbiased group std, group size and whether the group is flat (all
    rewards equal), in float64 (vectorised with scatter_add)."""
    r = rewards.double()
    idx, g = _group_index(group_ids, r.shape[0])
    idx = idx.to(r.device)
    zeros = torch.zeros(g, dtype=torch.float64, device=r.device)
    count = zeros.clone().scatter_add_(0, idx, torch.ones_like(r))
    total = zeros.clone().scatter_add_(0, idx, r)
    mean = total / count
    sq = zeros.clone().scatter_add_(0, idx, (r - mean[idx]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))          # unbiased, like torch.std
    hi = zeros.clone().scatter_reduce_(0, idx, r, "amax", include_self=False)
    lo = zeros.clone().scatter_reduce_(0, idx, r, "amin", include_self=False)
    return mean[idx], std[idx], count[idx], (hi == lo)[idx]


def _warn_singletons(name: str, size: torch.Tensor, what: str) -> None:
    n_single = int((size == 1).sum())
    if n_single:
        warnings.warn(
            f"{name}: {n_single} group(s) of one sample get {what}; with one rollout per prompt "
            f"(e.g. the proposer with G_p=1) use 'reinforce++' or 'ema' for that role instead",
            stacklevel=3,
        )


def _broadcast(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return seq_values[:, None] * mask                               # (N, T)


# ----------------------------------------------------------------------------- estimators

@register("grpo")
def grpo(*, rewards, loss_mask, group_ids, eps: float = 1e-6, **_) -> AdvantageOutput:
    """GRPO group normalisation: A_i = (r_i - mean_g) / (std_g + eps), std unbiased.

    Paper: https://arxiv.org/abs/2402.03300 (DeepSeekMath, section 4.1.2).
    A group with identical rewards gives 0 everywhere (no signal, no NaN).
    Singleton group: the mean is the sample itself, so the advantage is 0 and the
    sample is not learned from (verl instead uses the raw reward there, i.e. no
    baseline at all); a warning names how many groups were singletons.
    """
    r, mask = _check(rewards, loss_mask)
    mean, std, size, flat = _group_stats(r, group_ids)
    _warn_singletons("grpo", size, "advantage 0")
    adv = torch.where((size > 1) & ~flat, (r - mean) / (std + eps), torch.zeros_like(r))
    return AdvantageOutput(_broadcast(adv, mask), _broadcast(r, mask))


@register("grpo_no_std")
def grpo_no_std(*, rewards, loss_mask, group_ids, **_) -> AdvantageOutput:
    """Group mean baseline without the std division (Dr. GRPO): A_i = r_i - mean_g.

    Paper: https://arxiv.org/abs/2503.20783 (removes the std's difficulty bias).
    A group with identical rewards gives exactly 0.
    Singleton group: advantage 0 (the sample is its own baseline), with a warning.
    """
    r, mask = _check(rewards, loss_mask)
    mean, _, size, flat = _group_stats(r, group_ids)
    _warn_singletons("grpo_no_std", size, "advantage 0")
    adv = torch.where((size > 1) & ~flat, r - mean, torch.zeros_like(r))
    return AdvantageOutput(_broadcast(adv, mask), _broadcast(r, mask))


@register("rloo")
def rloo(*, rewards, loss_mask, group_ids, **_) -> AdvantageOutput:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g).

    Paper: https://arxiv.org/abs/2402.14740 (Ahmadian et al., "Back to Basics").
    A group with identical rewards gives exactly 0.
    Undefined for n = 1 (no other sample to form the baseline): such sequences get
    advantage 0, with a warning.
    """
    r, mask = _check(rewards, loss_mask)
    mean, _, size, flat = _group_stats(r, group_ids)
    _warn_singletons("rloo", size, "advantage 0 (leave-one-out is undefined for n=1)")
    adv = torch.where((size > 1) & ~flat, (r - mean) * size / (size - 1).clamp(min=1), torch.zeros_like(r))
    return AdvantageOutput(_broadcast(adv, mask), _broadcast(r, mask))


def _masked_global_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) with token-weighted mean/var summed over all ranks, in float64 (so a
    batch of equal values has exactly that mean and whitens to 0)."""
    x, mask = x.double(), mask.double()
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()])
    _all_reduce_sum(stats, all_reduce)
    s, sq, n = stats.tolist()
    if n == 0:
        return torch.zeros_like(x)
    mean = s / n
    var = max(sq / n - mean * mean, 0.0) * (n / (n - 1) if n > 1 else 1.0)   # unbiased, like OpenRLHF
    return (x - mean) / (math.sqrt(var) + eps) * mask


@register("reinforce++")
def reinforce_pp(*, rewards, loss_mask, all_reduce: AllReduce | None = None, eps: float = 1e-6,
                 **_) -> AdvantageOutput:
    """REINFORCE++: the outcome return of each token, normalised over the whole batch.

    Paper: https://arxiv.org/abs/2501.03262. With gamma = 1 and one outcome reward,
    every sampled token's return is the sequence reward r_i; advantages are
    (r_i - mu) / sigma with mu, sigma over all sampled tokens of the global batch
    (token-weighted, summed across ranks). The KL penalty lives in the loss here.
    Singleton groups are fine: the baseline is batch-wide, so this is a sound
    choice for the proposer with G_p = 1. A batch whose rewards are all equal gives 0.
    """
    r, mask = _check(rewards, loss_mask)
    returns = _broadcast(r, mask)
    return AdvantageOutput(_masked_global_whiten(returns, mask, all_reduce, eps), returns)


@register("reinforce++_baseline")
def reinforce_pp_baseline(*, rewards, loss_mask, group_ids, all_reduce: AllReduce | None = None,
                          eps: float = 1e-6, **_) -> AdvantageOutput:
    """REINFORCE++-baseline: subtract the group mean, then normalise over the global batch.

    A flat group (identical rewards) centres to exactly 0; whitening then shifts it by the batch
    mean like every other token, so it is 0 only when the whole batch is flat.

    Singleton group: the group mean is the sample, so its advantage is 0 (with a
    warning); use plain "reinforce++" when groups have one member.
    """
    r, mask = _check(rewards, loss_mask)
    mean, _, size, flat = _group_stats(r, group_ids)
    _warn_singletons("reinforce++_baseline", size, "advantage 0")
    centred = _broadcast(torch.where(flat, torch.zeros_like(r), r - mean), mask)
    return AdvantageOutput(_masked_global_whiten(centred, mask, all_reduce, eps), _broadcast(r, mask))


@register("ema")
def ema_baseline(*, rewards, loss_mask, roles: Sequence[str], state: dict | None = None,
                 decay: float = 0.95, role_names: Sequence[str] = ("proposer", "solver"),
                 all_reduce: AllReduce | None = None, **_) -> AdvantageOutput:
    """Per-role EMA baseline (SPIRAL's role-conditioned advantage estimation, RAE).

    Paper: https://arxiv.org/abs/2506.24119 (Algorithm 1). For each role p:
    b_p <- decay * b_p + (1 - decay) * mean(r over role p in this global batch),
    then A_i = r_i - b_p (update first, as in the paper). The first batch of a role
    seeds b_p with its mean; a role absent from the whole batch keeps its b_p.
    Batch sums are all-reduced over the fixed `role_names`, so every rank keeps the
    same state even when a rank holds no sample of some role.
    `state` is a plain dict {role: {"baseline": float, "count": int}} (JSON-
    serialisable: store it in the checkpoint); the new state is returned in
    `out.state` and the input dict is not modified.
    One sample per prompt is fine: the baseline is a running mean over steps.
    """
    r, mask = _check(rewards, loss_mask)
    if len(roles) != r.shape[0]:
        raise ValueError(f"roles has {len(roles)} entries for {r.shape[0]} sequences")
    unknown = sorted(set(roles) - set(role_names))
    if unknown:
        raise ValueError(f"roles {unknown} are not in role_names={list(role_names)}; pass role_names with every role")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema decay must be in [0, 1), got {decay}")
    new_state = {k: dict(v) for k, v in (state or {}).items()}
    sel = [torch.tensor([x == name for x in roles], dtype=torch.bool) for name in role_names]
    stats = torch.tensor([[float(r[s].double().sum()), float(s.sum())] for s in sel], dtype=torch.float64)
    _all_reduce_sum(stats, all_reduce)
    baseline = torch.zeros_like(r)
    for name, s, (total, count) in zip(role_names, sel, stats.tolist()):
        if count == 0:
            continue
        old = new_state.get(name)
        b = total / count if old is None else decay * old["baseline"] + (1 - decay) * total / count
        new_state[name] = {"baseline": b, "count": (0 if old is None else old["count"]) + 1}
        baseline[s] = b
    return AdvantageOutput(_broadcast(r - baseline, mask), _broadcast(r, mask), new_state)


@register("gae")
def gae(*, token_rewards, values, loss_mask, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
        all_reduce: AllReduce | None = None, eps: float = 1e-6, **_) -> AdvantageOutput:
    """Generalised advantage estimation for PPO with a critic (token-level values).

    Paper: https://arxiv.org/abs/1506.02438. `token_rewards` and `values` are (N, T)
    aligned to tokens (put the outcome reward on the last sampled token, plus any
    per-token penalty). Multi-turn: only sampled tokens (mask 1) are time steps; the
    retrieved text between turns is skipped, carrying the next sampled token's
    value and advantage through it (same rule as verl's multi-turn GAE). After the
    last sampled token the next value is 0. Returns = A + V (the critic target),
    computed before whitening. `whiten` normalises A over the global batch.
    A single sample per prompt is fine: the critic is the baseline.
    """
    mask = torch.as_tensor(loss_mask).float()
    rew = torch.as_tensor(token_rewards, dtype=torch.float32)
    val = torch.as_tensor(values, dtype=torch.float32)
    if not (rew.shape == val.shape == mask.shape) or mask.ndim != 2:
        raise ValueError(f"token_rewards {tuple(rew.shape)}, values {tuple(val.shape)} and loss_mask "
                         f"{tuple(mask.shape)} must all be the same (N, T)")
    # Every rank must agree before raising: a rank that raised alone would leave the others waiting in the
    # whitening all-reduce below. One flag per input, summed over ranks.
    bad = torch.tensor([float(not torch.isfinite(x[mask > 0]).all()) for x in (rew, val)], dtype=torch.float64)
    _all_reduce_sum(bad, all_reduce)
    for name, b in zip(("token_rewards", "values"), bad.tolist()):
        if b:
            raise ValueError(f"non-finite {name} on sampled tokens of {int(b)} rank(s); check the reward/critic")
    n, t_len = mask.shape
    next_value = torch.zeros(n)
    last_gae = torch.zeros(n)
    adv = torch.zeros_like(rew)
    for t in reversed(range(t_len)):             # loop over time, vectorised over the batch
        m = mask[:, t]
        delta = rew[:, t] + gamma * next_value - val[:, t]
        cur = delta + gamma * lam * last_gae
        adv[:, t] = cur * m
        # Unsampled tokens are not time steps: keep the carried value/advantage.
        next_value = torch.where(m > 0, val[:, t], next_value)
        last_gae = torch.where(m > 0, cur, last_gae)
    returns = (adv + val) * mask
    if whiten:
        adv = _masked_global_whiten(adv, mask, all_reduce, eps)
    return AdvantageOutput(adv, returns)


# ----------------------------------------------------------------------------- per role, from trajectories

def role_advantages(trajs, algo, critic=None, *, state: dict | None = None, values=None, old=None, ref=None,
                    all_reduce: AllReduce | None = None):
    """Per-token advantages of every trajectory, each role with its own estimator (algo.*_estimator).
    Returns (advantages, returns, new EMA state): lists aligned to `trajs`, (T_i,) float32; returns[i]
    is the critic's target for a gae role and None for the others.

    gae roles need `values` (per trajectory, from training/algorithm/critic.py; None for other roles) and
    critic = training.settings.config.CriticArgs: the outcome reward goes on the last sampled token, minus
    --kl_in_reward x (old - ref) on each sampled token when that is on. Both roles run on every rank,
    because estimators may all-reduce."""
    from training.algorithm.critic import token_rewards

    out: list = [None] * len(trajs)
    rets: list = [None] * len(trajs)
    for role in ("proposer", "solver"):
        name = getattr(algo, f"{role}_estimator")
        idx = [i for i, t in enumerate(trajs) if t.role == role]
        sub = [trajs[i] for i in idx]
        width = max([len(t.token_ids) for t in sub] + [1])
        mask = torch.zeros(len(sub), width)
        for j, t in enumerate(sub):
            mask[j, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        extra: dict = {}
        if name == "gae":
            kl_coef = critic.kl_in_reward
            tok, val = torch.zeros(len(sub), width), torch.zeros(len(sub), width)
            for j, (i, t) in enumerate(zip(idx, sub)):
                n = len(t.token_ids)
                kl = (old[i] - ref[i]) if kl_coef else None            # k1: log pi_old - log pi_ref
                tok[j, :n] = token_rewards(t.reward, mask[j, :n], kl, kl_coef)
                val[j, :n] = values[i]
            extra = dict(token_rewards=tok, values=val, gamma=critic.gae_gamma, lam=critic.gae_lambda)
        res = compute_advantages(
            name, rewards=torch.tensor([t.reward for t in sub], dtype=torch.float32), loss_mask=mask,
            group_ids=[t.group_id for t in sub], roles=[role] * len(sub), state=state, decay=algo.ema_decay,
            all_reduce=all_reduce, **extra)
        if res.state is not None:
            state = res.state
        for j, i in enumerate(idx):
            n = len(trajs[i].token_ids)
            out[i] = res.advantages[j, :n].float()
            if name == "gae":
                rets[i] = res.returns[j, :n].float()
    return out, rets, state
