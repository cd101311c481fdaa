"""bench/replay_engine.py: the step-time model reproduces its published points; a real model's recorded rollouts
replay token for token under both schedules, at the modelled step times; a request never recorded is refused.

    .venv/bin/python -m pytest tests/bench/test_replay_engine.py -q
    .venv/bin/python bench/bench_rollout_gpu_model.py          # the bench these pieces serve (section rollout_async_gpu_model)
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.replay_engine import (CONSTANTS, Recorder, ReplayEngine, ReplayMiss, StepCostModel,  # noqa: E402
                                 request_key)
from inference.engine_api import GenOutput, SamplingConfig, SteppedGenerator, TokenGenerator  # noqa: E402


def test_the_h100_model_reproduces_the_published_points_it_cites():
    data = json.loads(CONSTANTS.read_text())["models"]["h100_vllm_8b"]
    m = StepCostModel.load("h100_vllm_8b")
    assert len(data["points"]) >= 5 and all(p["source"] for p in data["points"])
    for pt in data["points"]:
        got = m.step_s(pt["B"], pt["B"] * pt["L"], 0)
        assert got == pytest.approx(pt["step_s"], rel=0.05), pt
    # a 7-8B model on an H100 is memory-bound at small batches: the step floor dominates 8 sequences
    assert 0.005 < m.a < 0.01 and m.b > 0 and m.step_s(8, 8 * 500, 0) < 1.2 * m.a
    hf = StepCostModel.load("h200_hf_eager_7b")
    assert hf.step_s(8, 4000, 0) > 5 * m.step_s(8, 4000, 0)  # the upper bound sits well above vLLM


def test_the_replay_engine_keeps_the_stepped_protocol():
    for proto in (SteppedGenerator, TokenGenerator):
        for name in [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]:
            want = [p.name for p in inspect.signature(getattr(proto, name)).parameters.values()]
            for cls in (ReplayEngine, Recorder):
                assert [p.name for p in inspect.signature(getattr(cls, name)).parameters.values()] == want, (cls, name)
    assert ReplayEngine.lockstep_ranks == 1 and Recorder.lockstep_first


class _Tok:
    def decode(self, ids, **_):
        return " ".join(map(str, ids))


def _model(a=0.004, b=0.0005, c=1e-6, p=2e-5, **sch) -> StepCostModel:
    return StepCostModel(a, b, c, p, "test", "test", {}, {"max_num_seqs": 256, "max_num_batched_tokens": 64,
                                                          "block_size": 4, **sch})


def test_each_step_lasts_the_modelled_time_and_emits_one_token_per_sequence():
    s = SamplingConfig(temperature=0.0, max_tokens=8)
    prompts = [list(range(10)), list(range(100, 106))]
    outs = [GenOutput([1, 2, 3], [-0.1] * 3, "x", "length"), GenOutput([7, 8, 9, 10, 11], [-0.2] * 5, "y", "eos")]
    eng = ReplayEngine({request_key(p, s): o for p, o in zip(prompts, outs)}, _Tok(), 2048, _model())
    t0 = time.perf_counter()
    got = eng.generate(prompts, s)
    wall = time.perf_counter() - t0
    assert [o.token_ids for o in got] == [[1, 2, 3], [7, 8, 9, 10, 11]]
    # step 1 prefills both prompts (16 tokens) and emits the first tokens; then 2 steps of 2 sequences (contexts
    # 11 + 7, then 12 + 8), and 2 of the longer reply alone (9, then 10)
    m = eng.model
    want = m.step_s(0, 0, 16) + m.step_s(2, 18, 0) + m.step_s(2, 20, 0) + m.step_s(1, 9, 0) + m.step_s(1, 10, 0)
    assert eng.steps == 5 and eng.modelled_s == pytest.approx(want)
    assert wall >= eng.modelled_s


def test_the_prefix_cache_saves_prefill_and_a_reset_forgets_it():
    s = SamplingConfig(temperature=0.0, max_tokens=4)
    prompt = list(range(40))
    eng = ReplayEngine({request_key(prompt, s): GenOutput([5], [0.0], "", "eos")}, _Tok(), 2048, _model(a=0.0))
    eng.generate([prompt], s)
    assert eng.prefill_tokens == 40 and eng.cached_tokens == 0
    eng.reset_counters()
    eng.generate([prompt], s)
    assert eng.cached_tokens == 39 and eng.prefill_tokens == 1  # the last prompt token is always computed
    eng.reset_prefix_cache()
    eng.reset_counters()
    eng.generate([prompt], s)
    assert eng.cached_tokens == 0 and eng.prefill_tokens == 40


def test_a_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    s = SamplingConfig(temperature=0.0, max_tokens=4)
    prompt = list(range(150))  # budget 64 a step: 64 + 64 + 22
    eng = ReplayEngine({request_key(prompt, s): GenOutput([5, 6], [0.0, 0.0], "", "eos")}, _Tok(), 2048,
                       _model(a=0.0))
    eng.submit("k", prompt, s)
    assert eng.step() == [] and eng.step() == []
    assert eng.step() == [] and eng.prefill_tokens == 150  # the third step ends the prefill, emits token 1
    assert [(k, o.token_ids) for k, o in eng.step()] == [("k", [5, 6])] and eng.num_unfinished() == 0


def test_a_request_never_recorded_is_refused_with_a_reason():
    s = SamplingConfig(temperature=1.0, max_tokens=4, seed=3)
    eng = ReplayEngine({request_key([1, 2, 3], s): GenOutput([5], [0.0], "", "eos")}, _Tok(), 2048, _model())
    with pytest.raises(ReplayMiss, match="never made this request"):
        eng.submit("k", [1, 2, 3], SamplingConfig(temperature=1.0, max_tokens=4, seed=4))  # another seed
    with pytest.raises(ReplayMiss, match="prompt of 4 tokens"):
        eng.generate([[1, 2, 3, 4]], s)


@pytest.mark.slow
def test_a_real_models_rollouts_replay_token_for_token_under_both_schedules(smollm2_dir):
    """SmolLM2-135M (HF engine, greedy) recorded under both schedules, then replayed under both: the same
    trajectories, and each replayed run takes at least its modelled GPU time."""
    from bench.bench_rollout import build_prompts
    from inference.hf_engine import HFEngine
    from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts

    eng = HFEngine(smollm2_dir, batch_size=4)
    qs = ["What is the capital of France?", "Who wrote Hamlet?"]
    prompts = build_prompts(eng.tokenizer, qs, "fewshot")
    corpus = ["Paris is the capital of France.", "Hamlet is a play by William Shakespeare."]

    def search(queries, topk):  # a word-overlap ranker: deterministic, like BM25
        score = lambda q, d: len(set(q.lower().split()) & set(d.lower().split()))  # noqa: E731
        return [[{"id": str(i), "contents": d, "score": float(score(q, d))}
                 for i, d in sorted(enumerate(corpus), key=lambda x: -score(q, x[1]))[:topk]] for q in queries]

    cfg = dict(max_turns=2, max_total_tokens=2048, max_tokens_per_turn=24, max_info_tokens=96, topk=1,
               temperature=0.0, seed=0)

    def run(e, sch):
        reqs = [RolloutRequest("solver", f"g{i}", p, question=q) for i, (p, q) in enumerate(zip(prompts, qs))]
        return run_rollouts(e, reqs, search, RolloutConfig(schedule=sch, **cfg))

    rec = Recorder(eng)
    recorded = {sch: run(rec, sch) for sch in ("turn", "trajectory")}
    assert any(t.num_searches for t in recorded["turn"]), "the few-shot prompt should make SmolLM2 search"
    assert sum(t.num_turns for t in recorded["turn"]) > len(qs)
    replay = ReplayEngine(rec.table, eng.tokenizer, eng.max_model_len, StepCostModel.load("h100_vllm_8b"))
    for sch in ("turn", "trajectory"):
        replay.reset_prefix_cache()
        replay.reset_counters()
        t0 = time.perf_counter()
        got = run(replay, sch)
        wall = time.perf_counter() - t0
        for a, b in zip(got, recorded[sch]):
            assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.logprobs == b.logprobs
        n_tok = sum(t.num_sampled for t in got)
        assert replay.steps >= max(t.num_sampled for t in got) and wall >= replay.modelled_s > 0
        assert n_tok == sum(t.num_sampled for t in recorded[sch])
