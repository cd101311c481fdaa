"""Ranks faked with threads for tests of code that calls utils.dist's collectives: thread r is rank r, and
all_reduce_sum / all_gather_object meet at a barrier like the real collectives, so every rank must call them
alike (a rank that skips one hangs the barrier, which times out and fails the test)."""

from __future__ import annotations

import threading


class ThreadRanks:
    def __init__(self, world: int = 2):
        self.world, self.local = world, threading.local()
        self.barrier = threading.Barrier(world, timeout=10)
        self.slots: list = [None] * world
        self.calls = [0] * world   # all_reduce_sum calls per rank

    def rank(self) -> int:
        return self.local.rank

    def _meet(self, x) -> list:
        r = self.rank()
        self.slots[r] = x
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()   # nobody writes the next call's values before everyone read these
        return out

    def all_gather_object(self, obj) -> list:
        return self._meet(obj)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        self.calls[self.rank()] += 1
        got = self._meet([float(v) for v in values])
        return [sum(g[i] for g in got) for i in range(len(values))]

    def run(self, fn) -> list:
        """fn(rank) on every rank's thread; their results by rank; the first error re-raised."""
        out, errs = [None] * self.world, []

        def go(r):
            self.local.rank = r
            try:
                out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errs.append(e)
                self.barrier.abort()
        threads = [threading.Thread(target=go, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if errs:
            raise errs[0]
        return out
