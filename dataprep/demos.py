"""One cold-start demo (dataprep/coldstart.py builds them; dataprep/reading_sets.py mixes them): its shape, one JSON
line of what training/loop/sft.py reads, built from the searches it made and checked, and which retrieved document
grounds its answer.

  {"role": "solver", "question", "answer": [aliases], "source", "turns": [...]}
  {"role": "proposer", "answer": str, "n_searches": 2, "source", "question": <question written>, "turns": [...]}
  turns: {"kind": "model", "text"} | {"kind": "info", "docs": [{"id", "contents", "score"}]}
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dataprep.clues import STOPWORDS
from utils.text import normalize_answer

SEARCH_DONE_TAIL = "</search>"
RETRY_THINK = "<think> No document fits; try fewer words. </think>\n"


def _norm_pad(s: str) -> str:
    return f" {normalize_answer(s)} "


def page_title(doc: dict) -> str:
    return str(doc.get("contents", "")).split("\n", 1)[0].strip()


def _clean_docs(docs: list[dict]) -> list[dict]:
    return [{"id": str(d.get("id")), "contents": d.get("contents", ""), "score": float(d.get("score", 0.0))}
            for d in docs]


def _words(s: str) -> set[str]:
    # "Louis XIV's" normalises to "louis xivs": keep the word without a possessive s as well
    ws = {w for w in normalize_answer(s).split() if w not in STOPWORDS}
    return ws | {w[:-1] for w in ws if w.endswith("s") and len(w) > 3}


def _about_question(doc: dict, question: str, answers: list[str]) -> bool:
    """A doc other than the answer's own article grounds the answer only if it is the article of
    something the question names (every content word of its title is in the question) and
    holds the answer as written. FanOutQA needs this: its short answers ("Physics",
    "Various") otherwise match in unrelated docs ("the various codes of rugby")."""
    tw = _words(page_title(doc))
    text = str(doc.get("contents", ""))
    return bool(tw) and tw <= _words(question) and any(
        re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text) for a in answers if a.strip())


def find_answer_doc(docs: list[dict], answers: list[str], question: str | None = None) -> tuple[int, bool] | None:
    """(1-based doc number, doc is the answer's own article) of the best doc holding an answer, or None.

    Whole normalised words only, so "Lead" is not found inside "leader". With `question`, a doc
    that merely mentions the answer must also pass _about_question."""
    keys = [_norm_pad(a) for a in answers if normalize_answer(a)]
    found = None
    for i, d in enumerate(docs, 1):
        if any(_norm_pad(page_title(d)) == k for k in keys):
            return i, True
        if (found is None and any(k in _norm_pad(d.get("contents", "")) for k in keys)
                and (question is None or _about_question(d, question, answers))):
            found = (i, False)
    return found


def _search_turn(query: str, think: str = "") -> dict:
    return {"kind": "model", "text": f"{think}<search> {query} </search>"}


def solver_demo(question: str, answers: list[str], source: str, searches: list[tuple[str, list[dict]]],
                hit: tuple[int, bool]) -> dict:
    turns = []
    for i, (q, docs) in enumerate(searches):
        turns.append(_search_turn(q, RETRY_THINK if i else ""))
        turns.append({"kind": "info", "docs": _clean_docs(docs)})
    k, own = hit
    think = f"<think> Doc {k} {'is about' if own else 'mentions'} {answers[0]}. </think>\n"
    turns.append({"kind": "model", "text": f"{think}<answer> {answers[0]} </answer>"})
    return {"role": "solver", "question": question, "answer": list(answers), "source": source, "turns": turns}


def proposer_demo(answer: str, question: str, source: str, searches: list[tuple[str, list[dict]]], k: int) -> dict:
    """k: the 1-based number of the answer's article in the last search's docs."""
    turns = []
    for q, docs in searches:
        turns.append(_search_turn(q))
        turns.append({"kind": "info", "docs": _clean_docs(docs)})
    turns.append({"kind": "model", "text": f"<think> Doc {k} is about {answer}. </think>\n<question> {question} </question>"})
    return {"role": "proposer", "answer": answer, "n_searches": len(searches), "source": source,
            "question": question, "turns": turns}


def validate_demo(demo: dict) -> None:
    """Raise ValueError unless the demo has the shape training/loop/sft.py and the rollout loop expect."""
    role, turns = demo.get("role"), demo.get("turns") or []
    final = {"solver": "</answer>", "proposer": "</question>"}.get(role)
    if final is None:
        raise ValueError(f"demo role {role!r} is not 'solver' or 'proposer'")
    if len(turns) < 3 or len(turns) % 2 == 0:
        raise ValueError(f"{role} demo has {len(turns)} turns; expected model/info pairs then a final model turn")
    for i, t in enumerate(turns):
        want = "model" if i % 2 == 0 else "info"
        if t.get("kind") != want:
            raise ValueError(f"{role} demo turn {i} is {t.get('kind')!r}, expected {want!r}")
        if want == "info" and not isinstance(t.get("docs"), list):
            raise ValueError(f"{role} demo info turn {i} has no docs list")
        if want == "model":
            text, end = t.get("text", ""), final if i == len(turns) - 1 else SEARCH_DONE_TAIL
            if not text.endswith(end) or text != text.strip():
                raise ValueError(f"{role} demo turn {i} must end with {end!r} and carry no outer whitespace: {text!r}")


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
