"""--distill topk wired end to end (issue 22): the teacher's top-K pass and the student's top-K reverse-KL
term in the update, under ZeRO-3 over gloo, against plain torch on the whole batch.

tests/training/distill_worker.py runs under torchrun twice (1 rank: K = 8 and K = V; 2 ranks: K = 8; see
its docstring for the phases). The
model is a tiny random Llama with a 256-token vocabulary and a tied lm_head, so that K = V (the exact
full-vocabulary KL) is cheap and the term's gradient reaches the embeddings through the tied weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest

VOCAB = 256


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama_v256")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, use_cache=False,
                      initializer_range=0.15)   # peaked enough that the prompt moves the top-K: mean KL ~0.5
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def runs(small_vocab_model, tmp_path_factory):
    """runs(world) -> {K: results}: distill_worker.py at `world` ranks, launched once per module. One rank runs
    K = 8 and K = V in one process, two ranks K = 8 (a launch costs ~10 CPU-s of start-up a rank)."""
    from tests.training.launch import launch_worker

    out_dir, done = tmp_path_factory.mktemp("distill"), {}
    ks = {1: f"8,{VOCAB}", 2: "8"}

    def run(world: int) -> dict:
        if world not in done:
            done[world] = launch_worker(small_vocab_model, out_dir, "distill_worker", world, ks[world], timeout=300)
        return done[world]
    return run


def _check_term(res: dict) -> None:
    # the teacher pass: the reference's top-K ids and log-probs, zero rows off the loss mask
    assert res["teacher_id_mismatch"] == 0 and res["teacher_lp_err"] < 3e-5, res     # measured 4e-6 to 6e-6
    assert res["teacher_off_rows"] == 0.0, res
    # the wired term: per-token KL and gradient of every parameter against plain torch on the whole batch;
    # rows off the loss mask (prompt, <information>) and trajectories without a teacher carry exactly 0,
    # although their teacher rows hold NaN and id -1
    assert res["term_kl_err"] < 1e-5 and res["term_off_mask"] == 0.0, res
    assert res["term_grad_norm"] > 1e-4 and res["term_grad_rel_err"] < 1e-5, res


@pytest.mark.parametrize("world", [1, 2])
def test_topk_term_and_its_gradient_match_plain_torch(runs, world):
    res = runs(world)["8"]
    assert res["world"] == world and res["k"] == 8, res
    _check_term(res)
    assert 0 < res["kl_ref_mean"] < 50, res
    # in ppo_update: beta 0 leaves the gradient of --distill off (to 1e-6), beta adds beta x the term's
    assert res["zero_vs_off_max_abs"] <= 1e-6 * max(res["off_grad_max_abs"], 1.0), res
    assert res["update_term_rel_err"] < 1e-4, res
    m = res["update_metrics"]
    assert "distill/kl" not in m["off"] and m["zero"]["distill/kl"] > 0, m
    for name in ("zero", "beta"):    # one optimizer step at unchanged weights: the reference's mean KL
        assert m[name]["distill/kl"] == pytest.approx(res["kl_ref_mean"], rel=1e-5), (name, m, res["kl_ref_mean"])
    assert m["zero"]["distill/kl_loss"] == 0.0 and m["beta"]["distill/kl_loss"] > 0, m
    seq = res["sequential"]   # proposer steps without a covered token, 2 epochs x 2 mini-batches
    assert seq["optimizer_steps"] > 4 and seq["skipped"] == 0, seq
    assert seq["distill/kl"] == pytest.approx(res["kl_ref_mean"], rel=1e-5), (seq, res["kl_ref_mean"])


def test_topk_with_k_equal_vocab_is_the_full_reverse_kl(runs):
    res = runs(1)[str(VOCAB)]
    assert res["k"] == res["vocab"] == VOCAB
    _check_term(res)
    assert res["full_kl_err"] < 1e-5 and res["kl_ref_mean"] > 0, res
