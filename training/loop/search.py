"""The step's search tools: one backend per kind (--proposer_search, --solver_search), timed and counted.

    backends = build_searches(cfg, llm, seed)     # {"proposer": TimedSearch | None, "solver": ...}, simulated
    ... the rollouts call backends[role].search ...
    search_counts(backends)                       # search/calls, search/queries, search/failures (summed)
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from inference.engine_api import TokenGenerator
from inference.simulated_search import SimulatedSearch
from utils import dist as D
from utils.metrics import summed

if TYPE_CHECKING:
    from training.settings.config import Config

ROLES = ("proposer", "solver")

summed("search/calls", "search/queries", "search/failures")  # search_counts: global counts over ranks


class TimedSearch:
    """Wraps a backend's `search` to count calls, queries, failures and seconds for the step metrics."""

    def __init__(self, backend):
        self.backend = backend
        # the rollout loop passes (question, answer) contexts to backends that want them (simulated search)
        self.wants_context = bool(getattr(backend, "wants_context", False))
        # the rollout's trajectory schedule calls search from several threads at once where the backend allows
        self.concurrent_safe = bool(getattr(backend, "concurrent_safe", True))
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.calls = self.queries = self.failures = 0
        self.seconds = 0.0

    def uncounted(self, queries: list[str], topk: int) -> list[list[dict]]:
        """The backend's search, left out of the counts: for the game's metric probes (inference/game.uncounted)."""
        return self.backend.search(queries, topk)

    def search(self, queries: list[str], topk: int, contexts: list[dict] | None = None) -> list[list[dict]]:
        t0 = time.perf_counter()
        with self._lock:
            self.calls += 1
            self.queries += len(queries)
        try:
            if os.environ.get("SSP_FAULT", "") == f"search_raises:{D.rank()}":
                # Fault injection (bench/bench_faults.py): this rank's search back-end is down.
                raise ConnectionError(f"SSP_FAULT: rank {D.rank()}'s search back-end raises")
            if self.wants_context:
                return self.backend.search(queries, topk, contexts=contexts)
            return self.backend.search(queries, topk)
        except Exception:
            with self._lock:
                self.failures += 1
            raise  # the rollout loop records it per trajectory and carries on
        finally:
            with self._lock:  # summed over concurrent calls: seconds spent in search, not wall time
                self.seconds += time.perf_counter() - t0


def build_search_backend(cfg: Config, kind: str, engine: TokenGenerator | None = None, seed: int = 0):
    """The `search(queries, topk)` backend of one role; None for no tool and for self-search (SSRL),
    where the policy writes its own <information> (masked like retrieved text)."""
    s = cfg.search
    if kind == "none" or kind == "self":
        return None
    if kind == "simulated":
        return SimulatedSearch(url=s.sim_url or None, engine=None if s.sim_url else engine, model=s.sim_model or None,
                               noise_start=s.sim_noise_start, noise_end=s.sim_noise_end,
                               total_steps=cfg.optimisation.total_steps, seed=seed, template=cfg.model.template)
    if cfg.search.retriever_url:
        from retrieval.client import RetrievalClient
        return RetrievalClient(cfg.search.retriever_url)
    from retrieval.retriever import load_retriever
    return load_retriever(cfg.search.index)


def build_searches(cfg: Config, engine: TokenGenerator, seed: int) -> tuple[dict, object]:
    """({role: TimedSearch or None}, the simulated backend or None). One instance per kind, shared by the
    roles that use it."""
    backends: dict = {}
    for role in ROLES:
        kind = getattr(cfg.search, f"{role}_search")
        if kind not in backends:
            backends[kind] = build_search_backend(cfg, kind, engine=engine, seed=seed)
    search = {role: (TimedSearch(b) if (b := backends[getattr(cfg.search, f"{role}_search")]) else None)
              for role in ROLES}
    return search, backends.get("simulated")


def reset(search: dict) -> None:
    for s in search.values():
        if s is not None:
            s.reset()


def search_counts(search: dict) -> dict:
    """This rank's search calls, queries and failures of the step, over both roles (keys only with a tool)."""
    m: dict = {}
    for s in search.values():
        if s is not None:
            m["search/calls"] = m.get("search/calls", 0) + s.calls
            m["search/queries"] = m.get("search/queries", 0) + s.queries
            m["search/failures"] = m.get("search/failures", 0) + s.failures
    return m


def search_seconds(search: dict) -> dict:
    """This rank's seconds in each role's search tool (per rank, not reduced)."""
    return {f"timing_s/search_{role}": s.seconds for role, s in search.items() if s is not None}
