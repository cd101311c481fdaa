"""Chunked log-prob/entropy against a full log_softmax reference; the Triton kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from training.algorithm.logprobs import auto_chunk_size, chunked_logprobs_entropy, full_logprobs_entropy

REPO = Path(__file__).resolve().parents[2]


def _inputs(seed, n=45, h=24, v=301, bias=True):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.5
    b = torch.randn(v, generator=g) if bias else None
    tgt = torch.randint(0, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hid, w, b, tgt, g_lp, g_ent


def _grads(fn, hid, w, b, tgt, g_lp, g_ent, temperature, entropy, dtype=torch.float32):
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (hid, w) + ((b,) if b is not None else ())]
    lp, ent = fn(leaves[0], leaves[1], tgt, leaves[2] if b is not None else None, temperature, entropy)
    obj = (lp * g_lp.to(dtype)).sum() + ((ent * g_ent.to(dtype)).sum() if entropy else 0)
    return [lp.detach().double(), (ent.detach().double() if entropy else None)] + [
        x.double() for x in torch.autograd.grad(obj, leaves)]


def _full(h, w, t, b, temp, ent):
    return full_logprobs_entropy(h, w, t, b, temp, ent)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("temperature,entropy,bias", [(1.0, True, True), (0.7, True, False), (1.3, False, True)])
def test_chunked_matches_full_log_softmax(chunk, temperature, entropy, bias):
    args = _inputs(chunk or 0, bias=bias)
    ref = _grads(_full, *args, temperature, entropy, dtype=torch.float64)      # fp64 ground truth
    got = _grads(lambda h, w, t, b, temp, e: chunked_logprobs_entropy(h, w, t, b, temp, chunk, e, backend="torch"),
                 *args, temperature, entropy)
    for name, r, x in zip(["logprob", "entropy", "d_hidden", "d_weight", "d_bias"], ref, got):
        if r is None:
            assert x is None
            continue
        err = float((r - x).abs().max() / r.abs().max().clamp(min=1))
        assert err < 1e-5, f"{name}: relative error {err}"


def test_frozen_head_and_only_hidden_grad():
    hid, w, b, tgt, g_lp, _ = _inputs(3)
    h = hid.clone().requires_grad_(True)
    lp, _ = chunked_logprobs_entropy(h, w, tgt, b, 1.0, 8, compute_entropy=False, backend="torch")
    (lp * g_lp).sum().backward()
    h2 = hid.clone().requires_grad_(True)
    lp2, _ = full_logprobs_entropy(h2, w, tgt, b, 1.0, False)
    (lp2 * g_lp).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-5, rtol=1e-5)


def test_errors_and_chunk_size():
    hid, w, b, tgt, _, _ = _inputs(0)
    with pytest.raises(ValueError, match="target ids must be in"):
        chunked_logprobs_entropy(hid, w, tgt + 1000)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs_entropy(hid, w, tgt, temperature=0.0)
    with pytest.raises(ValueError, match="partitioned"):
        chunked_logprobs_entropy(hid, torch.empty(0, hid.shape[1]), tgt)
    assert auto_chunk_size(151_936, 10_000) == 256
    assert auto_chunk_size(49_152, 10_000) == 1024
    assert auto_chunk_size(151_936, 5) == 5


_TRITON_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported
    sys.path.insert(0, os.environ["REPO"])
    import torch
    from training.algorithm.logprobs import chunked_logprobs_entropy
    out = {}
    for case, (n, h, v, bias, temp, ent, chunk) in enumerate(
            [(37, 32, 300, True, 0.7, True, 16), (20, 16, 130, False, 1.0, True, 64), (9, 16, 77, True, 1.2, False, 4)]):
        g = torch.Generator().manual_seed(case)
        hid = torch.randn(n, h, generator=g); w = torch.randn(v, h, generator=g) * 0.5
        b = torch.randn(v, generator=g) if bias else None
        tgt = torch.randint(0, v, (n,), generator=g)
        g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
        res = {}
        for backend in ("torch", "triton"):
            leaves = [x.clone().requires_grad_(True) for x in (hid, w) + ((b,) if bias else ())]
            lp, e = chunked_logprobs_entropy(leaves[0], leaves[1], tgt, leaves[2] if bias else None, temp, chunk,
                                             ent, backend=backend)
            obj = (lp * g_lp).sum() + ((e * g_ent).sum() if ent else 0)
            res[backend] = [lp.detach(), e.detach() if ent else None] + list(torch.autograd.grad(obj, leaves))
        out[case] = [None if a is None else float((a - c).abs().max() / c.abs().max().clamp(min=1))
                     for a, c in zip(res["triton"], res["torch"])]
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.timeout(240)
def test_triton_kernel_matches_reference_under_interpreter():
    """Runs in a subprocess: TRITON_INTERPRET must be set before triton is imported (vLLM may import it first)."""
    env = dict(os.environ, REPO=str(REPO), TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    for case, errs in json.loads(line[len("RESULT "):]).items():
        for name, err in zip(["logprob", "entropy", "d_hidden", "d_weight", "d_bias"], errs):
            assert err is None or err < 1e-5, f"case {case} {name}: relative error {err}"


@pytest.mark.gpu
def test_triton_kernel_on_cuda_bf16():
    """GPU only (skipped on CPU): compiled kernel vs the torch reference at a realistic vocabulary."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(300, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(151_936, 256, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    tgt = torch.randint(0, w.shape[0], (300,), device="cuda", generator=g)
    res = {}
    for backend in ("torch", "triton"):
        h = hid.clone().requires_grad_(True)
        lp, ent = chunked_logprobs_entropy(h, w, tgt, None, 0.9, 128, True, backend=backend)
        (lp.sum() + ent.sum()).backward()
        res[backend] = (lp, ent, h.grad.float())
    for a, b in zip(res["triton"], res["torch"]):
        assert float((a - b).abs().max()) < 5e-2
