"""The judge client: verdict parsing, exact-match mode, a dead server, and a real vLLM server with the cache."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from inference.judge import Judge, JudgeItem, parse_verdict
from tests.json_server import JSONHandler
from tests.inference.test_judge_hang import hang, hang_url  # noqa: F401 - fixtures: a judge that never answers

# Wrong-by-exact-match items, so each one needs the judge model.
HARD = [
    JudgeItem("What is the capital of France?", ["Paris"], "the French capital city, Paris, France"),
    JudgeItem("Who wrote Hamlet?", "William Shakespeare", "Shakespeare"),
    JudgeItem("How many legs does a spider have?", ["8", "eight"], "six"),
]


@pytest.mark.parametrize(
    "reply, verdict",
    [
        ("yes", True), ("Yes.", True), ("**No**", False), ("no, it is not correct", False),
        ("Verdict: YES, both name the same city", True), ("Correct", True), ("incorrect", False),
        ("<think>is it yes? no wait</think> No", False), ("<think>unfinished yes", None),
        ("", None), (None, None), ("maybe", None), ("The answer is wrong.", False),
    ],
)
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) is verdict


def test_em_mode_needs_no_server():
    judge = Judge()  # no url -> exact match only
    assert judge.mode == "em"
    items = [JudgeItem("q", ["Paris", "City of Light"], "the city of light"), JudgeItem("q", "Paris", "Lyon"),
             JudgeItem("q", "Paris", None), JudgeItem("q", "Paris", "  ")]
    res = judge.judge_many(items)
    assert [r.correct for r in res] == [True, False, False, False]
    assert [r.source for r in res] == ["em", "em", "no_answer", "no_answer"]
    assert judge.stats["calls"] == 0
    with pytest.raises(RuntimeError, match="exact-match only"):
        judge.chat_many([[{"role": "user", "content": "hi"}]])


def test_bad_config_messages():
    with pytest.raises(ValueError, match="needs a server url"):
        Judge(mode="llm")
    with pytest.raises(ValueError, match="mode must be"):
        Judge(mode="gpt")


@pytest.mark.timeout(60)
def test_server_down_marks_judge_failed_and_em_stands(dead_url, tmp_path):
    judge = Judge(dead_url, model="judge", retries=2, backoff_s=0.05, timeout_s=2.0, cache_path=tmp_path / "c.sqlite",
                  max_concurrency=1, cooldown_s=0.5)
    items = HARD + [JudgeItem("q", "Paris", "Paris")]
    t0 = time.monotonic()
    res = judge.judge_many(items)
    assert time.monotonic() - t0 < 20
    assert [r.judge_failed for r in res] == [True, True, True, False]
    assert [r.correct for r in res] == [False, False, False, True]
    assert res[-1].source == "em"
    assert judge.stats["failures"] == 3
    # the first request tried 1 + retries times and found the judge unreachable: the others failed at once
    assert judge.stats["calls"] == 3
    # failures are not cached: a later call asks again, once the breaker's cool-down has passed (one probe)
    judge.judge_many(items[:1])
    assert judge.stats["calls"] == 3
    time.sleep(0.6)
    judge.judge_many(items[:1])
    assert judge.stats["calls"] == 3 + 1


@pytest.mark.timeout(60)
def test_model_discovery_waits_only_between_tries(dead_url, monkeypatch):
    """After its last failed try nothing follows, so no backoff: that sleep cost ~2 s a step while the judge was down."""
    import inference.judge as J

    waits = []
    real_sleep = J.asyncio.sleep

    async def record(s):
        waits.append(s)
        await real_sleep(0)

    monkeypatch.setattr(J.asyncio, "sleep", record)
    judge = Judge(dead_url, retries=2, backoff_s=0.5, timeout_s=2.0)
    assert all(r.judge_failed for r in judge.judge_many(HARD[:1]))
    assert waits == [0.5, 1.0]   # 3 tries, 2 waits (before: a third of 2.0 s after the last)


@pytest.mark.timeout(60)
def test_server_down_model_discovery_and_give_up(dead_url):
    # model=None makes the client ask /v1/models first; that failing fails the batch at once
    judge = Judge(dead_url, retries=1, backoff_s=0.01, timeout_s=2.0)
    res = judge.judge_many(HARD * 10)
    assert all(r.judge_failed for r in res) and judge.stats["failures"] == 30
    assert judge.stats["calls"] == 0
    # with a known model name, the first refused request opens the breaker: the rest of the batch fails at once
    # (failures that are answers, 5xx, open it after give_up_after in a row: test_the_give_up_streak_outlives_the_call)
    judge = Judge(dead_url, model="judge", retries=0, backoff_s=0.0, max_concurrency=1, give_up_after=4)
    res = judge.judge_many(HARD * 10)
    assert all(r.judge_failed for r in res)
    assert judge.stats["calls"] == 1


@pytest.mark.timeout(60)
def test_server_hanging_marks_judge_failed_and_em_stands(hang_url, tmp_path):
    """The hanging-server variant of the test above: the judge accepts the connection and never answers, so
    every try waits out the timeout. One wave of them, then the breaker fails what follows without the network."""
    judge = Judge(hang_url, model="judge", retries=1, backoff_s=0.0, timeout_s=1.0, cache_path=tmp_path / "c.sqlite")
    items = HARD + [JudgeItem("q", "Paris", "Paris")]
    t0 = time.monotonic()
    res = judge.judge_many(items)
    assert [r.judge_failed for r in res] == [True, True, True, False]
    assert [r.correct for r in res] == [False, False, False, True] and res[-1].source == "em"
    assert judge.stats["failures"] == 3 and judge.stats["calls"] <= 3 * 2
    calls = judge.stats["calls"]
    for _ in range(5):   # the same outage: failed at once, nothing sent, nothing cached
        assert [r.judge_failed for r in judge.judge_many(items)] == [True, True, True, False]
    assert judge.stats["calls"] == calls and judge.stats["failures"] == 3 * 6
    assert time.monotonic() - t0 < 3 * 2 * 1.0


class _Flaky(BaseHTTPRequestHandler):
    """Answers "yes" while `up` is set; while it is not, a chat request hangs (no reply) or gets a 500 (`mode`)."""

    hits: list = []
    up = threading.Event()
    release = threading.Event()
    mode = "hang"

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.hits.append(time.monotonic())
        if not self.up.is_set():
            if self.mode == "hang":
                self.release.wait(10)   # the client times out first; then drop the connection unanswered
                return
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "yes"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def flaky():
    handler = type("Handler", (_Flaky,), {"hits": [], "up": threading.Event(), "release": threading.Event()})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        handler.release.set()
        srv.shutdown()
        srv.server_close()


@pytest.mark.timeout(60)
def test_the_give_up_streak_outlives_the_call(flaky):
    """Before, the streak restarted with every call, so one-item calls (the pipeline's) never reached it."""
    url, server = flaky
    server.mode = "500"
    judge = Judge(url, model="m", retries=0, backoff_s=0.0, give_up_after=3)
    res = [judge.judge_many(HARD[:1])[0] for _ in range(6)]
    assert all(r.judge_failed for r in res) and judge.stats["failures"] == 6
    assert len(server.hits) == 3 and judge.stats["calls"] == 3


@pytest.mark.timeout(60)
def test_the_breaker_probes_once_after_its_cool_down_and_closes_when_the_judge_is_back(flaky):
    url, server = flaky
    judge = Judge(url, model="m", retries=0, timeout_s=2.0, cooldown_s=1.5)
    assert judge.judge_many(HARD[:1])[0].judge_failed and len(server.hits) == 1   # timed out: the breaker opens

    def from_threads(n):
        out = [None] * n

        def go(k):
            out[k] = judge.judge_many(HARD)
        threads = [threading.Thread(target=go, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    # open: eight threads at once fail at once, nothing reaches the server
    t0 = time.monotonic()
    assert all(r.judge_failed for res in from_threads(8) for r in res)
    assert time.monotonic() - t0 < judge.timeout_s and len(server.hits) == 1
    # cooled down, still hanging: of four threads one sends a single probe, the others fail at once
    time.sleep(1.6)
    assert all(r.judge_failed for res in from_threads(4) for r in res)
    assert len(server.hits) == 2
    assert judge.judge_many(HARD)[0].judge_failed and len(server.hits) == 2   # the failed probe reopened it
    # back up: after the cool-down the probe succeeds, and the rest of its call goes out with it
    server.up.set()
    time.sleep(1.6)
    res = judge.judge_many(HARD)
    assert [r.source for r in res] == ["llm"] * 3 and all(r.correct for r in res) and len(server.hits) == 5
    assert [r.source for r in judge.judge_many(HARD[1:])] == ["llm", "llm"] and len(server.hits) == 7
    assert judge.chat_many([[{"role": "user", "content": "hi"}]]) == ["yes"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_server_calls_cache_and_parse(judge_server, tmp_path):
    cache = tmp_path / "verdicts.sqlite"
    # vLLM's structured outputs force a one-word verdict, so the parse is checked on a real reply
    force = {"structured_outputs": {"choice": ["yes", "no"]}}
    judge = Judge(judge_server, cache_path=cache, extra_body=force, max_concurrency=4)
    items = HARD + [JudgeItem("Capital of Italy?", "Rome", "Rome")]
    res = judge.judge_many(items)
    assert judge.model == "judge"                       # discovered from /v1/models
    assert judge.stats["calls"] == 3 and judge.stats["failures"] == 0
    assert [r.source for r in res] == ["llm", "llm", "llm", "em"]
    assert all(r.reply in ("yes", "no") for r in res[:3])
    assert all(r.correct == (r.reply == "yes") for r in res[:3])
    assert judge.stats["unparsed"] == 0

    # second call: all from the cache, no new requests, same verdicts
    again = judge.judge_many(items)
    assert judge.stats["calls"] == 3 and judge.stats["cache_hits"] == 3
    assert [r.source for r in again] == ["cache", "cache", "cache", "em"]
    assert [r.correct for r in again] == [r.correct for r in res]
    judge.close()

    # the cache file outlives the client (another process / rank opening it sees the verdicts)
    other = Judge(judge_server, model="judge", cache_path=cache)
    assert [r.source for r in other.judge_many(items[:2])] == ["cache", "cache"]
    assert other.stats["calls"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_server_free_text_and_errors(judge_server):
    judge = Judge(judge_server, model="judge", max_tokens=16, retries=2, backoff_s=0.05)
    # free-form replies: the client returns them whatever they say; unparsed ones count as wrong
    res = judge.judge_many(HARD)
    assert judge.stats["calls"] == 3 and all(isinstance(r.reply, str) and r.reply for r in res)
    assert judge.stats["unparsed"] == sum(parse_verdict(r.reply) is None for r in res)
    assert all(r.correct == bool(parse_verdict(r.reply)) for r in res)
    # chat_many serves the RAG check: one reply per chat, in order
    replies = judge.chat_many([[{"role": "user", "content": f"Say {w}."}] for w in ("one", "two")], max_tokens=4)
    assert len(replies) == 2 and all(isinstance(r, str) for r in replies)
    # a wrong model name is a 404: no retries, marked failed
    bad = Judge(judge_server, model="no-such-model", retries=3, backoff_s=0.05)
    res = bad.judge_many(HARD[:1])
    assert res[0].judge_failed and bad.stats["calls"] == 1


@pytest.mark.timeout(120)
def test_cache_shared_by_concurrent_processes(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from inference.judge import _VerdictCache

    repo = Path(__file__).resolve().parents[2]
    db = tmp_path / "shared.sqlite"
    writer = (
        "import sys; from inference.judge import _VerdictCache, JudgeItem\n"
        "c = _VerdictCache(sys.argv[1]); tag = sys.argv[2]\n"
        "for i in range(100):\n"
        "    c.put_many([(_VerdictCache.key(JudgeItem(f'q{i}', ['r'], tag), 'm'), tag)])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(repo))
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(db), tag], env=env, cwd=repo) for tag in ("a", "b")]
    assert [p.wait(timeout=100) for p in procs] == [0, 0]
    cache = _VerdictCache(db)
    keys = [_VerdictCache.key(JudgeItem(f"q{i}", ["r"], tag), "m") for tag in ("a", "b") for i in range(100)]
    got = cache.get_many(keys)
    assert len(got) == 200 and sorted(set(got.values())) == ["a", "b"]


# ---- a tiny real HTTP server on 127.0.0.1 that records what the client sends ----------------------

class _Recorder(JSONHandler):
    """OpenAI-compatible enough: /v1/models names "m1"; a chat answers "yes" for model m1, "no" otherwise."""

    seen: list = []

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Authorization"), None))
        self._reply({"object": "list", "data": [{"id": "m1", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, self.headers.get("Authorization"), body["model"]))
        word = "yes" if body["model"] == "m1" else "no"
        self._reply({"choices": [{"message": {"role": "assistant", "content": word}}]})


@pytest.fixture
def recorder():
    seen: list = []
    handler = type("Handler", (_Recorder,), {"seen": seen})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.timeout(60)
def test_api_key_from_the_environment_is_a_bearer_token_and_never_shown(recorder, monkeypatch, caplog):
    url, seen = recorder
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    caplog.set_level(logging.DEBUG)
    judge = Judge(url + "/v1")                      # model=None: /v1/models is asked first, with the key too
    res = judge.judge_many(HARD[:2])
    assert [r.source for r in res] == ["llm", "llm"] and judge.model == "m1"
    assert [p for p, _, _ in seen] == ["/v1/models", "/v1/chat/completions", "/v1/chat/completions"]
    assert all(auth == f"Bearer {secret}" for _, auth, _ in seen), seen
    assert secret not in judge.describe() and secret not in repr(judge) and secret not in caplog.text
    assert "API key set" in judge.describe()

    # an explicit key wins over the environment
    seen.clear()
    Judge(url, model="m1", api_key="sk-explicit").judge_many(HARD[:1])
    assert seen == [("/v1/chat/completions", "Bearer sk-explicit", "m1")]
    # no key anywhere: no Authorization header at all (a local vLLM server needs none)
    monkeypatch.delenv("OPENAI_API_KEY")
    seen.clear()
    Judge(url, model="m1").judge_many(HARD[:1])
    assert seen == [("/v1/chat/completions", None, "m1")]


def test_api_key_never_reaches_the_run_config(monkeypatch, tmp_path):
    from training.settings.config import parse_config

    secret = "sk-test-should-not-be-saved"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    cfg = parse_config(["--judge", "llm", "--judge_url", "http://127.0.0.1:1/v1",
                        "--retriever_url", "http://127.0.0.1:2"])
    cfg.save(tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text()
    assert secret not in text and "api_key" not in text


@pytest.mark.timeout(60)
def test_cache_key_includes_the_judge_model(recorder, tmp_path):
    url, seen = recorder
    cache = tmp_path / "verdicts.sqlite"
    item = [HARD[1]]
    a = Judge(url, model="m1", cache_path=cache)
    assert a.judge_many(item)[0].correct is True and a.stats["calls"] == 1
    # same question and answer, another model: not answered from m1's verdict
    b = Judge(url, model="m2", cache_path=cache)
    res = b.judge_many(item)[0]
    assert (res.source, res.correct) == ("llm", False) and b.stats["calls"] == 1 and b.stats["cache_hits"] == 0
    # each model now finds its own entry
    assert a.judge_many(item)[0].source == "cache" and b.judge_many(item)[0].source == "cache"
    assert a.judge_many(item)[0].correct is True and b.judge_many(item)[0].correct is False
    import sqlite3
    assert sqlite3.connect(cache).execute("SELECT COUNT(*) FROM verdicts").fetchone()[0] == 2
    # model=None: the name is discovered before the cache is read, so m1's entry is found
    seen.clear()
    c = Judge(url, cache_path=cache)
    assert c.judge_many(item)[0].source == "cache" and c.model == "m1"
    assert [p for p, _, _ in seen] == ["/v1/models"]


@pytest.mark.timeout(60)
def test_cache_with_unknown_model_and_dead_server_fails_the_items(dead_url, tmp_path):
    judge = Judge(dead_url, retries=0, backoff_s=0.0, timeout_s=2.0, cache_path=tmp_path / "c.sqlite")
    res = judge.judge_many(HARD + [JudgeItem("q", "Paris", "Paris")])
    assert [r.judge_failed for r in res] == [True, True, True, False] and judge.stats["failures"] == 3
