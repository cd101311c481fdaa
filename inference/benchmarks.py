"""The QA benchmarks papers report (SSP's Table 1, Search-R1, ZeroSearch): their files, names, order and table.

    files = eval_files("data/benchmarks")      # a folder in FlashRAG's or Search-R1's layout -> its row files
    table = benchmark_table(result)             # evaluate()'s result -> one row per benchmark, and their average
    lines = benchmark_markdown(table)           # results.md's "## Benchmarks" section

A folder given to eval.py --data is read as the benchmarks it holds: its own row files (.jsonl, .json, .parquet)
and those of each folder inside it, one level down. Files named by a split (FlashRAG's nq/test.jsonl,
hotpotqa/dev.jsonl, Search-R1's test.parquet) count once per folder, the first of test, dev, validation, val that is
there; train files are never read. A row without data_source takes its folder's name when its file is named by a
split (inference/data.py load_eval_rows), so FlashRAG's nq/test.jsonl reports as nq.

The table: rows are the benchmarks in SSP's order (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle) when
present, then any other data source by name; columns are EM and the LLM judge's accuracy (judge_acc: EM, else the
judge's verdict; blank without --judge_url, where it would only repeat EM); the last row is the unweighted mean over
the benchmarks, as SSP's Table 1 averages (results.md's "overall" row pools every question instead).
"""

from __future__ import annotations

import re
from pathlib import Path

from inference.data import EVAL_SPLITS, ROW_SUFFIXES, SPLIT_STEMS, RowError

# (name in the table, the data_source spellings it covers, lower-case with only letters and digits kept)
BENCHMARKS = (
    ("NQ", ("nq", "naturalquestions", "nqopen")),
    ("TriviaQA", ("triviaqa", "tqa")),
    ("PopQA", ("popqa",)),
    ("HotpotQA", ("hotpotqa",)),
    ("2Wiki", ("2wikimultihopqa", "2wiki", "2wikimqa", "wikimultihopqa")),
    ("MuSiQue", ("musique",)),
    ("Bamboogle", ("bamboogle",)),
)
_KNOWN = {alias: (i, name) for i, (name, aliases) in enumerate(BENCHMARKS) for alias in aliases}


def benchmark_name(source: str) -> tuple[int, str]:
    """(its place in the table, its name): a known benchmark's place and name (2wikimultihopqa -> 2Wiki); any other
    data source after them, under its own name."""
    return _KNOWN.get(re.sub(r"[^a-z0-9]", "", source.lower()), (len(BENCHMARKS), source))


def _row_files(folder: Path) -> list[Path]:
    """A folder's own row files: every one not named by a split, and the first split of EVAL_SPLITS present."""
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in ROW_SUFFIXES and not f.name.startswith("."))
    split = next(([f for f in files if f.stem == s] for s in EVAL_SPLITS if any(f.stem == s for f in files)), [])
    return [f for f in files if f.stem not in SPLIT_STEMS] + split[:1]


def eval_files(path: str | Path) -> list[str]:
    """The row files an eval.py --data entry stands for: a file itself; a folder's own row files and those of each
    folder inside it (module docstring). RowError for a folder that holds none."""
    p = Path(path)
    if not p.is_dir():
        return [str(p)]
    subs = sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
    files = _row_files(p) + [f for d in subs for f in _row_files(d)]
    if not files:
        raise RowError(f"{p} is a folder with no eval files: expected <benchmark>/test.jsonl (or dev, .parquet) as "
                       "FlashRAG writes them, <benchmark>.jsonl / .parquet, or Search-R1's test.parquet (train files "
                       "are never read)")
    return [str(f) for f in files]


def benchmark_table(result: dict) -> dict:
    """{"judge": "llm" | "none", "rows": [{"benchmark", "data_source", "n", "em", "judge_acc"}], "average": {"n",
    "benchmarks", "em", "judge_acc"}} from evaluate()'s per-source metrics; judge_acc is None without an LLM judge,
    and the average is the unweighted mean over the rows."""
    llm = bool(result.get("llm_judge"))
    rows = [{"benchmark": benchmark_name(src)[1], "data_source": src, "n": m["n"], "em": m["em"],
             "judge_acc": m["judge_acc"] if llm else None}
            for src, m in sorted(result["per_source"].items(), key=lambda kv: (benchmark_name(kv[0]), kv[0]))]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in rows if r[key] is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {"judge": "llm" if llm else "none", "rows": rows,
            "average": {"n": sum(r["n"] for r in rows), "benchmarks": len(rows), "em": mean("em"),
                        "judge_acc": mean("judge_acc")}}


def benchmark_markdown(table: dict) -> list[str]:
    """results.md's "## Benchmarks" section: one row per benchmark, then the average."""
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    avg = table["average"]
    lines = ["## Benchmarks", "", "| benchmark | data_source | n | EM | LLM judge acc |", "|---|---|---|---|---|",
             *(f"| {r['benchmark']} | {r['data_source']} | {r['n']} | {cell(r['em'])} | {cell(r['judge_acc'])} |"
               for r in table["rows"]),
             f"| **Average** | {avg['benchmarks']} benchmarks | {avg['n']} | {cell(avg['em'])} | {cell(avg['judge_acc'])} |",
             "", "Rows in SSP's Table 1 order; Average: the unweighted mean over the benchmarks, as SSP reports it. "
             + ("LLM judge acc: exact match, else the judge's verdict." if table["judge"] == "llm" else
                "LLM judge acc: - (no --judge_url; the judge column above is exact match).")]
    return lines
