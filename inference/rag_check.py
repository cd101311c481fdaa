"""The RAG check of the self-play game: is a proposer's question answerable from the documents its own searches
returned, shuffled with other trajectories' as distractors? SSP asks a judge LLM (rag_prompt: documents cut to
GameConfig.rag_max_doc_chars); the policy verifier instead reads the solver's own prompt with search turns that
return exactly what the proposer's searches showed, cut to --max_info_tokens as a rollout cuts them (solver_view),
so it sees no more than a solver that searched well would (issue 31). The round's pipeline (inference/pipeline.py,
RoundPipeline) makes these checks on each question the cheap filters let through, as its proposer ends, with the
pieces below: search_questions and searched_verdict, then pick_distractors, rag_request, rag_reply and rag_graded.

A small policy can neither be trusted to pass nor to refuse (issue 41: the 135M verifier refused 40-47% of rollouts),
so the retrieval check asks no model: a question is answerable when one search of the question itself, with the
solver's back-end and topk, returns a document holding the answer (Dr. Zero's rule). The same search decides the
shortcut_title refusal; both schedules make it on the lockstep group's first rank, once per question."""

from __future__ import annotations

import logging
import random
from typing import Any, Callable, Protocol, Sequence

from inference.engine_api import SamplingConfig
from inference.game_metrics import one_search_answerable
from inference.prompts import build_solver_prompt, doc_title, format_docs
from inference.rewards import extract_answer
from inference.rollout import info_block_tokens
from inference.trajectory import Trajectory
from utils.text import exact_match

log = logging.getLogger(__name__)

RAG_VERIFIERS = ("judge", "policy", "off", "retrieval", "policy+retrieval")
"""Who checks that a question is answerable: an LLM reading the proposer's documents (judge, policy), one search of
the question (retrieval: the answer must be in what it returns), both (policy+retrieval), or nobody (off)."""


class RagSettings(Protocol):
    """The game settings the RAG check reads (inference.game.GameConfig has them; the game imports this module,
    so this module names only what it needs)."""
    rag_verify: str
    rag_distractors: int
    rag_max_doc_chars: int
    rag_max_context_chars: int
    rag_max_tokens: int
    template: str
    shortcut_filter: str

QUESTION_SEARCH_NEEDS = ("--rag_verify retrieval|policy+retrieval and --shortcut_filter title|both search each "
                         "question with the solver's back-end: they need --solver_search retriever (a simulated search "
                         "writes its documents for the policy and says nothing about what a search finds; self and "
                         "none have no back-end)")


def rag_reader(rag_verify: str) -> str | None:
    """The LLM that answers the question from the proposer's documents: "policy", "judge", or None (no LLM)."""
    return {"policy": "policy", "policy+retrieval": "policy", "judge": "judge"}.get(rag_verify)


def uses_retrieval(rag_verify: str) -> bool:
    return rag_verify in ("retrieval", "policy+retrieval")


def needs_question_search(cfg: RagSettings) -> bool:
    """Whether a check searches the question itself: the retrieval verdict, or the shortcut_title refusal."""
    return uses_retrieval(cfg.rag_verify) or cfg.shortcut_filter in ("title", "both")


def both(a: bool | None, b: bool | None) -> bool | None:
    """Two verdicts joined: False if either refuses, else None (undecided) if either is, else True."""
    return False if (a is False or b is False) else (None if (a is None or b is None) else True)


def search_questions(questions: Sequence[str], answers: Sequence[Any], search: Any,
                     topk: int) -> list[tuple[bool, list[dict]]] | None:
    """One search of each question itself: per question, (the answer is in a returned document's title or text,
    the documents). None when the search failed: the checks then decide nothing."""
    got: list = []

    def keep(qs: list[str], k: int) -> list[list[dict]]:
        try:
            got.append(search(qs, k))
        except Exception as e:  # noqa: BLE001 - a failed check passes undecided; the round goes on
            log.warning("question check: search failed (%s: %s); its questions pass undecided", type(e).__name__, e)
            got.append(None)
        return got[-1] or [[] for _ in qs]

    found = one_search_answerable(questions, answers, keep, topk)
    if found is None or not got or got[0] is None or len(got[0]) != len(questions):
        return None   # failed, or results that cannot be paired with their questions
    return list(zip(found, got[0]))


def searched_verdict(t: Trajectory, got: tuple[bool, list[dict]] | None,
                     cfg: RagSettings) -> tuple[str | None, bool | None]:
    """What a question's own search decides: the shortcut_title refusal (else None), and the retrieval verdict
    (True when --rag_verify reads no retrieval; None when the search failed)."""
    docs = got[1] if got is not None else []
    title = cfg.shortcut_filter in ("title", "both") and bool(docs) and bool(exact_match(doc_title(docs[0]), t.answer))
    if not uses_retrieval(cfg.rag_verify):
        return ("shortcut_title" if title else None), True
    return ("shortcut_title" if title else None), (None if got is None else bool(got[0]))


RAG_INSTRUCTION = (
    "Answer the question using only the documents below. Give just the short answer inside "
    "<answer> and </answer>.\n\n"
    "Example:\nDocuments:\nDoc 1 (Title: Eiffel Tower) The Eiffel Tower in Paris was designed by the engineering "
    "company of Gustave Eiffel.\nQuestion: Whose company designed the landmark tower in Paris?\n"
    "<answer> Gustave Eiffel </answer>\n\n"
    "Documents:\n{docs}Question: {question}\n"
)


def _flat_docs(docs: Sequence[Sequence[dict]]) -> list[dict]:
    seen, out = set(), []
    for call in docs:
        for d in call:
            key = d.get("id") or d.get("contents")
            if key not in seen and str(d.get("contents", "")).strip():
                seen.add(key)
                out.append(d)
    return out


def rag_prompt(question: str, own: list[dict], distractors: list[dict], cfg: RagSettings, rng: random.Random,
               fits: Callable[[str], bool] = lambda s: True) -> str:
    """The RAG-check user message: own docs always, distractors while they fit, all in shuffled order.

    Over budget, distractors go first; then every document is shortened, halving until it fits.
    """
    own_ids = {d.get("id") for d in own}
    extra = [d for d in distractors if d.get("id") not in own_ids]
    doc_chars = cfg.rag_max_doc_chars
    while True:
        chosen = [{**d, "contents": str(d.get("contents", ""))[:doc_chars]} for d in own]
        budget = cfg.rag_max_context_chars - sum(len(d["contents"]) for d in chosen)
        for d in extra:
            d = {**d, "contents": str(d.get("contents", ""))[:doc_chars]}
            if len(d["contents"]) <= budget:
                chosen.append(d)
                budget -= len(d["contents"])
        rng.shuffle(chosen)
        text = RAG_INSTRUCTION.format(docs=format_docs(chosen), question=question.strip())
        if (budget >= 0 and fits(text)) or doc_chars <= 50:
            return text
        if extra:
            extra = []
        else:
            doc_chars //= 2


def _rag_answer_text(reply: str | None) -> str | None:
    if reply is None:
        return None
    ans = extract_answer(reply)
    if ans is None:  # a verifier that ignored the tags: take its first non-empty line
        lines = [ln.strip() for ln in reply.replace("<answer>", "").splitlines() if ln.strip()]
        ans = lines[0] if lines else ""
    return ans


def _searches(t: Trajectory) -> list[tuple[str, list[dict]]]:
    """A trajectory's (query, documents) pairs, in the order it searched."""
    return [(str(q), list(d or [])) for q, d in zip(t.queries or [], t.docs or [])]

def solver_view(tok: Any, question: str, own: list[tuple[str, list[dict]]], distractors: list[tuple[str, list[dict]]],
                template: str, max_info_tokens: int, limit: int, rng: random.Random) -> list[int]:
    """The policy verifier's prompt: the solver's own prompt for `question`, then search turns that return exactly
    what the proposer's searches showed, each <information> block cut to max_info_tokens as a rollout cuts it, and
    the distractors' searches shuffled in among them. It reads what a solver that searched well would read, in the
    solver's own format, so a question passes only when those blocks answer it. Distractors are dropped, last
    first, while the prompt is over `limit` tokens; the proposer's own searches always stay."""
    def ids(searches: list[tuple[str, list[dict]]]) -> list[int]:
        out = build_solver_prompt(tok, question, template)
        for q, docs in searches:
            out += tok(f"<search> {q} </search>", add_special_tokens=False)["input_ids"]
            out += info_block_tokens(tok, format_docs(docs), max_info_tokens)
        return out

    order = [("own", s) for s in own] + [("other", s) for s in distractors]
    rng.shuffle(order)
    while True:
        got = ids([s for _, s in order])
        others = [k for k, (who, _) in enumerate(order) if who == "other"]
        if len(got) < limit or not others:
            return got
        del order[others[-1]]

def pick_distractors(i: int, props: Sequence[Trajectory | None], k: int, rng: random.Random,
                     rows: Sequence[int]) -> list[int] | None:
    """Up to k distractor trajectories for candidate i: trajectories of *other* proposer prompts (meta.row) that
    found documents, drawn uniformly without replacement. The G_p samples of one prompt search around the same
    answer, so their documents would help.

    props[j] is None while trajectory j is still running (the game's pipeline, inference/pipeline.py): the
    others are shuffled with `rng` and scanned in that order, keeping those with documents, so the draw is the
    same whenever the others end. None = a trajectory the scan needs is still running; ask again later.
    rows[j]: trajectory j's prompt row, known before it ends (the pipeline passes its requests' rows), so a
    still-running sibling of candidate i is left out of the draw as an ended one is, and the shuffle, hence the
    pick, is the same whenever the siblings end."""
    others = [j for j in range(len(props)) if j != i and rows[j] != rows[i]]
    rng.shuffle(others)
    picked: list[int] = []
    for j in others:
        if len(picked) == k:
            break
        if props[j] is None:
            return None
        if _flat_docs(props[j].docs):
            picked.append(j)
    return picked


def rag_request(i: int, picked: list[int], props: Sequence[Trajectory], tok: Any, cfg: RagSettings,
                rng: random.Random, max_info_tokens: int, limit: int) -> list[int] | list[dict]:
    """What candidate i's verifier reads: the policy's prompt ids (solver_view), or the judge's chat messages."""
    t = props[i]
    if rag_reader(cfg.rag_verify) == "policy":
        return solver_view(tok, t.question, _searches(t), [s for j in picked for s in _searches(props[j])],
                           cfg.template, max_info_tokens, limit, rng)
    text = rag_prompt(t.question, _flat_docs(t.docs), [d for j in picked for d in _flat_docs(props[j].docs)], cfg, rng)
    return [{"role": "user", "content": text}]


def rag_sampling(cfg: RagSettings) -> SamplingConfig:
    """The policy verifier answers greedily, in a short answer."""
    return SamplingConfig(temperature=0.0, max_tokens=cfg.rag_max_tokens, stop=["</answer>"])


def rag_reply(t: Trajectory, reply: str | None) -> bool | None | str:
    """The verdict a verifier's reply gives: True (its answer matches exactly), None (no reply: undecided), or the
    predicted answer, which the judge must grade (rag_graded). Records outcome.rag_answer."""
    pred = _rag_answer_text(reply)
    t.outcome.rag_answer = pred
    if pred is None:
        return None
    return True if exact_match(pred, t.answer) else pred


def rag_graded(result: Any) -> bool | None:
    """The verdict of a judged RAG answer. A judge that is down decides nothing: "wrong" would give the proposer
    the invalid penalty for an outage. Undecided passes unchecked, and mark_excluded leaves the proposer group out."""
    return None if result.judge_failed else result.correct


def rag_rng(seed: int, tag: Any, i: int) -> random.Random:
    """Candidate i's own random stream (distractors, document order): the same whichever candidate is checked first."""
    return random.Random(f"rag/{seed}/{tag}/{i}")
