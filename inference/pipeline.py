"""The game's round as a pipeline: no stage waits for the whole batch.

    every proposer rollout, and every fixed-QA solver group, start on one StepLoop (inference/step_loop.py)
    a proposer ends -> its cheap filters -> its RAG check (once the distractors it draws have ended:
                       the policy verifier's greedy answer joins the engine's batch, the judge's call runs
                       in a thread) -> valid: its solver group starts at once;
                                        invalid: its slot's pool question, if it has one, starts instead
    a solver ends   -> graded at once (the judge in a thread, the solvers that end in one engine step in
                       one call), while the others decode
    after the loop  -> the proposers' rewards, read off their solver groups (inference/game.py score())

Under the turn schedule the same pipeline runs in waves, one a turn (StepLoop barrier=True: every call between two
waves, in the loop's thread), as does a round whose search may not run beside the engine. What the round draws does
not depend on when a trajectory ends, so for one seed both give the same trajectories and rewards:
  * slot i belongs to proposer trajectory i: its own question when valid, else a past question from the
    pool (FillPlan); fixed QA questions take the slots after the proposers'. Slot j's solver group is
    "s{tag}-q{j}" and samples with seed index j * G_s + k, whenever it starts;
  * candidate i's RAG check draws its distractors and document order from its own stream (rag_rng).

No importance correction is needed: the weights are the same for the whole step, so every token is sampled by
the policy the step trains. Nothing continues across steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from inference.data import ProposerRow
from inference.filters import check_question
from inference.judge import Judge, JudgeItem
from inference.prompts import build_proposer_prompt, build_solver_prompt
from inference.rag_check import (both, pick_distractors, rag_graded, rag_reader, rag_reply, rag_request, rag_sampling,
                                 search_questions, searched_verdict)
from inference.rewards import extract_answer
from inference.rollout import RolloutBatch, RolloutConfig, RolloutRequest, new_state, to_trajectory, token_limit
from inference.self_search import build_self_search_prompt
from inference.step_loop import StepLoop
from inference.trajectory import GameMeta, Trajectory

QCP_DOC_CHARS = 1200  # a stored document's contents are cut here (the teacher's token budget cuts again)


def qcp_of(t: Trajectory) -> dict:
    """A proposer trajectory's question construction path (QCP): its queries in order and the documents
    each returned. The solver's self-distillation teacher reads it as privileged context (issue 22;
    inference/prompts.teacher_context)."""
    docs = [[{"id": str(d.get("id", "")), "contents": str(d.get("contents", ""))[:QCP_DOC_CHARS]} for d in call]
            for call in (t.docs or [])]
    return {"queries": [str(q) for q in (t.queries or [])], "docs": docs}


class FillPlan:
    """Which past question fills each invalid slot: the pool is shuffled once per round; invalid slot i takes the
    i-th question of that order, and once every slot is decided, the invalid slots past the pool's size take
    what the valid slots left, in slot order. So the fills are distinct, there are as many as the pool holds
    (min(invalid slots, pool size), as before), and slot i's fill is known the moment slot i turns out invalid
    whenever i < pool size: the pipeline starts that solver group at once."""

    def __init__(self, order: Sequence[dict], slots: int):
        self.order, self.slots = list(order), slots

    def now(self, slot: int) -> dict | None:
        return self.order[slot] if slot < len(self.order) else None

    def late(self, reasons: Sequence[str | None]) -> dict[int, dict]:
        """The fills of invalid slots at or past the pool's size; needs every slot's reason."""
        late = [i for i, r in enumerate(reasons) if r is not None and i >= len(self.order)]
        spare = [self.order[j] for j in range(min(len(self.order), self.slots)) if reasons[j] is None]
        spare += self.order[self.slots:]
        return dict(zip(late, spare))


def proposer_requests(tok: Any, rows: Sequence[ProposerRow], cfg: Any, tag: Any) -> list[RolloutRequest]:
    """G_p proposer rollouts per row; the G_p samples of row i share group id "s{tag}-p{i}"."""
    reqs = []
    for i, row in enumerate(rows):
        ids = build_proposer_prompt(tok, row.answer, row.search_turns, cfg.template)
        reqs += [RolloutRequest("proposer", f"s{tag}-p{i}", ids, answer=row.answer,
                                meta=GameMeta(search_turns=row.search_turns, row=i))] * cfg.proposer_n
    return reqs


def slot_question(slot: int, props: Sequence[Trajectory], reasons: Sequence[str | None],
                  fill: dict | None) -> dict | None:
    """Slot `slot`'s question ({"question", "answer", "proposer", "qcp"}): the proposer's own when valid, else its fill."""
    if reasons[slot] is None:
        t = props[slot]
        return {"question": t.question, "answer": t.answer, "proposer": slot, "qcp": qcp_of(t)}
    if fill is None:
        return None
    return {"question": fill["question"], "answer": fill["answer"], "proposer": None, "qcp": fill.get("qcp")}


def qa_question(q: dict) -> dict:
    return {"question": q["question"], "answer": q["answer"], "proposer": None, "source": "qa"}


def solver_requests(tok: Any, slot: int, q: dict, cfg: Any, rollout_cfg: RolloutConfig, tag: Any) -> list[RolloutRequest]:
    """Slot `slot`'s G_s solver rollouts: group "s{tag}-q{slot}", seed indices slot * G_s + k."""
    ids = (build_self_search_prompt if rollout_cfg.self_search else build_solver_prompt)(tok, q["question"], cfg.template)
    source = q.get("source", "proposer" if q["proposer"] is not None else "pool")
    meta = GameMeta(proposer=q["proposer"], source=source, qcp=q.get("qcp"))
    return [RolloutRequest("solver", f"s{tag}-q{slot}", ids, question=q["question"], answer=q["answer"], meta=meta,
                           index=slot * cfg.solver_n + k) for k in range(cfg.solver_n)]


def filter_reason(t: Trajectory, cfg: Any) -> str | None:
    """An ended proposer's cheap-filter reason (None: its question goes on to the question checks). The question is
    the rollout's final <question> action (inference/parser.py); a trajectory that stopped any other way has none."""
    q = t.question if t.stop_reason == "question" else None
    return check_question(q, t.answer, t.queries, t.docs, t.meta.search_turns, cfg.filter_config())


def judge_item(t: Trajectory) -> JudgeItem:
    return JudgeItem(t.question, t.answer, extract_answer(t.response_text))


@dataclass
class Played:
    """What a round's rollouts produced, before the rewards: each proposer's reason (None = valid) and RAG verdict,
    the slots' questions, the solver trajectories in slot order, and (pipeline) their judge verdicts."""
    props: list[Trajectory]
    reasons: list[str | None]
    verdict: dict[int, bool | None]
    fills: list[dict]
    sols: list[Trajectory]
    sol_verdicts: list[Any]
    timing: dict = field(default_factory=dict)
    probe: Any = None   # what `probe` returned for the valid questions (game_metrics.one_search_answerable)


class RoundPipeline:
    """One round under the trajectory schedule (see the module's docstring)."""

    def __init__(self, engine: Any, judge: Judge, cfg: Any, prop_search: Any, solver_search: Any,
                 prop_rcfg: RolloutConfig, sol_rcfg: RolloutConfig, tag: Any, plan: FillPlan,
                 rng_for: Callable[[int], Any], q_search: Any = None, barrier: bool = False,
                 probe: Callable[[list[str], list[Any]], Any] | None = None):
        self.engine, self.judge, self.cfg, self.tag, self.plan, self.rng_for = engine, judge, cfg, tag, plan, rng_for
        self.q_search = q_search   # the question checks' search (game.question_searcher); None: none searches
        self.probe, self.probed = probe, None   # a metric's call on the valid questions, once all are decided
        self.sol_rcfg = sol_rcfg
        self.tok = engine.tokenizer
        self.loop = StepLoop(engine, sol_rcfg.max_inflight, sol_rcfg.search_workers, barrier=barrier)
        self.props_batch = RolloutBatch(self.loop, prop_search, prop_rcfg, self.tok, token_limit(engine, prop_rcfg),
                                        on_done=self._proposer_done)
        self.sol_limit = token_limit(engine, sol_rcfg)
        self.sols_batch = RolloutBatch(self.loop, solver_search, sol_rcfg, self.tok, self.sol_limit,
                                       on_done=self._solver_done)
        self.rag_limit = int(getattr(engine, "max_model_len", 4096)) - cfg.rag_max_tokens
        self.props: list[Trajectory | None] = []
        self.reasons: list[str | None] = []
        self.decided: list[bool] = []
        self.verdict: dict[int, bool | None] = {}
        self.pre: dict[int, bool | None] = {}   # the retrieval verdict of a candidate waiting for its reader
        self.rag_waiting: list[int] = []
        self.rag_asks: list[tuple[int, list[dict]]] = []     # judge verifier: (candidate, chat) to send
        self.rag_items: list[tuple[int, JudgeItem]] = []     # judge verifier: (candidate, its answer) to grade
        self.rag_busy = False
        self.fills: dict[int, dict] = {}
        self.sol_states: dict[int, list[Any]] = {}
        self.graded: dict[int, Any] = {}   # id(solver state) -> JudgeResult
        self.to_grade: list[Any] = []
        self.grading = False
        self.loop.hook_after_step(self._grade)
        self.loop.hook_after_step(self._rag_send)

    def play(self, rows: Sequence[ProposerRow], qa_questions: Sequence[dict]) -> Played:
        reqs = proposer_requests(self.tok, rows, self.cfg, self.tag)
        n = len(reqs)
        self.props, self.reasons, self.decided = [None] * n, [None] * n, [False] * n
        self.rows = [r.meta.row for r in reqs]  # each trajectory's prompt row, known before it ends
        for m, q in enumerate(qa_questions):   # known already: their solver groups start with the proposers
            self._start_solvers(n + m, qa_question(q))
        limit = token_limit(self.engine, self.props_batch.cfg)
        for i, r in enumerate(reqs):
            self.props_batch.start(new_state(r, i, limit))
        if n == 0:
            self._all_decided()
        self._rag_send()   # candidates that ended at their start (the loop's hooks have not run yet)
        before = dict(self.judge.stats)
        self.loop.run()
        self.props_batch.close()
        self.sols_batch.close()
        # Only a TP group's first rank called the judge: the others take its counts, so every rank's stats
        # read the round as played (the trainer's metrics treat the group's ranks as copies of one game).
        made = self.loop.share({k: self.judge.stats[k] - before[k] for k in before})
        if not self.loop.first:
            for k, v in made.items():
                self.judge.stats[k] = before[k] + v
        states = [s for slot in sorted(self.sol_states) for s in self.sol_states[slot]]
        return Played(self.props, self.reasons, self.verdict, [self.fills[i] for i in sorted(self.fills)],
                      [to_trajectory(s, self.tok) for s in states], [self.graded[id(s)] for s in states],
                      {"engine_idle_s": self.loop.idle_s, "engine_steps": self.loop.steps}, self.probed)

    # --- proposers ---------------------------------------------------------------------------------
    def _proposer_done(self, s: Any) -> None:
        i = s.index
        t = self.props[i] = to_trajectory(s, self.tok)
        why = filter_reason(t, self.cfg)
        if why is None and self.q_search is not None:   # one search of the question, on the first rank
            topk = self.sol_rcfg.topk
            self.loop.call(lambda: search_questions([t.question], [t.answer], self.q_search, topk),
                           lambda got: self._searched(i, *searched_verdict(t, got[0] if got else None, self.cfg)))
            self._try_rag()   # this trajectory may be the distractor others wait for
        else:
            self._searched(i, why, True)

    def _searched(self, i: int, why: str | None, found: bool | None) -> None:
        """After the filters and the question's own search (found: its retrieval verdict): decided, or to the reader."""
        if why is not None or found is False or rag_reader(self.cfg.rag_verify) is None:
            if why is None:
                self.verdict[i] = found
            self._decide(i, why if why is not None else ("rag_failed" if found is False else None))
        else:
            self.pre[i] = found
            self.rag_waiting.append(i)
        self._try_rag()

    def _try_rag(self) -> None:
        """Start the RAG check of every waiting candidate whose distractors have ended (in index order)."""
        for i in sorted(self.rag_waiting):
            rng = self.rng_for(i)
            picked = pick_distractors(i, self.props, self.cfg.rag_distractors, rng, self.rows)
            if picked is None:
                continue
            self.rag_waiting.remove(i)
            ask = rag_request(i, picked, self.props, self.tok, self.cfg, rng, self.sol_rcfg.max_info_tokens,
                              self.rag_limit)
            if rag_reader(self.cfg.rag_verify) == "policy":
                self.loop.generate(ask, rag_sampling(self.cfg), lambda out, i=i: self._rag_reply(i, out.text))
            else:
                self.rag_asks.append((i, ask))   # sent with the others ready in this pass (_rag_send)

    def _rag_reply(self, i: int, reply: str | None) -> None:
        t = self.props[i]
        v = rag_reply(t, reply)
        if not isinstance(v, str):
            self._rag_verdict(i, v)
        else:   # graded with the others ready in this pass (_rag_send), whichever model read the documents
            self.rag_items.append((i, JudgeItem(t.question, t.answer, v)))

    def _rag_send(self) -> None:
        """The judge verifier's waiting chats and every verifier's waiting gradings, in one call in a thread (as
        _grade): one call at a time,
        what becomes ready meanwhile goes in the next. A judge that is down then costs a wave, not one per candidate."""
        if self.rag_busy or not (self.rag_asks or self.rag_items):
            return
        asks, items, self.rag_asks, self.rag_items, self.rag_busy = self.rag_asks, self.rag_items, [], [], True
        max_tokens = self.cfg.rag_max_tokens

        def ask_judge() -> tuple[list, list]:
            replies = self.judge.chat_many([a for _, a in asks], max_tokens=max_tokens) if asks else []
            graded = self.judge.judge_many([it for _, it in items]) if items else []
            return replies, graded

        self.loop.call(ask_judge, lambda got: self._rag_back(asks, items, *got), serial=True)

    def _rag_back(self, asks: list, items: list, replies: list, graded: list) -> None:
        # zip would silently pair verdicts with the wrong candidates, or drop some
        if len(replies) != len(asks) or len(graded) != len(items):
            raise RuntimeError(f"the judge returned {len(replies)} replies for {len(asks)} RAG prompts and "
                               f"{len(graded)} verdicts for {len(items)} RAG answers")
        self.rag_busy = False   # the hooks run next, and send what waited
        for (i, _), res in zip(items, graded):
            self._rag_verdict(i, rag_graded(res))
        for (i, _), reply in zip(asks, replies):
            self._rag_reply(i, reply)

    def _rag_verdict(self, i: int, v: bool | None) -> None:
        v = self.verdict[i] = both(self.pre.get(i, True), v)
        self._decide(i, "rag_failed" if v is False else None)

    def _decide(self, i: int, why: str | None) -> None:
        self.reasons[i], self.decided[i] = why, True
        fill = self.plan.now(i) if why is not None else None
        if fill is not None:
            self.fills[i] = fill
        q = slot_question(i, self.props, self.reasons, fill)
        if q is not None:
            self._start_solvers(i, q)
        if all(self.decided):
            self._all_decided()

    def _all_decided(self) -> None:
        if self.probe is not None:   # a call like the others: a TP group's first rank makes it and shares it
            valid = [i for i, why in enumerate(self.reasons) if why is None]
            qs, ans, probe = [self.props[i].question for i in valid], [self.props[i].answer for i in valid], self.probe
            self.loop.call(lambda: probe(qs, ans), lambda got: setattr(self, "probed", got))
        for slot, fill in self.plan.late(self.reasons).items():
            self.fills[slot] = fill
            self._start_solvers(slot, slot_question(slot, self.props, self.reasons, fill))

    # --- solvers ---------------------------------------------------------------------------------------
    def _start_solvers(self, slot: int, q: dict) -> None:
        states = [new_state(r, r.index, self.sol_limit)
                  for r in solver_requests(self.tok, slot, q, self.cfg, self.sol_rcfg, self.tag)]
        self.sol_states[slot] = states
        for s in states:
            self.sols_batch.start(s)

    def _solver_done(self, s: Any) -> None:
        self.to_grade.append(s)

    def _grade(self) -> None:
        """The solvers that ended since the last judge call went out, graded in one call in a thread. One call at a
        time: those that end meanwhile wait for it and go together in the next (a remote judge's latency is paid
        once per call, not once per engine step)."""
        if not self.to_grade or self.grading:
            return
        states, self.to_grade, self.grading = self.to_grade, [], True
        items = [judge_item(to_trajectory(s, self.tok)) for s in states]
        self.loop.call(lambda: self.judge.judge_many(items), lambda res: self._graded(states, res), serial=True)

    def _graded(self, states: list[Any], results: list[Any]) -> None:
        for s, r in zip(states, results):
            self.graded[id(s)] = r
        self.grading = False  # the loop's hooks run next, and send what waited
