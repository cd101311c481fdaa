"""What every section of the learning ladder's report reads: metrics.jsonl, timings.tsv and eval.py's results.json,
and the pooled numbers made from them (the reading score, the title baselines, searches per question).
Used by bench/learning_proof.py (the rungs) and bench/learning_compare.py (two rungs at equal wall time)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def mean_of(key):
    """Mean of `key` over the rows that hold a finite value of it (metrics.jsonl writes an undefined metric,
    e.g. distill/kl on a step without a teacher, as the string "nan")."""
    def f(rows):
        vals = [float(r[key]) for r in rows if key in r]
        vals = [v for v in vals if not math.isnan(v)]
        return statistics.mean(vals) if vals else float("nan")
    return f


def _ratio_of_sums(num, den):
    """A share over a window of steps read off the game's summed counts (inference.game.is_count), each step
    weighted by its count: sum(num) / sum(den); nan where the window has none (or predates the counts).
    num may be a tuple of keys, summed."""
    nums = (num,) if isinstance(num, str) else tuple(num)

    def f(rows):
        n = sum(r.get(den, 0.0) for r in rows)
        return sum(r.get(k, 0.0) for r in rows for k in nums) / n if n else float("nan")
    return f


# Share of valid proposer questions whose answer is Doc 1's title of the proposer's first search.
doc1_title_share = _ratio_of_sums("game/valid_doc1_title", "game/valid_questions")
# Solver accuracy on the proposer's own fresh questions, weighted by how many there were.
fresh_acc = _ratio_of_sums("solver/fresh_correct", "solver/fresh_trajs")
# Solver groups whose rewards are not all equal: the only ones a group baseline draws a gradient from.
informative_share = _ratio_of_sums("game/informative_groups", "game/solver_groups")
# The trainer's game/informative_per_slot over a window (issue 41): informative groups on the rounds' own fresh
# questions per proposer slot, the slots left empty in the denominator and pool replays not in the numerator.
informative_per_slot = _ratio_of_sums("game/informative_groups/fresh", "game/solver_slots")
empty_slot_share = _ratio_of_sums("game/empty_slots", "game/solver_slots")


def total_of(key):
    """Sum of a count over a window of steps; nan where no step has it (a run from before the count)."""
    def f(rows):
        vals = [float(r[key]) for r in rows if key in r]
        return sum(vals) if vals else float("nan")
    return f
_FRESH = ("game/fresh_s0", "game/fresh_mid", "game/fresh_s1")


def _fresh_share(key):
    """Share of fresh questions whose solve rate is s = 0 / 0 < s < 1 / s = 1 (key one of _FRESH)."""
    def f(rows):
        n = sum(r.get(k, 0.0) for r in rows for k in _FRESH)
        return sum(r.get(key, 0.0) for r in rows) / n if n else float("nan")
    return f


# the game's own columns, for the self-play rungs (2 and 3)
informative_share_fresh = _ratio_of_sums("game/informative_groups/fresh", "game/solver_groups/fresh")
GAME_COLUMNS = [("informative share", informative_share), ("informative share, fresh", informative_share_fresh),
                ("informative per slot", informative_per_slot), ("empty slots", empty_slot_share),
                ("fresh s=0", _fresh_share("game/fresh_s0")),
                ("fresh 0<s<1", _fresh_share("game/fresh_mid")), ("fresh s=1", _fresh_share("game/fresh_s1")),
                ("no question", _ratio_of_sums("game/no_question", "game/proposer_trajs")),
                ("pool-served acc", _ratio_of_sums("game/pool_served_correct", "game/pool_served_trajs"))]


# per rung: (run-folder prefix, training curves (title, fn over a window of step rows), table columns)
def read_metrics(path: Path) -> list[dict]:
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "game/valid_rate" in row:  # training-step lines (eval lines carry eval/* only)
                by_step[row["step"]] = row  # a resumed step overwrites the crashed attempt's line
    return [by_step[k] for k in sorted(by_step)]


def read_timings(path: Path) -> dict:
    out: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            stage, secs, seed = line.split("\t")
            out.setdefault((stage, seed), 0.0)
            out[(stage, seed)] += float(secs)
    return out


def read_json(path: Path, hint: str) -> dict:
    if not path.exists():
        sys.exit(f"learning_proof.py: {path} is missing; {hint}")
    return json.loads(path.read_text())


def em(res: dict, src: str | None = None) -> float:
    g = res["overall"] if src is None else res["per_source"].get(src)
    return 100 * g["em"] if g else float("nan")


# data_source values whose questions need the retrieved text read (fanoutqa: multi-hop FanOutQA, fanoutqa_single:
# single-hop); the reading score pools EM over those present. wiki_desc_heldout is answered by a title: not here.
READING_SOURCES = ("reading_heldout", "twohop_heldout", "capitals", "fanoutqa", "fanoutqa_single")
TWOHOP_SOURCES = ("twohop_heldout", "fanoutqa")  # searches per question is read on the first one present
NAN = float("nan")


def field(g: dict, key: str) -> float | None:
    """g[key], or g["title_copy_at"]["1"] for "title_copy_at.1"; None where the eval predates the field."""
    head, _, sub = key.partition(".")
    v = g.get(head)
    return (v or {}).get(sub) if sub else v


def pooled(res: dict, key: str = "em", sources: tuple | None = READING_SOURCES) -> float:
    """key pooled over the data sources present (all with sources=None), n-weighted, in %; nan if none has it."""
    pairs = [(g["n"], field(g, key)) for src, g in res["per_source"].items() if sources is None or src in sources]
    pairs = [(n, v) for n, v in pairs if v is not None]
    n = sum(n for n, _ in pairs)
    return 100 * sum(n * v for n, v in pairs) / n if n else NAN


def pooled_hist(res: dict, sources: tuple | None = READING_SOURCES) -> dict:
    """searches_hist pooled like pooled()."""
    groups = [g for src, g in res["per_source"].items() if (sources is None or src in sources) and g.get("searches_hist")]
    n = sum(g["n"] for g in groups)
    return mean_hist([g["searches_hist"] for g in groups], [g["n"] / n for g in groups]) if n else {}


def mean_hist(hists: list[dict], weights: list[float] | None = None) -> dict:
    """Weighted (default: plain) mean of {"searches": share} dicts, a missing key counting 0."""
    w = weights or [1 / len(hists)] * len(hists)
    keys = sorted({k for h in hists for k in h}, key=int)
    return {k: round(sum(wi * h.get(k, 0.0) for wi, h in zip(w, hists)), 4) for k in keys}


def hist_str(hist: dict) -> str:
    return " ".join(f"{k}:{v:.2f}" for k, v in hist.items()) or "-"


def twohop_set(res: dict) -> str | None:
    return next((s for s in TWOHOP_SOURCES if s in res["per_source"]), None)


def searches(res: dict, src: str | None) -> tuple[float, dict]:
    """(searches per question, their distribution) on one data source; nan / {} where it is missing."""
    g = res["per_source"].get(src) or {}
    return (NAN if g.get("searches_mean") is None else g["searches_mean"]), g.get("searches_hist") or {}


def json_number(x: float, nd: int = 2) -> float | None:
    """A JSON-safe rounded number: None for nan (not measured)."""
    return None if x is None or math.isnan(x) else round(x, nd)


def fmt_num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def verdict(ok: bool | None) -> str:
    return "n/a (not measured)" if ok is None else ("met" if ok else "NOT met")


def load_rung(out: Path, prefix: str, seeds: list[str], steps: list[int]) -> dict:
    runs = {}
    for s in seeds:
        hint = (f"run scripts/learning_proof_cpu.sh for {prefix}{s} (milestones {' '.join(map(str, steps))}) first")
        evals = {m: read_json(out / f"{prefix}{s}" / f"eval_step{m}" / "results.json", hint) for m in steps}
        runs[s] = {"metrics": read_metrics(out / f"{prefix}{s}" / "metrics.jsonl"), "evals": evals}
    return runs


OOD_SOURCES = ("capitals", "fanoutqa", "fanoutqa_single")  # held-out sets nothing in training is built like
