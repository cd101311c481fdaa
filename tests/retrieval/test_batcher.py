"""The micro-batcher on its own: routing, batching, no wait for a lone client, errors."""

import asyncio
import time

import pytest

from retrieval.batcher import MicroBatcher


class Echo:
    """fn that records its batches and answers each query with (query, topk); `delay` s per call."""

    def __init__(self, delay=0.0, fail_on=None):
        self.delay, self.fail_on, self.batches = delay, fail_on, []

    def __call__(self, queries, topks):
        self.batches.append(list(queries))
        time.sleep(self.delay)
        if self.fail_on and self.fail_on in queries:
            raise ValueError(f"boom on {self.fail_on}")
        return [(q, k) for q, k in zip(queries, topks)]


def run(coro_fn, fn, **kw):
    async def main():
        b = MicroBatcher(fn, **kw)
        b.start()
        try:
            return await coro_fn(b)
        finally:
            await b.stop()
    return asyncio.run(main())


def test_each_request_gets_its_own_results_in_order():
    fn = Echo(delay=0.05)

    async def go(b):
        return await asyncio.gather(*(b.submit([f"q{i}a", f"q{i}b"], i % 3 + 1) for i in range(20)))
    res = run(go, fn, max_batch=64)
    assert res == [[(f"q{i}a", i % 3 + 1), (f"q{i}b", i % 3 + 1)] for i in range(20)]
    assert len(fn.batches) <= 3  # 20 concurrent requests, not 20 calls


def test_max_batch_is_respected():
    fn = Echo(delay=0.02)

    async def go(b):
        return await asyncio.gather(*(b.submit([f"q{i}"], 1) for i in range(50)))
    run(go, fn, max_batch=8)
    assert max(len(x) for x in fn.batches) <= 8 and sum(len(x) for x in fn.batches) == 50


def test_a_lone_client_never_waits():
    fn = Echo(delay=0.02)

    async def go(b):
        lat = []
        for i in range(10):  # sequential: the closed loop of one search agent
            t = time.perf_counter()
            await b.submit([f"q{i}"], 1)
            lat.append(time.perf_counter() - t)
        return lat
    lat = run(go, fn, max_batch=64, max_wait_s=1.0)
    assert max(lat[1:]) < 0.02 + 0.1, lat  # far below the 1 s cap (or 1/4 of compute = 5 ms)


def test_closed_loop_clients_merge_into_full_batches():
    """Two groups of clients out of phase must merge, not alternate (the 2/62 pattern)."""
    fn = Echo(delay=0.1)

    async def client(b, i, start):
        await asyncio.sleep(start)
        for j in range(6):
            await b.submit([f"c{i}-{j}"], 1)

    async def go(b):
        await asyncio.gather(*(client(b, i, 0.0 if i < 4 else 0.03) for i in range(32)))
    run(go, fn, max_batch=64, max_wait_s=0.05)
    sizes = [len(x) for x in fn.batches]
    assert sum(sizes) == 32 * 6
    assert sum(s == 32 for s in sizes) >= 3, sizes


def test_errors_reach_the_callers_and_the_worker_survives():
    fn = Echo(fail_on="bad")

    async def go(b):
        r = await asyncio.gather(b.submit(["bad"], 1), return_exceptions=True)
        ok = await b.submit(["good"], 2)
        return r, ok
    (r,), ok = run(go, fn)
    assert isinstance(r, ValueError) and "boom on bad" in str(r)
    assert ok == [("good", 2)]


def test_a_wrong_result_count_is_an_error():
    async def go(b):
        with pytest.raises(RuntimeError, match="1 results for 2 queries"):
            await b.submit(["a", "b"], 1)
    run(go, lambda qs, ks: [None])


def test_one_bad_request_fails_alone_and_its_neighbours_get_answers():
    """A query that makes the search raise fails its own request, not the others in its micro-batch."""
    fn = Echo(fail_on="bad")

    async def go(b):
        return await asyncio.gather(b.submit(["good1"], 1), b.submit(["bad", "x"], 2), b.submit(["good2", "y"], 3),
                                    return_exceptions=True)
    a, bad, c = run(go, fn, max_batch=64)
    assert fn.batches[0] == ["good1", "bad", "x", "good2", "y"]  # they did share one batch
    assert a == [("good1", 1)] and c == [("good2", 3), ("y", 3)]
    assert isinstance(bad, ValueError) and "boom on bad" in str(bad)


def test_a_failed_batch_of_one_request_is_not_rerun():
    fn = Echo(fail_on="bad")

    async def go(b):
        return await asyncio.gather(b.submit(["bad", "x"], 1), return_exceptions=True)
    (r,) = run(go, fn)
    assert isinstance(r, ValueError) and fn.batches == [["bad", "x"]]
