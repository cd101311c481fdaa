"""The HTTP client: waiting for a late server, retries with backoff, clear errors.

The failure modes (503s, slow answers, 4xx) come from a small real HTTP server on 127.0.0.1
(http.server in a thread) that answers what the test tells it to; the late-start test uses the
real retrieval server.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from retrieval.client import RetrievalClient, RetrievalError

GOOD = {"result": [[{"document": {"id": "1", "contents": "T\nx"}, "score": 0.5}]]}


class Scripted:
    """An HTTP server whose answers to POST /retrieve follow a script of (status, body, delay_s)."""

    def __init__(self, script):
        self.script = list(script)
        self.posts = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self._send(200, {"status": "ok"})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                status, body, delay = outer.script[min(outer.posts, len(outer.script) - 1)]
                outer.posts += 1
                time.sleep(delay)
                self._send(status, body)

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:  # the client timed out and hung up
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    servers = []

    def make(*script):
        s = Scripted(script)
        servers.append(s)
        return s
    yield make
    for s in servers:
        s.close()


def test_retries_5xx_with_backoff_then_succeeds(scripted):
    s = scripted((503, {"detail": "loading"}, 0), (500, {"detail": "boom"}, 0), (200, GOOD, 0))
    c = RetrievalClient(s.url, retries=3, backoff=0.1)
    t = time.monotonic()
    assert c.search(["q"], 1) == [[{"id": "1", "contents": "T\nx", "score": 0.5}]]
    assert s.posts == 3
    assert time.monotonic() - t >= 0.1 * 0.75 + 0.2 * 0.75  # slept 0.1 then 0.2 (+-25% jitter)


def test_retries_are_bounded_and_the_error_names_the_url(scripted):
    s = scripted((502, {"detail": "bad gateway"}, 0))
    c = RetrievalClient(s.url, retries=2, backoff=0.01)
    with pytest.raises(RetrievalError, match=f"{s.url}/retrieve failed 3 times.*502"):
        c.search(["q"], 1)
    assert s.posts == 3


def test_timeouts_are_retried(scripted):
    s = scripted((200, GOOD, 1.5), (200, GOOD, 0))
    c = RetrievalClient(s.url, timeout=0.5, retries=1, backoff=0.01)
    assert c.search(["q"], 1)[0][0]["id"] == "1"
    assert s.posts == 2


def test_4xx_is_not_retried_and_carries_the_servers_message(scripted):
    s = scripted((422, {"detail": "'topk' is 0; it must be between 1 and 100"}, 0))
    c = RetrievalClient(s.url, retries=5, backoff=0.01)
    with pytest.raises(ValueError, match="HTTP 422.*between 1 and 100"):
        c.search(["q"], 1)
    assert s.posts == 1


def test_misaligned_response_is_an_error(scripted):
    s = scripted((200, {"result": []}, 0))
    with pytest.raises(ValueError, match="0 result lists for 1 queries"):
        RetrievalClient(s.url).search(["q"], 1)


def test_url_forms_and_local_checks(scripted):
    s = scripted((200, GOOD, 0))
    assert RetrievalClient(s.url + "/retrieve").url == s.url  # Search-R1 configs give the full /retrieve URL
    c = RetrievalClient(s.url + "/")
    assert c.search([], 3) == [] and s.posts == 0
    with pytest.raises(TypeError, match="single str"):
        c.search("bare string", 3)
    with pytest.raises(ValueError, match="http://"):
        RetrievalClient("localhost:8000", wait_for_server=False)


def test_a_server_that_never_comes_up_fails_with_the_url(helpers):
    url = f"http://127.0.0.1:{helpers.free_port()}"
    t = time.monotonic()
    with pytest.raises(RetrievalError, match=f"{url} was not ready after 2s.*start_retriever.sh"):
        RetrievalClient(url, startup_timeout=2)
    assert time.monotonic() - t < 6


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_client_waits_for_a_server_that_starts_late(bm25_index, bm25_retriever, launcher, helpers):
    port = helpers.free_port()
    url = f"http://127.0.0.1:{port}"
    got = {}

    def wait():
        t = time.monotonic()
        try:
            c = RetrievalClient(url, startup_timeout=180)
            got["waited"] = time.monotonic() - t
            got["docs"] = c.search(["greek philosophy"], 3)
        except Exception as e:
            got["error"] = e

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(3)  # the client is polling a closed port by now
    assert th.is_alive()
    launcher.start(bm25_index, port=port)
    th.join(200)
    assert "error" not in got, got.get("error")
    assert got["waited"] >= 3
    helpers.same(got["docs"], bm25_retriever.search(["greek philosophy"], 3), tol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_client_splits_at_the_servers_caps_and_keeps_the_order(bm25_index, bm25_retriever, launcher, helpers):
    """More queries than the server takes per request (its /health says how many, and how many
    bytes): every query still gets its own results, in order."""
    _, url = launcher.start_ready(bm25_index, "--max-queries", "7", "--max-body-bytes", "2000")
    health = httpx.get(f"{url}/health").json()
    assert (health["max_queries"], health["max_body_bytes"]) == (7, 2000)
    words = ["greek philosophy", "music", "war", "art history", "ancient", "river", "empire"]
    short = [f"{words[i % 7]} {i}" for i in range(30)]
    long = [(f"{words[i % 7]} " * 60)[:400] for i in range(12)]  # 3 fit under 2000 bytes, whatever the count cap
    for wait in (True, False):  # without the start-up check, the caps are read before the first search
        with RetrievalClient(url, wait_for_server=wait) as c:
            before = httpx.get(f"{url}/health").json()["queries"]
            helpers.same(c.search(short, 3), bm25_retriever.search(short, 3), tol=1e-6)
            helpers.same(c.search(long, 2), bm25_retriever.search(long, 2), tol=1e-6)
            assert httpx.get(f"{url}/health").json()["queries"] - before == 42  # each query searched once


def test_split_queries_keeps_every_request_under_both_caps():
    """Against what httpx really sends: random runs of ASCII, accents, CJK, emoji, quotes and escapes."""
    import random

    from retrieval.client import split_queries
    rng = random.Random(0)
    alphabet = "abc xyz\"\\\n\t" + "éüß" + "日本語" + "🎵🙂"
    for _ in range(200):
        qs = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) for _ in range(rng.randint(0, 60))]
        max_n, max_bytes = rng.randint(1, 20), rng.choice([None, 800, 3000])
        chunks = split_queries(qs, max_n, max_bytes)
        assert [q for c in chunks for q in c] == qs and all(chunks)
        for c in chunks:
            body = httpx.Request("POST", "http://x/retrieve", json={"queries": c, "topk": 100,
                                                                     "return_scores": True}).content
            assert len(c) <= max_n and (max_bytes is None or len(body) <= max_bytes or len(c) == 1)
        if max_bytes is None:  # only the count cap binds: chunks are as full as it allows
            assert [len(c) for c in chunks] == [min(max_n, len(qs) - i) for i in range(0, len(qs), max_n)]
