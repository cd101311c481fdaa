"""The server's search engine in a child process, so encoding never holds the event loop's GIL.

Encoding a micro-batch is mostly small torch ops driven from Python; run in a thread of the
server process it holds the GIL most of the time, and the event loop that parses requests and
writes responses starves. Measured on the 2-core box with 64 closed-loop clients: requests then
reached the queue a few at a time, batches shrank to 1-10 queries, and throughput fell below the
32-client figure. In a separate process the event loop keeps its GIL, requests queue up while a
batch computes, and the next batch takes them all (the same reason vLLM runs its engine core in
its own process).

Protocol over a multiprocessing Pipe: parent sends (queries, topks); the child answers
("ok", docs) or ("error", message). If the child dies, the batch in flight fails with
SearchRestarted (the server answers 503), a new child starts, and the client's retry succeeds.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import traceback

log = logging.getLogger(__name__)


class SearchRestarted(RuntimeError):
    """The search process died under a batch and was replaced: a retry will be served."""


def _child(conn, load_kwargs: dict, env: dict, warmup: int, topk: int) -> None:
    os.environ.update(env)  # thread settings must be in place before torch / FAISS load
    try:
        if env.get("OMP_NUM_THREADS"):
            import torch
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        from retrieval.retriever import load_retriever

        r = load_retriever(**load_kwargs)
        # Warm up before declaring ready: the first full-size batch pays one-off costs (BLAS and
        # OpenMP thread pools, allocator growth) that measured ~10 s on a busy 2-core CPU.
        for n in sorted({1, warmup}):
            r.search_mixed([f"warm-up query {i}" for i in range(n)], [topk] * n)
        conn.send(("ready", r.describe()))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            queries, topks = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        try:
            conn.send(("ok", r.search_mixed(queries, topks)))
        except Exception:  # the whole traceback: the server logs it (and tells the client only a ref)
            conn.send(("error", traceback.format_exc()))


class SearchProcess:
    """`search_mixed(queries, topks)` and `describe()` of a retriever living in a child process."""

    def __init__(self, load_kwargs: dict, threads: int | None = None, warmup: int = 64, topk: int = 3):
        self.load_kwargs = dict(load_kwargs)
        self.env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        self.warmup, self.topk = warmup, topk
        self._lock = threading.Lock()  # one request/answer exchange on the pipe at a time
        self._info = None
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads and locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, self.load_kwargs, self.env, self.warmup, self.topk),
                                 name="retrieval-search", daemon=True)
        self._proc.start()
        child.close()
        try:
            status, payload = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"search process died while loading (exit code {self._proc.exitcode})") from None
        if status != "ready":
            self._proc.join(5)
            raise RuntimeError(payload)
        self._info = payload

    def describe(self) -> dict:
        return {**self._info, "search_pid": self._proc.pid}

    def search_mixed(self, queries: list[str], topks: list[int]) -> list[list[dict]]:
        with self._lock:
            try:
                self._conn.send((queries, topks))
                status, payload = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                code = self._proc.exitcode
                log.error("search process died (exit code %s); starting a new one", code)
                self._proc.join(1)
                self._start()
                raise SearchRestarted(f"search process died (exit code {code}) and was restarted; retry") from None
        if status != "ok":
            raise RuntimeError(f"in the search process:\n{payload}")
        return payload

    def close(self) -> None:
        self._conn.close()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.terminate()
