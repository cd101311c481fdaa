"""HTTP client for a `/retrieve` server (ours or Search-R1's), with the search-backend interface.

    client = RetrievalClient("http://127.0.0.1:8000")    # waits for the server to be ready
    client.search(["who wrote hamlet"], topk=3)           # [[{"id", "contents", "score"}, ...]]

Every call has a timeout; transport errors, timeouts and 5xx/503 answers are retried with
exponential backoff (bounded); a 4xx is the caller's fault and raises at once with the server's
message. Thread-safe (one httpx.Client, shared), so rollout threads can share one instance.

A search with more queries than the server takes per request (max_queries and max_body_bytes on
its /health) is sent as several requests, one after another, and the results come back in order:
a 14B run's 64 prompts x 5 samples must not turn into one refused request and a turn of
"search failed".
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import httpx

from retrieval.schema import parse_result

log = logging.getLogger(__name__)


# A server that reports no cap: ours before it did (it refused more than 256 queries), or Search-R1's
# (no /health, no cap). 256 queries per request suits both.
FALLBACK_MAX_QUERIES = 256
_ENVELOPE_BYTES = 100  # {"queries":[],"topk":100,"return_scores":true} with room to spare


class RetrievalError(RuntimeError):
    pass


def wait_for_health(url: str, proc, timeout: float, log=None, poll: float = 0.2, request_timeout: float = 2.0) -> None:
    """Wait until the server process `proc` we started answers 200 on `url`/health.

    Raises RuntimeError as soon as the process exits (with the tail of `log`, a path, when given) and
    TimeoutError after `timeout` seconds. For launchers (bench, tests); a client of a server it did not
    start uses `RetrievalClient.wait_until_ready`.
    """
    deadline = time.monotonic() + timeout
    where = f"; log {log}" if log is not None else ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = f":\n{Path(log).read_text()[-2000:]}" if log is not None else ""
            raise RuntimeError(f"server for {url} exited with {proc.returncode}{where}{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=request_timeout).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll)
    raise TimeoutError(f"server {url} not ready after {timeout}s{where}")


def split_queries(queries: list[str], max_queries: int, max_bytes: int | None = None) -> list[list[str]]:
    """Consecutive runs of `queries`, each at most max_queries long and, with max_bytes, small enough
    for a request body of at most max_bytes. A single query over max_bytes goes alone (the server says why)."""
    chunks, cur, size = [], [], _ENVELOPE_BYTES
    for q in queries:
        n = len(json.dumps(q)) + 1  # the ASCII-escaped form is never shorter than UTF-8; +1 for the comma
        if cur and (len(cur) >= max_queries or (max_bytes and size + n > max_bytes)):
            chunks.append(cur)
            cur, size = [], _ENVELOPE_BYTES
        cur.append(q)
        size += n
    if cur:
        chunks.append(cur)
    return chunks


def _caps(health: dict) -> tuple[int, int | None]:
    """(max queries, max body bytes) per request from a /health answer, with fallbacks for older servers."""
    def positive(v):
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
    return positive(health.get("max_queries")) or FALLBACK_MAX_QUERIES, positive(health.get("max_body_bytes"))


class RetrievalClient:
    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5,
                 startup_timeout: float = 300.0, wait_for_server: bool = True, topk: int = 3):
        """
        url: server base URL, or its full /retrieve URL as Search-R1 configs give it.
        timeout: seconds per HTTP call (connect is capped at 10 s).
        retries: extra attempts after a failed call (transport error, timeout, 5xx).
        backoff: first retry delay in seconds; doubles each attempt, with +-25% jitter.
        startup_timeout: how long the start-up health check waits for a loading server.
        wait_for_server: run that health check in the constructor (else it runs before the first
            search, which needs the server's per-request caps from it).
        topk: default topk when search() is called without one.
        """
        url = url.rstrip("/")
        if url.endswith("/retrieve"):
            url = url[: -len("/retrieve")]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retrieval url {url!r} must start with http:// or https://")
        self.url = url
        self.retries = retries
        self.backoff = backoff
        self.topk = topk
        self.startup_timeout = startup_timeout
        self.caps: tuple[int, int | None] | None = None  # (max queries, max body bytes) per request
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                  limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        if wait_for_server:
            self.wait_until_ready(startup_timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_until_ready(self, timeout: float = 300.0) -> dict:
        """Poll GET /health until the server answers ready, or raise after `timeout` seconds.

        A Search-R1 server has no /health: any answer other than 503/5xx (e.g. its 404) means
        it is up, since it only opens its port once the index is loaded.
        """
        deadline = time.monotonic() + timeout
        delay, last = 0.2, "no answer yet"
        while True:
            try:
                r = self._http.get(f"{self.url}/health", timeout=min(10.0, max(1.0, timeout)))
                if r.status_code == 200:
                    health = r.json()
                    self.caps = _caps(health if isinstance(health, dict) else {})
                    return health
                if r.status_code < 500:
                    self.caps = _caps({})
                    return {"status": "ok", "detail": f"no /health endpoint (HTTP {r.status_code})"}
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code == 500 and "failed" in r.text:
                    raise RetrievalError(f"retrieval server at {self.url} failed to load its index: {r.text[:500]}")
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + delay > deadline:
                raise RetrievalError(
                    f"retrieval server at {self.url} was not ready after {timeout:.0f}s (last: {last}); "
                    "start it with `bash scripts/start_retriever.sh` or check its log")
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    def search(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        """Per query, up to topk {"id", "contents", "score"} dicts, best first."""
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings, got a single str; wrap it: search([query], topk)")
        queries = list(queries)
        if not queries:
            return []
        if self.caps is None:
            self.wait_until_ready(self.startup_timeout)
        out = []
        for chunk in split_queries(queries, *self.caps):
            payload = {"queries": chunk, "topk": topk or self.topk, "return_scores": True}
            out += parse_result(self._post("/retrieve", payload), len(chunk))
        return out

    def _post(self, path: str, payload: dict) -> dict:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                d = self.backoff * 2 ** (attempt - 1) * random.uniform(0.75, 1.25)
                log.warning("retrieval %s%s failed (%s); retry %d/%d in %.2fs", self.url, path, last, attempt,
                            self.retries, d)
                time.sleep(d)
            try:
                r = self._http.post(f"{self.url}{path}", json=payload)
            except httpx.TransportError as e:  # connect refused/reset, timeouts
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code >= 500:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            if r.status_code >= 400:
                try:
                    body = r.json()
                    detail = body.get("detail", body) if isinstance(body, dict) else body
                except ValueError:
                    detail = r.text
                raise ValueError(f"retrieval server {self.url}{path} rejected the request (HTTP {r.status_code}): {detail}")
            return r.json()
        raise RetrievalError(f"retrieval server {self.url}{path} failed {self.retries + 1} times; last error: {last}")
