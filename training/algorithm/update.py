"""The clipped-surrogate (PPO/GRPO-family) update of one SSP step, over the step's packed micro-batches.

    for epoch, mini-batch (and role, in sequential mode):
        accumulate(engine, micro-batches, policy_loss)     # training/algorithm/micro_batches.py: forward + backward
        optimizer_step(engine, "actor")                    # or skipped on every rank alike

The forward-and-backward rules it relies on (DeepSpeed's forward prologue, the data-parallel scale) live in
training/algorithm/micro_batches.py; both are checked against plain torch on the whole batch (tests/training/test_update.py).
"""

from __future__ import annotations

import math
import torch

from training.algorithm.micro_batches import accumulate
from training.algorithm.step_batch import ADV, OLD, REF, StepBatch, put_missing
from utils import dist as D
from utils.logging import print0
from utils.metrics import summed


def split_mini_batches(trajs, n: int, seed: int) -> list[list[int]]:
    """Indices of `trajs` in `n` mini-batches that keep each (role, group) together, so group
    statistics stay whole; groups are dealt round-robin in a seeded shuffle."""
    groups: dict = {}
    for i, t in enumerate(trajs):
        groups.setdefault((t.role, t.group_id), []).append(i)
    keys = sorted(groups, key=str)
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    out: list[list[int]] = [[] for _ in range(max(1, n))]
    for j, g in enumerate(order):
        out[j % len(out)].extend(groups[keys[g]])
    return [sorted(b) for b in out]


def ppo_update(engine, trajs, adv, old, ref, algo, *, temperature: float, micro_token_budget: int,
               seed: int = 0, distill=None, batch=None) -> tuple[dict[str, float], int, int]:
    """The clipped-surrogate update of one SSP step. Returns (this rank's metrics of the SSP step,
    see `reduce_step_metrics`; optimizer steps; of which skipped for a non-finite loss or gradient
    norm on some rank).

    algo: training.settings.config.AlgoArgs. `update_mode` combined = both roles in one optimizer step,
    sequential = the proposer's step, then the solver's. `ppo_epochs` x `ppo_mini_batches`
    reuses the step's rollouts for several optimizer steps (the PPO ratio leaves 1 after the
    first, and clipping acts); the old log-probs stay those of the rollout policy.
    distill: a training.algorithm.teacher.TopKTerm (--distill topk), whose beta x top-K reverse KL joins the
    loss of the solver's tokens with a teacher, with the policy loss's normaliser; or None.
    batch: the step's training.algorithm.step_batch.StepBatch of `trajs` (packed once, its columns reused where
    they are already there), or None to pack `trajs` here. A mini-batch's micro-batches are the batch's
    own with one mini-batch in combined mode, else a selection of it (training/algorithm/step_batch.py).
    """
    from training.algorithm.loss import count_normaliser, policy_loss

    if batch is None:
        batch = StepBatch(trajs, micro_token_budget)
    elif len(batch) != len(trajs):
        raise ValueError(f"the step batch holds {len(batch)} trajectories, the update got {len(trajs)}")
    columns = {ADV: adv, OLD: old, REF: ref}

    roles = [None] if algo.update_mode == "combined" else ["proposer", "solver"]
    steps: list[tuple[int, list[dict]]] = []     # (epoch, micro-batch metrics) per optimizer step
    n_steps = n_skipped = 0
    engine.train()
    for epoch in range(algo.ppo_epochs):
        # The same split on every rank count is not needed: each rank splits its own trajectories,
        # and the number of mini-batches (hence of optimizer steps) is fixed by the config.
        minis = split_mini_batches(trajs, algo.ppo_mini_batches, seed + epoch)
        for role in roles:
            for mini in minis:
                sub = [i for i in mini if role is None or trajs[i].role == role]
                # one mini-batch: every epoch selects the same trajectories (all of them, or the role's), decided
                # by the config alike on every rank; several: a new split each epoch, packed when it is trained
                view = (batch if role is None else batch.view(sub, key=role)) if algo.ppo_mini_batches == 1 \
                    else batch.view(sub)
                put_missing(view, columns, sub)
                if distill is not None:
                    for name, per_traj in distill.per_token(sub).items():
                        view.put(name, per_traj)
                mbs = view.micro_batches
                local = sum(count_normaliser(mb.tensors["loss_mask"], algo.loss_agg, mb.cu_seqlens) for mb in mbs)
                normaliser = D.all_reduce_sum([local])[0]
                if normaliser == 0:  # nothing sampled anywhere: the same decision on every rank
                    continue

                def loss_fn(mb, lp, ent, kl=None):
                    t = mb.tensors
                    out = policy_loss(
                        lp, t["old_logprobs"], t["advantages"], t["loss_mask"], normaliser=normaliser,
                        agg=algo.loss_agg, cu_seqlens=mb.cu_seqlens, clip_low=algo.clip_low,
                        clip_high=algo.clip_high, dual_clip=algo.dual_clip or None,
                        ref_logprobs=t.get("ref_logprobs"), kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
                        entropy=ent, entropy_coef=algo.entropy_coef, rollout_logprobs=t["rollout_logprobs"],
                        tis_cap=algo.tis_cap or None, on_nonfinite="skip")
                    return out if distill is None else distill.add_loss(out, mb, kl, normaliser, algo.loss_agg)

                extra = None if distill is None else (lambda mb, sub=sub: distill.head_extra(mb, sub))
                mb_metrics = accumulate(engine, mbs, loss_fn, temperature=temperature, compute_entropy=True,
                                        head_extra=extra)
                steps.append((epoch, mb_metrics))
                n_steps += 1
                bad = any(float(m.get("actor/nonfinite", 0.0)) for m in mb_metrics)
                n_skipped += not optimizer_step(engine, "actor", bad)
    out = reduce_step_metrics(steps)
    if distill is not None:
        out.update(distill.metrics())   # collective: every rank runs it
    return out, n_steps, n_skipped


# A loss metric is this rank's share of a loss normalised by the global token count (training/algorithm/loss.py), so the
# step's loss is the ranks' sum; the tokens are a count. Summed over ranks (utils/metrics.py), the rest averaged.
summed("actor/num_tokens")
summed(suffixes=("_loss",), shares=True)


def reduce_step_metrics(steps: list[tuple[int, list[dict]]]) -> dict[str, float]:
    """One SSP step's metrics on this rank from its optimizer steps, [(epoch, micro-batch metrics)].

    "*_loss": the mean over optimizer steps of each step's loss (this rank's share of it; the trainer
    sums the shares over ranks): a sum over steps grew with ppo_epochs x ppo_mini_batches.
    "actor/num_tokens": the tokens of one pass over the step's trajectories (the largest epoch
    total: a non-finite micro-batch reports none), not once per epoch. The rest as
    training.algorithm.loss.reduce_metrics over every micro-batch of every step."""
    from training.algorithm.loss import reduce_metrics

    if not steps:
        return {}
    out = reduce_metrics([m for _, mbs in steps for m in mbs])
    per_step = [reduce_metrics(mbs) for _, mbs in steps]
    for k in [k for k in out if k.endswith("_loss")]:
        # a step without the key (all its micro-batches non-finite) contributed a zero loss
        out[k] = sum(s.get(k, 0.0) for s in per_step) / len(per_step)
    if "actor/num_tokens" in out:
        per_epoch: dict[int, float] = {}
        for (epoch, _), s in zip(steps, per_step):
            per_epoch[epoch] = per_epoch.get(epoch, 0.0) + s.get("actor/num_tokens", 0.0)
        out["actor/num_tokens"] = max(per_epoch.values())
    return out


def optimizer_step(engine, role: str, bad: bool = False) -> bool:
    """engine.step() after `accumulate`, unless the step is non-finite on some rank: then every rank skips it
    alike and returns False (`{role}/skipped_steps`). The one step rule of the actor, the critic and SFT. Collective.

    bad: this rank met a non-finite loss input or log-prob (policy_loss on_nonfinite="skip" zeroed that
    micro-batch's loss, so stepping would apply the other micro-batches and ranks alone).
    DeepSpeed's ZeRO and bf16 optimizers skip a step of non-finite global gradient norm themselves (norm inf,
    on every rank); a bare torch optimizer (ZeRO-0, fp32) would apply it, so its gradients are checked here.
    zero_grad() also resets ZeRO-3's micro_step_id: the next accumulation overwrites the stale partitions."""
    if engine.optimizer is getattr(engine, "basic_optimizer", None):   # one device sync, not one per parameter
        flags = [p.grad.isfinite().all() for p in engine.module.parameters() if p.grad is not None]
        bad = bad or (bool(flags) and not bool(torch.stack(flags).all()))
    why = "loss inputs, log-probs or gradients"
    if D.all_reduce_max(float(bad)):
        engine.optimizer.zero_grad()
    else:
        engine.step()
        gn = float(engine.get_global_grad_norm() or 0.0)
        if math.isfinite(gn):
            return True
        why = f"gradient norm ({gn}) from finite losses"    # DeepSpeed skipped it
    print0(f"update: NON-FINITE {why} on some rank; every rank skipped this {role} optimizer step "
           f"({role}/skipped_steps; --max_nonfinite_steps stops the run after that many in a row)")
    return False


def _local_trainable(engine) -> list[torch.Tensor]:
    """This rank's stored copy of each trained weight: the ZeRO-3 partition (in the run's dtype,
    bf16 or fp32; the optimizer's fp32 master copy is elsewhere) or the full tensor."""
    return [getattr(p, "ds_tensor", p.data).reshape(-1) for p in engine.module.parameters() if p.requires_grad]


def snapshot_weights(engine, max_per_tensor: int = 1 << 18) -> list[torch.Tensor]:
    """A sample (the first elements of each local partition) of the stored trained weights."""
    return [t[:max_per_tensor].detach().clone() for t in _local_trainable(engine)]


def changed_fraction(engine, snapshot: list[torch.Tensor]) -> float:
    """Share of the sampled stored weights that changed since `snapshot`, over all ranks. In bf16 a
    weight near 1.0 moves only by steps of 0.0078, so small Adam steps can leave most of it
    unchanged although the fp32 master weights move: this says whether an update reached the model
    that generates."""
    now = [t[: len(s)] for t, s in zip(_local_trainable(engine), snapshot)]
    changed = sum(int((a != b).sum()) for a, b in zip(now, snapshot))
    total = sum(len(s) for s in snapshot)
    c, n = D.all_reduce_sum([changed, total])
    return c / n if n else 0.0
