"""bench/bench_sync.py's table and keys from constructed per-configuration results (the torchrun part is
smoke-run by hand: it needs two ranks of vLLM + DeepSpeed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import bench.bench_sync as bench_sync  # noqa: E402


def _res(t0, t1, gaps, stale, mb):
    return {"times": {"0": t0, "1024": t1}, "gaps": gaps, "stale_gaps": stale, "calls": {"0": 32, "1024": 1},
            "mb_sent": mb, "default_mb": 1024}


def test_report_rows_check_and_keys():
    args = argparse.Namespace(model="data/models/SmolLM2-135M-Instruct", repeats=3, lr=1e-3)
    keys, md = bench_sync.report(args, {
        ("fp32", 0): _res([3.0, 1.0, 2.0], [0.5, 0.7, 0.6], [1e-5, 2e-5, 1e-5], [0.3, 0.2, 0.4], 513.0),
        ("bf16", 8): _res([0.4, 0.5, 0.3], [0.1, 0.2, 0.3], [6e-3, 1e-2, 2e-3], [0.05, 0.2, 0.3], 60.4),
    })
    assert "| fp32 | all | 513.0 | 1024 MiB buckets (default) | 1 | 0.6 | 0.5 | 0.7 |" in md
    assert "| bf16 | top 8 | 60.4 | one decoder layer per call (bucket_mb=0) | 32 | 0.4 | 0.3 | 0.5 |" in md
    # the check, round by round: the gap after each sync against the gap on the stale weights just before it
    assert "| fp32 | all | 2.00e-05 | 2.00e-01 | 0.0001 | ok |" in md
    assert "| bf16 | top 8 | 1.00e-02 | 5.00e-02 | 0.12 | NO POWER |" in md   # round 1: 6e-3 after, 0.05 before
    assert abs(keys["sync.bf16_top8.worst_gap_ratio"] - 0.12) < 1e-9
    # the old keys keep their meaning (fp32, all layers); each configuration has its own
    assert keys["sync.seconds"] == keys["sync.fp32_full.seconds"] == 0.6
    assert keys["sync.seconds_per_layer_buckets"] == 2.0 and keys["sync.max_logprob_gap"] == 2e-5
    assert keys["sync.bf16_top8.seconds"] == 0.2 and keys["sync.bf16_top8.min_stale_logprob_gap"] == 0.05
    assert "sync.bf16_top8.max_logprob_gap" in keys and keys["sync.bf16_top8.mb_sent"] == 60.4


def test_the_check_pairs_each_sync_with_its_own_stale_gap():
    """A bf16-like run: one round's sampled token carries 0.25 nats of kernel rounding after a good sync, while
    another round's update moved the model little (0.03 before). Each sync is still 10x below its own stale
    gap, so the check passes; the same numbers paired across rounds (max after against min before) would not.
    A stale sync (after = before in one round) fails."""
    args = argparse.Namespace(model="m", repeats=4, lr=1e-3)
    good = _res([1.0] * 4, [1.0] * 4, [0.25, 8e-3, 8e-3, 2e-4], [11.8, 11.6, 24.7, 0.03], 256.6)
    _, md = bench_sync.report(args, {("bf16", 0): good})
    assert "| bf16 | all | 2.50e-01 | 3.00e-02 | 0.021 | ok |" in md
    stale = _res([1.0] * 4, [1.0] * 4, [1e-4, 1e-4, 0.03, 1e-4], [11.8, 11.6, 0.03, 2.0], 256.6)
    _, md = bench_sync.report(args, {("bf16", 0): stale})
    assert "| 1 | NO POWER |" in md
