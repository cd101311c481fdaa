"""The rollout-engine protocol: what the game, the evaluator and the hybrid engine ask of a generator.

    engine.generate(prompts: list[list[int]], sampling) -> list[GenOutput]   # one output per prompt
    engine.tokenizer; engine.max_model_len
    engine.expect_weights(names)                                            # once, before the first sync
    engine.load_weights(bucket) ...; engine.reset_prefix_cache()            # a weight sync, bucket by bucket
    engine.update_weights(named_tensors)                                    # the same in one call
    engine.sleep(level); engine.wake_up(["weights"]); engine.wake_up(["kv_cache"])

Two implementations: `inference.engines.VLLMEngine` (vLLM in-process, or one engine per rank under
torchrun) and `inference.hf_engine.HFEngine` (the slow transformers reference that checks it, and the
trainer's engine where vLLM is missing: --rollout_engine hf). Rollouts, the game and the simulated search
only generate (`TokenGenerator`); the hybrid engine also syncs weights and frees memory (`RolloutEngine`).
Both are `typing.Protocol`s: an engine implements one by having its members, no base class needed.

Semantics every generator keeps:
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

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

MAX_MODEL_LEN = 4096
"""The engine's context length unless told otherwise, and the one default of train.py's and eval.py's
--max_model_len: room for RolloutConfig.max_total_tokens, the hard cap on a trajectory."""

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")
"""What wake_up(tags) may name, in the order tags=None wakes them."""


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


@runtime_checkable
class TokenGenerator(Protocol):
    """What a rollout, the game, the evaluator and the simulated search call: token ids in, samples out."""

    tokenizer: Any
    """The HF tokenizer of the served model: prompts are built and replies decoded with it."""
    max_model_len: int
    """Prompt plus reply tokens one sequence may hold; a longer prompt is the caller's to refuse."""

    def generate(self, prompts: list[list[int]],
                 sampling: SamplingConfig | Sequence[SamplingConfig]) -> list[GenOutput]:
        """One GenOutput per prompt, in order, with the semantics of the module docstring; [] for [].

        `sampling` is one config for every prompt (a seed becomes seed + i) or one per prompt.
        Raises RuntimeError while the engine is asleep (sleep() without the matching wake_up()), and,
        on vLLM, after a level-2 sleep until every weight was sent again.
        """
        ...


@runtime_checkable
class RolloutEngine(TokenGenerator, Protocol):
    """A TokenGenerator the hybrid engine (training/engine/hybrid.py) also syncs weights into and puts to sleep.

    One sync, as the hybrid engine runs it each step:
        expect_weights(actor names)                     # once, at start
        sleep(level)                                    # train mode: free the GPU for DeepSpeed
        wake_up(["weights"]); load_weights(bucket)...; reset_prefix_cache(); wake_up(["kv_cache"])
    """

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """load_weights(named_tensors) then reset_prefix_cache(): a whole sync in one call.

        vLLM: one reload_weights call, so it must carry whole decoder layers (vLLM rebuilds each fused
        q/k/v and gate/up weight from one call's tensors only). HF: an in-place copy per tensor.
        """
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load (HF name, tensor) pairs, without the prefix-cache reset; the hybrid engine calls it per bucket
        (inference/layer_buckets.py: whole decoder layers) and resets once at the end.

        vLLM: one reload_weights call on every worker (GPU and CPU alike; on CPU a tied lm_head's packed
        copy is rebuilt too), and the names count as re-sent after a level-2 sleep.
        HF: copies each tensor into the parameter of that name; an unknown name raises KeyError.
        """
        ...

    def expect_weights(self, names: Iterable[str]) -> None:
        """The HF names every sync after a level-2 sleep must cover (the actor's parameter names).

        vLLM: replaces the names read from a local checkpoint (a hub id gives none); generate() after a
        level-2 sleep refuses until all of them were loaded again. HF: checks that the model has a parameter
        of each name (KeyError otherwise, as load_weights would raise later); it never discards weights.
        """
        ...

    def reset_prefix_cache(self) -> None:
        """Forget cached KV computed with the old weights; called once after each sync.

        vLLM (GPU and CPU): drops the prefix cache, or prompts longer than one KV block would reuse KV of
        the old weights. HF: nothing to drop, no KV cache outlives a generate() call.
        """
        ...

    def sleep(self, level: int = 2) -> None:
        """Free the accelerator's memory for training; level must be 1 or 2 (ValueError otherwise).

        Level 1 keeps the weights (vLLM on a GPU offloads them to host memory, wake_up restores them);
        level 2 discards them (vLLM on a GPU: every weight must be loaded again before generate()).
        Both drop the KV cache. Sleeping twice is a no-op. vLLM on CPU has no sleep mode: a no-op (the
        engine stays awake), unless SSP_EMULATE_GPU_SLEEP=1 gives it a GPU's semantics
        (inference/sleep_emulation.py). HF: frees no memory (its weights stay where they are, and it
        holds no KV pool between calls) but keeps the state, so generate() refuses until wake_up(),
        as on vLLM.
        """
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what sleep() freed: tags from WAKE_TAGS, None = weights first, then the KV cache.

        The hybrid engine wakes the weights, syncs, then wakes the KV cache, so the sync never competes
        with a KV pool for memory. A no-op when awake. vLLM on a GPU re-allocates (level 1: the host copy
        comes back); on CPU only the emulation has anything to restore. HF: clears the sleeping state.
        """
        ...


@runtime_checkable
class SteppedGenerator(TokenGenerator, Protocol):
    """A TokenGenerator that also takes requests one at a time and is stepped: the rollout's trajectory
    schedule (inference/rollout.py). vLLM: submit() enqueues into the running engine and step() is one decode
    iteration, into which new requests are admitted at once; GenerateStepper adapts an engine with generate()
    only (HFEngine, test doubles) by generating everything submitted since the last step as one batch."""

    lockstep_ranks: int
    """Ranks that must make identical engine calls in the same order (a tensor-parallel group); 1 otherwise."""

    lockstep_first: bool
    """Whether this rank is the first of its lockstep group (the one that decides; always True at 1 rank)."""

    def share_from_first(self, obj: Any) -> Any:
        """The first rank's `obj`, returned on every rank of the lockstep group (`obj` itself at 1 rank). A
        collective: every rank of the group calls it, in the same order (inference/step_loop.py)."""
        ...

    def submit(self, key: Any, prompt: list[int], sampling: SamplingConfig) -> None:
        """Add one request, identified by the hashable `key` in what step() returns."""
        ...

    def step(self) -> list[tuple[Any, GenOutput]]:
        """Run one engine step; (key, output) of every submitted request that finished in it."""
        ...

    def num_unfinished(self) -> int:
        """Submitted requests not yet returned by step()."""
        ...

    def abort_all(self) -> None:
        """Drop every unfinished request (after an error), so the engine is empty again."""
        ...


class GenerateStepper:
    """submit()/step() over any engine that only has generate(): a step generates every request submitted
    since the previous one, as one batch, to its stop. The rollout's trajectory schedule uses it for such
    engines (test doubles, HFEngine): then each wave of the turn schedule is one generate() call, and under the
    trajectory schedule trajectories whose search comes back late start their next turn in a later batch."""

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

    lockstep_ranks = 1  # one caller drives the wrapped engine
    lockstep_first = True

    def share_from_first(self, obj: Any) -> Any:
        return obj
