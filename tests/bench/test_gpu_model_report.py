"""bench/bench_rollout_gpu_model.report on hand-made replay results (no engine): the keys and prose it writes.

The bench's run is its measurement; this checks the arithmetic and the sentences it builds around the numbers:
the trajectory-over-turn ratio of sampled tokens per wall second, the target verdicts, the policy it names, and the
note that a rollout cell without a single search times decode alone (the SFT policy's n=8 cells did that).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench_rollout_gpu_model as B  # noqa: E402
from bench.replay_engine import StepCostModel  # noqa: E402


def _run(tokens: int, wall: float, calls: int) -> dict:
    return {"tokens": tokens, "wall": wall, "gpu_s": wall / 2, "steps": 10, "overrun": 0.0, "max_batch": 2,
            "calls": calls, "same": 2}


def _report(calls: int, model: str | None):
    args = argparse.Namespace(n=2, max_turns=3, max_tokens_per_turn=32, topk=2, max_info_tokens=192, seed=0,
                              repeats=1, model=model, step_judge_ms=300)
    cell = {"turn": [_run(100, 2.0, calls)], "trajectory": [_run(100, 1.25, calls)]}   # 50 and 80 tokens/s
    part = dict(n=2, recorded={"turn": {"wall": 9.0}, "trajectory": {"wall": 8.0}}, rec_same=2,
                roll={"h100_vllm_8b": {"300ms": cell}}, floors={"h100_vllm_8b": {"300ms": 0.5}}, qsrc="capitals")
    models = {"h100_vllm_8b": StepCostModel.load("h100_vllm_8b")}
    return B.report(args, models, SimpleNamespace(table={}, conflicts=0), [part], None, {}, "bm25", 10.0, "")


@pytest.mark.parametrize("calls, model", [(0, "runs/x/sft/hf"), (3, None)])
def test_the_report_computes_the_ratio_and_says_what_ran(calls, model):
    md, keys = _report(calls, model)
    assert keys["rollout_async_gpu_model.speedup_300ms"] == pytest.approx(1.6)     # 80 / 50 tokens per second
    assert keys["rollout_async_gpu_model.target_speedup_300ms_met"] is True
    assert "Every time and ratio below is EMULATED" in md and "speedup_300ms 1.60x against >= 1.5x (met)" in md
    named = "the policy at runs/x/sft/hf" if model else "SmolLM2-135M-Instruct"
    assert f"hands out the tokens {named} (fp32" in md
    decode_alone = "wrote no search in the rollouts' few-shot prompt (search calls 0)"
    assert (decode_alone in md) == (calls == 0)
