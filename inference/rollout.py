"""The multi-turn rollout loop: many trajectories at once, token ids and loss mask built as they go.

One loop: one state machine per trajectory (RolloutBatch) over a stepped engine (engine.submit/step) driven by
inference/step_loop.StepLoop. A trajectory whose turn ends in a search hands it to a thread and the engine keeps
decoding the others; the moment its documents are back its next turn joins the running batch. No turn barrier:
a long turn holds up only its own trajectory, and search latency is hidden behind decoding.

RolloutConfig.schedule (--rollout_schedule) "turn" is a setting of the same loop, which then runs in waves (StepLoop
barrier=True), as the original turn loop did; both give the same trajectories:

    for turn in range(max_turns):
        every active trajectory decodes one turn                   # one wave of the engine
        append each turn's sampled tokens                          (mask 1, engine log-probs)
        action = parse_action(this turn's text)                    # last complete tag
        answer/question -> done;  search -> queued;  nothing -> done
        docs = search_fn(all queued queries, topk)                 # in the loop's thread, the engine empty
        append "\\n\\n<information>" + format_docs(docs) + "</information>\\n\\n"   (mask 0)

A search back-end that may not be called beside the engine (`concurrent_safe = False`: simulated search on the
policy's own engine, which calls engine.generate) runs the waves whatever the schedule says.

Token ids are the source of truth: the sampled ids are kept verbatim (also the part of a
token that overshoots a stop string, e.g. "</search>\\n"), and only the new information
block is ever tokenised. Nothing is decoded and re-tokenised.

Modes:
  * search_fn given: the tool is called as above.
  * search_fn=None: no tool. Generation does not stop at </search>; the model goes on to
    its answer (one turn), and a <search> it writes is plain text, not a search.
  * cfg.self_search=True (SSRL): no tool; the model writes its own
    <information>..</information> after each <search>, in the same turn, and the tokens of
    those blocks get mask 0 (found through character offsets of incremental decoding).

stop_reason: "answer" (solver) | "question" (proposer) | "eos" (EOS without an action)
| "max_tokens" (turn or total token budget used up; Trajectory.cap says which: "turn" or "total")
| "max_turns" (a search asked for in the last turn) | "no_action" (stopped on a stop string
without a usable action, e.g. "</search>" with no opening tag).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from inference.engine_api import SamplingConfig
from inference.parser import PROPOSER_KINDS, SOLVER_KINDS, all_contents, find_blocks, model_text, parse_action
from inference.prompts import format_docs
from inference.step_loop import StepLoop
from inference.trajectory import ROLES, GameMeta, Trajectory

log = logging.getLogger(__name__)

SearchFn = Callable[[list[str], int], list[list[dict]]]

INFO_OPEN, INFO_CLOSE = "\n\n<information>", "</information>\n\n"
SEARCH_FAILED_TEXT = "Search failed; no results.\n"
EMPTY_QUERY_TEXT = "Empty query; no results.\n"
SCHEDULES = ("trajectory", "turn")


@dataclass
class RolloutConfig:
    max_turns: int = 4
    """Generation calls per trajectory; every search costs one. 4 = up to 3 searches + answer."""
    max_total_tokens: int = 4096
    """Cap on prompt + all turns + information blocks; keeps training sequences bounded."""
    max_tokens_per_turn: int = 512
    """One turn is think + one action; longer turns are almost always degenerate loops."""
    max_info_tokens: int = 512
    """Tokens of one <information> block (topk docs), tags included; longer doc text is cut."""
    topk: int = 3
    """Docs per query; 3 is Search-R1's setting and fits max_info_tokens for ~100-word docs."""
    temperature: float = 1.0
    """1.0 = sample from the policy itself, which the on-policy loss assumes."""
    top_p: float = 1.0
    seed: int | None = None
    """Base seed; trajectory i at turn k uses a seed derived from (seed, i, k). None = unseeded."""
    self_search: bool = False
    """SSRL mode: the model writes its own <information> blocks (masked 0); needs search_fn=None."""
    progress: bool = False
    """Show a tqdm bar over turns (turn it on on rank 0 only)."""
    schedule: str = "trajectory"
    """"trajectory": each trajectory runs on its own through a stepped engine; its search runs in a thread
    while the others decode, and its next turn joins the running batch when the documents are back.
    "turn": the same loop in waves, one a turn: every trajectory's turn, then the turn's searches (a comparison)."""
    max_inflight: int = 0
    """At most this many sequences in the engine at once (0 = no bound beyond the
    engine's own scheduler and KV budget, which queue what does not fit)."""
    search_workers: int = 16
    """Threads serving search calls concurrently (none in waves: the turn schedule calls in the loop's thread)."""

    def __post_init__(self) -> None:
        errs = rollout_errors(vars(self))
        if errs:
            raise ValueError("; ".join(errs))


ROLLOUT_FLAGS = ("max_turns", "max_total_tokens", "max_tokens_per_turn", "max_info_tokens", "topk", "rollout_schedule",
                 "max_inflight")
"""train.py's and eval.py's flags (their dest names) that become RolloutConfig fields of the same name, but
--rollout_schedule, which is `schedule`."""


def rollout_flag_errors(flags: dict) -> list[str]:
    """rollout_errors on flag values keyed by ROLLOUT_FLAGS, the messages naming the flags."""
    values = {("schedule" if k == "rollout_schedule" else k): v for k, v in flags.items()}
    return rollout_errors(values, name=lambda field: "--" + ("rollout_schedule" if field == "schedule" else field))


def rollout_errors(values: dict, name=lambda field: f"RolloutConfig.{field}") -> list[str]:
    """What is wrong with these RolloutConfig fields ([] when nothing is); fields absent from `values` are not
    checked. `name` spells a field in the messages: train.py and eval.py pass their flags' names, so a bad flag
    is refused before anything loads (training/settings/validation.py, eval.py) with the rules RolloutConfig enforces."""
    errs = []
    for field in ("max_turns", "max_total_tokens", "max_tokens_per_turn", "max_info_tokens", "topk", "search_workers"):
        if field in values and values[field] < 1:
            errs.append(f"{name(field)} must be >= 1, got {values[field]}")
    if "schedule" in values and values["schedule"] not in SCHEDULES:
        errs.append(f"{name('schedule')} must be one of {', '.join(SCHEDULES)}, got {values['schedule']!r}")
    if values.get("max_inflight", 0) < 0:
        errs.append(f"{name('max_inflight')} must be >= 0 (0 = no bound beyond the engine's own), "
                    f"got {values['max_inflight']}")
    if 1 <= values.get("max_info_tokens", 8) < 8:
        errs.append(f"{name('max_info_tokens')} {values['max_info_tokens']} leaves no room for the <information> "
                    f"tags; use >= 8")
    return errs


@dataclass
class RolloutRequest:
    role: str                 # "proposer" | "solver"
    group_id: str             # trajectories sharing it share a baseline
    prompt_ids: list[int]     # from prompts.build_*_prompt
    question: str = ""        # solver: the question asked
    answer: Any = None        # golden answer(s)
    meta: GameMeta = field(default_factory=GameMeta)  # the game's tag, copied into Trajectory.meta
    index: int | None = None
    """The trajectory's number in its sampling seeds (seed, index, turn); None = its position in the call. The
    game numbers a solver group by its question's slot, so a group samples the same tokens however it starts."""


@dataclass
class _State:
    req: RolloutRequest
    index: int
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    texts: list[str] = field(default_factory=list)
    turns: int = 0
    queries: list[str] = field(default_factory=list)
    docs: list[list[dict]] = field(default_factory=list)
    search_failed: int = 0
    stop_reason: str = ""
    action_kind: str = "none"
    action_content: str = ""
    pending_query: str | None = None  # search to serve before the next turn
    cap: str = ""  # with stop_reason "max_tokens": "turn" (max_tokens_per_turn) or "total" (the trajectory's budget)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)


ROLE_SEED_SALT = {"proposer": 1_299_709, "solver": 0}
"""Keeps the roles' seed streams apart: proposer trajectory i and solver trajectory i of one round (same base seed,
same index) sampled with the same seeds before. No (index, turn) of one role reaches another's for turns < 100."""


def _turn_seed(base: int | None, i: int, turn: int, role: str = "solver") -> int | None:
    if base is None:
        return None
    return (base * 1_000_003 + i * 10_007 + turn * 101 + ROLE_SEED_SALT[role]) % (2**31 - 1)


def _final_kind(role: str) -> str:
    return "question" if role == "proposer" else "answer"


def token_char_ends(tokenizer: Any, token_ids: Sequence[int]) -> tuple[str, list[int]]:
    """Decoded text of `token_ids` and, per token, the character offset where it ends.

    Incremental decoding: a token's end is the length of the decoded prefix. A prefix that
    ends inside a multi-byte character decodes to a replacement char, which is not a
    prefix of the full text; such a token ends where the previous one did (its bytes
    belong to the next full character).
    """
    full = tokenizer.decode(list(token_ids), skip_special_tokens=False)
    ends, prev = [], 0
    for k in range(1, len(token_ids) + 1):
        pre = tokenizer.decode(list(token_ids[:k]), skip_special_tokens=False)
        if full.startswith(pre):
            prev = len(pre)
        ends.append(prev)
    return full, ends


def mask_spans(ends: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Indices of tokens whose character range [start, end) overlaps any span."""
    out, start = [], 0
    for k, end in enumerate(ends):
        if any(start < e and end > s for s, e in spans) or (start == end and any(s <= start < e for s, e in spans)):
            out.append(k)
        start = end
    return out


def run_rollouts(
    engine: Any,
    requests: Sequence[RolloutRequest],
    search_fn: SearchFn | None,
    cfg: RolloutConfig,
    stats: dict | None = None,
) -> list[Trajectory]:
    """Roll out every request to the end; returns one Trajectory per request, in order.

    cfg.schedule "turn" runs the loop in waves (needs_barrier). `stats`, when given, receives the schedule that ran, its wall seconds
    and the seconds the engine had nothing to run ("engine_idle_s": waiting on searches).
    """
    if cfg.self_search and search_fn is not None:
        raise ValueError("self_search=True means the model writes its own documents; pass search_fn=None")
    tok = engine.tokenizer
    limit = token_limit(engine, cfg)
    states = [new_state(r, i, limit) for i, r in enumerate(requests)]

    barrier = needs_barrier(cfg, search_fn)
    t0 = time.perf_counter()
    timing = {"engine_idle_s": 0.0}
    _per_trajectory(engine, states, search_fn, cfg, tok, limit, timing, barrier)
    schedule = "turn" if barrier else "trajectory"
    if stats is not None:
        stats.update(timing, schedule=schedule, wall_s=time.perf_counter() - t0)
    for s in states:
        if not s.done:  # defensive: _absorb_turn never queues a search past the last turn
            s.stop_reason, s.pending_query = "max_turns", None
    return [to_trajectory(s, tok) for s in states]


def token_limit(engine: Any, cfg: RolloutConfig) -> int:
    """A trajectory's token budget: the smaller of cfg.max_total_tokens and the engine's max_model_len."""
    return min(cfg.max_total_tokens, int(getattr(engine, "max_model_len", cfg.max_total_tokens)))


def new_state(r: RolloutRequest, i: int, limit: int) -> _State:
    """Request i's rollout state (its prompt checked against the budget)."""
    if r.role not in ROLES:
        raise ValueError(f"request {i}: role must be one of {ROLES}, got {r.role!r}")
    if not r.prompt_ids:
        raise ValueError(f"request {i}: prompt_ids is empty")
    if len(r.prompt_ids) >= limit:
        raise ValueError(
            f"request {i}: prompt has {len(r.prompt_ids)} tokens, at or over the budget of {limit} "
            "(min of RolloutConfig.max_total_tokens and the engine's max_model_len); raise them or shorten the prompt"
        )
    n = len(r.prompt_ids)
    return _State(r, i if r.index is None else int(r.index), list(map(int, r.prompt_ids)), [0] * n, [0.0] * n)


def search_attr(search_fn: Any, name: str, default: Any) -> Any:
    """A flag set on the search function, or on the object it is a bound method of (TimedSearch, a retriever)."""
    if hasattr(search_fn, name):
        return getattr(search_fn, name)
    return getattr(getattr(search_fn, "__self__", None), name, default)


def concurrent_search(search_fn: SearchFn | None) -> bool:
    """Whether search_fn may run in threads beside the engine: backends say `concurrent_safe = False` otherwise."""
    return search_fn is None or bool(search_attr(search_fn, "concurrent_safe", True))


def needs_barrier(cfg: RolloutConfig, *search_fns: SearchFn | None) -> bool:
    """Whether the loop runs in waves (StepLoop barrier=True): the turn schedule asked for, or a search back-end
    that may not be called beside the engine (simulated search on the policy's own engine)."""
    barrier = cfg.schedule == "turn" or not all(concurrent_search(f) for f in search_fns)
    if barrier and cfg.schedule != "turn":
        log.info("rollout: a search back-end is not safe to call beside the engine; the loop runs in waves (the turn "
                 "schedule)")
    return barrier


def _sampling_for(s: _State, i: int, cfg: RolloutConfig, search_fn: SearchFn | None, limit: int) -> SamplingConfig:
    """Trajectory i's next turn. The seed depends on (cfg.seed, role, i, turn) only, never on which other
    sequences share the engine's batch, so both schedules sample the same tokens."""
    # Without a tool (no search_fn, or self-search) a <search> is just text: keep writing.
    stops = ["</search>"] if search_fn is not None else []
    stops.append(f"</{_final_kind(s.req.role)}>")
    return SamplingConfig(
        temperature=cfg.temperature, top_p=cfg.top_p, stop=stops, seed=_turn_seed(cfg.seed, i, s.turns, s.req.role),
        max_tokens=min(cfg.max_tokens_per_turn, limit - len(s.ids)),
    )


def _per_trajectory(engine: Any, states: list[_State], search_fn: SearchFn | None, cfg: RolloutConfig, tok: Any,
                    limit: int, timing: dict, barrier: bool) -> None:
    """Every trajectory a RolloutBatch on one StepLoop (inference/step_loop.py); barrier: in waves, one a turn."""
    loop = StepLoop(engine, cfg.max_inflight, cfg.search_workers, barrier=barrier)
    batch = RolloutBatch(loop, search_fn, cfg, tok, limit)
    for s in states:
        batch.start(s)
    t0 = loop.idle_s
    loop.run()
    batch.close()
    timing["engine_idle_s"] += loop.idle_s - t0


class RolloutBatch:
    """Trajectories sharing a search function and a RolloutConfig, each its own state machine on a StepLoop:

        start(state) -> a turn joins the engine's running batch -> _absorb_turn
          -> final action / stop: done (on_done(state))
          -> search: the queries asked in one engine step go to a thread as one search_fn call; the engine
             keeps decoding the others; when the documents are back the block is appended (mask 0) and the
             trajectory's next turn is queued at once.

    Several batches may share one loop (the game: proposers, RAG checks and solver groups, inference/pipeline.py).

    No importance correction is needed: the engine's weights are fixed for the whole loop (a weight sync
    happens between steps, never during a rollout), so every token is sampled by the policy the step trains,
    exactly as under the turn schedule. No rollout continues across steps.

    Token ids stay the source of truth: the sampled ids are appended verbatim by _absorb_turn and only the
    information block is tokenised (in the loop's thread; the worker threads only call search_fn).
    """

    def __init__(self, loop: StepLoop, search_fn: SearchFn | None, cfg: RolloutConfig, tok: Any, limit: int,
                 on_done: Callable[[_State], None] | None = None):
        self.loop, self.search_fn, self.cfg, self.tok, self.limit = loop, search_fn, cfg, tok, limit
        self.on_done = on_done
        self.asking: list[_State] = []
        self.bar = None
        if cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=0, desc="rollout trajectories", leave=False)
        loop.hook_after_step(self._flush)

    def start(self, s: _State) -> None:
        if self.bar is not None:
            self.bar.total += 1
            self.bar.refresh()
        if s.done:
            self._done(s)
        else:
            self._turn(s)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _turn(self, s: _State) -> None:
        sampling = _sampling_for(s, s.index, self.cfg, self.search_fn, self.limit)
        self.loop.generate(s.ids, sampling, lambda out: self._absorb(s, out))

    def _absorb(self, s: _State, out: Any) -> None:
        _absorb_turn(s, out, self.cfg, self.tok, self.search_fn, self.limit)
        if s.pending_query is not None:
            self.asking.append(s)
        elif s.done:
            self._done(s)

    def _flush(self) -> None:
        """After an engine step: one search_fn call, in a thread, for the searches asked in it."""
        if not self.asking:
            return
        waiting, self.asking = self.asking, []
        self.loop.call(lambda: _fetch_docs(waiting, self.search_fn, self.cfg),
                       lambda got: self._docs_back(waiting, got))

    def _docs_back(self, waiting: list[_State], got: tuple[list | None, bool]) -> None:
        _answer_searches(waiting, got, self.cfg, self.tok, self.limit)
        for s in waiting:
            if s.done:
                self._done(s)
            else:
                self._turn(s)

    def _done(self, s: _State) -> None:
        if self.bar is not None:
            self.bar.update(1)
        if self.on_done is not None:
            self.on_done(s)


def _absorb_turn(s: _State, out: Any, cfg: RolloutConfig, tok: Any, search_fn: SearchFn | None, limit: int) -> None:
    """Append one turn's sampled tokens and decide what happens next."""
    start = len(s.ids)
    s.ids += list(out.token_ids)
    s.mask += [1] * len(out.token_ids)
    s.logprobs += list(out.logprobs)
    s.turns += 1
    turn_text = tok.decode(list(out.token_ids), skip_special_tokens=True)

    role = s.req.role
    kinds = PROPOSER_KINDS if role == "proposer" else SOLVER_KINDS
    if cfg.self_search:
        _mask_self_information(s, start, tok)
        # Searches inside the turn were answered by the model itself; record them as such.
        for q in all_contents(model_text(turn_text), "search"):
            s.queries.append(q)
        for a, b in find_blocks(turn_text, "information"):
            s.docs.append([{"id": "self", "contents": turn_text[a:b], "score": 0.0}])
        kinds = (_final_kind(role),)
    s.texts.append(turn_text)

    action = parse_action(turn_text, kinds)
    s.action_kind, s.action_content = action.kind, action.content
    if action.kind == _final_kind(role):
        s.stop_reason = action.kind
    elif action.kind == "search" and search_fn is not None:
        if len(s.ids) >= limit:
            s.stop_reason, s.cap = "max_tokens", "total"
        elif s.turns >= cfg.max_turns:
            s.stop_reason = "max_turns"
        else:
            s.pending_query = action.content
    elif out.finish_reason == "eos":
        s.stop_reason = "eos"
    elif out.finish_reason == "length":
        s.stop_reason = "max_tokens"
        # which cap cut it: the turn's own (max_tokens_per_turn) or the trajectory's total budget
        s.cap = "turn" if len(out.token_ids) >= cfg.max_tokens_per_turn else "total"
    else:
        s.stop_reason = "no_action"


def _answer_searches(waiting: list[_State], got: tuple[list | None, bool], cfg: RolloutConfig, tok: Any,
                     limit: int) -> None:
    """Append to each trajectory of `waiting` the information block of what _fetch_docs returned for it."""
    results, failed = got
    asked = [s for s in waiting if s.pending_query]
    by_id = {id(s): list(r or []) for s, r in zip(asked, results or [])}
    for s in waiting:
        _append_info(s, by_id.get(id(s), []), failed, cfg, tok, limit)


def _fetch_docs(waiting: list[_State], search_fn: SearchFn | None, cfg: RolloutConfig) -> tuple[list | None, bool]:
    """One search_fn call for the non-empty queries of `waiting`: (one result list per asked query, failed)."""
    asked = [s for s in waiting if s.pending_query]
    if not asked:
        return [], False
    try:
        queries = [s.pending_query for s in asked]
        if getattr(search_fn, "wants_context", False):
            # simulated search (ZeroSearch) writes documents knowing the question and its answer
            contexts = [{"question": s.req.question, "answer": s.req.answer} for s in asked]
            results = search_fn(queries, cfg.topk, contexts=contexts)
        else:
            results = search_fn(queries, cfg.topk)
        if not isinstance(results, list) or len(results) != len(asked):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise ValueError(f"search_fn returned {got} result lists for {len(asked)} queries")
    except Exception as e:  # noqa: BLE001 - a failing backend must not kill the run; counted per trajectory
        log.warning("search_fn failed for %d queries: %s: %s", len(asked), type(e).__name__, e)
        return None, True
    return results, False


def _append_info(s: _State, docs: list[dict], failed: bool, cfg: RolloutConfig, tok: Any, limit: int) -> None:
    """Append the information block answering s.pending_query (mask 0), or end the trajectory if it cannot fit."""
    q = s.pending_query
    s.pending_query = None
    if not q:  # "<search></search>": not a search, but the model still gets a block saying so
        docs, body = [], EMPTY_QUERY_TEXT
    elif failed:
        s.search_failed += 1
        docs, body = [], SEARCH_FAILED_TEXT
    else:
        body = format_docs(docs)
    block = info_block_tokens(tok, body, cfg.max_info_tokens)
    if len(s.ids) + len(block) >= limit:
        s.stop_reason, s.cap = "max_tokens", "total"  # no room left to read the documents and answer
        return
    if q:  # a search counts once its results are in the sequence the model reads
        s.queries.append(q)
        s.docs.append(docs)
    s.ids += block
    s.mask += [0] * len(block)
    s.logprobs += [0.0] * len(block)
    s.texts.append(tok.decode(block, skip_special_tokens=False))


def info_block_tokens(tok: Any, body: str, max_tokens: int) -> list[int]:
    """Tokens of "\\n\\n<information>" + body + "</information>\\n\\n", the body cut to fit max_tokens."""
    head = tok(INFO_OPEN, add_special_tokens=False)["input_ids"]
    tail = tok(INFO_CLOSE, add_special_tokens=False)["input_ids"]
    mid = tok(body, add_special_tokens=False)["input_ids"]
    room = max(0, max_tokens - len(head) - len(tail))
    return list(head) + list(mid[:room]) + list(tail)


def _mask_self_information(s: _State, start: int, tok: Any) -> None:
    """Self-search: zero the mask (and log-probs) of this turn's tokens inside <information> blocks.

    A token that straddles a block edge is masked too: only whole model-written tokens
    outside the blocks carry loss.
    """
    text, ends = token_char_ends(tok, s.ids[start:])
    for k in mask_spans(ends, find_blocks(text, "information")):
        s.mask[start + k] = 0
        s.logprobs[start + k] = 0.0


def to_trajectory(s: _State, tok: Any) -> Trajectory:
    r = s.req
    final = _final_kind(r.role)
    question = r.question
    if r.role == "proposer":
        question = s.action_content if s.action_kind == final else ""
    return Trajectory(
        role=r.role, group_id=r.group_id, token_ids=s.ids, loss_mask=s.mask, logprobs=s.logprobs,
        prompt_len=len(r.prompt_ids), num_turns=s.turns, num_searches=len(s.queries),
        response_text="".join(s.texts), question=question, answer=r.answer, stop_reason=s.stop_reason,
        queries=s.queries, docs=s.docs, search_failed=s.search_failed,
        final_action={"kind": s.action_kind, "content": s.action_content}, cap=s.cap, meta=replace(r.meta),
    )
