"""The bench scripts that no other test runs, each run for real at the smallest scale that still goes through its
code, into a temporary BENCH_RESULTS_DIR: the section is written, and what the script checks came out as it should
(packed == padded loss, a non-writing rank's export allocates nothing of the model, both rollout schedules give the
same trajectories, every simulated document was written). Their measured numbers are bench/RESULTS.md's; these
runs only keep the scripts from rotting between measurements. They search the session's 200-document BM25 index
(conftest bm25_corpus), not data/indexes/bm25, which only the demo and ladder scripts build."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, script: str, *args: str, timeout: int = 600) -> tuple[dict, str]:
    """Run bench/<script> with its results sent to tmp_path; (results.json, RESULTS.md) afterwards."""
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(REPO / ".torch_extensions")}
    r = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text()), (tmp_path / "RESULTS.md").read_text()


def test_gpu_check_report_carries_the_reports_numbers(tmp_path):
    rep = json.loads((REPO / "bench" / "gpu_check_h200.json").read_text())
    keys, md = _bench(tmp_path, "gpu_check_report.py", "bench/gpu_check_h200.json", "--note", "a note")
    assert "## gpu_check" in md and "a note" in md
    assert keys["gpu_check.ok"] is bool(rep["ok"])
    lp = rep["steps"]["logprobs"]
    assert keys["gpu_check.logprobs_fp32_max_abs_diff"] == lp["fp32_max_abs_diff"]
    assert keys["gpu_check.export_max_abs_diff"] == rep["steps"]["export"]["max_abs_diff"]


def test_bench_loss_packed_matches_padded(tmp_path):
    keys, md = _bench(tmp_path, "bench_loss.py", "--seqs", "3", "--median-len", "40", "--min-len", "16", "--max-len",
                      "64", "--max-tokens", "128", "--padded-mb", "2", "--vocab", "256", "--repeats", "1",
                      "--mem-tokens", "64", "--mem-vocab", "512", "--mem-hidden", "16", "--skip-trl")
    assert "## loss" in md
    # the same fp32 loss over the same tokens, summed in another order: a few ulps of a value of order 1
    assert keys["loss.packed_loss_abs_diff"] <= 1e-5 and keys["loss.packed_grad_max_abs_diff"] <= 1e-5
    assert 0 < keys["loss.padding_fraction"] < 1 and keys["loss.packed_tokens_per_s"] > 0


def _dump(folder: Path) -> None:
    """Two (step, rank) files as --dump_rollouts writes them: proposers and solvers, one excluded, one not sampled."""
    folder.mkdir()
    for step in (1, 2):
        rows = [{"role": "proposer", "group_id": 0, "answer": "Paris", "searches": 1, "question": None,
                 "response": "<think>x</think><search>Paris</search><information>Doc 1: Paris</information>"
                             "<question>What is the capital of France?</question>", "sampled_tokens": 30, "reward": 1.0},
                {"role": "solver", "group_id": 1, "question": "What is the capital of France?", "answer": "Paris",
                 "response": "<search>capital France</search><information>Doc 1 (Title: Paris)</information>"
                             "<answer>Paris</answer>", "sampled_tokens": 12, "reward": 1.0},
                {"role": "solver", "group_id": 1, "question": "What is the capital of France?", "answer": "Paris",
                 "response": "<answer>Lyon</answer>", "sampled_tokens": 6, "reward": 0.0},
                {"role": "solver", "group_id": 2, "question": "q", "answer": "a", "response": "<answer>a</answer>",
                 "sampled_tokens": 5, "reward": 1.0, "excluded": "judge_failed"},
                {"role": "solver", "group_id": 3, "question": "q", "answer": "a", "response": "", "sampled_tokens": 0,
                 "reward": 0.0}]
        (folder / f"step_{step}.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_bench_pack_packs_once_where_it_packed_per_phase(tmp_path):
    _dump(tmp_path / "rollouts")
    keys, md = _bench(tmp_path, "bench_pack.py", "--rollouts", str(tmp_path / "rollouts"), "--repeats", "2")
    assert "## pack" in md
    assert keys["pack.steps"] == 2 and keys["pack.trajs_per_step"] == 3   # the excluded and the empty one left out
    assert keys["pack.default.packings_after"] == 1 < keys["pack.default.packings_before"]
    assert keys["pack.full.packings_after"] == 1 < keys["pack.full.packings_before"]


@pytest.mark.slow
def test_bench_rollout_async_schedules_give_identical_trajectories(tmp_path, tiny_model_dir, bm25_corpus):
    keys, md = _bench(tmp_path, "bench_rollout_async.py", "--n", "2", "--max-turns", "2", "--max-tokens-per-turn",
                      "8", "--repeats", "1", "--latencies", "0ms", "--model", str(tiny_model_dir),
                      "--index", str(bm25_corpus / "bm25"))
    assert "## rollout_async" in md and keys["rollout_async.speedup_0ms"] > 0
    row = next(line for line in md.splitlines() if line.startswith("| 0ms | trajectory"))
    assert row.rstrip().endswith("| 2/2 |"), row


@pytest.mark.slow
def test_bench_export_non_writing_rank_allocates_no_model(tmp_path, tiny_model_dir):
    keys, md = _bench(tmp_path, "bench_export.py", "--model", str(tiny_model_dir), "--repeats", "1")
    assert "## export" in md and keys["export.shards"] >= 1
    # the script's own target: a non-writing rank's peak RSS rise within the largest layer group + 10%
    assert keys["export.rank1_over_largest_group"] <= 1.1, keys


@pytest.mark.slow
def test_bench_backends_every_document_written(tmp_path, tiny_model_dir, bm25_corpus):
    keys, md = _bench(tmp_path, "bench_backends.py", "--queries", "1", "--repeats", "1", "--model", str(tiny_model_dir),
                      "--index", str(bm25_corpus / "bm25"))
    assert "## search backends" in md and "3 docs written, 0 failed" in md, md[-2000:]
    assert 0 < keys["backends.retriever_s"] < keys["backends.simulated_s"]


@pytest.mark.slow
def test_bench_rollout_async_step_plays_identical_rounds(tmp_path, tiny_model_dir, bm25_corpus):
    """--step: one whole round of the game (proposers, filters, RAG check, pool, solvers, grading) under both
    schedules; a random model writes no valid question, so this keeps the script's path alive, not the game's."""
    keys, md = _bench(tmp_path, "bench_rollout_async.py", "--step", "--step-rows", "2", "--step-solver-n", "2",
                      "--repeats", "1", "--max-tokens-per-turn", "8", "--step-search-ms", "0", "--step-judge-ms", "0",
                      "--model", str(tiny_model_dir), "--index", str(bm25_corpus / "bm25"))
    assert "## rollout_async_step" in md and keys["rollout_async.step_speedup"] > 0
    row = next(line for line in md.splitlines() if line.startswith("| trajectory |"))
    assert re.search(r"\| (\d+)/\1, stats equal \|$", row.rstrip()), row      # every trajectory identical
