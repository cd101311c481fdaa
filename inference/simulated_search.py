"""Simulated search (ZeroSearch, arXiv:2505.04588): an LLM writes the documents a search engine would return.

It lives in inference/, not retrieval/: it is generation (a chat client or an in-process engine, sampling
settings, chat templates) that only speaks the retrievers' output format, and retrieval/ knows nothing of
generation.

    sim = SimulatedSearch(url="http://127.0.0.1:8001", noise_start=0.25, noise_end=0.5, total_steps=200)
    sim.set_step(step)                                              # once per training step
    sim.search(["capital of france"], topk=3,
               contexts=[{"question": "Which city ...?", "answer": ["Paris"]}])
    # -> [[{"id": "sim-3f2a..", "contents": "Title\\ntext", "score": 1.0, "simulated": "useful"}, ...]]

Each of the topk documents is drawn independently: noisy with probability p(step), useful
otherwise, and one LLM request writes it (useful and noisy documents have their own prompt).
As in ZeroSearch the simulator sees the question and its answer when they are known, so a
useful document can carry the fact the policy needs and a noisy one can steer clear of it.
The noise probability follows ZeroSearch's curriculum (`noise_probability`): documents get
worse as training goes on, so the policy first learns the search format, then to doubt.

The LLM is either
  * a server speaking the OpenAI chat API (vLLM, SGLang, ...): `url=`; requests go through
    inference.judge.Judge's client (concurrency cap, timeout, retries, give-up streak), or
  * an in-process TokenGenerator of inference/engine_api.py (the policy itself, or any other):
    `engine=`; prompts are built with the tokenizer's chat template.

The output matches the retrievers' format, so rollouts, format_docs and the RAG check cannot
tell the difference; the extra "simulated" field says which kind each document was.
A failed request (server down, timeout, empty reply) drops that document; a query whose
documents all failed gets an empty list. Both are counted in `stats`.
When *no* request of a call got a reply (the server is down, or the engine raised), `search`
raises SimulatorUnavailable after counting: an outage must not look like a search that found
nothing. The rollout then records a failed search on those trajectories, and the game leaves
their groups out of the loss (inference/game.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import re
import threading
from typing import Any, Sequence

from inference.engine_api import SamplingConfig, TokenGenerator
from inference.judge import Judge
from inference.prompts import encode_prompt, render_chat

log = logging.getLogger(__name__)


class SimulatorUnavailable(RuntimeError):
    """Every document request of one search call failed without a reply."""


# --- prompts (our wording) -------------------------------------------------------------------

_COMMON = (
    "You play the part of a web search engine. For the search query below, write the text of "
    "search result number {rank} of {k}: one short encyclopedia-style passage of about {words} words, "
    "on a different aspect than the other results would cover.\n"
)
_USEFUL = (
    "This result must be relevant and helpful: state concrete, correct facts that bear on the query."
    "{hint}\n"
)
_NOISY = (
    "This result must be a poor match: it may share words with the query, but it is about a different "
    "person, place or thing, or it stays vague, so a reader learns nothing that answers the question."
    "{hint}\n"
)
_HINT = " The person searching wants to answer the question \"{question}\"{answer_part}."
_USEFUL_ANSWER = ", whose correct answer is {answer}; include the facts that lead to it"
_NOISY_ANSWER = ", whose correct answer is {answer}; never mention that answer"
_FORMAT = (
    "Write the page title on the first line, starting with \"Title: \", and the passage on the next line. "
    "Write nothing else.\n\n"
    "Query: {query}"
)


def _answer_text(answer: Any) -> str:
    if answer is None:
        return ""
    if isinstance(answer, (list, tuple)):
        names = [str(a).strip() for a in answer if str(a).strip()]
        return " / ".join(names[:3])  # a few aliases; the first is the canonical one
    return str(answer).strip()


def build_messages(query: str, noisy: bool, context: dict | None, rank: int, k: int, words: int = 60) -> list[dict]:
    """The chat (a single user message) that asks for one useful or noisy document for `query`.

    The instruction sits in the user message, not a system message, because some chat
    templates refuse or rewrite system messages (same choice as inference/prompts.py).
    """
    context = context or {}
    question = str(context.get("question") or "").strip()
    answer = _answer_text(context.get("answer"))
    hint = ""
    if question or answer:
        answer_part = (_NOISY_ANSWER if noisy else _USEFUL_ANSWER).format(answer=answer) if answer else ""
        if question:
            hint = _HINT.format(question=question, answer_part=answer_part)
        else:  # proposer rollouts: the answer is known, the question is what is being written
            hint = (" The searcher is looking for facts about " + answer + "." if not noisy
                    else " Do not mention " + answer + ".")
    text = _COMMON.format(rank=rank, k=k, words=words) + (_NOISY if noisy else _USEFUL).format(hint=hint)
    text += _FORMAT.format(query=query.strip())
    return [{"role": "user", "content": text}]


# --- the curriculum --------------------------------------------------------------------------

def noise_probability(step: int, total_steps: int, start: float, end: float, base: float = 4.0) -> float:
    """ZeroSearch's curriculum: p(t) = start + (b^(t/T) - 1) / (b - 1) * (end - start).

    t is clamped to [0, T], so p stays at `end` after the planned steps. With b > 1 the
    noise rises slowly at first and faster near the end (b = 4: half-way, a third of the
    way from start to end); b = 1 is the linear limit.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    for name, v in (("start", start), ("end", end)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"noise {name} must be a probability in [0, 1], got {v}")
    if base <= 0:
        raise ValueError(f"curriculum base must be > 0, got {base}")
    frac = min(max(step, 0), total_steps) / total_steps
    shape = frac if math.isclose(base, 1.0) else (base ** frac - 1.0) / (base - 1.0)
    return start + shape * (end - start)


# --- parsing the simulator's reply -----------------------------------------------------------

_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)
_TITLE = re.compile(r"^[\s#>*_\-]*title\s*[:\-]\s*(.*)$", re.IGNORECASE)
_LABEL = re.compile(r"^[\s*_]*(?:text|passage|content|document|body)[\s*_]*:\s*", re.IGNORECASE)
_MARKUP = re.compile(r"^[*_#\s\"']+|[*_#\s\"']+$")


def parse_document(reply: str | None, query: str, max_chars: int = 1500) -> tuple[str, str] | None:
    """(title, text) from a reply in the "Title: ...\\n<passage>" format; None if there is no text.

    Robust to thinking blocks, markdown bold, "Text:"-style labels and a title written
    later than the first line. Without a title line the whole reply is the text and the
    query is the title (a search result always has one); a reply that is only a title
    line becomes the text under the query's title.
    """
    if not reply:
        return None
    reply = _THINK.sub(" ", reply).strip()
    lines = [ln for ln in reply.splitlines() if ln.strip()]
    title = ""
    for i, ln in enumerate(lines):
        m = _TITLE.match(ln)
        if m:
            title = m.group(1)
            while (again := _TITLE.match(title)) is not None:  # "Title: Title: X"
                title = again.group(1)
            title = _MARKUP.sub("", title)
            lines = lines[:i] + lines[i + 1:]
            break
    text = " ".join(_LABEL.sub("", ln).strip() for ln in lines)
    text = " ".join(text.split())[:max_chars].strip()
    if not text:
        title, text = "", title  # only a title line: small models stop there or put the passage on it
    if not text:
        return None
    title = " ".join(title.split())[:200] or " ".join(query.split())[:200]
    return title, text


# --- the backend -----------------------------------------------------------------------------

class SimulatedSearch:
    """Search backend whose documents an LLM writes; same `search` interface as the retrievers."""

    # The rollout loop passes per-query contexts (question, answer) to backends that want them.
    wants_context = True
    # With engine= it may generate with the policy's own engine, which the rollout loop steps: it must not be called
    # from threads beside the engine (the loop calls it between waves instead, inference/step_loop.py). With url= it may (set per instance in __init__): its
    # draws are keyed by what is asked, not by the order of the calls, and a lock serialises its client and counts.
    concurrent_safe = False

    def __init__(
        self,
        url: str | None = None,
        engine: TokenGenerator | None = None,
        model: str | None = None,
        noise_start: float = 0.25,
        noise_end: float = 0.5,
        total_steps: int = 1,
        curriculum_base: float = 4.0,
        seed: int = 0,
        doc_words: int = 60,
        max_tokens: int = 160,
        temperature: float = 0.8,
        template: str = "auto",
        timeout_s: float = 30.0,
        retries: int = 1,
        max_concurrency: int = 32,
        give_up_after: int = 16,
        api_key: str | None = None,
        extra_body: dict | None = None,
        show_answer: bool = True,
    ):
        """
        url / engine: exactly one. url = an OpenAI-compatible server (root or /v1); engine = an
            in-process TokenGenerator (inference/engine_api.py), e.g. the policy's VLLMEngine.
        model: served model name (url only); None asks the server's /v1/models.
        noise_start, noise_end, total_steps, curriculum_base: the curriculum (noise_probability).
            0.25 -> 0.5 is ZeroSearch's example setting; total_steps is the number of training steps.
        seed: seeds the noisy/useful draws (and the engine's sampling seeds); give each rank its own.
        doc_words: the length asked for; ~60 words is close to the demo corpus' ~77-word extracts.
        max_tokens: cap on one document's reply; must leave room in the engine's max_model_len.
        temperature: > 0 so the k documents of one query differ.
        template: chat template for engine prompts (inference.prompts.TEMPLATES).
        timeout_s, retries, max_concurrency, give_up_after: server client limits; with the server
            down a batch ends after about one wave of timeouts (see inference/judge.py).
        api_key: the server's API key (Bearer); None reads OPENAI_API_KEY, like the judge.
        extra_body: merged into every server request, e.g. {"chat_template_kwargs": {"enable_thinking": False}}
            for a Qwen3 simulator. The server path sends no per-document seed (the judge client has one body
            for all requests); a fixed {"seed": s} here makes the k documents of a query near-identical.
        show_answer: show the simulator the golden answer from the contexts (ZeroSearch does, in training).
            Turn it off for evaluation, or the documents leak the answer the policy is tested on.
        """
        if (url is None) == (engine is None):
            raise ValueError("SimulatedSearch needs exactly one of url= (an OpenAI-compatible server) or "
                             f"engine= (an in-process engine); got url={url!r}, engine={type(engine).__name__}")
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1 (the number of training steps), got {total_steps}")
        noise_probability(0, total_steps, noise_start, noise_end, curriculum_base)  # validates the rest
        if max_tokens < 8 or temperature < 0 or doc_words < 1:
            raise ValueError(f"need max_tokens >= 8, temperature >= 0, doc_words >= 1; "
                             f"got {max_tokens}, {temperature}, {doc_words}")
        if engine is not None and template == "auto" and not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError("the simulator engine's tokenizer has no chat template; pass template= one of "
                             "inference.prompts.TEMPLATES[1:] (e.g. 'r_search' for a base model)")
        self.engine = engine
        self.client = None
        self.show_answer = show_answer
        if url is not None:
            self.client = Judge(url, model=model, mode="llm", api_key=api_key, max_concurrency=max_concurrency,
                                timeout_s=timeout_s, retries=retries, give_up_after=give_up_after, extra_body=extra_body)
        self.noise_start, self.noise_end = float(noise_start), float(noise_end)
        self.total_steps, self.curriculum_base = int(total_steps), float(curriculum_base)
        self.doc_words, self.max_tokens, self.temperature = doc_words, max_tokens, temperature
        self.template = template
        self.step = 0
        self.seed = int(seed)
        self.concurrent_safe = url is not None
        self._lock = threading.Lock()
        # Cumulative counters; callers log per-step deltas (search/sim_noisy_frac = noisy / docs).
        # calls: documents requested; failures: requests that gave no document, of which unparsed: a reply
        # came back but held no text (the rest: server down, timeout, refused); empty: queries left with none.
        self.stats = {"queries": 0, "calls": 0, "docs": 0, "noisy": 0, "failures": 0, "unparsed": 0, "empty": 0}

    def describe(self) -> str:
        src = self.client.describe() if self.client else f"in-process {type(self.engine).__name__}"
        return (f"simulated search ({src}), noise {self.noise_start:g} -> {self.noise_end:g} over "
                f"{self.total_steps} steps (b={self.curriculum_base:g}), now p={self.noise_p:.3f}")

    # --- curriculum state -----------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        self.step = int(step)

    @property
    def noise_p(self) -> float:
        return noise_probability(self.step, self.total_steps, self.noise_start, self.noise_end, self.curriculum_base)

    def state_dict(self) -> dict:
        """JSON-serialisable: the step, the seed and the counters, so a resumed run draws the same noise."""
        return {"step": self.step, "seed": self.seed, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint from before the keyed draws holds "rng" instead of "seed": its seed is this run's.
        try:
            self.step = int(state["step"])
            self.seed = int(state["seed"] if "seed" in state or "rng" not in state else self.seed)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a SimulatedSearch state dict ({type(e).__name__}: {e}); "
                             "pass what state_dict() returned") from e
        self.stats.update(state.get("stats", {}))

    # --- search ---------------------------------------------------------------------------------
    def search(self, queries: Sequence[str], topk: int, contexts: Sequence[dict | None] | None = None) -> list[list[dict]]:
        """topk simulated documents per query (fewer where requests failed).

        Raises SimulatorUnavailable (after counting) when not one request got a reply.
        """
        with self._lock:
            return self._search(list(queries), topk, contexts)

    def _search(self, queries: list[str], topk: int, contexts: Sequence[dict | None] | None) -> list[list[dict]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if contexts is not None and len(contexts) != len(queries):
            raise ValueError(f"got {len(contexts)} contexts for {len(queries)} queries; pass one per query (or None)")
        contexts = list(contexts) if contexts is not None else [None] * len(queries)
        jobs = self.plan(queries, topk, contexts)
        if not self.show_answer:
            contexts = [dict(c, answer=None) if c else c for c in contexts]
        msgs = [build_messages(str(queries[qi]), noisy, contexts[qi], rank + 1, topk, self.doc_words)
                for qi, rank, noisy, _ in jobs]
        replies, error = self._generate(msgs, [seed for *_, seed in jobs])

        out: list[list[dict]] = [[] for _ in queries]
        self.stats["queries"] += len(queries)
        self.stats["calls"] += len(jobs)
        for (qi, rank, noisy, _), reply in zip(jobs, replies):
            parsed = parse_document(reply, str(queries[qi]))
            if parsed is None:
                self.stats["failures"] += 1
                if reply is not None:
                    self.stats["unparsed"] += 1
                    log.debug("simulated search: no document in reply %r", reply[:300])
                continue
            title, text = parsed
            contents = f"{title}\n{text}"
            out[qi].append({
                "id": "sim-" + hashlib.sha1(contents.encode("utf-8")).hexdigest()[:12],
                "contents": contents,
                "score": 1.0 / (rank + 1),  # the order it was asked in: result 1 first
                "simulated": "noisy" if noisy else "useful",
            })
            self.stats["docs"] += 1
            self.stats["noisy"] += int(noisy)
        self.stats["empty"] += sum(1 for docs in out if not docs)
        n_failed = sum(1 for r in replies if r is None)
        if jobs and n_failed == len(jobs):
            cause = f"{type(error).__name__}: {error}" if error is not None else "no reply from the simulator"
            raise SimulatorUnavailable(f"simulated search: all {len(jobs)} document requests failed ({cause}); "
                                       f"simulator: {self.describe()}") from error
        if n_failed:
            log.warning("simulated search: %d/%d document requests failed", n_failed, len(jobs))
        return out

    def plan(self, queries: Sequence[str], topk: int,
             contexts: Sequence[dict | None] | None = None) -> list[tuple[int, int, bool, int]]:
        """The documents one search call asks for: (query index, rank, noisy, sampling seed) each.

        Each document is noisy with probability noise_p. Its draws are keyed by (seed, step, query, the question
        it serves, rank), not by the order of the calls: threads may call in any order and a round stays a
        function of its seed. search() draws with this, so the draws can be checked at scale without an LLM.
        """
        p = self.noise_p
        jobs = []
        for qi, q in enumerate(queries):
            if not str(q or "").strip():
                continue  # an empty query asks for nothing; it comes back empty and counted
            ctx = (contexts[qi] if contexts is not None else None) or {}
            for rank in range(topk):
                r = random.Random(f"sim/{self.seed}/{self.step}/{q}/{ctx.get('question')}/{rank}")
                jobs.append((qi, rank, r.random() < p, r.getrandbits(31)))
        return jobs

    # The rollout finds the flag on a bound `backend.search` too (method attributes fall through to the function).
    search.wants_context = True  # type: ignore[attr-defined]

    def _generate(self, messages: list[list[dict]], seeds: list[int]) -> tuple[list[str | None], Exception | None]:
        """One reply per chat (None where it failed), and the exception that failed them all, if one did."""
        if not messages:
            return [], None
        try:
            if self.client is not None:
                return self.client.chat_many(messages, max_tokens=self.max_tokens, temperature=self.temperature), None
            return self._engine_generate(messages, seeds), None
        except Exception as e:  # noqa: BLE001 - counted as failures; search() raises it on as SimulatorUnavailable
            log.warning("simulated search: generation failed for %d documents: %s: %s",
                        len(messages), type(e).__name__, e)
            return [None] * len(messages), e

    def _engine_generate(self, messages: list[list[dict]], seeds: list[int]) -> list[str | None]:
        tok = self.engine.tokenizer
        limit = int(getattr(self.engine, "max_model_len", 1 << 30))
        prompts, idx = [], []
        for i, m in enumerate(messages):
            ids = encode_prompt(tok, render_chat(tok, m[0]["content"], self.template), self.template)
            if len(ids) + self.max_tokens <= limit:  # a too-long prompt (huge question) fails alone
                prompts.append(ids)
                idx.append(i)
        samplings = [SamplingConfig(temperature=self.temperature, max_tokens=self.max_tokens, seed=seeds[i])
                     for i in idx]
        outs = self.engine.generate(prompts, samplings) if prompts else []
        replies: list[str | None] = [None] * len(messages)
        for i, o in zip(idx, outs):
            replies[i] = o.text
        return replies
