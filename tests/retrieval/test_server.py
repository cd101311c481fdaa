"""The HTTP server, run for real on 127.0.0.1: schema, bad input, concurrency, refusals."""

import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from retrieval.client import RetrievalClient
from retrieval.schema import parse_result
from retrieval.server import create_app

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_response_schema_matches_in_process(dense_server, dense_retriever, helpers):
    qs = ["twentieth century composers", "ancient greek philosophy"]
    want = dense_retriever.search(qs, 4)
    r = httpx.post(f"{dense_server}/retrieve", json={"queries": qs, "topk": 4, "return_scores": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["result"] and len(body["result"]) == 2
    for row, w in zip(body["result"], want):
        assert [set(item) for item in row] == [{"document", "score"}] * 4
        assert [item["document"] for item in row] == [{"id": d["id"], "contents": d["contents"]} for d in w]
        assert [item["score"] for item in row] == pytest.approx([d["score"] for d in w], abs=1e-4)
    # return_scores false (also Search-R1's default): the bare documents per query
    r = httpx.post(f"{dense_server}/retrieve", json={"queries": qs, "topk": 4}, timeout=60)
    assert r.json() == {"result": [[{"id": d["id"], "contents": d["contents"]} for d in w] for w in want]}
    # no topk: the server default (3, as in Search-R1)
    r = httpx.post(f"{dense_server}/retrieve", json={"queries": qs[:1]}, timeout=60)
    assert len(r.json()["result"][0]) == 3
    h = httpx.get(f"{dense_server}/health").json()
    assert h["status"] == "ok" and h["kind"] == "dense" and h["count"] == 64 and h["dim"] == 384
    assert httpx.get(f"{dense_server}/status").json() == "ok"


BAD = [
    (b"{not json", 400),
    (b"", 400),
    (b"[" * 100_000, 400),  # nested past json's recursion limit: a 400, not a 500
    (b'{"queries": ["a"], "topk": ' + b"[" * 100_000, 400),
    (b'["a list"]', 422),
    (b'{"topk": 3}', 422),
    (b'{"queries": "not a list"}', 422),
    (b'{"queries": [""]}', 422),
    (b'{"queries": ["   "]}', 422),
    (b'{"queries": [42]}', 422),
    (b'{"queries": [null]}', 422),
    (b'{"queries": [["nested"]]}', 422),
    (b'{"queries": ["ok", "\\ud800"]}', 422),  # a lone surrogate: no valid text, and no UTF-8 for the encoder
    (b'{"queries": ["a"], "topk": 0}', 422),
    (b'{"queries": ["a"], "topk": -1}', 422),
    (b'{"queries": ["a"], "topk": 101}', 422),
    (b'{"queries": ["a"], "topk": "3"}', 422),
    (b'{"queries": ["a"], "topk": 2.5}', 422),
    (b'{"queries": ["a"], "return_scores": "yes"}', 422),
    (json.dumps({"queries": ["x" * 4097]}).encode(), 422),  # over-long query
]


def over_the_limits(health: dict) -> list[tuple[bytes, int]]:
    """Requests just past the limits the server reports on /health."""
    n, size = health["max_queries"], health["max_body_bytes"]
    return [(json.dumps({"queries": ["q"] * (n + 1)}).encode(), 422),  # too many queries
            (json.dumps({"queries": ["x" * 4000] * (size // 4000 + 1)}).encode(), 413)]  # oversized body


@pytest.mark.timeout(300)
def test_every_bad_input_gets_a_4xx_and_the_server_lives_on(dense_server):
    with httpx.Client(base_url=dense_server, timeout=60) as c:
        health = c.get("/health").json()
        for body, status in BAD + over_the_limits(health):
            r = c.post("/retrieve", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body[:60], r.status_code, r.text[:200])
            assert isinstance(r.json()["detail"], str) and r.json()["detail"], body[:60]

        def chunks():  # an oversized body with no Content-Length: the server must stop reading it
            yield b'{"queries": ["'
            for _ in range(health["max_body_bytes"] // 8192 + 1):
                yield b"y" * 8192
            yield b'"]}'
        r = c.post("/retrieve", content=chunks())
        assert r.status_code == 413 and "limit" in r.json()["detail"]
        assert c.get("/retrieve").status_code == 405
        assert c.post("/nope", json={}).status_code == 404
        # odd but valid queries are answered, not crashed on
        odd = ["x" * 4096, "emoji 🎵 and ümlauts", "nul\u0000char", "\n\t tabs", "日本の首都"]
        r = c.post("/retrieve", json={"queries": odd, "topk": 100, "return_scores": True})
        assert r.status_code == 200 and [len(row) for row in r.json()["result"]] == [64] * 5  # topk capped at corpus
        # still alive and still right
        assert c.get("/health").json()["status"] == "ok"
        r = c.post("/retrieve", json={"queries": ["music"], "topk": 2, "return_scores": True})
        assert r.status_code == 200 and len(r.json()["result"][0]) == 2


@pytest.mark.timeout(300)
def test_64_concurrent_clients_batched_and_identical(dense_server, dense_retriever, corpus_rows, helpers):
    rng = random.Random(0)
    titles = [r["contents"].split("\n", 1)[0] for r in corpus_rows]
    work = [[(f"what is {rng.choice(titles)}", rng.choice([1, 3, 5])) for _ in range(4)] for _ in range(64)]
    before = httpx.get(f"{dense_server}/health").json()
    results, errors = {}, []
    start = threading.Barrier(64)

    def client(i):
        try:
            with RetrievalClient(dense_server, timeout=120, retries=0) as c:
                start.wait()
                for j, (q, k) in enumerate(work[i]):
                    results[i, j] = c.search([q], k)[0]
        except Exception as e:  # collected, so one failure does not hide the others
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert errors == [] and len(results) == 256
    for i in range(64):
        for j, (q, k) in enumerate(work[i]):
            helpers.same([results[i, j]], dense_retriever.search([q], k))
    after = httpx.get(f"{dense_server}/health").json()
    n_q, n_b = after["queries"] - before["queries"], after["batches"] - before["batches"]
    assert n_q == 256
    assert n_b < 256 * 0.75, f"{n_b} batches for {n_q} queries: micro-batching did not happen"


@pytest.mark.timeout(300)
def test_bm25_server_matches_in_process(bm25_server, bm25_retriever, helpers):
    qs = ["greek philosophy", "the of", "music history"]
    with RetrievalClient(bm25_server) as c:
        helpers.same(c.search(qs, 5), bm25_retriever.search(qs, 5), tol=1e-6)
    assert httpx.get(f"{bm25_server}/health").json()["kind"] == "bm25"


@pytest.mark.timeout(180)
def test_wrong_encoder_is_refused_before_the_port_opens(dense_index, bm25_index, other_encoder, minilm, helpers):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "retrieval.server", "--port", str(helpers.free_port()), *args],
                              cwd=helpers.REPO, env=helpers.server_env(), capture_output=True, text=True, timeout=120)
    p = run("--index", str(dense_index), "--encoder", other_encoder)
    assert p.returncode == 2 and "is not the encoder that built index" in p.stderr, p.stderr[-2000:]
    p = run("--index", str(bm25_index), "--encoder", minilm)
    assert p.returncode == 2 and "BM25 index" in p.stderr
    p = run("--index", str(dense_index.parent / "missing"))
    assert p.returncode == 2 and "not a finished index" in p.stderr
    assert "Traceback" not in p.stderr  # an input mistake is a message (tests/test_bad_input.py has the others)


@pytest.mark.timeout(180)
def test_a_failed_load_stops_the_server(tmp_path, bm25_index, launcher):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(bm25_index, broken)
    (broken / "bm25" / "data.csc.index.npy").write_text("not numpy")  # every file there, one damaged: found only when loading
    proc, url = launcher.start(broken)
    assert proc.wait(120) == 1  # exits with an error instead of serving 503 forever
    assert "loading the index failed" in proc.log_path.read_text()


@pytest.mark.timeout(240)
def test_a_killed_search_process_is_replaced(bm25_index, bm25_retriever, launcher, helpers):
    import os
    import signal

    proc, url = launcher.start_ready(bm25_index)
    pid = httpx.get(f"{url}/health").json()["search_pid"]
    os.kill(pid, signal.SIGKILL)  # e.g. the OOM killer
    r = httpx.post(f"{url}/retrieve", json={"queries": ["music"], "topk": 2}, timeout=120)
    assert r.status_code == 503 and "restarted" in r.json()["detail"]  # the batch in flight fails, loudly
    new_pid = httpx.get(f"{url}/health").json()["search_pid"]
    assert new_pid != pid and proc.poll() is None
    with RetrievalClient(url, retries=2, backoff=0.2) as c:  # and the server answers again
        helpers.same(c.search(["music history"], 3), bm25_retriever.search(["music history"], 3), tol=1e-6)


class Flaky:
    """A real BM25 retriever that raises on the query "explode", and holds a batch holding "hold"
    until released (so the test can make requests pile up into one micro-batch)."""

    SECRET = "secret internal state: /srv/idx/shard_07 at 0xdeadbeef"

    def __init__(self, inner):
        self.inner, self.batches, self.release = inner, [], threading.Event()

    def describe(self):
        return self.inner.describe()

    def search_mixed(self, queries, topks):
        self.batches.append(list(queries))
        if "hold" in queries:
            self.release.wait(60)
        if "explode" in queries:
            raise RuntimeError(self.SECRET)
        return self.inner.search_mixed(queries, topks)


@pytest.fixture
def flaky_server(bm25_retriever, helpers):
    """create_app over a Flaky retriever, served by uvicorn on 127.0.0.1 in a thread of this process."""
    import uvicorn

    flaky = Flaky(bm25_retriever)
    app = create_app(lambda: flaky)
    port = helpers.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not (server.started and httpx.get(f"{url}/health").status_code == 200):
        assert time.monotonic() < deadline, "in-process server did not start"
        time.sleep(0.05)
    yield url, flaky, app
    flaky.release.set()
    server.should_exit = True
    th.join(10)


@pytest.mark.timeout(120)
def test_one_bad_query_fails_only_its_own_request(flaky_server, bm25_retriever, helpers):
    url, flaky, app = flaky_server
    bodies = [["hold"], ["music history"], ["explode", "art"], ["greek philosophy"]]
    got = {}

    def post(i):
        got[i] = httpx.post(f"{url}/retrieve", json={"queries": bodies[i], "topk": 3, "return_scores": True},
                            timeout=60)

    threads = [threading.Thread(target=post, args=(0,))]
    threads[0].start()
    deadline = time.monotonic() + 30
    while flaky.batches != [["hold"]]:  # the search thread is busy with "hold" ...
        assert time.monotonic() < deadline
        time.sleep(0.01)
    threads += [threading.Thread(target=post, args=(i,)) for i in (1, 2, 3)]
    for t in threads[1:]:
        t.start()
    while app.state.batcher._queued < 4:  # ... while the three others queue up behind it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    flaky.release.set()
    for t in threads:
        t.join(60)
    assert sorted(flaky.batches[1]) == sorted(["music history", "explode", "art", "greek philosophy"])  # one batch
    assert [got[i].status_code for i in range(4)] == [200, 200, 500, 200]
    for i in (1, 3):
        helpers.same(parse_result(got[i].json(), 1), bm25_retriever.search(bodies[i], 3), tol=1e-6)


@pytest.mark.timeout(120)
def test_a_500_names_no_internal_detail(flaky_server, caplog):
    url, _, _ = flaky_server
    with caplog.at_level("ERROR"):
        r = httpx.post(f"{url}/retrieve", json={"queries": ["explode"]}, timeout=60)
    assert r.status_code == 500
    detail = r.json()["detail"]
    assert "deadbeef" not in r.text and "RuntimeError" not in r.text and "shard_07" not in r.text
    assert "server log" in detail
    ref = detail.split("ref ")[1].split(")")[0]  # the operator finds the full error by this reference
    assert ref and ref in caplog.text and Flaky.SECRET in caplog.text
