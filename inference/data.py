"""Readers for the two row kinds the game and eval consume, in the formats users already have.

Proposer rows (a ground-truth answer + how many searches the question should need):
  * ours:            {"answer": "Paris" | [...], "search_turns": 2}
  * SSP raw release: {"ground_truth": "Paris", "search_turns": 2, "sys_question_example": ...}
  * SSP / verl processed: {"reward_model": {"ground_truth": {"target": ...}}, "extra_info": {...},
    "prompt": [..., {"role": "user", "content": "... requires 2 searches. ..."}]}; the count is
    taken from `search_turns` (top level or under extra_info) and else read from that prompt text.
Eval rows (question, golden answers, data source):
  * ours / FlashRAG / Search-R1 test: {"question", "golden_answers": [...], "data_source"}
  * Search-R1 / verl train parquet: golden answers in reward_model.ground_truth.target, the
    question in extra_info.question or after "Question:" in the user prompt.

JSONL (.jsonl, .json lines or one JSON array) and parquet. A row that lacks a field fails
with the file, the row number, the fields looked for and the keys the row has.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

Answer = Any  # str | list[str]


@dataclass
class ProposerRow:
    answer: Answer             # the ground truth the question must lead to: str or list of aliases
    search_turns: int          # the n of "write a question that needs n searches"
    data_source: str = ""
    meta: dict = field(default_factory=dict)   # the row's other fields, untouched


@dataclass
class EvalRow:
    question: str
    golden_answers: list[str]
    data_source: str
    id: str = ""
    meta: dict = field(default_factory=dict)


class RowError(ValueError):
    pass


def read_records(path: str | Path) -> Iterator[dict]:
    """Dict rows of a JSONL / JSON-array / parquet file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
        return
    if path.suffix not in (".jsonl", ".json"):
        raise RowError(f"{path}: unknown row file type {path.suffix!r}; use .jsonl, .json or .parquet")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        rows = json.loads(text)
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise RowError(f"{path}: item {i} is a {type(r).__name__}, expected an object")
            yield r
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise RowError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from None
        if not isinstance(r, dict):
            raise RowError(f"{path}:{lineno}: a {type(r).__name__}, expected a JSON object")
        yield r


def _get(row: dict, dotted: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _answer_value(v: Any) -> Answer | None:
    """A str, or a non-empty list of str, out of the shapes ground truths come in ({"target": ...}, list, numpy array)."""
    if isinstance(v, dict):
        return _answer_value(v.get("target"))
    if hasattr(v, "tolist") and not isinstance(v, str):
        v = v.tolist()
    if isinstance(v, str):
        return v if v.strip() else None
    if isinstance(v, (list, tuple)):
        vals = [str(x) for x in v if x is not None and str(x).strip()]
        return vals or None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)    # numeric answers ("1969") sometimes come unquoted
    return None


def _first(row: dict, keys: tuple[str, ...], conv) -> Any:
    for k in keys:
        v = conv(_get(row, k))
        if v is not None:
            return v
    return None


def _missing(path: Path, i: int, what: str, keys: tuple[str, ...], row: dict, hint: str = "") -> RowError:
    return RowError(
        f"{path}: row {i} has no {what} (looked for {', '.join(keys)}); the row has keys {sorted(row)}"
        + (f". {hint}" if hint else "")
    )


def _user_text(row: dict) -> str:
    prompt = row.get("prompt")
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users else ""
    return ""


_N_SEARCHES = re.compile(r"requires?\s+(\d+)\s+search", re.IGNORECASE)


def _int(v: Any) -> int | None:
    try:
        n = int(v)
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


ANSWER_KEYS = ("answer", "ground_truth", "reward_model.ground_truth", "golden_answers", "extra_info.ground_truth")
TURN_KEYS = ("search_turns", "extra_info.search_turns", "n_searches")


def load_proposer_rows(path: str | Path, default_search_turns: int | None = None, limit: int | None = None) -> list[ProposerRow]:
    """Proposer rows from our JSONL or SSP's release (raw or verl-processed), JSONL or parquet.

    default_search_turns: used for rows that carry no search count anywhere; None makes such a row an error.
    """
    path = Path(path)
    out = []
    for i, row in enumerate(read_records(path)):
        if limit is not None and len(out) >= limit:
            break
        answer = _first(row, ANSWER_KEYS, _answer_value)
        if answer is None:
            raise _missing(path, i, "ground-truth answer", ANSWER_KEYS, row)
        n = _first(row, TURN_KEYS, _int)
        if n is None:
            m = _N_SEARCHES.search(_user_text(row))
            n = int(m.group(1)) if m else default_search_turns
        if n is None:
            raise _missing(path, i, "search count", TURN_KEYS + ("'requires N searches' in the user prompt",), row,
                           "Pass default_search_turns to use one count for every row")
        ds = row.get("data_source") or ""
        meta = {k: v for k, v in row.items() if k not in ("answer", "search_turns")}
        out.append(ProposerRow(answer=answer, search_turns=n, data_source=str(ds), meta=meta))
    if not out:
        raise RowError(f"{path}: no rows")
    return out


def clamp_search_turns(rows: list[ProposerRow], lo: int, hi: int) -> int:
    """Move each row's search count n into [lo, hi] (in place) and return how many moved. The game
    rejects questions with fewer than `lo` distinct searches and a rollout of max_turns turns has
    room for max_turns - 1 searches before the question, so an n outside the range punishes a
    proposer for obeying its prompt."""
    moved = 0
    for r in rows:
        n = min(max(r.search_turns, lo), hi)
        moved += n != r.search_turns
        r.search_turns = n
    return moved


def parse_search_turns_mix(spec: str) -> list[float]:
    """"4:3:2:1" -> the weights of n = 1, 2, 3, 4 (any non-negative numbers, at least one positive; they need
    not sum to 1); "" -> [] (off). A ValueError says what is wrong."""
    if not spec.strip():
        return []
    try:
        w = [float(x) for x in spec.split(":")]
    except ValueError:
        raise ValueError(f"search_turns_mix {spec!r}: expected weights of n = 1, 2, ... separated by ':', "
                         f"e.g. 4:3:2:1") from None
    if any(not x >= 0 or x == float("inf") for x in w) or not sum(w) > 0:
        raise ValueError(f"search_turns_mix {spec!r}: weights must be finite, >= 0 and not all 0")
    return w


SEARCH_TURNS_STREAM = 0x5EA4C4  # keeps these draws apart from any other stream seeded by (seed, position)


def draw_search_turns(weights: list[float], seed: int, position: int) -> int:
    """The search count n (1-based: weights[0] is n = 1's) of the row at `position` of the data stream, drawn
    from `weights` by its own generator seeded with (seed, position): the same n on every call, rank and
    resume, whatever was drawn before."""
    import numpy as np

    u = np.random.default_rng([seed & (2**64 - 1), position, SEARCH_TURNS_STREAM]).random()
    cum = np.cumsum(weights) / sum(weights)
    return 1 + min(int(np.searchsorted(cum, u, side="right")), len(weights) - 1)


def mix_search_turns(rows: list[ProposerRow], start: int, spec: str, seed: int, lo: int, hi: int) -> list[ProposerRow]:
    """`rows` (positions start, start + 1, ... of the data stream) with their search_turns drawn from the mix
    `spec` (parse_search_turns_mix; draw_search_turns), then clamped into [lo, hi] as clamp_search_turns does;
    copies, so a row read again in a later epoch gets its new position's n. spec "": `rows` as they are."""
    import dataclasses

    weights = parse_search_turns_mix(spec)
    if not weights:
        return rows
    return [dataclasses.replace(r, search_turns=min(max(draw_search_turns(weights, seed, start + i), lo), hi))
            for i, r in enumerate(rows)]


QUESTION_KEYS = ("question", "extra_info.question", "problem")
GOLDEN_KEYS = ("golden_answers", "reward_model.ground_truth", "answer", "answers", "ground_truth")


def _question_from_prompt(row: dict) -> str | None:
    # Search-R1's train prompts end with "Question: <q>\n"; the last occurrence is the question.
    text = _user_text(row)
    if "Question:" not in text:
        return None
    q = text.rsplit("Question:", 1)[1].strip()
    return q or None


def load_eval_rows(path: str | Path, limit: int | None = None) -> list[EvalRow]:
    """Eval rows (question, golden answers as a list, data source) from JSONL or parquet.

    A row without data_source takes the file's stem, so per-source tables still group it.
    """
    path = Path(path)
    out = []
    for i, row in enumerate(read_records(path)):
        if limit is not None and len(out) >= limit:
            break
        q = _first(row, QUESTION_KEYS, lambda v: v.strip() if isinstance(v, str) and v.strip() else None)
        q = q or _question_from_prompt(row)
        if q is None:
            raise _missing(path, i, "question", QUESTION_KEYS + ("'Question:' in the user prompt",), row)
        golden = _first(row, GOLDEN_KEYS, _answer_value)
        if golden is None:
            raise _missing(path, i, "golden answers", GOLDEN_KEYS, row)
        golden = [golden] if isinstance(golden, str) else list(golden)
        ds = str(row.get("data_source") or path.stem)
        rid = _first(row, ("id", "extra_info.index"), lambda v: v)
        rid = str(i if rid is None else rid)
        meta = {k: v for k, v in row.items() if k not in ("question", "golden_answers", "data_source", "id")}
        out.append(EvalRow(question=q, golden_answers=golden, data_source=ds, id=rid, meta=meta))
    if not out:
        raise RowError(f"{path}: no rows")
    return out


def fanoutqa_scalar_answer(ans: Any) -> list[str] | None:
    """A FanOutQA answer as golden aliases; its answers are str, number, list or dict, and only
    scalars make EM-gradable rows (None otherwise)."""
    if isinstance(ans, bool):
        return None
    if isinstance(ans, (int, float)):
        return [str(ans)]
    if isinstance(ans, str) and ans.strip():
        return [ans.strip()]
    return None


def walk_decomposition(decomp: list | None) -> Iterator[dict]:
    """Every sub-question of a FanOutQA decomposition tree, depth first."""
    for d in decomp or []:
        yield d
        yield from walk_decomposition(d.get("decomposition") or [])
