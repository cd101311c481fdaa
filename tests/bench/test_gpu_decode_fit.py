"""bench/gpu_decode_fit.py: the --tiny run (2-layer Qwen2, fp32, CPU) times every grid point and its fit reproduces
them; the chunked prefill's merged cache decodes as one unchunked prefill does.

    .venv/bin/python -m pytest tests/bench/test_gpu_decode_fit.py -q
    .venv/bin/python bench/gpu_decode_fit.py --out /tmp/tiny.json --tiny      # the run the first test launches
    python bench/gpu_decode_fit.py --out decode_fit.json                      # on a GPU: Qwen2.5-7B shape, bf16
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import bench.gpu_decode_fit as gdf  # noqa: E402


def test_tiny_run_times_the_grid_and_fits_it(tmp_path):
    out = tmp_path / "fit.json"
    proc = subprocess.run([sys.executable, "bench/gpu_decode_fit.py", "--tiny", "--out", str(out)], cwd=REPO,
                          check=True, capture_output=True, text=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["env"]["shape"] == "tiny" and res["env"]["device"] == "cpu" and res["env"]["dtype"] == "float32"
    assert "not vLLM" in res["note"] and res["skipped"] == [] and res["total_s"] > 0
    Bs, Ls = gdf.GRID["tiny"]
    assert sorted((p["B"], p["L"]) for p in res["points"]) == sorted((b, l) for b in Bs for l in Ls)
    for p in res["points"]:
        assert p["step_s"] > 0 and p["prefill_s"] > 0 and p["prefill_tok_s"] > 0 and p["steps"] == 8
        assert p["tokens"] == p["B"] * p["L"]
    step, pre = res["fits"]["step_s"], res["fits"]["prefill_s"]
    assert all(math.isfinite(step[k]) for k in ("a", "b", "c", "max_rel_err", "r2"))
    assert all(math.isfinite(pre[k]) for k in ("p0", "p1", "max_rel_err", "r2"))
    # the fit reproduces the measured points: on the tiny model a step is ~1 ms of mostly Python overhead, and on a
    # loaded 2-core CPU shared with other jobs the medians jitter by tens of percent, so the bound is only 3x
    for p in res["points"]:
        for pred, meas in [(step["a"] + step["b"] * p["B"] + step["c"] * p["B"] * p["L"], p["step_s"]),
                           (pre["p0"] + pre["p1"] * p["tokens"], p["prefill_s"])]:
            assert meas / 3 < pred < meas * 3, (p, pred)
    assert "step_s: a=" in proc.stdout and "R^2" in proc.stdout


def test_chunked_prefill_merges_into_the_same_cache():
    torch.manual_seed(0)
    with torch.inference_mode():
        model, cfg = gdf.build("tiny", "cpu", torch.float32)
        ids = torch.randint(0, cfg.vocab_size, (3, 16))
        whole = gdf.prefill(model, cfg, ids, chunk_tokens=1024)   # one chunk
        parts = gdf.prefill(model, cfg, ids, chunk_tokens=16)     # one sequence per chunk
        assert parts.get_seq_length() == whole.get_seq_length() == 16
        k_w, v_w = gdf._kv(whole, 1)
        k_p, v_p = gdf._kv(parts, 1)
        assert k_p.shape == k_w.shape and k_w.shape[0] == 3
        torch.testing.assert_close(k_p, k_w, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v_p, v_w, rtol=1e-4, atol=1e-5)
        tok = torch.tensor([[5], [6], [7]])
        a = model(input_ids=tok, past_key_values=whole, use_cache=True, logits_to_keep=1).logits
        b = model(input_ids=tok, past_key_values=parts, use_cache=True, logits_to_keep=1).logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
