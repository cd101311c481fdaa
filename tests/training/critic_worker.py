"""Run under torchrun by tests/training/test_critic_update.py: one PPO step with a critic under ZeRO-3,
against plain torch on the whole batch (an independent reference, not another run of our code).

    torchrun --nproc_per_node {1,2} tests/training/critic_worker.py MODEL_DIR OUT.json
        [--phases=sgd[,nan][,bypass][,control]]

OUT.json holds one sub-dict per phase run, in this order ({"sgd": {...}, "bypass": {...}, ...}).
test_critic_update.py launches twice: 1 rank with --phases=sgd,control, 2 ranks with --phases=sgd,nan,bypass.

sgd (the default): the solver uses gae, the proposer reinforce++ (per-role estimators mix). The
  trainer's path (training.algorithm.critic.step_values -> training.algorithm.advantages.role_advantages -> ppo_update for
  the actor, train_step_critic for the critic; plain SGD in both) against a reference that runs each
  unpacked sequence through eager attention, GAE as a plain loop over sampled tokens, the whitening, the
  clipped surrogate and the value loss by their formulas: each of actor and critic must move by -lr * g.
bypass: a negative control, after sgd: the sgd phase again on freshly built engines and references
  (the same start as sgd's: each phase starts from the torch RNG state the launch started with, which
  initialises the critic's score head), with the critic's forward through engine.module (skipping
  DeepSpeedEngine.forward): the gradient of all but the last micro-batch is lost, which the check must see.
  The patch stays installed, so nothing that uses the critic's forward runs after it.
nan: at --zero_stage 3, 2 and 0 (AdamW, the run's optimizer), one critic step whose value target is NaN on the
  last rank only, then a clean step: every rank must skip the first (weights unchanged and finite, counted as
  critic/skipped_steps, not critic/optimizer_steps) and take the second.
control: a positive control on one rank. Two fixed prompts, each with a constant reward (1.0
  and -0.5): under AdamW the critic's values converge to each prompt's reward and the explained
  variance rises.
"""

from __future__ import annotations

import gc
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

CLIP_LOW, CLIP_HIGH, LR, LR_C, GAMMA, LAM = 0.2, 0.28, 0.05, 0.02, 0.95, 0.9


def make_trajs(vocab: int) -> list[Trajectory]:
    """8 solver and 4 proposer trajectories; prompts and an <information> block carry mask 0."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(12):
        n = int(torch.randint(24, 56, (1,), generator=g))
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        mask = [0] * 6 + [1] * (n - 6)
        mask[14:20] = [0] * 6
        role = "solver" if i < 8 else "proposer"
        out.append(Trajectory(role=role, group_id=f"{role}{i % 2}", token_ids=ids, loss_mask=mask,
                              logprobs=[0.0] * n, reward=float(torch.rand((), generator=g))))
    return out


def shifted(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1), x[:-1]])


def ref_logprobs(model, t) -> torch.Tensor:
    ids = torch.tensor(t.token_ids)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]])


def ref_values(model, t) -> torch.Tensor:
    """The value of token i is the head on the state before it: the token-classification logit at i-1."""
    return shifted(model(input_ids=torch.tensor(t.token_ids)[None], use_cache=False).logits[0, :, 0].float())


def loop_gae(reward, values, mask, gamma, lam):
    pos = [k for k in range(len(mask)) if mask[k]]
    adv, last = torch.zeros(len(mask)), 0.0
    for j in reversed(range(len(pos))):
        nxt = float(values[pos[j + 1]]) if j + 1 < len(pos) else 0.0
        r = reward if j == len(pos) - 1 else 0.0
        last = r + gamma * nxt - float(values[pos[j]]) + gamma * lam * last
        adv[pos[j]] = last
    return adv, (adv + values) * torch.tensor(mask, dtype=torch.float32)


def whiten(per_traj, masks):
    flat = torch.cat([a[torch.tensor(m, dtype=torch.bool)] for a, m in zip(per_traj, masks)]).double()
    mu, sd = flat.mean(), flat.std()
    return [((a.double() - mu) / (sd + 1e-6) * torch.tensor(m)).float() for a, m in zip(per_traj, masks)]


def gathered(engine) -> dict[str, torch.Tensor]:
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {k: p.detach().clone() for k, p in params.items()}


def load_into(model, w):
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(w[k])
    model.zero_grad(set_to_none=True)


def rel_err(got: dict, want: dict) -> float:
    num = sum(float((got[k] - want[k]).double().pow(2).sum()) for k in want)
    den = sum(float(want[k].double().pow(2).sum()) for k in want)
    return (num / den) ** 0.5


def sgd_phase(cfg, model_dir, rank, world, bypass) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    import training.algorithm.critic as CR
    from training.algorithm.advantages import role_advantages
    from training.engine.engine_builder import _load_model, build_critic, build_ds_config
    from training.algorithm.update import ppo_update

    # the references first: while an HfDeepSpeedConfig is alive, from_pretrained partitions (ZeRO-3);
    # in a later call, the last call's engines and HfDeepSpeedConfigs must be gone
    gc.collect()
    assert not is_deepspeed_zero3_enabled(), "an HfDeepSpeedConfig outlived the last sgd_phase"
    ref_actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ref_critic = CR.load_value_model(model_dir, torch.float32, "eager")
    ds_config = {**build_ds_config(cfg), "zero_allow_untested_optimizer": True}
    model, _keep = _load_model(cfg, ds_config)
    actor, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ds_config)
    critic, _keep_c = build_critic(cfg, optimizer_fn=lambda p: torch.optim.SGD(p, lr=LR_C))
    if bypass == "critic_forward":   # the forward skips DeepSpeedEngine.forward: ZeRO-3 keeps one micro-batch's grads
        CR.engine_values = lambda e, mb: CR.sequence_values(e.module, mb.to(e.device))
    wa0, wc0 = gathered(actor), gathered(critic)
    load_into(ref_actor, wa0)
    load_into(ref_critic, wc0)

    trajs = make_trajs(ref_actor.config.vocab_size)
    mine_idx = list(range(12)) if world == 1 else ([0, 1, 2, 3, 4, 5, 6, 8, 9] if rank == 0 else [7, 10, 11])
    mine = [trajs[i] for i in mine_idx]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        old = [ref_logprobs(ref_actor, t) + 0.3 * torch.randn(len(t.token_ids), generator=g) for t in trajs]
        want_values = [ref_values(ref_critic, t) for t in trajs]
    algo = cfg.algorithm
    res: dict = {"world": world, "bypass": bypass}

    # ---- the trainer's path
    values = CR.step_values(critic, mine, algo, cfg.optimisation.micro_token_budget)
    res["values_err"] = max(float((values[j] - want_values[i]).abs().max())
                            for j, i in enumerate(mine_idx) if mine[j].role == "solver")
    assert all(v is None for v, t in zip(values, mine) if t.role == "proposer")
    adv, returns, _ = role_advantages(mine, algo, cfg.critic, values=values,
                                      all_reduce=lambda x: D.all_reduce_tensor(x, "sum"))
    _, n_steps, _ = ppo_update(actor, mine, adv, [old[i] for i in mine_idx], None, algo, temperature=1.0,
                               micro_token_budget=cfg.optimisation.micro_token_budget)
    cm = CR.train_step_critic(critic, cfg, 0, mine, values, returns, lambda m: m)
    res["actor_steps"], res["critic_steps"] = n_steps, cm["critic/optimizer_steps"]
    res["critic_lr"] = cm["critic/lr"]
    wa1, wc1 = gathered(actor), gathered(critic)

    # ---- the reference: the whole batch in plain torch
    masks = [t.loss_mask for t in trajs]
    sol = [i for i, t in enumerate(trajs) if t.role == "solver"]
    pro = [i for i, t in enumerate(trajs) if t.role == "proposer"]
    raw = {i: loop_gae(trajs[i].reward, want_values[i], masks[i], GAMMA, LAM) for i in sol}
    ref_adv = dict(zip(sol, whiten([raw[i][0] for i in sol], [masks[i] for i in sol])))
    ref_adv.update(zip(pro, whiten([torch.full((len(masks[i]),), trajs[i].reward) for i in pro],
                                   [masks[i] for i in pro])))
    res["adv_err"] = max(float((adv[j] - ref_adv[i]).abs().max()) for j, i in enumerate(mine_idx))
    terms, n_tok = [], 0
    for i, t in enumerate(trajs):
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        ratio = torch.exp(ref_logprobs(ref_actor, t) - old[i])
        a = ref_adv[i]
        terms.append(-torch.minimum(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)[m].sum())
        n_tok += int(m.sum())
    (torch.stack(terms).sum() / n_tok).backward()
    want_actor = {k: -LR * p.grad for k, p in ref_actor.named_parameters()}
    vl, n_sol = [], 0
    for i in sol:
        m = torch.tensor(masks[i], dtype=torch.bool)
        v, old_v, ret = ref_values(ref_critic, trajs[i]), want_values[i], raw[i][1]
        v_clip = old_v + (v - old_v).clamp(-cfg.critic.value_clip, cfg.critic.value_clip)
        vl.append(torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)[m].sum())
        n_sol += int(m.sum())
    (0.5 * torch.stack(vl).sum() / n_sol).backward()
    want_critic = {k: -LR_C * p.grad for k, p in ref_critic.named_parameters()}
    res["actor_rel_err"] = rel_err({k: wa1[k] - wa0[k] for k in wa0}, want_actor)
    res["critic_rel_err"] = rel_err({k: wc1[k] - wc0[k] for k in wc0}, want_critic)
    res["critic_moved"] = max(float((wc1[k] - wc0[k]).abs().max()) for k in wc0)
    res["critic_backbone_moved"] = max(float((wc1[k] - wc0[k]).abs().max()) for k in wc0 if not k.startswith("score"))
    return res


def nan_phase(cfg, rank, world) -> dict:
    import copy

    from transformers.integrations import is_deepspeed_zero3_enabled

    from training.algorithm.advantages import role_advantages
    from training.algorithm.critic import step_values, train_step_critic
    from training.engine.engine_builder import build_critic

    res: dict = {}
    for stage in (3, 2, 0):
        c = copy.deepcopy(cfg)
        c.deepspeed.zero_stage = stage
        gc.collect()
        assert not is_deepspeed_zero3_enabled(), "the last stage's HfDeepSpeedConfig outlived its critic"
        critic, keep = build_critic(c)
        trajs = make_trajs(1000)
        mine = trajs[rank::world]
        algo = c.algorithm
        values = step_values(critic, mine, algo, c.optimisation.micro_token_budget)
        _, returns, _ = role_advantages(mine, algo, c.critic, values=values,
                                        all_reduce=lambda x: D.all_reduce_tensor(x, "sum"))
        bad = [None if r is None else r.clone() for r in returns]
        if rank == world - 1:   # one sampled token's target, on one rank
            j = next(i for i, r in enumerate(bad) if r is not None)
            bad[j][mine[j].loss_mask.index(1)] = float("nan")
        out = {}
        for name, rets in (("nan", bad), ("after", returns)):
            w0 = gathered(critic)
            m = train_step_critic(critic, c, 0, mine, values, rets, lambda m: m)
            w1 = gathered(critic)
            out[name] = {"finite": all(bool(torch.isfinite(w).all()) for w in w1.values()),
                         "moved": max(float((w1[k] - w0[k]).abs().max()) for k in w0),
                         "optimizer_steps": m["critic/optimizer_steps"],
                         "skipped_steps": m.get("critic/skipped_steps")}
        res[f"stage{stage}"] = D.all_gather_object(out)     # per rank
        del critic, keep
    return res


def control_phase(cfg, steps: int = 40) -> dict:
    from training.algorithm.critic import critic_update, critic_values, explained_variance
    from training.engine.engine_builder import build_critic

    critic, _keep = build_critic(cfg)
    g = torch.Generator().manual_seed(4)
    prompts = {1.0: torch.randint(0, 1000, (8,), generator=g).tolist(),
               -0.5: torch.randint(0, 1000, (8,), generator=g).tolist()}
    trajs = []
    for reward, prompt in prompts.items():
        for _ in range(4):
            resp = torch.randint(0, 1000, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()
            trajs.append(Trajectory(role="solver", group_id=str(reward), token_ids=prompt + resp,
                                    loss_mask=[0] * len(prompt) + [1] * len(resp), logprobs=[0.0] * (8 + len(resp)),
                                    reward=reward))
    masks = [torch.tensor(t.loss_mask) for t in trajs]
    returns = [m.float() * t.reward for m, t in zip(masks, trajs)]    # gamma = lam = 1: the reward everywhere
    evs, gaps = [], []
    for _ in range(steps):
        values = critic_values(critic, trajs, 256)
        evs.append(explained_variance(values, returns, masks))
        gaps.append(max(float((v - r)[m.bool()].abs().mean()) for v, r, m in zip(values, returns, masks)))
        critic_update(critic, trajs, values, returns, cfg.algorithm, micro_token_budget=256, value_clip=0.5)
    values = critic_values(critic, trajs, 256)
    evs.append(explained_variance(values, returns, masks))
    gaps.append(max(float((v - r)[m.bool()].abs().mean()) for v, r, m in zip(values, returns, masks)))
    return {"ev": evs, "gap": gaps}


PHASES = ("sgd", "nan", "bypass", "control")


def main() -> None:
    from tests.training.launch import phases_from_argv

    model_dir, out_path = sys.argv[1], Path(sys.argv[2])
    phases = phases_from_argv(sys.argv, PHASES, "sgd", ("bypass", "control"))
    D.init_distributed()
    rank, world = D.rank(), D.world_size()
    cfg = Config()
    cfg.model.model_path, cfg.model.dtype, cfg.model.attn_implementation = model_dir, "fp32", "sdpa"
    cfg.model.gradient_checkpointing = False
    cfg.optimisation.max_grad_norm = 1e9
    cfg.optimisation.micro_token_budget = 64            # several micro-batches per step: accumulation matters
    cfg.algorithm = AlgoArgs(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=0.0,
                             solver_estimator="gae", proposer_estimator="reinforce++")
    c = cfg.critic
    c.critic_lr, c.critic_max_grad_norm, c.gae_gamma, c.gae_lambda = LR_C, 1e9, GAMMA, LAM
    c.critic_gradient_checkpointing = False
    res: dict = {}
    torch.manual_seed(0)   # the critic's score head: one init on every run (unseeded, the control's first EV varied)
    rng = torch.random.get_rng_state()      # the critic's score head is initialised from it
    for phase in phases:
        torch.random.set_rng_state(rng)     # so bypass builds the very critic that sgd built
        if phase == "sgd":
            res["sgd"] = sgd_phase(cfg, model_dir, rank, world, "")
        elif phase == "nan":
            res["nan"] = nan_phase(cfg, rank, world)
        elif phase == "bypass":
            res["bypass"] = sgd_phase(cfg, model_dir, rank, world, "critic_forward")
        else:
            c.critic_lr = 2e-3
            res["control"] = control_phase(cfg)
    if rank == 0:
        out_path.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
