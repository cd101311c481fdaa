"""Packing: planning, round trips, and packed == unpacked on a tiny real transformers model."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from training.algorithm.packing import (block_causal_mask, dummy_micro_batch, equalise_micro_batches, pack_micro_batches,
                              plan_micro_batches, unpack_to_sequences)

REPO = Path(__file__).resolve().parents[2]


def _naive_ffd_count(lengths, budget):
    loads = []
    for n in sorted(lengths, reverse=True):
        for i, load in enumerate(loads):
            if load + n <= budget:
                loads[i] += n
                break
        else:
            loads.append(n)
    return len(loads)


@pytest.mark.parametrize("seed", range(8))
def test_plan_respects_budget_and_uses_ffd_bin_count(seed):
    rnd = random.Random(seed)
    budget = rnd.choice([64, 100, 257])
    lengths = [rnd.randint(1, budget) for _ in range(rnd.randint(1, 40))]
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))      # each sequence exactly once
    assert all(sum(lengths[i] for i in b) <= budget for b in plan)
    assert math.ceil(sum(lengths) / budget) <= len(plan) <= _naive_ffd_count(lengths, budget)
    k = len(plan) + 2
    more = plan_micro_batches(lengths, budget, min_micro_batches=k)
    assert len(more) == min(k, len(lengths)) or len(more) == len(plan)        # LPT split, or FFD if it can't fit
    assert all(sum(lengths[i] for i in b) <= budget for b in more)


def test_plan_errors():
    with pytest.raises(ValueError, match="over the micro-batch budget max_tokens=10"):
        plan_micro_batches([5, 11], 10)
    with pytest.raises(ValueError, match="positive"):
        plan_micro_batches([5], 0)


def test_pack_unpack_round_trip_and_validation():
    rnd = random.Random(1)
    ids = [[rnd.randint(0, 99) for _ in range(rnd.randint(2, 30))] for _ in range(9)]
    masks = [[0] + [rnd.randint(0, 1) for _ in range(len(s) - 1)] for s in ids]
    lps = [torch.randn(len(s)) for s in ids]
    mbs = pack_micro_batches(ids, 48, per_token={"loss_mask": masks, "rollout_logprobs": lps},
                             per_seq={"reward": list(range(9))})
    for mb in mbs:
        assert mb.num_tokens <= 48 and mb.position_ids.shape == mb.input_ids.shape
        for i, pos, n in zip(mb.seq_indices, mb.unpack(mb.position_ids), mb.seq_lens):
            assert pos.tolist() == list(range(n)) and n == len(ids[i])           # positions restart per sequence
        assert mb.seq_tensors["reward"].tolist() == mb.seq_indices
    back = unpack_to_sequences(mbs, [mb.input_ids for mb in mbs], len(ids))
    assert [b.tolist() for b in back] == ids
    back = unpack_to_sequences(mbs, [mb.tensors["rollout_logprobs"] for mb in mbs], len(ids))
    assert all(torch.equal(a, b) for a, b in zip(back, lps))
    with pytest.raises(ValueError, match=r"loss_mask\[0\] is 1"):
        pack_micro_batches([[1, 2]], 8, per_token={"loss_mask": [[1, 1]]})
    with pytest.raises(ValueError, match="expected"):
        pack_micro_batches([[1, 2]], 8, per_token={"loss_mask": [[0, 1, 1]]})


def test_block_causal_mask_against_loop():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    seq = [0, 0, 0, 1, 2, 2, 2, 2]
    want = torch.tensor([[seq[i] == seq[j] and j <= i for j in range(8)] for i in range(8)])
    assert torch.equal(block_causal_mask(cu, 8)[0, 0], want)
    add = block_causal_mask(cu, 8, torch.float32)[0, 0]
    assert torch.equal(add == 0, want) and (add[~want] == torch.finfo(torch.float32).min).all()


def test_equalise_pads_with_dummies():
    mbs = pack_micro_batches([[1, 2, 3]], 8, per_token={"loss_mask": [[0, 1, 1]], "advantages": [[0.0, 1.0, 1.0]]})
    out = equalise_micro_batches(mbs, all_reduce_max=lambda n: 3)
    assert len(out) == 3 and [m.is_dummy for m in out] == [False, True, True]
    assert set(out[1].tensors) == {"loss_mask", "advantages"} and out[1].tensors["loss_mask"].sum() == 0
    assert len(equalise_micro_batches([], all_reduce_max=lambda n: 2)) == 2


_DIST_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.environ["REPO"])
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from training.algorithm.packing import pack_micro_batches, equalise_micro_batches

    def run(rank, store):
        # A file store: no TCP port to race other processes for on a shared machine.
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        n_seqs = 5 if rank == 0 else 1
        mbs = pack_micro_batches([[1] * 6] * n_seqs, 8, per_token={"loss_mask": [[0] + [1] * 5] * n_seqs})
        out = equalise_micro_batches(mbs)
        # One write per rank into its own file: two forked ranks printing to one pipe can interleave their lines.
        with open(f"{store}.rank{rank}", "w") as f:
            f.write(f"RANK{rank} {len(mbs)} {len(out)} {sum(m.is_dummy for m in out)}")
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.start_processes(run, args=(sys.argv[1],), nprocs=2, start_method="fork")   # fork: no second torch import
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_equalise_over_torch_distributed(tmp_path):
    """Two gloo ranks with 5 and 1 micro-batches both end with 5 (rank 1 gets 4 dummies)."""
    script = tmp_path / "equalise.py"
    script.write_text(_DIST_SCRIPT)
    env = dict(os.environ, REPO=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], env=env, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [(tmp_path / f"store.rank{r}").read_text() for r in range(2)]
    assert lines == ["RANK0 5 5 0", "RANK1 1 5 4"]


# ----------------------------------------------------------------------------- tiny real model

def _tiny_model(kind: str, attn: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    if kind == "qwen2":   # q/k/v biases, untied head; use_cache left at its default True (the trap)
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False, attn_implementation=attn))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, attn_implementation=attn))
    assert model.config._attn_implementation == attn
    return model.float()


def _trajectories(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    ids, masks, advs = [], [], []
    for _ in range(n):
        t = rnd.randint(4, 40)
        ids.append(torch.randint(0, 211, (t,), generator=g))
        m = (torch.rand(t, generator=g) < 0.75).long()
        m[: rnd.randint(1, 3)] = 0
        masks.append(m)
        advs.append(torch.full((t,), rnd.uniform(-1, 1)))
    return ids, masks, advs


def _unpacked_logprobs(model, ids, temperature):
    """Plain HF forward per sequence, full logits, log_softmax: the thing packing must reproduce."""
    logits = model(ids[None], use_cache=False).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = torch.cat([torch.zeros(1), logp[:-1].gather(1, ids[1:, None]).squeeze(1)])
    ent = torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)[:-1]])
    return lp, ent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,attn,varlen", [("qwen2", "sdpa", True), ("llama", "sdpa", False),
                                              ("llama", "eager", False)])
def test_packed_equals_unpacked_logprobs_loss_and_grads(kind, attn, varlen):
    """sdpa+varlen: one SDPA call per sequence; sdpa / eager: explicit 4D block-diagonal mask."""
    from training.algorithm.logprobs import sequence_logprobs
    from training.algorithm.loss import count_normaliser, policy_loss

    model = _tiny_model(kind, attn)
    ids, masks, advs = _trajectories(1)
    temp, agg = 0.8, "seq-mean-token-mean"
    kw = dict(agg=agg, clip_low=0.2, clip_high=0.28, entropy_coef=0.01)

    # Unpacked reference: one forward per sequence.
    model.zero_grad()
    ref_lp, loss_ref = [], 0.0
    with torch.no_grad():
        olds = [_unpacked_logprobs(model, x, temp)[0] + 0.1 * torch.randn(len(x)) for x in ids]
    norm = sum(count_normaliser(m[None], agg) for m in masks)
    for x, m, a, old in zip(ids, masks, advs, olds):
        lp, ent = _unpacked_logprobs(model, x, temp)
        ref_lp.append(lp.detach())
        loss, _ = policy_loss(lp[None], old[None], a[None], m[None], normaliser=norm, entropy=ent[None], **kw)
        loss.backward()
        loss_ref += float(loss.detach())
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}

    # Packed: two micro-batches, explicit block-diagonal attention, chunked head.
    model.zero_grad()
    mbs = pack_micro_batches(ids, 80, per_token={"loss_mask": masks, "advantages": advs, "old_logprobs": olds})
    assert len(mbs) >= 2 and max(len(mb.seq_indices) for mb in mbs) >= 2
    assert norm == sum(count_normaliser(mb.tensors["loss_mask"], agg, mb.cu_seqlens) for mb in mbs)
    loss_packed, all_lp, masked_lp = 0.0, [], []
    for mb in mbs:
        lp_all, _ = sequence_logprobs(model, mb, temp, compute_entropy=True, only_masked=False, varlen_sdpa=varlen)
        all_lp.append(lp_all.detach())
        lp, ent = sequence_logprobs(model, mb, temp, compute_entropy=True, varlen_sdpa=varlen)   # only_masked
        masked_lp.append(lp.detach())
        loss, _ = policy_loss(lp, mb.tensors["old_logprobs"], mb.tensors["advantages"], mb.tensors["loss_mask"],
                              normaliser=norm, entropy=ent, cu_seqlens=mb.cu_seqlens, **kw)
        loss.backward()
        loss_packed += float(loss.detach())

    assert model.config._attn_implementation == ("ssp_varlen_sdpa" if varlen else attn)
    for got, want, m in zip(unpack_to_sequences(mbs, all_lp, len(ids)), ref_lp, masks):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for got, want, m in zip(unpack_to_sequences(mbs, masked_lp, len(ids)), ref_lp, masks):
        torch.testing.assert_close(got, want * m, atol=1e-5, rtol=0)              # zeros off the mask
    assert abs(loss_packed - loss_ref) < 1e-5
    worst = max(float((p.grad - grads_ref[n]).abs().max()) for n, p in model.named_parameters())
    assert worst < 1e-5, f"max gradient difference {worst}"


@pytest.mark.timeout(60)
def test_naive_packing_with_cache_leaks_across_sequences():
    """Negative control for the trap: the same comparison catches cross-sequence attention."""
    from training.algorithm.packing import model_inputs

    model = _tiny_model("qwen2", "sdpa")
    ids, _, _ = _trajectories(2, n=3)
    mb = pack_micro_batches(ids, 200)[0]
    with torch.no_grad():
        sep = torch.cat([model.model(ids[i][None], use_cache=False).last_hidden_state[0] for i in mb.seq_indices])
        ours = model.model(**model_inputs(mb, "sdpa")).last_hidden_state[0]                 # 4D block mask
        naive = model.model(input_ids=mb.input_ids, position_ids=mb.position_ids).last_hidden_state[0]  # cache on
    assert float((ours - sep).abs().max()) < 1e-5
    assert float((naive - sep).abs().max()) > 1e-3


@pytest.mark.timeout(60)
def test_start_up_guard_passes_ours_and_catches_the_trap():
    from training.algorithm.packing import verify_packed_attention

    for kind, attn in (("qwen2", "sdpa"), ("llama", "eager")):
        assert verify_packed_attention(_tiny_model(kind, attn)) < 1e-5

    def naive_inputs(mb, impl, dtype):                      # position_ids only, cache on by default
        return {"input_ids": mb.input_ids, "position_ids": mb.position_ids}
    with pytest.raises(RuntimeError, match="leaks across sequences"):
        verify_packed_attention(_tiny_model("qwen2", "sdpa"), inputs_fn=naive_inputs)


@pytest.mark.timeout(60)
def test_dummy_micro_batch_gives_zero_loss_and_gradient():
    from training.algorithm.logprobs import sequence_logprobs
    from training.algorithm.loss import policy_loss

    model = _tiny_model("llama", "sdpa")
    model.zero_grad()
    mb = equalise_micro_batches([], all_reduce_max=lambda n: 1, per_token_keys=("loss_mask", "advantages",
                                                                                "old_logprobs"))[0]
    lp, ent = sequence_logprobs(model, mb, 1.0, compute_entropy=True)
    loss, metrics = policy_loss(lp, mb.tensors["old_logprobs"], mb.tensors["advantages"], mb.tensors["loss_mask"],
                                normaliser=17, entropy=ent, entropy_coef=0.01)
    assert loss.requires_grad and float(loss.detach()) == 0.0 and float(metrics["actor/num_tokens"]) == 0
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert any(g is not None for g in grads)                  # the backward did run through the model
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)
    assert dummy_micro_batch().unpack(torch.zeros(1)) == []


@pytest.mark.gpu
def test_flash_attention_varlen_matches_sdpa():
    """GPU only (skipped here): the flash-attn varlen branch of model_inputs against sdpa."""
    from training.algorithm.logprobs import sequence_logprobs

    pytest.importorskip("flash_attn")
    ids, masks, _ = _trajectories(3)
    mbs = pack_micro_batches(ids, 400, per_token={"loss_mask": masks})
    out = {}
    for attn in ("sdpa", "flash_attention_2"):
        model = _tiny_model("qwen2", attn).to("cuda", torch.bfloat16)
        with torch.no_grad():
            out[attn] = sequence_logprobs(model, mbs[0].to("cuda"), 1.0)[0].float()
    assert float((out["sdpa"] - out["flash_attention_2"]).abs().max()) < 5e-2
