"""Shared writer for benchmark outputs.

Every bench script owns one *section*. Its machine-readable figures are merged
into bench/results.json (flat dotted keys, e.g. "retrieval.qps_ratio_32") and
its markdown replaces the block between markers in bench/RESULTS.md, so the
benches can run in any order without clobbering each other.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
# BENCH_RESULTS_DIR sends a run's results elsewhere (a smoke test must not overwrite the measured ones)
_RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS_DIR", BENCH_DIR))
RESULTS_JSON = _RESULTS_DIR / "results.json"
RESULTS_MD = _RESULTS_DIR / "RESULTS.md"
_HEADER = (
    "# Benchmark results\n\n"
    "Written by the scripts in `bench/`; each section is replaced when its script runs again.\n"
    "Figures are medians over repeats unless a section says otherwise; ratios are measured side by side in one run.\n"
)


def machine_line() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_results(section: str, keys: dict, markdown: str) -> None:
    """Merge `keys` (flat, dotted) into results.json and put `markdown` under `## section`."""
    data = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    data.update(keys)
    RESULTS_JSON.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")

    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else _HEADER
    begin, end = f"<!-- begin {section} -->", f"<!-- end {section} -->"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    block = f"{begin}\n## {section}\n\n_Run {stamp} on {machine_line()}._\n\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS_MD.write_text(text)


def md_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
