"""The transformers reference engine: the interface of inference/engines.py without vLLM.

Slow, but it needs nothing beyond transformers: it checks VLLMEngine in the tests, and it is the
trainer's rollout engine where vLLM is missing (--rollout_engine hf, a lent GPU without vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from inference.engines import GenOutput, SamplingConfig, cut_at_stop, per_prompt_sampling


class HFEngine:
    """The slow transformers reference, same interface as VLLMEngine.

    A manual batched sampling loop (left padding + KV cache) rather than model.generate,
    because it returns the sampled token's raw log-prob directly, supports per-prompt
    seeds / stop strings / max_tokens, and never touches `synced_gpus` (HF's generate
    defaults it to True while a DeepSpeed ZeRO-3 config is alive and then hangs).
    Prompts are processed in chunks of `batch_size`.
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

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig | Sequence[SamplingConfig]) -> list[GenOutput]:
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
        """Copy (HF name, tensor) pairs into the model in place; unknown names raise KeyError."""
        import torch

        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in params:
                    raise KeyError(f"update_weights: the model has no parameter {name!r}")
                params[name].copy_(t.to(params[name].device, params[name].dtype))

    load_weights = update_weights  # the hybrid engine's per-bucket call: a copy needs no finishing step

    def reset_prefix_cache(self) -> None:  # no cache outlives a generate() call
        pass

    def expect_weights(self, names: Iterable[str]) -> None:  # weights are never discarded here
        pass

    def sleep(self, level: int = 2) -> None:  # keeps its weights: a partial sync is always safe
        pass

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        pass

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

    def _stepper(self) -> "GenerateStepper":
        if not hasattr(self, "_steps"):
            self._steps = GenerateStepper(self)
        return self._steps


class GenerateStepper:
    """submit()/step() over any engine that only has generate(): a step generates every request submitted
    since the previous one, as one batch, to its stop. The rollout's trajectory schedule uses it for such
    engines (test doubles, HFEngine): then it makes the same engine calls as the turn schedule, except that
    trajectories whose search comes back late start their next turn in a later batch."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = getattr(engine, "max_model_len", None)
        self.pending: list[tuple[Any, list[int], SamplingConfig]] = []

    def submit(self, key: Any, prompt: list[int], sampling: SamplingConfig) -> None:
        self.pending.append((key, list(prompt), sampling))

    def step(self) -> list[tuple[Any, GenOutput]]:
        batch, self.pending = self.pending, []
        if not batch:
            return []
        outs = self.engine.generate([p for _, p, _ in batch], [s for *_, s in batch])
        if len(outs) != len(batch):
            raise RuntimeError(f"engine returned {len(outs)} outputs for {len(batch)} prompts")
        return [(k, o) for (k, _, _), o in zip(batch, outs)]

    def num_unfinished(self) -> int:
        return len(self.pending)

    def abort_all(self) -> None:
        self.pending = []
