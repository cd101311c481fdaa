"""The cheap validity checks on a proposer's question, run before the RAG check.

Pure functions: no model, no network. Each failure has a named reason, so the
game can count them (`game/filter/<reason>`) and a run shows *why* questions
are refused. The checks run in a fixed order and the first failure wins:

  no_question        no complete <question>...</question> was written, or it is empty
  too_short          fewer than `min_chars` characters
  too_long           more than `max_chars` characters
  too_few_words      fewer than `min_words` whitespace-separated words
  answer_in_question a golden answer (any alias) occurs in the question, as whole normalised words
  too_few_searches   fewer distinct non-empty search queries than required
  empty_retrieval    the searches returned no text at all
  shortcut_queries   a proposer query holds the answer (--shortcut_filter queries|both; SSP's search-terms filter)
  shortcut_title     searching the question returns the answer's page first (--shortcut_filter title|both;
                     decided after a search of the question, inference/rag_check.py)

A shortcut question scores its proposer 0 (SHORTCUT_REASONS), not the format penalty: it is well formed, only too
easy to count as a search question.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from utils.text import Golden, contains_answer, normalize_answer

FILTER_REASONS = (
    "no_question", "too_short", "too_long", "too_few_words",
    "answer_in_question", "too_few_searches", "empty_retrieval", "shortcut_queries", "shortcut_title",
)
SHORTCUT_REASONS = ("shortcut_queries", "shortcut_title")
"""Refusals that score the proposer 0, never the format penalty (inference/game.score)."""
SHORTCUT_FILTERS = ("off", "title", "queries", "both")


@dataclass
class FilterConfig:
    min_chars: int = 10
    """SSP's lower bound: anything shorter cannot state a multi-hop question."""
    max_chars: int = 1000
    """SSP's upper bound: longer "questions" are usually the reasoning pasted in."""
    min_words: int = 10
    """SSP's word floor (split on whitespace)."""
    min_searches: int = 2
    """Distinct non-empty queries required. 2 = SSP's code (a one-search question is
    a lookup). With `searches_at_least_n` the prompt's n is required if larger."""
    searches_at_least_n: bool = False
    """Require at least the n searches the proposer prompt asked for (the SSP paper's intent)."""
    shortcut_queries: bool = False
    """Refuse a question whose proposer searched for its answer (shortcut_queries)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_chars <= self.max_chars:
            raise ValueError(f"need 0 <= min_chars <= max_chars, got {self.min_chars}, {self.max_chars}")
        if self.min_words < 0 or self.min_searches < 0:
            raise ValueError(f"min_words and min_searches must be >= 0, got {self.min_words}, {self.min_searches}")


def distinct_queries(queries: Sequence[str]) -> list[str]:
    """Non-empty queries, de-duplicated after normalisation (order kept).

    Normalising means "Paris" and "paris?" count once: a proposer must not meet
    the search quota by repeating one query with new punctuation.
    """
    seen, out = set(), []
    for q in queries:
        key = normalize_answer(q or "")
        if key and key not in seen:
            seen.add(key)
            out.append(q)
    return out


def retrieved_text(docs: Sequence[Sequence[dict]]) -> str:
    """All retrieved contents of one trajectory, one document per paragraph."""
    return "\n\n".join(
        str(d.get("contents", "")).strip() for call in docs for d in call if str(d.get("contents", "")).strip()
    )


def check_question(
    question: str | None,
    answer: Golden,
    queries: Sequence[str],
    docs: Sequence[Sequence[dict]],
    required_n: int,
    cfg: FilterConfig,
) -> str | None:
    """The first failed check's reason (one of FILTER_REASONS), or None if the question passes.

    `answer` may be a string or a list of aliases; every alias is checked for leaking.
    `docs` is the trajectory's retrieved documents, one list per search call.
    """
    q = (question or "").strip()
    if not q:
        return "no_question"
    if len(q) < cfg.min_chars:
        return "too_short"
    if len(q) > cfg.max_chars:
        return "too_long"
    if len(q.split()) < cfg.min_words:
        return "too_few_words"
    if contains_answer(q, answer):
        return "answer_in_question"
    need = max(cfg.min_searches, required_n) if cfg.searches_at_least_n else cfg.min_searches
    if len(distinct_queries(queries)) < need:
        return "too_few_searches"
    if not retrieved_text(docs):
        return "empty_retrieval"
    if cfg.shortcut_queries and any(contains_answer(str(q or ""), answer) for q in queries):
        return "shortcut_queries"
    return None
