"""The step batch packed once (training/algorithm/step_batch.py) against plain torch on unpacked sequences.

The trainer's path: SSPTrainer.forward_logprobs fills the batch's old and reference log-prob columns from
its packed micro-batches, then ppo_update trains on that batch (the micro-batches reused with one
mini-batch, selections of it with several or in sequential mode). The reference is independent: eager
attention on each sequence alone, a full log-softmax and the published clipped surrogate plus k3 KL,
token-mean over each optimizer step's trajectories, on every rank's together. fp32 on the CPU. A stand-in
engine records each optimizer step's gradient (DeepSpeed's average over ranks, taken here by hand)
and leaves the weights where they are, so every step's gradient is that of its mini-batch's loss.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from inference.trajectory import Trajectory
from tests.thread_ranks import ThreadRanks
from training.settings.config import AlgoArgs
from training.algorithm.step_batch import ADV, OLD, REF, StepBatch
from training.loop.trainer import SSPTrainer
from training.algorithm.update import ppo_update, split_mini_batches
from utils import dist as D

VOCAB, BUDGET, KL_COEF = 64, 96, 0.05


def tiny(impl: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, use_cache=False, attn_implementation=impl)
    return LlamaForCausalLM(cfg).float()


def perturbed(model, seed: int, scale: float = 0.05):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return out


def as_eager(model):
    ref = tiny("eager")
    ref.load_state_dict(model.state_dict())
    return ref.eval()


class Engine:
    """The DeepSpeed engine as ppo_update and forward_logprobs use it: the forward through engine(), backward
    of the loss it is given (already x dp_world_size, as DeepSpeed's average over ranks expects), and a step
    that records this rank's gradient and zeroes it without moving a weight."""

    def __init__(self, model, world: int = 1):
        self.module, self.device, self.dp_world_size = model, torch.device("cpu"), world
        self.grads: list[list[torch.Tensor]] = []
        self.optimizer = SimpleNamespace(zero_grad=self._zero)

    def __call__(self):
        return self.module()

    def train(self):
        self.module.train()

    def set_gradient_accumulation_boundary(self, _):
        pass

    def backward(self, loss):
        loss.backward()

    def _zero(self):
        for p in self.module.parameters():
            p.grad = None

    def step(self):
        self.grads.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                           for p in self.module.parameters()])
        self._zero()

    def get_global_grad_norm(self):
        return 0.0


def make_trajs(seed: int, groups: int) -> list[Trajectory]:
    """Solver groups of 3 and one proposer each, lengths 9..50 (uneven), prompts and a retrieved block masked."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        for role, n in (("solver", 3), ("proposer", 1)):
            for _ in range(n):
                L = int(torch.randint(9, 51, (1,), generator=g))
                mask = [0] * 4 + [1] * (L - 4)
                mask[6:8] = [0, 0]
                out.append(Trajectory(role=role, group_id=f"r{seed}-{role}-{k}", token_ids=torch.randint(
                    0, VOCAB, (L,), generator=g).tolist(), loss_mask=mask, logprobs=[0.0] * L,
                    reward=float(torch.rand((), generator=g))))
    return out


def plain_logprobs(model, t) -> torch.Tensor:
    ids = torch.tensor(t.token_ids)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]])


def reference_grad(model, trajs, adv, old, ref, algo) -> tuple[list[torch.Tensor], float]:
    """Gradient and value of the published loss on `trajs` together: clipped surrogate + kl_coef x k3 KL to the
    reference, summed over sampled tokens and divided by their count."""
    model.zero_grad()
    terms, n = [], 0
    for t, a, o, r in zip(trajs, adv, old, ref):
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        lp = plain_logprobs(model, t)
        ratio = torch.exp(lp - o)
        surr = torch.minimum(ratio * a, ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high) * a)
        d = r - lp
        k3 = torch.exp(d) - d - 1
        terms.append((-surr + KL_COEF * k3)[m].sum())
        n += int(m.sum())
    loss = torch.stack(terms).sum() / n
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()], float(loss.detach())


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((a - b).double().pow(2).sum()) for a, b in zip(got, want))
    return (num / sum(float(b.double().pow(2).sum()) for b in want)) ** 0.5


def trainer_self():
    cfg = SimpleNamespace(optimisation=SimpleNamespace(micro_token_budget=BUDGET), rollout=SimpleNamespace(temperature=1.0))
    return SimpleNamespace(cfg=cfg)


def step_on_rank(policy, old_model, ref_model, trajs, algo, world):
    """The trainer's path on one rank: the batch's old/ref columns from its packed micro-batches, advantages
    per trajectory, ppo_update on the batch. Returns (engine with its recorded gradients, batch, adv, metrics)."""
    me = trainer_self()
    batch = StepBatch(trajs, BUDGET)
    old = SSPTrainer.forward_logprobs(me, Engine(old_model), batch, OLD)
    ref = SSPTrainer.forward_logprobs(me, Engine(ref_model), batch, REF)
    g = torch.Generator().manual_seed(len(trajs))
    adv = [torch.full((len(t.token_ids),), float(torch.randn((), generator=g))) for t in trajs]
    engine = Engine(policy, world)
    metrics, n_steps, n_skipped = ppo_update(engine, trajs, adv, old, ref, algo, temperature=1.0,
                                             micro_token_budget=BUDGET, seed=3, batch=batch)
    assert n_skipped == 0 and n_steps == len(engine.grads)
    return engine, batch, adv, metrics


def reference_steps(policy, per_rank, algo) -> list[tuple[list[torch.Tensor], float]]:
    """Each optimizer step's (gradient, loss) in plain torch: ppo_update's order (epoch, role, mini-batch), each
    mini-batch the union of every rank's own split (split_mini_batches on its trajectories)."""
    ref_model = as_eager(policy)
    roles = [None] if algo.update_mode == "combined" else ["proposer", "solver"]
    out = []
    for epoch in range(algo.ppo_epochs):
        splits = [split_mini_batches(r["trajs"], algo.ppo_mini_batches, 3 + epoch) for r in per_rank]
        for role in roles:
            for k in range(algo.ppo_mini_batches):
                rows = [(r, i) for r, s in zip(per_rank, splits) for i in s[k]
                        if role is None or r["trajs"][i].role == role]
                if not rows:
                    continue
                out.append(reference_grad(ref_model, *[[r[key][i] for r, i in rows]
                                                       for key in ("trajs", "adv", "old", "ref")], algo))
    return out


def run_ranks(world, algo, trajs_of_rank):
    policy = tiny("sdpa")
    old_model, ref_model = perturbed(policy, 1), perturbed(policy, 2, 0.1)
    ranks = ThreadRanks(world)

    def one(r):
        e, batch, adv, m = step_on_rank(copy.deepcopy(policy), copy.deepcopy(old_model), copy.deepcopy(ref_model),
                                        trajs_of_rank[r], algo, world)
        return {"engine": e, "batch": batch, "adv": adv, "metrics": m, "trajs": trajs_of_rank[r]}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "all_reduce_sum", ranks.all_reduce_sum)
        mp.setattr(D, "all_reduce_max", lambda v: max(ranks.all_gather_object(v)))
        res = ranks.run(one)
    for r in res:
        r["old"], r["ref"] = r["batch"].column(OLD), r["batch"].column(REF)
    return policy, old_model, ref_model, res


@pytest.mark.parametrize("world,mini,mode,epochs", [
    (1, 1, "combined", 1),       # the defaults: the batch's own micro-batches
    (1, 2, "combined", 2),       # several mini-batches: a selection packed per mini-batch, the split new each epoch
    (1, 1, "sequential", 2),     # one selection per role, packed once for both epochs
    (2, 1, "combined", 1),       # 2 ranks with unequal work: the equalised counts, the gradient of the whole batch
    (2, 2, "sequential", 1),
])
def test_step_batch_update_is_the_whole_batch_gradient(world, mini, mode, epochs):
    algo = AlgoArgs(ppo_mini_batches=mini, update_mode=mode, ppo_epochs=epochs, kl_coef=KL_COEF, kl_estimator="k3")
    trajs_of_rank = [make_trajs(10 + r, 3 - r) for r in range(world)]   # rank 1 holds fewer groups than rank 0
    policy, old_model, ref_model, res = run_ranks(world, algo, trajs_of_rank)

    # the old and reference log-probs the batch holds are those of each sequence alone (on its sampled tokens)
    for r in res:
        assert r["batch"].num_real >= 2 and len(r["batch"].micro_batches) == len(res[0]["batch"].micro_batches)
        for model, got in ((old_model, r["old"]), (ref_model, r["ref"])):
            eager = as_eager(model)
            with torch.no_grad():
                want = [plain_logprobs(eager, t) for t in r["trajs"]]
            masks = [torch.tensor(t.loss_mask, dtype=torch.bool) for t in r["trajs"]]   # computed where sampled
            assert max(float((a - b)[m].abs().max()) for a, b, m in zip(got, want, masks)) < 2e-5
        # the advantages were scattered into the packed rows of the micro-batches the update trained on
        if mini == 1 and mode == "combined":
            assert all(ADV in mb.tensors for mb in r["batch"].micro_batches)
            assert all(torch.equal(a, b) for a, b in zip(r["batch"].column(ADV), r["adv"]))

    want = reference_steps(policy, res, algo)
    steps = [len(r["engine"].grads) for r in res]
    assert steps == [len(want)] * world, (steps, len(want))
    assert len(want) >= (2 if mini * epochs > 1 or mode == "sequential" else 1)
    for k, (g_want, _) in enumerate(want):
        got = [sum(r["engine"].grads[k][j] for r in res) / world for j in range(len(g_want))]  # DeepSpeed's mean
        assert rel_err(got, g_want) < 2e-5, (k, rel_err(got, g_want))
    # the logged policy loss: the mean over optimizer steps of each step's loss, summed over ranks
    pg_plus_kl = sum(r["metrics"]["actor/pg_loss"] + r["metrics"]["actor/kl_loss"] for r in res)
    assert pg_plus_kl == pytest.approx(sum(loss for _, loss in want) / len(want), rel=2e-5, abs=1e-7)


def test_one_packing_serves_the_default_step():
    """One mini-batch, combined: the old and reference forwards and the update all use the batch's micro-batches,
    packed (and their count all-reduced) once; several mini-batches pack each one when it is trained."""
    trajs = make_trajs(5, 3)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "all_reduce_max", lambda v: calls.append(v) or v)
        policy, old_model = tiny("sdpa"), tiny("sdpa", 1)
        for mini, want in ((1, 1), (2, 1 + 2)):
            calls.clear()
            batch = StepBatch(trajs, BUDGET)
            old = SSPTrainer.forward_logprobs(trainer_self(), Engine(old_model), batch, OLD)
            adv = [torch.ones(len(t.token_ids)) for t in trajs]
            ppo_update(Engine(policy), trajs, adv, old, None, AlgoArgs(ppo_mini_batches=mini), temperature=1.0,
                       micro_token_budget=BUDGET, batch=batch)
            # pack-equalise all-reduces (the non-finite check adds one float per optimizer step)
            assert sum(isinstance(v, int) for v in calls) == want, (mini, calls)
            assert batch.pack_seconds > 0
