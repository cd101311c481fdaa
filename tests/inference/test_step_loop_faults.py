"""The step loop under faults (issue 40, 8): an error on a lockstep group's first rank reaches every rank as the
same error, and an error in one call is raised at once even while another call hangs."""

from __future__ import annotations

import threading
import time

import pytest

from inference.engine_api import GenOutput
from inference.step_loop import StepLoop, first_rank_value
from tests.inference.test_rollout_schedule import ThreadGroup

pytestmark = pytest.mark.timeout(120)


class Rank:
    lockstep_ranks = 2

    def __init__(self, group, rank):
        self.group, self.rank, self.lockstep_first = group, rank, rank == 0

    def share_from_first(self, obj):
        return self.group.share(self.rank, obj)


def test_first_rank_value_raises_the_first_ranks_error_on_every_rank():
    group = ThreadGroup()
    got = [None, None]

    def go(r):
        def probe():
            raise ConnectionError("retriever down")
        try:
            first_rank_value(Rank(group, r), probe)
            got[r] = "returned"
        except BaseException as e:  # noqa: BLE001
            got[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(g, ConnectionError) and "retriever down" in str(g) for g in got), got


class Idle:
    """An engine with nothing to decode: the loop only waits on its calls."""

    def submit(self, key, prompt, sampling):
        raise AssertionError("no request was made")

    def step(self) -> list[tuple[int, GenOutput]]:
        return []


def test_a_failing_call_is_raised_at_once_while_another_call_hangs():
    release = threading.Event()
    loop = StepLoop(Idle())
    loop.call(lambda: release.wait(60), lambda _: None)       # a search that never answers

    def broken():
        time.sleep(0.2)
        raise RuntimeError("judge bug")
    loop.call(broken, lambda _: None)
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="judge bug"):
            loop.run()
        assert time.perf_counter() - t0 < 10, "the error waited for the hanging call"
    finally:
        release.set()
