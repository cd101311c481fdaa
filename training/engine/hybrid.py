"""The hybrid engine: switch a rank between vLLM generation and DeepSpeed training.

generate mode: wake vLLM's weights, stream the actor's ZeRO-3 shards into it one
               decoder layer at a time (GatheredParameters -> reload_weights), wake the
               KV cache, reset the prefix cache.
train mode:    put vLLM to sleep: level 2 (weights discarded) when the next sync re-sends
               every weight, level 1 (weights kept in host memory) when it leaves frozen
               ones out (--train_top_layers). A no-op on CPU, where vLLM has no sleep mode,
               unless SSP_EMULATE_GPU_SLEEP=1 gives it a GPU's semantics (the tests do).

Rules learned by breaking them (docs/PLATFORM_NOTES.md, Hybrid engine rules): torch.distributed is initialised before
vLLM; a bucket never splits a fused q/k/v or gate/up group (so: one decoder layer per
bucket); the prefix cache is reset after every sync; GatheredParameters is collective,
so every rank walks the same buckets in the same order.
"""

from __future__ import annotations

import os
import time

from inference.engine_api import RolloutEngine
from inference.layer_buckets import LAYER_RE, group_by_layer
from utils.logging import print0


class HybridEngine:
    def __init__(self, actor, llm_engine: RolloutEngine, bucket_mb: int = 1024):
        self.actor = actor            # deepspeed.DeepSpeedEngine (module = HF CausalLM)
        self.llm = llm_engine         # VLLMEngine, or HFEngine (--rollout_engine hf)
        self.bucket_mb = bucket_mb    # gathered weights per reload call (0 = one decoder layer per call)
        self.mode = "generate"        # vLLM starts awake, holding the initial weights
        self.last_sync_s = 0.0
        self.syncs = 0                # sync_weights calls so far (SSP_FAULT=skip_sync:N counts them)
        names = [n for n, _ in actor.module.named_parameters()]
        self.llm.expect_weights(names)  # what a sync after a level-2 sleep must cover
        frozen = sum(not p.requires_grad for p in actor.module.parameters())
        # Frozen weights are never re-sent (_buckets). After a level-2 sleep vLLM would hold garbage
        # in their place, so sleep at level 1 then: vLLM keeps its weights in host memory and puts
        # them back on wake. The alternative, re-sending everything after a level-2 sleep, costs an
        # all-gather of every frozen ZeRO-3 partition plus vLLM's reload of it each step, growing with
        # the frozen share (most of the model), while level 1 costs one host round trip of vLLM's
        # weights (PCIe, about a second for 7B bf16) and their size in host RAM per GPU.
        self.sleep_level = 1 if frozen else 2
        print0(f"hybrid engine: the rollout engine sleeps at level {self.sleep_level} "
               + (f"(weights kept in host memory: {frozen} frozen tensors are never re-sent)" if frozen
                  else "(weights discarded: every weight is re-sent at each sync)"))

    def sync_weights(self) -> float:
        """Push the actor's current weights into the generation engine. Collective.

        Whole decoder layers are grouped into buckets of about `bucket_mb` (gathered
        together, sent in one reload call): fewer calls cost less, because every vLLM
        reload call walks the whole model, while a bucket never splits a layer's fused groups.
        """
        import deepspeed

        t0 = time.perf_counter()
        self.syncs += 1
        if os.environ.get("SSP_FAULT", "") == f"skip_sync:{self.syncs}":
            # Fault injection for the tests' negative control: this sync is left out, as a broken one would
            # be, and the engine keeps the weights it had (on CPU without SSP_EMULATE_GPU_SLEEP).
            print0(f"SSP_FAULT: sync {self.syncs} skipped")
            self.last_sync_s = 0.0
            return 0.0
        for bucket in self._buckets():
            params = [p for _, p in bucket]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                self.llm.load_weights([(name, p.data) for name, p in bucket])
        self.llm.reset_prefix_cache()
        self.last_sync_s = time.perf_counter() - t0
        return self.last_sync_s

    def _buckets(self):
        budget = self.bucket_mb << 20
        out, cur, size = [], [], 0
        for layer in group_by_layer(self.actor.module.named_parameters()):
            # Frozen weights (--train_top_layers) never change after vLLM loaded them from the same
            # folder: a layer with no trainable weight is skipped; outside the decoder layers (no
            # fused groups there) only trainable tensors are sent.
            if not any(p.requires_grad for _, p in layer):
                continue
            if not LAYER_RE.search(layer[0][0]):
                layer = [(n, p) for n, p in layer if p.requires_grad]
            # ZeRO-3 params report their full size in ds_numel; plain tensors in numel()
            nbytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for _, p in layer)
            if cur and size + nbytes > budget:
                out.append(cur)
                cur, size = [], 0
            cur += layer
            size += nbytes
        return out + ([cur] if cur else [])

    def to_generate(self) -> dict:
        """Enter generate mode with fresh weights. Returns sync metrics."""
        if self.mode != "generate":
            self.llm.wake_up(["weights"])
            self.sync_weights()
            self.llm.wake_up(["kv_cache"])
            self.mode = "generate"
        else:
            self.sync_weights()
        return {"sync/seconds": self.last_sync_s}

    def to_train(self) -> None:
        if self.mode != "train":
            self.llm.sleep(level=self.sleep_level)
            self.mode = "train"
