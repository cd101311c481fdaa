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

Answers are read as their text in every shape the common QA exports give them (`answer_texts`): a
string, a number, a list of them, SQuAD/NQ's list of objects [{"text": "Paris", "answer_start": 17}],
HF SQuAD's {"text": [...], "answer_start": [...]}, TriviaQA's {"value", "aliases"}, verl's
{"target": ...}. Any other shape is refused, naming it: a stringified object would never match.

JSONL (.jsonl, .json lines or one JSON array) and parquet, UTF-8. Every row of a file is read in one
pass and the first few bad ones are listed together (`MAX_LISTED`), each by its 1-based line (item of
a JSON array, row of a parquet file), with the fields looked for and the keys the row has.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from utils.errors import InputError, InputFileMissing
from utils.jsonl import iter_jsonl, not_utf8

Answer = Any  # str | list[str]
MAX_LISTED = 5  # bad rows listed in one error; the rest are counted
ROW_SUFFIXES = (".jsonl", ".json", ".parquet")
EVAL_SPLITS = ("test", "dev", "validation", "val")   # the split an eval reads from a folder of splits, first present
SPLIT_STEMS = EVAL_SPLITS + ("train",)   # file names that say a split, not a data source (FlashRAG's nq/test.jsonl)


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
    where: str = ""   # "FILE: line N" (item N of a JSON array, row N of a parquet file) for messages; "" when built in code


class RowError(InputError):
    pass


class RowFileMissing(RowError, InputFileMissing):
    pass


def iter_records(path: str | Path) -> Iterator[tuple[str, dict | None, str | None]]:
    """(where, row, problem) for every row of a JSONL / JSON-array / parquet file, in one pass: `where` is
    "line N" (1-based, as JSON errors count), "item N" of a JSON array or "row N" of a parquet file; a row
    that cannot be read comes as (where, None, what is wrong) and the rest still follow. A file that cannot
    be read at all raises RowError."""
    path = Path(path)
    if not path.exists():
        raise RowFileMissing(f"{path}: no such file")
    if path.is_dir():
        raise RowError(f"{path} is a folder; a row file (.jsonl, .json or .parquet) is expected")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise RowError(f"{path}: not a readable parquet file ({e})") from None
        for i, r in enumerate(table.to_pylist(), 1):
            yield f"row {i}", r, None
        return
    if path.suffix not in (".jsonl", ".json"):
        raise RowError(f"{path}: unknown row file type {path.suffix!r}; use .jsonl, .json or .parquet")
    data = path.read_bytes()
    if data.lstrip()[:1] == b"[" or data.lstrip()[:4] == b"\xef\xbb\xbf[":
        try:
            rows = json.loads(data.decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise RowError(f"{path}: line {line}: " + not_utf8(path, data[e.start], e.start, e)) from None
        except json.JSONDecodeError as e:
            raise RowError(f"{path}: line {e.lineno} column {e.colno}: not valid JSON ({e.msg})") from None
        for i, r in enumerate(rows, 1):
            ok = isinstance(r, dict)
            yield f"item {i}", r if ok else None, None if ok else f"a {type(r).__name__}, expected a JSON object"
        return
    for lineno, r, problem in iter_jsonl(path):
        ok = problem is None and isinstance(r, dict)
        if problem is None and not ok:
            problem = f"a {type(r).__name__}, expected a JSON object"
        yield f"line {lineno}", r if ok else None, problem


def read_records(path: str | Path) -> Iterator[dict]:
    """Dict rows of a JSONL / JSON-array / parquet file; the first row that cannot be read raises RowError."""
    for where, row, problem in iter_records(path):
        if problem is not None:
            raise RowError(f"{path}: {where}: {problem}")
        yield row


def load_rows(path: str | Path, convert: Callable[[dict, str], Any], limit: int | None = None) -> list:
    """convert(row, where) over every row of `path` (the first `limit` good ones), in one pass. Rows that cannot
    be read or converted (RowError) are collected, and the first MAX_LISTED are raised together as one RowError."""
    path, out, bad = Path(path), [], []
    for where, row, problem in iter_records(path):
        if limit is not None and len(out) >= limit:
            break
        if problem is None:
            try:
                out.append(convert(row, where))
                continue
            except RowError as e:
                problem = str(e)
        bad.append(f"{where}: {problem}")
    if len(bad) == 1:
        raise RowError(f"{path}: {bad[0]}")
    if bad:
        more = f" (the first {MAX_LISTED} shown)" if len(bad) > MAX_LISTED else ""
        raise RowError(f"{path}: {len(bad)} rows cannot be read{more}:\n    " + "\n    ".join(bad[:MAX_LISTED]))
    if not out:
        raise RowError(f"{path}: no rows (the file is empty)")
    return out


def _get(row: dict, dotted: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


class ShapeError(ValueError):
    """A value's shape holds no answer text; the message describes the shape found."""


# Keys of an answer object that hold its text, in the order tried: verl's {"target"}, SQuAD/NQ's {"text"},
# TriviaQA's {"value", "aliases"} (both read), and a nested {"answer"}.
ANSWER_OBJECT_KEYS = ("target", "text", "value", "aliases", "answer")


def _shape(v: Any, plural: bool = False) -> str:
    """A short description of a value's shape ("an object with keys ['answer_start']"), for error messages."""
    if isinstance(v, dict):
        return f"{'objects' if plural else 'an object'} with keys {sorted(map(str, v))}"
    if isinstance(v, (list, tuple)):
        if not v:
            return "empty lists" if plural else "an empty list"
        kinds = sorted({_shape(x, plural=True) for x in v})
        return ("lists" if plural else "a list") + (f" of {kinds[0]}" if len(kinds) == 1 else f" mixing {' and '.join(kinds)}")
    if isinstance(v, bool):
        return "booleans" if plural else f"a boolean ({str(v).lower()})"
    name = {"str": "text", "int": "number", "float": "number"}.get(type(v).__name__)
    if name:
        return name + ("s" if plural else "")
    return f"values of type {type(v).__name__}" if plural else f"a value of type {type(v).__name__}"


def answer_texts(v: Any) -> list[str]:
    """The answer texts a value holds, in order, without repeats ([] when empty or missing); ShapeError for a
    shape that holds none (a boolean, an object without a text key, ...)."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()   # numpy arrays and scalars, as parquet gives lists
    if v is None:
        return []
    if isinstance(v, bool):
        raise ShapeError(f"{_shape(v)}: write a yes/no answer as the text \"yes\" or \"no\"")
    if isinstance(v, str):
        return [v.strip()] if v.strip() else []
    if isinstance(v, int):
        return [str(v)]            # numeric answers ("1969") sometimes come unquoted
    if isinstance(v, float):
        return [] if math.isnan(v) else [str(int(v)) if v.is_integer() else str(v)]
    if isinstance(v, dict):
        keys = [k for k in ANSWER_OBJECT_KEYS if k in v]
        if not keys:
            raise ShapeError(f"{_shape(v)}, none of which holds the answer text (expected one of "
                             f"{', '.join(ANSWER_OBJECT_KEYS)})")
        if keys[0] in ("value", "aliases"):
            keys = [k for k in ("value", "aliases") if k in v]
        else:
            keys = keys[:1]
        return _unique([t for k in keys for t in answer_texts(v[k])])
    if isinstance(v, (list, tuple)):
        try:
            return _unique([t for x in v for t in answer_texts(x)])
        except ShapeError:
            raise ShapeError(f"{_shape(v)}; expected texts, or objects holding one (SQuAD's {{\"text\": ...}})") from None
    raise ShapeError(_shape(v))


def _unique(xs: list[str]) -> list[str]:
    return list(dict.fromkeys(xs))


def _answer_value(v: Any) -> Answer | None:
    """A str (when given as one), or a non-empty list of str; None when empty. ShapeError for other shapes."""
    texts = answer_texts(v)
    if not texts:
        return None
    while isinstance(v, dict) and not ("value" in v and "aliases" in v):  # {"target": "Paris"} is one text too
        v = next(v[k] for k in ANSWER_OBJECT_KEYS if k in v)
    return texts[0] if isinstance(v, (str, int, float)) and len(texts) == 1 else texts


def _first(row: dict, keys: tuple[str, ...], conv) -> Any:
    """conv of the first of `keys` whose value is not empty; a value of the wrong shape is a RowError naming its field."""
    for k in keys:
        try:
            v = conv(_get(row, k))
        except ShapeError as e:
            raise RowError(f"field {k!r} is {e}") from None
        if v is not None:
            return v
    return None


def _missing(what: str, keys: tuple[str, ...], row: dict, hint: str = "") -> RowError:
    return RowError(f"no {what} (looked for {', '.join(keys)}); the row has keys {sorted(row)}"
                    + (f". {hint}" if hint else ""))


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
    """A search count: a whole number >= 0 (or its text); None when missing; ShapeError for anything else."""
    if v is None:
        return None
    try:
        n = int(v) if not isinstance(v, (bool, float)) or float(v).is_integer() else None
    except (TypeError, ValueError):
        n = None
    if n is None or n < 0 or isinstance(v, bool):
        raise ShapeError(f"{_shape(v)} ({v!r}); expected a whole number >= 0")
    return n


ANSWER_KEYS = ("answer", "ground_truth", "reward_model.ground_truth", "golden_answers", "extra_info.ground_truth")
TURN_KEYS = ("search_turns", "extra_info.search_turns", "n_searches")


def load_proposer_rows(path: str | Path, default_search_turns: int | None = None, limit: int | None = None) -> list[ProposerRow]:
    """Proposer rows from our JSONL or SSP's release (raw or verl-processed), JSONL or parquet.

    default_search_turns: used for rows that carry no search count anywhere; None makes such a row an error.
    """
    def convert(row: dict, where: str) -> ProposerRow:
        answer = _first(row, ANSWER_KEYS, _answer_value)
        if answer is None:
            raise _missing("ground-truth answer", ANSWER_KEYS, row)
        n = _first(row, TURN_KEYS, _int)
        if n is None:
            m = _N_SEARCHES.search(_user_text(row))
            n = int(m.group(1)) if m else default_search_turns
        if n is None:
            raise _missing("search count", TURN_KEYS + ("'requires N searches' in the user prompt",), row,
                           "Give every row a search_turns field (the number of searches its question should need)")
        meta = {k: v for k, v in row.items() if k not in ("answer", "search_turns")}
        return ProposerRow(answer=answer, search_turns=n, data_source=str(row.get("data_source") or ""), meta=meta)

    return load_rows(path, convert, limit)


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


PROPOSER_SEEDS = ("answers", "articles")
"""Where proposer rows come from: a file of given answers (SSP), or random articles of the corpus (Dr. Zero)."""
ARTICLE_STREAM = 0xA271C1E  # keeps these draws apart from the search-count stream seeded by (seed, position)
ARTICLE_ROWS = 1 << 17      # rows per epoch: bounds the trainer's per-epoch permutation, not the corpus


class ArticleRows:
    """Proposer rows drawn from a corpus (Dr. Zero's seeding): row k's answer is the title of a document drawn
    uniformly by a generator seeded with (seed, k), so every rank and a resumed run read the same row k; the trainer
    reads these rows as it reads a file's (a permutation per epoch, its cursor in the checkpoint). docs: anything
    with len() and get(i) -> {"id", "contents": "Title\\ntext"} (retrieval.corpus.DocStore)."""

    def __init__(self, docs: Any, seed: int, search_turns: int, size: int = ARTICLE_ROWS):
        self.docs, self.seed, self.search_turns = docs, seed, search_turns
        self.size = min(size, len(docs))
        if not self.size:
            raise RowError("--proposer_seed articles: the corpus holds no documents")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> ProposerRow:
        import numpy as np

        if not 0 <= k < self.size:
            raise IndexError(k)
        rng = np.random.default_rng([self.seed & (2**64 - 1), int(k), ARTICLE_STREAM])
        for _ in range(64):  # an untitled document gives no answer: draw again
            d = self.docs.get(int(rng.integers(len(self.docs))))
            title, sep, _ = str(d["contents"]).partition("\n")
            title = title.strip().strip('"').strip()   # wiki-18 quotes its titles
            if sep and title:
                return ProposerRow(title, self.search_turns, "articles", {"doc_id": str(d["id"])})
        raise RowError(f"--proposer_seed articles: 64 documents drawn for row {k} had no title line ('Title\\ntext')")


QUESTION_KEYS = ("question", "extra_info.question", "problem")
GOLDEN_KEYS = ("golden_answers", "reward_model.ground_truth", "answer", "answers", "ground_truth")


def _question_from_prompt(row: dict) -> str | None:
    # Search-R1's train prompts end with "Question: <q>\n"; the last occurrence is the question.
    text = _user_text(row)
    if "Question:" not in text:
        return None
    q = text.rsplit("Question:", 1)[1].strip()
    return q or None


def _question_text(v: Any) -> str | None:
    """A question as text: a string, or an object holding one under "text" (Natural Questions' HF export)."""
    if isinstance(v, dict) and "text" in v:
        v = v["text"]
    if v is None or isinstance(v, str):
        return v.strip() if v and v.strip() else None
    raise ShapeError(f"{_shape(v)}; expected the question's text")


def load_eval_rows(path: str | Path, limit: int | None = None) -> list[EvalRow]:
    """Eval rows (question, golden answers as a list, data source) from JSONL or parquet.

    A row without data_source takes the file's stem, so per-source tables still group it; a file named by a split
    (SPLIT_STEMS: FlashRAG's nq/test.jsonl) takes its folder's name instead.
    """
    path = Path(path)
    source = path.resolve().parent.name if path.stem in SPLIT_STEMS and path.resolve().parent.name else path.stem
    index = itertools.count()  # a row without an id is known by its 0-based position among the rows (as before)

    def convert(row: dict, where: str) -> EvalRow:
        i = next(index)
        q = _first(row, QUESTION_KEYS, _question_text) or _question_from_prompt(row)
        if q is None:
            raise _missing("question", QUESTION_KEYS + ("'Question:' in the user prompt",), row)
        golden = _first(row, GOLDEN_KEYS, _answer_value)
        if golden is None:
            raise _missing("golden answers", GOLDEN_KEYS, row)
        golden = [golden] if isinstance(golden, str) else list(golden)
        ds = str(row.get("data_source") or source)
        rid = _first(row, ("id", "extra_info.index"), lambda v: v)
        rid = str(i if rid is None else rid)
        meta = {k: v for k, v in row.items() if k not in ("question", "golden_answers", "data_source", "id")}
        return EvalRow(question=q, golden_answers=golden, data_source=ds, id=rid, meta=meta, where=f"{path}: {where}")

    return load_rows(path, convert, limit)


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
