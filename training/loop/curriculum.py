"""The simulated-search curriculum's bookkeeping (ZeroSearch; inference/simulated_search.py holds the noise schedule).

    curriculum.start(step)        # the backend's noise follows the step; its counters are read from here
    ... the step's rollouts search ...
    curriculum.step_metrics()     # search/sim_noise_p, sim_noisy_frac, sim_failures, sim_docs of this rank
    state_dict() / load_state_dict()   # the checkpoint's "curriculum": the same noise after a resume

Without simulated search (backend None) every call is a no-op and the step has no search/sim_* metrics.
"""

from __future__ import annotations

from utils.metrics import summed

summed("search/sim_failures", "search/sim_docs")  # step_metrics' counts: global over ranks


class SimCurriculum:
    def __init__(self, backend=None):
        self.backend = backend  # inference.simulated_search.SimulatedSearch, or None
        self._before: dict = {}

    def start(self, step: int) -> None:
        """Set the backend's step (its noise probability) and remember its counters, so the step's metrics
        are this step's differences."""
        if self.backend is not None:
            self.backend.set_step(step)
            self._before = dict(self.backend.stats)

    def step_metrics(self) -> dict:
        """This rank's curriculum metrics of the step since `start` ({} without simulated search)."""
        if self.backend is None:
            return {}
        st = {k: self.backend.stats[k] - self._before.get(k, 0) for k in self.backend.stats}
        return {"search/sim_noise_p": self.backend.noise_p,
                "search/sim_noisy_frac": st["noisy"] / max(st["docs"], 1),
                "search/sim_failures": float(st["failures"]),
                "search/sim_docs": float(st["docs"])}

    def state_dict(self) -> dict:
        return self.backend.state_dict() if self.backend is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.backend is not None and state:
            self.backend.load_state_dict(state)
