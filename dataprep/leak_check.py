"""Leak check: nothing of the eval sets may be trained on.

The cold-start builder (dataprep/coldstart.py) filters its candidates up front with EvalIndex and sends
its final set through check_no_leak, which raises LeakError on any overlap (see its docstring);
`python -m dataprep.coldstart --check FILE` runs the check alone on any demo file. The reading sets
(dataprep/reading_sets.py) check their rows and demos the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from inference.data import load_eval_rows
from utils.text import as_answer_list, normalize_answer

MIN_PHRASE_WORDS = 3   # containment check: eval questions this long or longer (normalised words)


class LeakError(ValueError):
    """Demos overlap the eval sets."""


def _eval_fields(row: Any) -> tuple[str, list[str], str]:
    """(question, golden answers, label) of an EvalRow or a plain dict row."""
    if isinstance(row, dict):
        q, golden = row.get("question", ""), as_answer_list(row.get("golden_answers"))
        label = f"{row.get('source_file') or row.get('data_source', '?')}:{row.get('id', '?')}"
    else:
        q, golden = row.question, list(row.golden_answers)
        label = f"{row.meta.get('source_file') or row.data_source}:{row.id}"
    return str(q), golden, label


class EvalIndex:
    """Normalised eval questions and answers, for O(1) equality look-ups and the containment scan."""

    def __init__(self, eval_rows: Iterable[Any]):
        self.questions: dict[str, tuple[str, str]] = {}   # norm question -> (label, question)
        self.answers: dict[str, tuple[str, str]] = {}     # norm answer -> (label, question)
        # Rows that name their entities (the reading and two-hop sets, dataprep/reading_sets.py) ban the
        # entities, not the answers: their answers are years and places that many unrelated facts share.
        self.entities: dict[str, tuple[str, str]] = {}
        self.n_rows = 0
        for row in eval_rows:
            q, golden, label = _eval_fields(row)
            self.n_rows += 1
            self.questions.setdefault(normalize_answer(q), (label, q))
            ents = row.get("entities") if isinstance(row, dict) else row.meta.get("entities")
            for e in ents or []:
                self.entities.setdefault(normalize_answer(e), (label, q))
            for a in [] if ents else golden:
                if normalize_answer(a):
                    self.answers.setdefault(normalize_answer(a), (label, q))
        # Short eval questions would match by chance inside longer text; equality still covers them.
        self.phrases = [(f" {nq} ", lab, q) for nq, (lab, q) in self.questions.items()
                        if len(nq.split()) >= MIN_PHRASE_WORDS]

    def overlaps(self, demo: dict) -> list[str]:
        """Why this demo overlaps the eval sets ([] if it does not)."""
        out = []
        q = demo.get("question") or ""
        nq = normalize_answer(q)
        what = "written question" if demo.get("role") == "proposer" else "question"
        if nq in self.questions:
            lab, eq = self.questions[nq]
            out.append(f"{what} {q!r} equals eval question {lab} {eq!r}")
        for a in as_answer_list(demo.get("answer")):
            na = normalize_answer(a)
            if na in self.answers:
                lab, eq = self.answers[na]
                out.append(f"answer {a!r} equals a golden answer of eval row {lab} {eq!r}")
        for e in as_answer_list(demo.get("answer")) + list(demo.get("entities") or []):
            if normalize_answer(e) in self.entities:
                lab, eq = self.entities[normalize_answer(e)]
                out.append(f"{e!r} is an entity of eval row {lab} {eq!r}")
        if not out:  # containment: an eval question copied into the demo's question or a model turn
            texts = [q] + [t.get("text", "") for t in demo.get("turns", []) if t.get("kind") == "model"]
            padded = [f" {normalize_answer(t)} " for t in texts if t]
            for phrase, lab, eq in self.phrases:
                if any(phrase in t for t in padded):
                    out.append(f"text contains eval question {lab} {eq!r}")
                    break
        return out


def check_no_leak(demos: list[dict], eval_rows: Iterable[Any], max_examples: int = 5) -> dict:
    """Raise LeakError if any demo overlaps an eval row; return the numbers checked otherwise.

    Overlap (all on utils.text.normalize_answer forms): the demo's question (solver) or written
    question (proposer) equals an eval question; a golden answer of the demo (solver aliases, the
    proposer's given answer) equals an eval golden answer; or an eval question of >= 3 words
    appears inside the demo's question or any model turn (catches copy-paste into a query or a
    think). Retrieved docs are not checked: they are corpus text, and the corpus holds every
    eval answer by construction (the eval sets are built to be answerable from it).
    """
    idx = eval_rows if isinstance(eval_rows, EvalIndex) else EvalIndex(eval_rows)
    bad = [(i, d, r) for i, d in enumerate(demos) if (r := idx.overlaps(d))]
    if bad:
        lines = [f"  demo #{i} ({d.get('role')}, {d.get('source')}): {'; '.join(r)}" for i, d, r in bad[:max_examples]]
        more = f"\n  ... and {len(bad) - max_examples} more" if len(bad) > max_examples else ""
        raise LeakError(
            f"leak check: {len(bad)} of {len(demos)} demos overlap the {idx.n_rows} eval rows:\n"
            + "\n".join(lines) + more
            + "\nDrop these demos, or rebuild with `python -m dataprep.coldstart --eval <the eval files>` "
              "so the builder filters them out up front."
        )
    return {"demos": len(demos), "eval_rows": idx.n_rows, "eval_questions": len(idx.questions),
            "eval_answers": len(idx.answers), "overlaps": 0}


def load_eval_files(paths: list[Path]) -> list[Any]:
    """The eval rows of these files, each labelled with its file name (leak messages name it)."""
    rows = []
    for p in paths:
        for r in load_eval_rows(p):
            r.meta["source_file"] = Path(p).name  # so leak messages name the file
            rows.append(r)
    return rows
