"""Run under torchrun by tests/training/test_update.py: the trainer's update path under ZeRO-3
against plain torch on the whole batch (an independent reference, not another run of our code).

    torchrun --nproc_per_node {1,2} tests/training/update_worker.py MODEL_DIR OUT.json
        [--phases=main[,uneven][,bypass][,epochs]] [--bypass=forward|scale]

OUT.json holds one sub-dict per phase run, in this order ({"main": {...}, "bypass": {...}, ...}).
test_update.py launches twice: 1 rank with --phases=main,epochs, 2 ranks with --phases=main,uneven,bypass
--bypass=forward.

main (the default) runs these, each at weights gathered from the engine so the reference sees exactly
the same model:
  grad_rl   accumulate() of the clipped-surrogate loss over several micro-batches per rank
            (rank 1 of 2 ends on an equalising pad) == gradient of the whole batch's loss
  grad_sft  the same for the SFT loss (token-mean NLL of the model-written tokens)
  sgd       one ppo_update() with plain SGD moves every weight by -lr * g_whole_batch
  nan       a NaN advantage on the last rank only: every rank skips that optimizer step, and the next
            step is exactly the whole batch's SGD step again (no stale gradient leaks into it)

uneven      2 ranks, the shape of a step that dynamic sampling with refill (training/loop/rounds.py) leaves: 5
            solver groups of 3 per rank, rank 0 with 3 informative and 2 flat, rank 1 with 1 informative and 4
            flat; then rank 1 with none at all. The trainer's path (drop_flat_solver_groups, role_advantages,
            ppo_update with plain SGD) on each rank's groups moves the weights by -lr * g, g the gradient of
            the whole batch of informative groups in plain torch (GRPO advantages by hand), without a hang.
bypass      a negative control, after main: installs the --bypass (default forward) in training.algorithm.micro_batches,
            then runs main's phases again from the engine's current weights (the reference re-synced to
            them): --bypass=forward runs the forward through engine.module (the code before the fix),
            --bypass=scale leaves DeepSpeed's averaging over ranks uncompensated; the test must see both.
epochs      what SSPTrainer.update logs at lr 0 for 2 PPO epochs x 2 mini-batches (combined and
            sequential) against one combined optimizer step on the same trajectories, with the
            reference re-synced to the engine's current weights. It sets lr 0 for good, so it runs
            last, and never in a launch with bypass (whose patch would stay installed).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from utils.dist import prepare_launch_env  # noqa: E402

prepare_launch_env()

import torch  # noqa: E402

from inference.trajectory import Trajectory  # noqa: E402
from training.settings.config import AlgoArgs, Config  # noqa: E402
from utils import dist as D  # noqa: E402

CLIP_LOW, CLIP_HIGH, LR = 0.2, 0.28, 0.05


def make_trajs(vocab: int) -> list[Trajectory]:
    """Eight solver trajectories in two groups; prompts and an <information> block carry mask 0."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(8):
        n = int(torch.randint(24, 56, (1,), generator=g))
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        mask = [0] * 6 + [1] * (n - 6)
        mask[14:20] = [0] * 6                            # retrieved text: never carries loss
        out.append(Trajectory(role="solver", group_id=f"q{i % 2}", token_ids=ids, loss_mask=mask,
                              logprobs=[0.0] * n, reward=float(torch.rand((), generator=g) > 0.5)))
    return out


def reference_logprobs(model, traj) -> torch.Tensor:
    """Plain HF forward of one unpacked sequence: log p(token_t | tokens_<t), 0 at t = 0."""
    ids = torch.tensor(traj.token_ids)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0].float()             # (T, V)
    lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]      # (T-1,)
    return torch.cat([torch.zeros(1), lp])


def reference_pg_loss(model, trajs, adv, old) -> tuple[torch.Tensor, float]:
    """The published clipped surrogate (PPO, with DAPO's clip-higher), token-mean over the batch."""
    terms, n_tok, clipped = [], 0, 0
    for t, a, o in zip(trajs, adv, old):
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        ratio = torch.exp(reference_logprobs(model, t) - o)
        surr = torch.minimum(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
        terms.append(-surr[m].sum())
        n_tok += int(m.sum())
        r = ratio.detach()[m]
        clipped += int(((r > 1 + CLIP_HIGH) | (r < 1 - CLIP_LOW)).sum())
    return torch.stack(terms).sum() / n_tok, clipped / n_tok


def reference_sft_loss(model, trajs) -> torch.Tensor:
    nll, n = [], 0
    for t in trajs:
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        nll.append(-reference_logprobs(model, t)[m].sum())
        n += int(m.sum())
    return torch.stack(nll).sum() / n


def gathered(engine) -> dict[str, torch.Tensor]:
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {k: p.detach().clone() for k, p in params.items()}


def full_grads(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad
    return {k: safe_get_full_grad(p).detach().clone() for k, p in engine.module.named_parameters()}


def rel_err(got: dict, want: dict) -> float:
    num = sum(float((got[k] - want[k]).double().pow(2).sum()) for k in want)
    den = sum(float(want[k].double().pow(2).sum()) for k in want)
    return (num / den) ** 0.5


def epochs_phase(engine, ref, base, cfg) -> dict:
    """The metrics SSPTrainer.update logs for several optimizer steps per SSP step, at lr 0.

    Every (role, group) holds copies of the same two sequences, so every mini-batch (and each role's
    share) has the whole batch's per-token make-up: at lr 0 each optimizer step's pg/kl/entropy loss
    equals that of one combined step over everything, and so must the logged per-step mean."""
    from types import SimpleNamespace

    from training.loop.trainer import SSPTrainer

    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    pair = base[:2]
    with torch.no_grad():
        lp = [reference_logprobs(ref, t) for t in pair]
    g = torch.Generator().manual_seed(3)
    old1 = [x + 0.3 * torch.randn(x.shape, generator=g) for x in lp]      # ratios away from 1: clipping acts
    ref1 = [x + 0.1 * torch.randn(x.shape, generator=g) for x in lp]      # a non-zero KL
    adv1 = [torch.full(x.shape, a) for x, a in zip(lp, (0.7, -1.3))]
    trajs, adv, old, ref_lp = [], [], [], []
    for role in ("proposer", "solver"):
        for k in range(4):
            for t, a, o, r in zip(pair, adv1, old1, ref1):
                trajs.append(dataclasses.replace(t, role=role, group_id=f"{role}{k}"))
                adv.append(a)
                old.append(o)
                ref_lp.append(r)
    cfg.optimisation.micro_token_budget = 64
    trainer = SimpleNamespace(actor=engine, cfg=cfg, step=0)
    w0 = gathered(engine)
    res = {}
    for name, kw in {"single": {}, "epochs": dict(ppo_epochs=2, ppo_mini_batches=2),
                     "sequential": dict(ppo_epochs=2, ppo_mini_batches=2, update_mode="sequential")}.items():
        cfg.algorithm = AlgoArgs(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=0.1, entropy_coef=0.05, **kw)
        res[name] = SSPTrainer.update(trainer, trajs, adv, old, ref_lp)
    w1 = gathered(engine)
    res["moved"] = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
    return res


PHASES = ("main", "uneven", "bypass", "epochs")
# rewards of each rank's 5 solver groups of 3: flat ones (all equal) are dropped before the update
UNEVEN = {"3+1": [[[1, 0, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0], [0, 1, 1]],
                  [[0, 0, 0], [1, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 0]]],
          "3+0": [[[0, 1, 0], [0, 0, 0], [1, 0, 1], [1, 1, 1], [1, 0, 0]],
                  [[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]]}


def uneven_phase(engine, ref, rank: int, world: int) -> dict:
    """The uneven phase (module docstring): per case of UNEVEN, the SGD step's error against plain torch,
    and each rank's informative groups and real / equalised micro-batches."""
    from training.algorithm.advantages import role_advantages
    from training.loop.rounds import drop_flat_solver_groups
    from training.loop.trainer import _all_reduce_tensor
    from training.algorithm.micro_batches import pack_equal
    from training.algorithm.update import ppo_update

    assert world == 2, "the uneven phase needs 2 ranks"
    algo = AlgoArgs(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=0.0, solver_estimator="grpo")
    res: dict = {}
    for case, per_rank in UNEVEN.items():
        g = torch.Generator().manual_seed(5)
        trajs = []   # every rank builds both ranks' groups (the same on each), then keeps its own
        for r, groups in enumerate(per_rank):
            for j, rewards in enumerate(groups):
                for reward in rewards:
                    n = int(torch.randint(24, 56, (1,), generator=g))
                    mask = [0] * 6 + [1] * (n - 6)
                    trajs.append((r, Trajectory(role="solver", group_id=f"s0-q{j}", token_ids=torch.randint(
                        0, ref.config.vocab_size, (n,), generator=g).tolist(), loss_mask=mask, logprobs=[0.0] * n,
                        reward=float(reward))))
        w_before = sync_reference(engine, ref)
        with torch.no_grad():
            old_of = {id(t): reference_logprobs(ref, t) + 0.3 * torch.randn(len(t.token_ids), generator=g)
                      for _, t in trajs}
        # the trainer's path on this rank's groups
        mine, n_flat = drop_flat_solver_groups([t for r, t in trajs if r == rank])
        adv, _, _ = role_advantages(mine, algo, all_reduce=_all_reduce_tensor)
        old = [old_of[id(t)] for t in mine]
        mbs, n_real = pack_equal(mine, 64)
        _, n_steps, n_skipped = ppo_update(engine, mine, adv, old, None, algo, temperature=1.0, micro_token_budget=64)
        w_after = gathered(engine)
        # the reference: every rank's informative groups as one batch, GRPO advantages by hand
        batch = [(r, t) for r, t in trajs if len({u.reward for q, u in trajs if q == r and u.group_id == t.group_id}) > 1]
        adv_ref = []
        for r, t in batch:
            rs = torch.tensor([u.reward for q, u in batch if q == r and u.group_id == t.group_id], dtype=torch.float64)
            adv_ref.append(float((t.reward - rs.mean()) / (rs.std() + 1e-6)))
        loss, _ = reference_pg_loss(ref, [t for _, t in batch], adv_ref, [old_of[id(t)] for _, t in batch])
        loss.backward()
        expected = {k: -LR * p.grad for k, p in ref.named_parameters()}
        res[case] = {"sgd_rel_err": rel_err({k: w_after[k] - w_before[k] for k in w_before}, expected),
                     "optimizer_steps": n_steps, "skipped": n_skipped, "batch_groups": len(batch) // 3,
                     f"rank{rank}": {"informative": len({t.group_id for t in mine}), "flat": n_flat,
                                     "real_micro_batches": n_real, "micro_batches": len(mbs)}}
        engine.optimizer.zero_grad()
        res[case].update({f"rank{r}": f for r, f in enumerate(D.all_gather_object(res[case][f"rank{rank}"]))})
    return res


def install_bypass(bypass: str) -> None:
    """Patch training.algorithm.micro_batches so the update path is the broken one: the negative control's code path."""
    import training.algorithm.micro_batches as U
    if bypass == "forward":  # the code before the fix: the forward skipped DeepSpeedEngine.forward
        from training.algorithm.logprobs import sequence_logprobs
        U.engine_logprobs = lambda e, mb, temp=1.0, ent=False, **kw: sequence_logprobs(e.module, mb, temp, ent)
    elif bypass == "scale":  # no compensation for DeepSpeed averaging gradients over ranks
        U.dp_world_size = lambda e: 1
    else:
        raise ValueError(f"unknown --bypass={bypass}")


def sync_reference(engine, ref) -> dict[str, torch.Tensor]:
    """Load the engine's current (gathered) weights into the reference; returns them."""
    w = gathered(engine)
    with torch.no_grad():
        for k, p in ref.named_parameters():
            p.copy_(w[k])
    ref.zero_grad(set_to_none=True)
    return w


def update_phases(engine, ref, trajs, rank: int, world: int, bypass: str) -> dict:
    """grad_rl, grad_sft, sgd and nan (the module docstring), from the engine's current weights."""
    from training.algorithm.loss import policy_loss
    from training.loop.sft import sft_loss
    from training.algorithm.micro_batches import accumulate, pack_equal
    from training.algorithm.update import ppo_update

    def sgd_step_by_hand():
        """-lr * g, g the reference's gradient of the whole batch's loss at its current weights."""
        loss, _ = reference_pg_loss(ref, trajs, adv_seq.tolist(), old)
        loss.backward()
        return {k: -LR * p.grad for k, p in ref.named_parameters()}

    engine.optimizer.zero_grad()
    # rank 0 gets 7 trajectories, rank 1 one: rank 1 runs out of micro-batches first and is padded last
    mine_idx = list(range(8)) if world == 1 else (list(range(7)) if rank == 0 else [7])
    mine = [trajs[i] for i in mine_idx]
    budget = 64                                          # one or two sequences per micro-batch
    # advantages: group-normalised rewards, by hand; old log-probs: the reference's, perturbed so
    # that some ratios land outside [1 - clip_low, 1 + clip_high]
    rewards = torch.tensor([t.reward for t in trajs])
    adv_seq = torch.zeros(8)
    for gid in ("q0", "q1"):
        idx = [i for i, t in enumerate(trajs) if t.group_id == gid]
        r = rewards[idx]
        adv_seq[idx] = (r - r.mean()) / (r.std() + 1e-6) + 0.1 * torch.arange(len(idx))
    g = torch.Generator().manual_seed(2)
    w0 = sync_reference(engine, ref)
    with torch.no_grad():
        old = [reference_logprobs(ref, t) + 0.3 * torch.randn(len(t.token_ids), generator=g) for t in trajs]
    adv = [torch.full((len(t.token_ids),), float(adv_seq[i])) for i, t in enumerate(trajs)]
    res: dict = {"world": world, "bypass": bypass}

    # ---- grad_rl: accumulated gradient of the clipped surrogate
    per_token = {"advantages": [adv[i] for i in mine_idx], "old_logprobs": [old[i] for i in mine_idx]}
    mbs, n_real = pack_equal(mine, budget, per_token)
    res[f"rank{rank}_micro_batches"] = len(mbs)
    res[f"rank{rank}_last_is_pad"] = bool(mbs[-1].is_dummy)
    normaliser = D.all_reduce_sum([sum(int(mb.tensors["loss_mask"].sum()) for mb in mbs)])[0]

    def pg_fn(mb, lp, ent):
        t = mb.tensors
        return policy_loss(lp, t["old_logprobs"], t["advantages"], t["loss_mask"], normaliser=normaliser,
                           clip_low=CLIP_LOW, clip_high=CLIP_HIGH)

    engine.train()
    accumulate(engine, mbs, pg_fn)
    got = full_grads(engine)
    loss, clip_frac = reference_pg_loss(ref, trajs, adv_seq.tolist(), old)
    loss.backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    res["grad_rl_rel_err"] = rel_err(got, want)
    res["clip_frac"] = clip_frac
    engine.optimizer.zero_grad()

    # ---- grad_sft: the SFT loss through the same path
    sync_reference(engine, ref)
    mbs, _ = pack_equal(mine, budget)
    n_tok = D.all_reduce_sum([sum(int(mb.tensors["loss_mask"].sum()) for mb in mbs)])[0]
    accumulate(engine, mbs, lambda mb, lp, ent: (sft_loss(lp, mb) / n_tok, {}))
    got = full_grads(engine)
    reference_sft_loss(ref, trajs).backward()
    res["grad_sft_rel_err"] = rel_err(got, {k: p.grad for k, p in ref.named_parameters()})
    engine.optimizer.zero_grad()

    # ---- sgd: one ppo_update moves the weights by -lr * g (g of the whole batch, in plain torch)
    w_before = sync_reference(engine, ref)
    assert all(torch.equal(w_before[k], w0[k]) for k in w0), "the gradient phases must not move the weights"
    algo = AlgoArgs(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=0.0)
    metrics, n_steps, _ = ppo_update(engine, mine, [adv[i] for i in mine_idx], [old[i] for i in mine_idx], None, algo,
                                  temperature=1.0, micro_token_budget=budget)
    w_after = gathered(engine)
    expected = sgd_step_by_hand()
    res["sgd_rel_err"] = rel_err({k: w_after[k] - w_before[k] for k in w_before}, expected)
    res["sgd_optimizer_steps"] = n_steps
    res["sgd_moved"] = max(float((w_after[k] - w_before[k]).abs().max()) for k in w_before)
    engine.optimizer.zero_grad()

    # ---- nan: a non-finite advantage on the last rank only; every rank skips that step together,
    # and the next step trains normally
    w_before = gathered(engine)
    bad_adv = [a.clone() for a in (adv[i] for i in mine_idx)]
    if rank == world - 1:
        bad_adv[0][-1] = float("nan")
    _, n_steps, n_skipped = ppo_update(engine, mine, bad_adv, [old[i] for i in mine_idx], None, algo,
                                       temperature=1.0, micro_token_budget=budget)
    w_after = gathered(engine)
    res["nan_skipped"] = n_skipped
    res["nan_moved"] = max(float((w_after[k] - w_before[k]).abs().max()) for k in w_before)
    # the next step: exactly -lr * g of the whole batch at the current weights, so nothing of the
    # skipped step's accumulated gradient leaked into it
    sync_reference(engine, ref)
    _, _, n_skipped = ppo_update(engine, mine, [adv[i] for i in mine_idx], [old[i] for i in mine_idx], None, algo,
                                 temperature=1.0, micro_token_budget=budget)
    w_next = gathered(engine)
    expected = sgd_step_by_hand()
    res["after_nan_skipped"] = n_skipped
    res["after_nan_rel_err"] = rel_err({k: w_next[k] - w_after[k] for k in w_after}, expected)
    res["after_nan_moved"] = max(float((w_next[k] - w_after[k]).abs().max()) for k in w_after)
    engine.optimizer.zero_grad()
    for f in D.all_gather_object({k: v for k, v in res.items() if k.startswith(f"rank{rank}_")}):
        res.update(f)
    return res


def main() -> None:
    import deepspeed
    from transformers import AutoModelForCausalLM

    from tests.training.launch import phases_from_argv
    from training.engine.engine_builder import _load_model, build_ds_config

    model_dir, out_path = sys.argv[1], Path(sys.argv[2])
    phases = phases_from_argv(sys.argv, PHASES, "main", ("bypass", "epochs"))
    bypass = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--bypass=")), "forward")
    D.init_distributed()
    rank, world = D.rank(), D.world_size()
    cfg = Config()
    cfg.model.model_path, cfg.model.dtype, cfg.model.attn_implementation = model_dir, "fp32", "sdpa"
    cfg.optimisation.max_grad_norm = 1e9       # no clipping: the update is exactly -lr * g
    # the reference first: while an HfDeepSpeedConfig is alive, from_pretrained partitions (ZeRO-3)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ds_config = {**build_ds_config(cfg), "zero_allow_untested_optimizer": True}  # plain SGD
    model, _keep = _load_model(cfg, ds_config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=ds_config)
    trajs = make_trajs(ref.config.vocab_size)
    res: dict = {}
    for phase in phases:
        if phase == "main":
            res["main"] = update_phases(engine, ref, trajs, rank, world, "")
        elif phase == "uneven":
            res["uneven"] = uneven_phase(engine, ref, rank, world)
        elif phase == "bypass":
            install_bypass(bypass)
            res["bypass"] = update_phases(engine, ref, trajs, rank, world, bypass)
        else:
            sync_reference(engine, ref)
            res["epochs"] = epochs_phase(engine, ref, trajs, cfg)
    if rank == 0:
        out_path.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
