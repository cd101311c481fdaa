"""LLM-as-a-judge client over any OpenAI-compatible `/v1/chat/completions` server.

vLLM, SGLang and OpenAI all speak this API, so the judge is whatever server the
user starts (scripts/start_judge.sh). One call judges a whole training step:

    judge = Judge("http://127.0.0.1:8000", cache_path="run/judge.sqlite")
    results = judge.judge_many([JudgeItem(question, golden, answer), ...])

For each item: no answer -> wrong, no call; exact match -> right, no call; a
cached verdict -> reused; else one request, at most `max_concurrency` in flight.
Each request has a timeout and `retries` retries with backoff. When the judge
stays down, the item is marked `judge_failed` (counted in `stats`, logged) and
exact match stands, so training goes on.

A breaker shared by every call of the client (and its threads) bounds what an outage
costs: it opens when a request found the server unreachable (every try a transport
error or timeout, and no request answered meanwhile) or after `give_up_after`
failed requests in a row, across calls. While open, requests fail at once without
the network; after `cooldown_s` one probe request (one try) decides: answered, it
closes; failed, it stays open another cool-down. So a hung judge costs one wave of
timeouts, not one per call.

mode="em" needs no server: exact match is the whole verdict.

The same client answers RAG-check prompts (`chat_many`): the game asks the judge
model to answer a proposer's question from the retrieved documents.

Authentication: the API key is read from the OPENAI_API_KEY environment variable (or
passed as api_key=) and sent as "Authorization: Bearer <key>"; no header without one (a
local vLLM server needs none). It is never a flag, so it never reaches config.json, and
neither describe() nor repr() shows it.

The verdict cache is keyed by (judge model, question, reference, answer): a new judge
model never reuses another model's verdicts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from utils.text import Golden, as_answer_list, exact_match

log = logging.getLogger(__name__)

JUDGE_SYSTEM = (
    "You check whether a candidate answer to a question is correct, given the reference answer. "
    "Reply with a single word: yes or no."
)
JUDGE_USER = (
    "Question: {question}\n"
    "Reference answer(s): {reference}\n"
    "Candidate answer: {answer}\n\n"
    "Does the candidate answer refer to the same thing as a reference answer? Differences in wording, "
    "spelling, abbreviation or level of detail are fine; a different person, place, number or date is not. "
    "Reply yes or no."
)

_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)
_WORD = re.compile(r"[a-z]+")
_YES = {"yes", "correct", "true", "right", "same"}
_NO = {"no", "incorrect", "false", "wrong", "different", "not"}


def parse_verdict(reply: str | None) -> bool | None:
    """True for yes, False for no, None when the reply says neither.

    The first yes-like or no-like word decides, after dropping any <think> block,
    so "Yes.", "**No**", "Verdict: yes, because ..." and "Correct" all parse, and
    "No, it is not correct" is no (its first such word is "no").
    """
    if not reply:
        return None
    for word in _WORD.findall(_THINK.sub(" ", reply).lower()):
        if word in _YES:
            return True
        if word in _NO:
            return False
    return None


@dataclass
class JudgeItem:
    question: str
    reference: Golden          # golden answer: a string or a list of aliases
    answer: str | None         # the model's extracted answer (None: it gave none)


@dataclass
class JudgeResult:
    correct: bool
    source: str                # "no_answer" | "em" | "cache" | "llm" | "judge_failed"
    judge_failed: bool = False
    reply: str = ""            # the judge's raw reply, for logs


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class _VerdictCache:
    """(judge model, question, reference, answer) -> the judge's reply, in SQLite.

    SQLite in WAL mode with a busy timeout lets several processes (ranks) share
    one file. The reply is stored, not the parsed verdict: a better parser later
    re-reads old replies.
    """

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False)
        # Switching a new file to WAL takes an exclusive lock and SQLite does not wait for it (no busy
        # handler): two ranks opening the same fresh cache at once got "database is locked". Retry it.
        deadline = time.monotonic() + 30.0
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, reply TEXT NOT NULL)")
        self._db.commit()
        self._lock = threading.Lock()

    @staticmethod
    def key(item: JudgeItem, model: str) -> str:
        # The model is part of the key: two judges disagree, and a cache shared between runs
        # (or kept across a judge upgrade) must not hand one model's verdicts to another.
        raw = json.dumps([model, item.question, as_answer_list(item.reference), item.answer], ensure_ascii=False)
        return hashlib.sha256(raw.encode("utf-8")).hexdigest()

    def get_many(self, keys: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        with self._lock:
            for i in range(0, len(keys), 500):   # SQLite caps the number of bound variables
                chunk = keys[i: i + 500]
                q = f"SELECT key, reply FROM verdicts WHERE key IN ({','.join('?' * len(chunk))})"
                out.update(dict(self._db.execute(q, chunk).fetchall()))
        return out

    def put_many(self, rows: list[tuple[str, str]]) -> None:
        if rows:
            with self._lock:
                self._db.executemany("INSERT OR REPLACE INTO verdicts (key, reply) VALUES (?, ?)", rows)
                self._db.commit()

    def close(self) -> None:
        self._db.close()


class _Breaker:
    """The outage state of one client, shared by its calls and threads (see the module's docstring)."""

    def __init__(self, give_up_after: int, cooldown_s: float, url: str | None):
        self._lock = threading.Lock()
        self.give_up_after, self.cooldown_s, self.url = give_up_after, cooldown_s, url
        self.streak = 0                     # failed requests in a row, across calls
        self.open_until: float | None = None
        self.probing = False
        self.last_ok = float("-inf")        # when a request last got an answer

    def is_open(self) -> bool:
        with self._lock:
            return self.open_until is not None

    def enter(self) -> str:
        """"go" (closed), "probe" (this call's first request decides whether the judge is back), or "fail"."""
        with self._lock:
            if self.open_until is None:
                return "go"
            if self.probing or time.monotonic() < self.open_until:
                return "fail"
            self.probing = True
            return "probe"

    def end_probe(self) -> None:
        """A probe that ended without a verdict (an exception): the next call may probe again."""
        with self._lock:
            self.probing = False

    def ok(self) -> None:
        with self._lock:
            if self.open_until is not None:
                log.warning("judge at %s answers again; the breaker is closed", self.url)
            self.streak, self.open_until, self.probing, self.last_ok = 0, None, False, time.monotonic()

    def failed(self, started: float, unreachable: bool, probe: bool = False) -> None:
        with self._lock:
            self.streak += 1
            if probe:
                self.probing = False
            # Unreachable only counts when nothing answered meanwhile: one slow request on a busy judge is no outage.
            if probe or (unreachable and self.last_ok < started) or self.streak >= self.give_up_after:
                if self.open_until is None:
                    log.warning("judge at %s is down (%d failed requests in a row); requests fail at once for %g s, "
                                "then one probe", self.url, self.streak, self.cooldown_s)
                self.open_until = time.monotonic() + self.cooldown_s


class Judge:
    """Batch judge. `url=None` (or mode="em") gives the exact-match-only judge."""

    def __init__(
        self,
        url: str | None = None,
        model: str | None = None,
        mode: str | None = None,
        api_key: str | None = None,
        max_concurrency: int = 32,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        give_up_after: int = 16,
        cooldown_s: float = 60.0,
        cache_path: str | Path | None = None,
        max_tokens: int = 8,
        extra_body: dict | None = None,
    ):
        """
        url: server root or its /v1 ("http://host:8000" or "http://host:8000/v1").
        model: served model name; None asks the server's /v1/models for the first one.
        api_key: sent as a Bearer token; None reads OPENAI_API_KEY (no header when neither is set).
        mode: "llm" or "em"; default "llm" when a url is given, else "em".
        give_up_after, cooldown_s: the breaker (see the module's docstring).
        max_tokens: room for the verdict word (raise it for judges that think first).
        extra_body: merged into every request, e.g. {"structured_outputs": {"choice": ["yes", "no"]}}
            on vLLM to force a one-word verdict.
        """
        self.mode = mode or ("llm" if url else "em")
        if self.mode not in ("llm", "em"):
            raise ValueError(f"judge mode must be 'llm' or 'em', got {self.mode!r}")
        if self.mode == "llm" and not url:
            raise ValueError("judge mode 'llm' needs a server url (start one with scripts/start_judge.sh), or use mode='em'")
        if max_concurrency < 1 or retries < 0 or timeout_s <= 0 or give_up_after < 1 or cooldown_s < 0:
            raise ValueError(f"need max_concurrency >= 1, retries >= 0, timeout_s > 0, give_up_after >= 1, cooldown_s >= 0; "
                             f"got {max_concurrency}, {retries}, {timeout_s}, {give_up_after}, {cooldown_s}")
        self.url = _base_url(url) if url else None
        self.model = model
        # Private, and kept out of describe()/repr(), so it cannot end up in a log or a config dump.
        self._api_key = api_key if api_key is not None else (os.environ.get("OPENAI_API_KEY") or None)
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.give_up_after = give_up_after
        self.cooldown_s = cooldown_s
        self._breaker = _Breaker(give_up_after, cooldown_s, self.url)
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        self.cache = _VerdictCache(cache_path) if cache_path else None
        # Cumulative counters; callers log per-step deltas.
        self.stats = {"items": 0, "em_hits": 0, "cache_hits": 0, "calls": 0, "failures": 0, "unparsed": 0}

    def describe(self) -> str:
        if self.mode == "em":
            return "exact match only (no judge server)"
        return f"llm {self.model or '(server default)'} at {self.url}" + (" (API key set)" if self._api_key else "")

    def __repr__(self) -> str:
        return f"Judge({self.describe()})"

    # ---- public, synchronous -------------------------------------------------

    def judge_many(self, items: Sequence[JudgeItem]) -> list[JudgeResult]:
        """One verdict per item, in order. Never raises for a server problem."""
        results: list[JudgeResult | None] = [None] * len(items)
        todo: list[int] = []
        self.stats["items"] += len(items)
        for i, it in enumerate(items):
            if it.answer is None or not str(it.answer).strip():
                results[i] = JudgeResult(False, "no_answer")
            elif exact_match(it.answer, it.reference):
                results[i] = JudgeResult(True, "em")
                self.stats["em_hits"] += 1
            elif self.mode == "em":
                results[i] = JudgeResult(False, "em")
            else:
                todo.append(i)
        if not todo:
            return results  # type: ignore[return-value]

        if self.cache and self.model is None:
            # The cache key holds the model name, so ask the server for it before looking anything up.
            self._run(self._discover_alone())
            if self.model is None:
                for i in todo:
                    results[i] = JudgeResult(False, "judge_failed", judge_failed=True)
                self.stats["failures"] += len(todo)
                log.warning("judge at %s is unreachable; %d items fall back to exact match", self.url, len(todo))
                return results  # type: ignore[return-value]
        keys = {i: _VerdictCache.key(items[i], self.model) for i in todo} if self.cache else {}
        cached = self.cache.get_many(list(keys.values())) if self.cache else {}
        ask = []
        for i in todo:
            if self.cache and keys[i] in cached:
                reply = cached[keys[i]]
                results[i] = self._verdict(reply, "cache")
                self.stats["cache_hits"] += 1
            else:
                ask.append(i)
        if ask:
            messages = [self._messages(items[i]) for i in ask]
            replies = self.chat_many(messages, max_tokens=self.max_tokens)
            new_rows = []
            for i, reply in zip(ask, replies):
                if reply is None:
                    results[i] = JudgeResult(False, "judge_failed", judge_failed=True)
                else:
                    results[i] = self._verdict(reply, "llm")
                    if self.cache:
                        new_rows.append((keys[i], reply))
            if self.cache:
                self.cache.put_many(new_rows)
        return results  # type: ignore[return-value]

    def chat_many(self, messages: Sequence[list[dict]], max_tokens: int = 64, temperature: float = 0.0) -> list[str | None]:
        """The assistant reply for each chat, None where the server failed; concurrency-limited."""
        if self.mode == "em":
            raise RuntimeError("this judge is exact-match only (no server url); it cannot answer prompts")
        if not messages:
            return []
        return self._run(self._chat_all(list(messages), max_tokens, temperature))

    @staticmethod
    def _run(coro):
        """Run a coroutine to completion from synchronous code."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        # Called from inside a running loop (a notebook, an async trainer): run on a private loop in a thread.
        out: list = []
        t = threading.Thread(target=lambda: out.append(asyncio.run(coro)))
        t.start()
        t.join()
        return out[0]

    async def _discover_alone(self) -> None:
        import httpx

        gate = self._breaker.enter()
        if gate == "fail":
            return
        probe = gate == "probe"
        try:
            async with httpx.AsyncClient(base_url=self.url, headers=self._headers(), timeout=self.timeout_s) as client:
                self.model, probe = await self._discover_model(client, probe=probe), False
        finally:
            if probe:   # left before the probe decided (an exception)
                self._breaker.end_probe()

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def close(self) -> None:
        if self.cache:
            self.cache.close()

    # ---- internals -------------------------------------------------------------

    def _verdict(self, reply: str, source: str) -> JudgeResult:
        v = parse_verdict(reply)
        if v is None:
            self.stats["unparsed"] += 1
        return JudgeResult(bool(v), source, reply=reply)

    @staticmethod
    def _messages(item: JudgeItem) -> list[dict]:
        ref = " | ".join(as_answer_list(item.reference))
        user = JUDGE_USER.format(question=item.question.strip(), reference=ref, answer=str(item.answer).strip())
        return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]

    async def _chat_all(self, messages: list[list[dict]], max_tokens: int, temperature: float) -> list[str | None]:
        import httpx

        gate = self._breaker.enter()
        if gate == "fail":   # the judge is down (the breaker): fail at once, no request
            self.stats["failures"] += len(messages)
            log.debug("judge at %s is down (breaker open); %d items fall back to exact match", self.url, len(messages))
            return [None] * len(messages)
        probe = gate == "probe"
        limits = httpx.Limits(max_connections=self.max_concurrency)
        try:
            async with httpx.AsyncClient(base_url=self.url, headers=self._headers(), timeout=self.timeout_s,
                                         limits=limits) as client:
                if self.model is None:
                    self.model, probe = await self._discover_model(client, probe=probe), False
                    if self.model is None:
                        self.stats["failures"] += len(messages)
                        log.warning("judge at %s is unreachable; %d items fall back to exact match", self.url, len(messages))
                        return [None] * len(messages)
                sem = asyncio.Semaphore(self.max_concurrency)

                async def one(msgs: list[dict]) -> str | None:
                    async with sem:
                        # Another request of this wave (or thread) found the judge down: do not wait it out again.
                        reply = None if self._breaker.is_open() else await self._post(client, msgs, max_tokens, temperature)
                        if reply is None:
                            self.stats["failures"] += 1
                        return reply

                first: list[str | None] = []
                if probe:   # the probe goes alone: when it fails, the rest of the call fails at once
                    probe = False
                    reply = await self._post(client, messages[0], max_tokens, temperature, probe=True)
                    if reply is None:
                        self.stats["failures"] += 1
                    first = [reply]
                replies = first + list(await asyncio.gather(*(one(m) for m in messages[len(first):])))
        finally:
            if probe:   # left before the probe was sent (an exception)
                self._breaker.end_probe()
        n_failed = sum(r is None for r in replies)
        if n_failed:
            log.warning("judge at %s failed on %d/%d requests; exact match stands for them", self.url, n_failed, len(replies))
        return list(replies)

    async def _discover_model(self, client, probe: bool = False) -> str | None:
        started = time.monotonic()
        tries = 1 if probe else self.retries + 1
        for attempt in range(tries):
            try:
                r = await client.get("/v1/models")
                r.raise_for_status()
                name = r.json()["data"][0]["id"]
                self._breaker.ok()
                return name
            except Exception as e:  # noqa: BLE001 - any failure means "no judge"; logged below
                err = e
                if attempt < tries - 1:   # no wait after the last try: nothing follows it
                    await asyncio.sleep(self.backoff_s * 2**attempt)
        log.warning("judge /v1/models at %s failed: %r", self.url, err)
        self._breaker.failed(started, unreachable=True, probe=probe)
        return None

    async def _post(self, client, msgs: list[dict], max_tokens: int, temperature: float,
                    probe: bool = False) -> str | None:
        """One request, recorded on the breaker. A probe makes one try; a request stops retrying once the
        breaker has opened (another request found the judge down)."""
        started = time.monotonic()
        try:
            reply, unreachable = await self._tries(client, msgs, max_tokens, temperature, 1 if probe else self.retries + 1)
        except BaseException:   # cancelled: no verdict on the judge, but never leave a probe marked in flight
            if probe:
                self._breaker.end_probe()
            raise
        if reply is not None:
            self._breaker.ok()
        else:
            self._breaker.failed(started, unreachable, probe)
        return reply

    async def _tries(self, client, msgs: list[dict], max_tokens: int, temperature: float,
                     tries: int) -> tuple[str | None, bool]:
        """(the reply or None, whether every try ended in a transport error: no HTTP answer at all)."""
        import httpx

        body = {"model": self.model, "messages": msgs, "max_tokens": max_tokens, "temperature": temperature}
        body.update(self.extra_body)
        unreachable = True
        for attempt in range(tries):
            if attempt and self._breaker.is_open():
                break
            self.stats["calls"] += 1
            try:
                r = await client.post("/v1/chat/completions", json=body)
                unreachable = False
                if r.status_code == 200:
                    return r.json()["choices"][0]["message"].get("content") or "", False
                # 4xx other than rate limiting will not get better on retry (bad model name, bad body).
                if r.status_code < 500 and r.status_code != 429:
                    log.warning("judge refused the request (%d): %s", r.status_code, r.text[:300])
                    return None, False
            except httpx.TransportError as e:   # refused, reset, timed out: no answer from the server
                if attempt == tries - 1:
                    log.debug("judge request failed after %d tries: %r", attempt + 1, e)
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:  # a malformed body
                unreachable = False
                if attempt == tries - 1:
                    log.debug("judge request failed after %d tries: %r", attempt + 1, e)
            if attempt < tries - 1:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        return None, unreachable
