"""The event loop under the trajectory schedule: one stepped engine, calls to the outside world in threads.

    loop = StepLoop(engine, max_inflight=0)
    loop.generate(prompt_ids, sampling, on_output)   # queued; joins the engine's running batch when there is room
    loop.call(fn, on_result)                         # fn() runs in a thread (a search, a judge call)
    loop.run()                                       # until no request and no call is left

    while requests or calls are left:
        1. calls that returned: on_result(result), in the order they were made
        2. queued requests -> engine.submit, up to max_inflight sequences in the engine
        3. nothing to decode: wait for the first call to return (the engine's idle time)
        4. one engine step; on_output(output) of each request that finished in it, in submission order
        5. the after-step hooks (a rollout batches the searches its trajectories asked for in this step);
           they also run after 1. when calls came back

With barrier=True (the turn schedule: RolloutConfig.schedule "turn") the same loop runs in waves: the requests
ready at a wave's start decode to their end, new ones wait; then, with the engine empty, the hooks run and the
calls the wave asked for run one after another in the loop's own thread (none in threads), their results are
delivered, and the next wave starts. So a search back-end that may not run beside the engine (simulated search
on the policy's own engine: it calls engine.generate) runs here, and one search call serves a whole turn.

Every callback runs in the loop's own thread, so callbacks may add requests and calls, and the state they
touch needs no lock. Threads only run the functions given to call().

Lockstep (tensor parallelism under vLLM's external_launcher): every rank of a TP group must submit the same
requests in the same order and step the same number of times, yet each rank's calls return at their own
moments. With engine.lockstep_ranks > 1 the group's first rank alone makes the calls; at each pass through
1. (only while calls are out) it decides which have returned and sends their results to the others through
engine.share_from_first. Everything else the loop does is a function of the engine's outputs and of those
results, which all ranks share, so the ranks stay in step: one search per TP group, not one per rank.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from inference.engine_api import GenerateStepper, GenOutput, SamplingConfig


def in_lockstep(engine: Any) -> bool:
    """Whether `engine` is one rank of a lockstep (tensor-parallel) group, whose ranks must make the same calls."""
    return int(getattr(engine, "lockstep_ranks", 1)) > 1


def first_rank_value(engine: Any, fn: Callable[[], Any]) -> Any:
    """fn() on the lockstep group's first rank, its value on every rank of the group (a collective there); fn()
    itself for an engine without a group. For what the loop's callers ask the outside world beside the loop."""
    if not in_lockstep(engine):
        return fn()
    # An exception on the first rank travels to the others, which would otherwise wait in the share forever.
    value = engine.share_from_first(_catching(fn) if engine.lockstep_first else None)
    if isinstance(value, _Failed):
        raise value.exc
    return value


class _Failed:
    """A call's exception, carried to the other ranks and raised on all of them."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class StepLoop:
    def __init__(self, engine: Any, max_inflight: int = 0, workers: int = 16, barrier: bool = False):
        """engine: a SteppedGenerator, or anything with generate() (wrapped in GenerateStepper).
        max_inflight: at most this many sequences in the engine at once (0 = no bound here).
        workers: threads serving call()s; a call made with serial=True runs on one thread of its own,
        in order (for clients that are not safe to call from several threads at once: the judge).
        barrier: run in waves, every call in the loop's thread between them (the module's docstring)."""
        self.engine = engine if hasattr(engine, "submit") else GenerateStepper(engine)
        self.lockstep = int(getattr(self.engine, "lockstep_ranks", 1)) > 1
        self.first = (not self.lockstep) or bool(self.engine.lockstep_first)
        self.bound = max_inflight
        self.barrier = bool(barrier)
        self.deferred: dict[int, Callable[[], Any]] = {}   # barrier: the calls waiting for the engine to empty
        self.ready: deque[tuple[int, list[int], SamplingConfig, Callable[[GenOutput], None]]] = deque()
        self.inflight: dict[int, Callable[[GenOutput], None]] = {}
        self.calls: dict[int, tuple[Future | None, Callable[[Any], None]]] = {}
        self.after_step: list[Callable[[], None]] = []
        self.keys = 0
        self.call_ids = 0
        self.idle_s = 0.0
        self.steps = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loop-call")
        self._serial = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loop-serial")

    # --- what callbacks use ------------------------------------------------------------------
    def generate(self, prompt: list[int], sampling: SamplingConfig, on_output: Callable[[GenOutput], None]) -> None:
        self.ready.append((self.keys, prompt, sampling, on_output))
        self.keys += 1

    def call(self, fn: Callable[[], Any], on_result: Callable[[Any], None], serial: bool = False) -> None:
        """Run fn() in a thread (on the lockstep group's first rank only); on_result(its value) runs in the loop
        once it is back. An exception fn raises is raised by run(), on every rank."""
        fut = None
        if self.first and self.barrier:
            self.deferred[self.call_ids] = fn
        elif self.first:
            fut = (self._serial if serial else self._pool).submit(_catching, fn)
        self.calls[self.call_ids] = (fut, on_result)
        self.call_ids += 1

    def share(self, obj: Any) -> Any:
        """The lockstep group's first rank's `obj` on every rank (`obj` itself without a group)."""
        return self.engine.share_from_first(obj) if self.lockstep else obj

    def hook_after_step(self, fn: Callable[[], None]) -> None:
        """fn() after each engine step and after each delivery of calls: where callbacks batch what they asked."""
        self.after_step.append(fn)

    # --- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while self.ready or self.inflight or self.calls:
                at_barrier = self.barrier and not self.inflight   # barrier: between two waves
                if self.calls and (at_barrier or not self.barrier):
                    self._deliver()
                    self._after()
                    if at_barrier:
                        continue   # calls made by those results run at this barrier too
                if at_barrier or not self.barrier:
                    while self.ready and (not self.bound or len(self.inflight) < self.bound):
                        key, prompt, sampling, cb = self.ready.popleft()
                        self.engine.submit(key, prompt, sampling)
                        self.inflight[key] = cb
                if not self.inflight:
                    if self.calls and self.first and not self.barrier:  # nothing to decode: idle until a call returns
                        t0 = time.perf_counter()
                        wait([f for f, _ in self.calls.values()], return_when=FIRST_COMPLETED)
                        self.idle_s += time.perf_counter() - t0
                    continue
                outs = self.engine.step()
                self.steps += 1
                for key, out in sorted(outs, key=lambda kv: kv[0]):
                    self.inflight.pop(key)(out)
                if not (self.barrier and self.inflight):   # barrier: the hooks batch a whole wave's asks
                    self._after()
        except BaseException:
            if self.inflight and hasattr(self.engine, "abort_all"):
                self.engine.abort_all()  # leave the engine empty for the next caller
            self.inflight.clear()
            # A call still running may never return (a search back-end that hangs): waiting for it would hang the
            # error too. Its thread is then left to end on its own, its result never read.
            idle = all(f is None or f.done() for f, _ in self.calls.values())
            self._pool.shutdown(wait=idle, cancel_futures=True)
            self._serial.shutdown(wait=idle, cancel_futures=True)
            raise
        self._pool.shutdown(wait=True)  # every call has been delivered: nothing is left to wait for
        self._serial.shutdown(wait=True)

    def _after(self) -> None:
        for fn in self.after_step:
            fn()

    def _deliver(self) -> None:
        """Hand back the calls that have returned: decided by the first rank, shared with the group."""
        if not self.calls:
            return
        back = None
        if self.first and self.barrier:   # the engine is empty: each call in turn, in this thread
            t0 = time.perf_counter()
            back = {cid: _catching(self.deferred.pop(cid)) for cid in sorted(self.calls)}
            self.idle_s += time.perf_counter() - t0
        elif self.first:
            back = {cid: fut.result() for cid, (fut, _) in self.calls.items() if fut.done()}
        if self.lockstep:
            back = self.engine.share_from_first(back)
        for cid in sorted(back):
            _, on_result = self.calls.pop(cid)
            value = back[cid]
            if isinstance(value, _Failed):
                raise value.exc
            on_result(value)


def _catching(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - re-raised by StepLoop.run on every rank of the group
        return _Failed(e)
