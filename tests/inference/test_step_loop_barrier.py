"""StepLoop(barrier=True), the turn schedule as a setting of the one loop (issue 43, 1): it runs in waves, and the
calls a wave asked for run in the loop's own thread while the engine holds no request. That is what lets a search
back-end that generates with the policy's own engine (simulated search in-process) run inside the loop, and what
makes the turn schedule's one search call per turn. Checked on an engine double that counts what it holds."""

from __future__ import annotations

import threading

import pytest

from inference.engine_api import GenOutput, SamplingConfig
from inference.step_loop import StepLoop


class Counting:
    """A stepped engine double: request k ends after (k % 3) + 1 steps. Records, per step, the keys it holds."""

    lockstep_ranks, lockstep_first = 1, True

    def __init__(self):
        self.held: dict[int, int] = {}   # key -> steps left
        self.steps: list[list[int]] = []

    def submit(self, key, prompt, sampling):
        self.held[key] = key % 3 + 1

    def step(self):
        self.steps.append(sorted(self.held))
        done = []
        for k in list(self.held):
            self.held[k] -= 1
            if not self.held[k]:
                del self.held[k]
                done.append((k, GenOutput([k], [0.0], str(k), "stop")))
        return done

    def num_unfinished(self):
        return len(self.held)


def _turns(barrier: bool):
    """Six trajectories, two turns each; after a turn, a call (a search) decides the next turn."""
    eng = Counting()
    loop = StepLoop(eng, barrier=barrier)
    seen, order = [], []

    def search(traj, turn):
        seen.append((threading.current_thread() is threading.main_thread(), eng.num_unfinished(), traj, turn))
        return traj

    def after_turn(traj, turn):
        loop.call(lambda: search(traj, turn), lambda got: next_turn(got, turn))

    def next_turn(traj, turn):
        order.append((traj, turn))
        if turn == 0:
            loop.generate([traj], SamplingConfig(), lambda out: after_turn(traj, 1))

    for t in range(6):
        loop.generate([t], SamplingConfig(), lambda out, t=t: after_turn(t, 0))
    loop.run()
    return eng, seen, order


def test_waves_call_between_waves_in_the_loops_thread():
    eng, seen, order = _turns(barrier=True)
    assert len(seen) == 12
    assert all(main and held == 0 for main, held, _, _ in seen), seen   # the engine empty, this thread
    # two waves: every first turn decodes before any second turn is submitted
    first_wave = [keys for keys in eng.steps if any(k < 6 for k in keys)]
    assert all(all(k < 6 for k in keys) for keys in first_wave)
    assert eng.steps[0] == list(range(6)) and eng.steps[len(first_wave)] == list(range(6, 12))
    assert [turn for _, turn in order] == [0] * 6 + [1] * 6   # the results in the order the calls were made


def test_without_the_barrier_calls_run_in_threads_beside_decoding():
    eng, seen, order = _turns(barrier=False)
    assert len(seen) == 12 and not any(main for main, *_ in seen)
    # a trajectory's second turn starts while others' first turns still decode
    assert any(any(k < 6 for k in keys) and any(k >= 6 for k in keys) for keys in eng.steps), eng.steps


def test_a_failing_call_between_waves_is_raised():
    eng = Counting()
    loop = StepLoop(eng, barrier=True)

    def boom():
        raise ConnectionError("search down")

    loop.generate([1], SamplingConfig(), lambda out: loop.call(boom, lambda got: None))
    with pytest.raises(ConnectionError, match="search down"):
        loop.run()
