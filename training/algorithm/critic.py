"""The PPO critic: token-level rewards, the clipped value loss, the value model and its update.

    values  = critic_values(critic, trajs)                 # per sampled token, packed, no grad
    r_tok   = token_rewards(reward, mask, kl)              # outcome on the last sampled token (- KL)
    adv, R  = advantages.gae(r_tok, values, mask)          # retrieved spans are not time steps
    critic_update(critic, trajs, values, R)                # clipped value loss, global normaliser

Pure functions first (tested against their formulas and a plain per-trajectory loop in
tests/training/test_critic.py); the engine parts below them.

The value model follows veRL's critic: `AutoModelForTokenClassification` with one label over the
actor's start (or --critic_model_path), dropout off. Its `score` head is an nn.Linear(hidden, 1)
with a bias, initialised as transformers initialises a new head (weight ~ N(0,
initializer_range), bias 0): what veRL's critic gets from the same class (DeepSpeed-Chat's and
OpenRLHF's heads are the same Linear without the bias). Values are
aligned like log-probs: v[i] is the head on hidden state i-1, the state in which token i was
sampled (veRL's `values[:, -response_length - 1:-1]`); the first token of a sequence gets 0.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch

from training.algorithm.lr_schedule import set_critic_lr
from training.algorithm.step_batch import RETURNS, VALUES, StepBatch, put_missing
from utils import dist as D


# ----------------------------------------------------------------------------- pure functions

def token_rewards(reward: float, loss_mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """One trajectory's per-token rewards, (T,) float32: the outcome `reward` on the last sampled token
    (loss_mask 1), minus kl_coef * kl on every sampled token when `kl` is given (the KL-in-reward
    form of DeepSpeed-Chat and Search-R1: kl = log pi_old - log pi_ref, their k1 estimate).
    A trajectory with no sampled token gets all zeros."""
    mask = torch.as_tensor(loss_mask).float()
    out = torch.zeros_like(mask)
    if kl is not None and kl_coef:
        out = out - kl_coef * torch.where(mask > 0, kl.float(), torch.zeros(()))
    idx = torch.nonzero(mask > 0).flatten()
    if idx.numel():
        out[idx[-1]] += float(reward)
    return out


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor, *,
               normaliser: float, clip: float, agg: str = "token-mean",
               cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (veRL's compute_value_loss with cliprange_value = `clip`):

        v_clip = old + clamp(v - old, -clip, clip)
        loss   = 0.5 * agg(max((v - R)^2, (v_clip - R)^2))  over sampled tokens

    normalised by `normaliser`, a global count of the same kind as the policy loss's (training/algorithm/loss.py:
    --loss_agg's tokens or sequences, summed over micro-batches and ranks; the critic's counts only the
    trajectories of gae roles, the ones it trains on), so this micro-batch's loss is its share of the
    step's loss. clip <= 0 turns the clipping off.
    Metrics: critic/value_loss (this micro-batch's share), critic/vf_clipfrac (share of sampled tokens
    where the clipped term is the larger), critic/values_mean, critic/num_tokens."""
    from training.algorithm.loss import AGG_MODES, aggregate_tokens, token_segments
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; choose one of {AGG_MODES}")
    if float(normaliser) <= 0:
        raise ValueError(f"normaliser must be the positive global count, got {normaliser}")
    m = loss_mask.bool()
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        if x.shape != m.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, loss_mask has {tuple(m.shape)}")
    z = torch.zeros((), dtype=values.dtype, device=values.device)
    v, old, ret = (torch.where(m, x, z) for x in (values, old_values.detach(), returns.detach()))
    mf = m.to(values.dtype)
    l1 = (v - ret).square()
    if clip > 0:
        v_clip = old + (v - old).clamp(-clip, clip)
        l2 = (v_clip - ret).square()
        per_tok = torch.maximum(l1, l2)
    else:
        l2, per_tok = l1, l1
    seg = token_segments(m, cu_seqlens) if agg != "token-mean" else None
    loss = 0.5 * aggregate_tokens(per_tok * mf, mf, agg, normaliser, seg)
    with torch.no_grad():
        n = mf.sum()
        denom = n.clamp(min=1)
        metrics = {"critic/value_loss": loss.detach(), "critic/num_tokens": n,
                   "critic/vf_clipfrac": ((l2 > l1).to(mf.dtype) * mf).sum() / denom,
                   "critic/values_mean": (v * mf).sum() / denom}
    return loss, {k: x.detach().float() for k, x in metrics.items()}


def explained_variance(values: Sequence[torch.Tensor], returns: Sequence[torch.Tensor],
                       masks: Sequence[torch.Tensor]) -> float:
    """1 - Var(R - V) / Var(R) over every sampled token of the global batch (all-reduced sums, float64);
    nan when the returns do not vary. 1 = the critic predicts the returns, 0 = no better than their mean."""
    s = torch.zeros(5, dtype=torch.float64)
    for v, r, m in zip(values, returns, masks):
        m = torch.as_tensor(m).bool()
        v, r = v.double()[m], r.double()[m]
        d = r - v
        s += torch.stack([r.sum(), (r * r).sum(), d.sum(), (d * d).sum(), torch.tensor(float(m.sum()))])
    D.all_reduce_tensor(s, "sum")
    sr, srr, sd, sdd, n = s.tolist()
    if n < 2:
        return float("nan")
    var_r, var_d = srr / n - (sr / n) ** 2, sdd / n - (sd / n) ** 2
    return 1.0 - var_d / var_r if var_r > 1e-12 else float("nan")


# ----------------------------------------------------------------------------- the value model

def load_value_model(path: str, dtype: torch.dtype, attn_implementation: str):
    """veRL's critic: AutoModelForTokenClassification(num_labels=1) from a causal LM folder, dropout off
    (a dropout of 0.1 is transformers' default for the head and would make values random in train mode).
    Under an alive HfDeepSpeedConfig (ZeRO-3) from_pretrained partitions while loading."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    conf = AutoConfig.from_pretrained(path)
    conf.num_labels, conf.classifier_dropout, conf.use_cache = 1, 0.0, False
    model = AutoModelForTokenClassification.from_pretrained(path, config=conf, dtype=dtype,
                                                            attn_implementation=attn_implementation)
    model.config.use_cache = False  # a KV cache disables packed-sequence handling (training/algorithm/packing.py)
    return model


def sequence_values(model, micro_batch) -> torch.Tensor:
    """Per-token values (T,) fp32 of a packed micro-batch, aligned to input_ids[0] like log-probs:
    v[i] = score(hidden[i-1]); 0 at each sequence start. The backbone and the head are called as
    modules, so ZeRO-3 hooks gather their weights (run it as the engine's forward: engine_values)."""
    from training.algorithm.packing import enable_varlen_sdpa, model_inputs

    enable_varlen_sdpa(model)
    backbone = model.base_model
    kwargs = model_inputs(micro_batch, model.config._attn_implementation, next(backbone.parameters()).dtype)
    hidden = backbone(**kwargs).last_hidden_state[0]                                 # (T, H)
    raw = model.score(hidden)[:, 0].float()                                          # (T,)
    v = torch.cat([raw.new_zeros(1), raw[:-1]])                                      # state i-1 values token i
    starts = micro_batch.cu_seqlens[:-1].long().to(v.device)
    return v.index_fill(0, starts, 0.0)


def engine_values(engine, micro_batch) -> torch.Tensor:
    """`sequence_values` run *as* DeepSpeedEngine.forward (the ZeRO-3 accumulation fact: training/algorithm/micro_batches.py)."""
    from training.algorithm.logprobs import forward_swapped

    model = engine.module
    micro_batch = micro_batch.to(engine.device)
    with forward_swapped(model, lambda: sequence_values(model, micro_batch)):
        return engine()


@torch.no_grad()
def critic_values(engine, trajs, micro_token_budget: int, batch=None) -> list[torch.Tensor]:
    """Each trajectory's per-token values (T_i,) under the critic; collective (equal micro-batch counts).
    batch: a training.algorithm.step_batch.StepBatch of `trajs` whose micro-batches the forward reuses (the values
    land in its VALUES column), or None to pack here."""
    if batch is None:
        batch = StepBatch(trajs, micro_token_budget)
    was_training = engine.module.training
    engine.module.eval()
    batch.put_packed(VALUES, [engine_values(engine, mb).float().cpu() for mb in batch.micro_batches])
    engine.module.train(was_training)
    return batch.column(VALUES)


def critic_update(engine, trajs, old_values, returns, algo, *, micro_token_budget: int, value_clip: float,
                  seed: int = 0, batch=None) -> tuple[dict[str, float], int, int]:
    """The critic's optimizer steps of one SSP step: --ppo_epochs x --ppo_mini_batches, the same split
    of the trajectories as the actor's (training.algorithm.update.split_mini_batches, same seed). Returns (this
    rank's metrics: critic/value_loss summed over micro-batches and averaged over optimizer steps, the
    rest token-weighted means; optimizer steps taken; steps skipped as non-finite on some rank). Collective.
    batch: the training.algorithm.step_batch.StepBatch of `trajs` the values were computed on (reused with one
    mini-batch, whose split is all of them in every epoch), or None to pack here."""
    from training.algorithm.loss import count_normaliser
    from training.algorithm.micro_batches import accumulate
    from training.algorithm.update import optimizer_step, split_mini_batches

    if batch is None:
        batch = StepBatch(trajs, micro_token_budget)
    elif len(batch) != len(trajs):
        raise ValueError(f"the critic's batch holds {len(batch)} trajectories, its update got {len(trajs)}")
    columns = {VALUES: old_values, RETURNS: returns}
    engine.train()
    per_step, n_steps, n_skipped = [], 0, 0
    for epoch in range(algo.ppo_epochs):
        for mini in split_mini_batches(trajs, algo.ppo_mini_batches, seed + epoch):
            view = batch if algo.ppo_mini_batches == 1 else batch.view(mini)   # the config decides, on every rank
            put_missing(view, columns, mini)
            mbs = view.micro_batches
            local = sum(count_normaliser(mb.tensors["loss_mask"], algo.loss_agg, mb.cu_seqlens) for mb in mbs)
            normaliser = D.all_reduce_sum([local])[0]
            if normaliser == 0:
                continue

            def loss_fn(mb, v, _):
                t = mb.tensors
                return value_loss(v, t[VALUES], t[RETURNS], t["loss_mask"], normaliser=normaliser,
                                  clip=value_clip, agg=algo.loss_agg, cu_seqlens=mb.cu_seqlens)

            per_step.append(accumulate(engine, mbs, loss_fn, forward=engine_values))
            stepped = optimizer_step(engine, "critic")
            n_steps, n_skipped = n_steps + stepped, n_skipped + (not stepped)
    return _reduce(per_step), n_steps, n_skipped


def _reduce(per_step: list[list[dict]]) -> dict[str, float]:
    out: dict[str, float] = {}
    if not per_step:
        return out
    out["critic/value_loss"] = sum(sum(float(m["critic/value_loss"]) for m in s) for s in per_step) / len(per_step)
    ms = [m for s in per_step for m in s]
    n = sum(float(m["critic/num_tokens"]) for m in ms)
    for k in ("critic/vf_clipfrac", "critic/values_mean"):
        if n:  # none without tokens (not NaN): the mean over ranks then reads the ranks that had some
            out[k] = sum(float(m[k]) * float(m["critic/num_tokens"]) for m in ms) / n
    return out


# ----------------------------------------------------------------------------- the trainer's two calls

def gae_roles(algo) -> set[str]:
    return {r for r in ("proposer", "solver") if getattr(algo, f"{r}_estimator") == "gae"}


def critic_batch(batch, trajs, algo):
    """The StepBatch the critic packs: the step's `batch` itself when every role uses gae (then its
    trajectories are all gae ones), else the selection of the gae roles' trajectories, keyed "critic"
    (packed once for the values and the update). Decided by the config, alike on every rank."""
    roles = gae_roles(algo)
    if roles >= {"proposer", "solver"}:
        return batch
    return batch.view([i for i, t in enumerate(trajs) if t.role in roles], key="critic")


def step_values(engine, trajs, algo, micro_token_budget: int, batch=None) -> list:
    """Values of the trajectories whose role uses gae (None for the others). Collective.
    batch: the step's training.algorithm.step_batch.StepBatch of `trajs` (its micro-batches, or its "critic"
    selection, are reused), or None to pack here."""
    roles = gae_roles(algo)
    idx = [i for i, t in enumerate(trajs) if t.role in roles]
    vals = critic_values(engine, [trajs[i] for i in idx], micro_token_budget,
                         batch=None if batch is None else critic_batch(batch, trajs, algo))
    out: list = [None] * len(trajs)
    for i, v in zip(idx, vals):
        out[i] = v
    return out


def train_step_critic(engine, cfg, step: int, trajs, values, returns, reduce, batch=None) -> dict[str, float]:
    """The critic's share of one SSP step: LR, explained variance of the values GAE used, the update.
    `reduce` = utils.metrics.reduce_over_ranks (*_loss summed, as training/algorithm/update.py declares). Collective.
    batch: the step's training.algorithm.step_batch.StepBatch of `trajs` (as step_values got it), or None."""
    idx = [i for i, r in enumerate(returns) if r is not None]
    if idx and os.environ.get("SSP_FAULT", "") == f"critic_nan:{step}:{D.rank()}":
        # Fault injection (bench/bench_faults.py): a NaN value target on this rank gives the critic a NaN gradient.
        print(f"SSP_FAULT: rank {D.rank()} plants a NaN critic target at step {step}", flush=True)
        returns = list(returns)
        returns[idx[0]] = returns[idx[0]] * float("nan")
    sub = [trajs[i] for i in idx]
    masks = [torch.tensor(t.loss_mask) for t in sub]
    ev = explained_variance([values[i] for i in idx], [returns[i] for i in idx], masks)
    lr = set_critic_lr(engine, cfg, step)
    o = cfg.optimisation
    m, n_steps, n_skipped = critic_update(
        engine, sub, [values[i] for i in idx], [returns[i] for i in idx], cfg.algorithm,
        micro_token_budget=o.micro_token_budget, value_clip=cfg.critic.value_clip, seed=o.seed * 7 + step,
        batch=None if batch is None else critic_batch(batch, trajs, cfg.algorithm))
    m.update({"critic/lr": lr, "critic/optimizer_steps": float(n_steps), "critic/skipped_steps": float(n_skipped)})
    gn = engine.get_global_grad_norm() if n_steps else None
    if gn is not None:
        m["critic/grad_norm"] = float(gn)
    out = reduce(m)
    if math.isfinite(ev):   # undefined when the returns do not vary (say, every reward equal): left out, not 0
        out["critic/explained_variance"] = ev
    return out
