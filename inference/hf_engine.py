"""The transformers reference engine: the RolloutEngine protocol (inference/engine_api.py) without vLLM.

Slow, but it needs nothing beyond transformers: it checks VLLMEngine in the tests, and it is the
trainer's rollout engine where vLLM is missing (--rollout_engine hf, a lent GPU without vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from inference.engine_api import (SLEEP_LEVELS, WAKE_TAGS, GenerateStepper, GenOutput, SamplingConfig, cut_at_stop,
                                  per_prompt_sampling)


class HFEngine:
    """The slow transformers reference: a RolloutEngine, as VLLMEngine is.

    A manual batched sampling loop (left padding + KV cache) rather than model.generate,
    because it returns the sampled token's raw log-prob directly, supports per-prompt
    seeds / stop strings / max_tokens, and never touches `synced_gpus` (HF's generate
    defaults it to True while a DeepSpeed ZeRO-3 config is alive and then hangs).
    Prompts are processed in chunks of `batch_size`.

    Weights and memory, against vLLM: a sync copies into the model's own parameters in place, so it never
    needs fused layers whole; no KV cache outlives a generate() call, so there is no prefix cache to reset
    and no KV pool to free; and sleep() frees nothing (the weights stay on their device, which
    training/engine/memory_plan.py counts in both phases), but keeps the sleeping state, so that generate()
    between sleep() and wake_up() is refused as on vLLM and a wrong order shows on CPU too.
    """

    def __init__(
        self,
        model_dir_or_model: Any,
        tokenizer: Any = None,
        dtype: str = "float32",
        device: str = "cpu",
        batch_size: int = 16,
        max_model_len: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(model_dir_or_model, (str, Path)):
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir_or_model), dtype=getattr(torch, dtype))
            self.model.to(device)
            src = str(model_dir_or_model)
        else:
            self.model = model_dir_or_model
            src = getattr(self.model.config, "_name_or_path", None) or getattr(self.model, "name_or_path", None)
        if tokenizer is None:
            if not src:
                raise ValueError("HFEngine got an in-memory model without a tokenizer; pass tokenizer=")
            tokenizer = AutoTokenizer.from_pretrained(src)
        self.tokenizer = tokenizer
        self.model.eval()
        self.device = next(self.model.parameters()).device
        self.batch_size = batch_size
        self.max_model_len = max_model_len or int(getattr(self.model.config, "max_position_embeddings", 4096))
        # vLLM stops on the tokenizer's EOS and on every eos id of generation_config; do the same.
        eos: set[int] = set()
        for src_ids in (tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(src_ids, int):
                eos.add(src_ids)
            elif src_ids:
                eos.update(int(i) for i in src_ids)
        self.eos_ids = sorted(eos)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.weight_names: set[str] | None = None  # expect_weights(): what the hybrid engine syncs
        self.asleep: set[str] = set()               # WAKE_TAGS still asleep since sleep()

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig | Sequence[SamplingConfig]) -> list[GenOutput]:
        """Chunks of `batch_size` prompts through one sampling loop each; see TokenGenerator.generate."""
        if self.asleep:
            raise RuntimeError(f"HFEngine.generate() while asleep ({sorted(self.asleep)}): call wake_up() first")
        samplings = per_prompt_sampling(sampling, len(prompts))
        out: list[GenOutput] = []
        for i in range(0, len(prompts), self.batch_size):
            out += self._generate_batch(prompts[i: i + self.batch_size], samplings[i: i + self.batch_size])
        return out

    def _generate_batch(self, prompts: list[list[int]], samplings: list[SamplingConfig]) -> list[GenOutput]:
        import torch

        B = len(prompts)
        dev = self.device
        T = max(len(p) for p in prompts)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding, so every row's next token is at column -1
            ids[b, T - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, T - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator(device="cpu").manual_seed(s.seed) if s.seed is not None else None for s in samplings]
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=dev)

        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        reason: list[str | None] = [None] * B
        stop_str: list[str | None] = [None] * B
        max_steps = max(s.max_tokens for s in samplings)
        past = None
        step_ids, step_pos = ids, pos
        with torch.no_grad():
            for step in range(max_steps):
                # logits_to_keep=1: only the next-token logits (the prefill would otherwise build (B, T, V)).
                res = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                 past_key_values=past, use_cache=True, logits_to_keep=1)
                past = res.past_key_values
                logits = res.logits[:, -1, :].float()  # (B, V)
                logp = torch.log_softmax(logits, dim=-1)
                nxt = torch.full((B,), self.pad_id, dtype=torch.long)
                for b, s in enumerate(samplings):
                    if reason[b] is not None:
                        continue
                    row = logits[b].clone()
                    if step < s.min_tokens and len(eos):
                        row[eos] = float("-inf")
                    t = self._pick(row, s, gens[b])
                    nxt[b] = t
                    toks[b].append(t)
                    lps[b].append(float(logp[b, t]))
                    if t in self.eos_ids:
                        reason[b] = "eos"
                    elif s.stop:
                        _, hit = cut_at_stop(self.tokenizer.decode(toks[b], skip_special_tokens=True), s.stop)
                        if hit is not None:
                            reason[b], stop_str[b] = "stop", hit
                    if reason[b] is None and len(toks[b]) >= s.max_tokens:
                        reason[b] = "length"
                if all(r is not None for r in reason):
                    break
                step_ids = nxt.view(B, 1).to(dev)
                mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], dim=1)
                step_pos = step_pos[:, -1:] + 1
        outs = []
        for b, s in enumerate(samplings):
            text = self.tokenizer.decode(toks[b], skip_special_tokens=True)
            if reason[b] == "stop":
                text, _ = cut_at_stop(text, s.stop)
            outs.append(GenOutput(toks[b], lps[b], text, reason[b] or "length", stop_str[b]))
        return outs

    @staticmethod
    def _pick(row, s: SamplingConfig, gen) -> int:
        import torch

        if s.temperature == 0:
            return int(torch.argmax(row))
        probs = torch.softmax(row / s.temperature, dim=-1)
        if s.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = (sp.cumsum(-1) - sp) < s.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        return int(torch.multinomial(probs.cpu(), 1, generator=gen))

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """load_weights, then reset_prefix_cache (which has nothing to drop here)."""
        self.load_weights(named_tensors)
        self.reset_prefix_cache()

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy (HF name, tensor) pairs into the model in place; unknown names raise KeyError.

        The hybrid engine's per-bucket call. Any split of the weights works: there is no fused layer to
        rebuild, and the copy is finished when it returns."""
        import torch

        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in params:
                    raise KeyError(f"HFEngine.load_weights: the model has no parameter {name!r}")
                params[name].copy_(t.to(params[name].device, params[name].dtype))

    def expect_weights(self, names: Iterable[str]) -> None:
        """Check that the model has a parameter of every name a sync will send (KeyError, as load_weights
        would raise at the first sync, otherwise). Weights are never discarded here, so a sync that leaves
        some out keeps their current values, as vLLM's level-1 sleep does."""
        names = set(names)
        missing = sorted(names - {n for n, _ in self.model.named_parameters()})
        if missing:
            raise KeyError(f"expect_weights: the model has no parameter named {missing[:3]} ({len(missing)} in all)")
        self.weight_names = names

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: each generate() call builds its KV cache and drops it on return."""

    def sleep(self, level: int = 2) -> None:
        """Enter the sleeping state: level must be 1 or 2 (ValueError otherwise); a no-op when asleep.

        Frees no memory at either level: the weights stay on their device (a partial sync is always
        safe) and there is no KV pool. generate() is refused until wake_up() woke every tag."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.asleep:
            self.asleep = set(WAKE_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Leave the sleeping state for `tags` (WAKE_TAGS; None = all). Nothing to re-allocate."""
        tags = list(tags or WAKE_TAGS)
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags must be among {WAKE_TAGS}, got {unknown}")
        self.asleep.difference_update(tags)

    # --- stepped generation (the rollout's trajectory schedule): the slow reference ------------
    # One step() runs every request submitted since the last step to its stop, as one generate()
    # batch. So decoding never overlaps a search here (only the searches overlap each other);
    # VLLMEngine's step is one decode iteration, into which new requests are admitted at once.
    def submit(self, key: Any, prompt: list[int], sampling: SamplingConfig) -> None:
        self._stepper().submit(key, prompt, sampling)

    def step(self) -> list[tuple[Any, GenOutput]]:
        return self._stepper().step()

    def num_unfinished(self) -> int:
        return self._stepper().num_unfinished()

    def abort_all(self) -> None:
        self._stepper().abort_all()

    @property
    def lockstep_ranks(self) -> int:
        """One process drives the whole model: no other rank must mirror its calls."""
        return 1

    lockstep_first = True

    def share_from_first(self, obj: Any) -> Any:
        """No group to share with: `obj` itself."""
        return obj

    def _stepper(self) -> GenerateStepper:
        if not hasattr(self, "_steps"):
            self._steps = GenerateStepper(self)
        return self._steps
