"""Shared writer for benchmark outputs, and the check that they are still current.

Every bench script owns one *section*. Its machine-readable figures are merged
into bench/results.json (flat dotted keys, e.g. "retrieval.qps_ratio_32") and
its markdown replaces the block between markers in bench/RESULTS.md, so the
benches can run in any order without clobbering each other.

Each section is stamped with the git commit it measured (plus "+dirty" when the
code it measures had uncommitted changes) and the repo paths whose code it
measures; results.json keeps them under "_sections". A number measured before
the code changed reads as if it described today's code, so:

    .venv/bin/python bench/report.py --check            # warn about stale sections (exit 0)
    .venv/bin/python bench/report.py --check --strict   # exit 1 when any section is stale
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
# BENCH_RESULTS_DIR sends a run's results elsewhere (a smoke test must not overwrite the measured ones)
RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS_DIR", BENCH_DIR))
RESULTS_JSON = RESULTS_DIR / "results.json"
RESULTS_MD = RESULTS_DIR / "RESULTS.md"
SECTIONS_KEY = "_sections"   # results.json: {section: {"commit", "run", "measures", "script"[, "dirty"]}}
UNKNOWN = "unknown"          # the commit of a section written where git could not say
_HEADER = (
    "# Benchmark results\n\n"
    "Written by the scripts in `bench/`; each section is replaced when its script runs again.\n"
    "Figures are medians over repeats unless a section says otherwise; ratios are measured side by side in one run.\n"
    "Each section names the commit it measured; `python bench/report.py --check` lists the sections whose code "
    "changed since.\n"
)
_BEGIN = re.compile(r"<!-- begin (.+?) -->")


def machine_line() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


# ----------------------------------------------------------------------------- git

def _git(repo: Path, *args: str) -> subprocess.CompletedProcess | None:
    """`git -C repo args`, or None where git is missing or repo is not a git work tree."""
    try:
        p = subprocess.run(["git", "-C", str(repo), *args], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return p


def _git_out(repo: Path, *args: str) -> str | None:
    p = _git(repo, *args)
    return p.stdout.strip() if p is not None and p.returncode == 0 else None


def _stamp(measures, repo: Path) -> tuple[str, list[str]]:
    """(HEAD's full hash plus "+dirty" when the measured paths have uncommitted or untracked changes, those
    paths); the whole tree counts when no path is named, the results files excepted; "unknown" without git."""
    head = _git_out(repo, "rev-parse", "--verify", "HEAD")
    if not head:
        return UNKNOWN, []
    # results files and plots are rewritten by the benches, so they never make a section dirty
    spec = list(measures) or [".", ":(exclude)bench/RESULTS.md", ":(exclude)bench/results.json",
                              ":(exclude)bench/*.png"]  # plots are outputs too
    p = _git(repo, "status", "--porcelain", "--", *spec)
    if p is None or p.returncode != 0:
        return UNKNOWN, []
    dirty = [line[3:] for line in p.stdout.splitlines() if line.strip()]  # "XY path": X may be a space
    return head + ("+dirty" if dirty else ""), dirty


def commit_stamp(measures: list[str] | tuple[str, ...] = (), repo: Path | None = None) -> str:
    """The commit a section measures now: HEAD, "+dirty" when its paths have uncommitted changes, or "unknown"."""
    return _stamp(measures, REPO if repo is None else repo)[0]


def _short(commit: str) -> str:
    return commit if commit == UNKNOWN else commit.split("+")[0][:10] + ("+dirty" if commit.endswith("+dirty") else "")


def _writer_of(section: str, repo: Path) -> str:
    """The bench script that writes `section` with a literal name, for sections stamped before scripts were."""
    for path in sorted((repo / "bench").glob("*.py")):
        text = path.read_text(errors="replace")
        if f'write_results("{section}"' in text or f"write_results('{section}'" in text:
            return str(path.relative_to(repo))
    return "the bench that writes it"


def _script_name(repo: Path) -> str:
    p = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if p is None:
        return ""
    try:
        return str(p.relative_to(repo))
    except ValueError:
        return p.name


# ----------------------------------------------------------------------------- writing

def write_results(section: str, keys: dict, markdown: str, measures: list[str] | tuple[str, ...] = (),
                  script: str | None = None, repo: Path | None = None) -> None:
    """Merge `keys` (flat, dotted) into results.json and put `markdown` under `## section`.

    measures: the repo paths (files or folders) whose code the section measures; the section is
    stamped with the commit it ran on and `--check` flags it once any of them changes. script: the
    command that re-measures it (default: the running script, relative to the repo)."""
    repo = REPO if repo is None else repo
    commit, dirty = _stamp(measures, repo)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    data = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)  # a fresh BENCH_RESULTS_DIR
    data.update(keys)
    data.setdefault(SECTIONS_KEY, {})[section] = {
        "commit": commit, "run": stamp, "measures": sorted(measures),
        "script": _script_name(repo) if script is None else script, **({"dirty": dirty[:20]} if dirty else {})}
    RESULTS_JSON.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")

    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else _HEADER
    begin, end = f"<!-- begin {section} -->", f"<!-- end {section} -->"
    what = f"commit `{_short(commit)}`" + (" (uncommitted changes to the measured code)" if commit.endswith("+dirty")
                                           else "")
    block = f"{begin}\n## {section}\n\n_Run {stamp} on {machine_line()}, {what}._\n\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS_MD.write_text(text)


def md_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- checking

def _changed_since(repo: Path, commit: str, measures: list[str]) -> str | None:
    """Why `commit` no longer measures today's `measures`, or None when it still does."""
    last = _git_out(repo, "log", "-1", "--format=%H", "--", *measures)
    if not last:
        return None  # none of the paths was ever committed: nothing to compare with
    anc = _git(repo, "merge-base", "--is-ancestor", last, commit)
    if anc is not None and anc.returncode == 0:
        return None
    if anc is None or anc.returncode != 1:  # 128: the commit is not in this repository
        return f"its commit is not in this repository (last change to the measured code: {last[:10]})"
    # the measured paths that differ between the section's commit and the last change to them; none when the
    # section's commit holds the same code by another history (a rebased or cherry-picked branch, a revert)
    changed = _git_out(repo, "diff", "--name-only", commit, last, "--", *measures)
    names = (changed or "").split()
    if changed is not None and not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{shown or ', '.join(measures)} changed since in {last[:10]}"


def stale_sections(results_json: Path | None = None, results_md: Path | None = None,
                   repo: Path | None = None) -> list[str]:
    """One warning per section of RESULTS.md that may not describe the code as it is now:
    no recorded commit, measured on uncommitted changes, or a measured path changed in a commit
    the recorded one does not contain (unless the recorded commit holds the same code, as after a
    rebase). Sections stamped without measured paths are not checked."""
    results_json = RESULTS_JSON if results_json is None else results_json
    results_md = RESULTS_MD if results_md is None else results_md
    repo = REPO if repo is None else repo
    if not results_md.exists():
        return []
    data = json.loads(results_json.read_text()) if results_json.exists() else {}
    info = data.get(SECTIONS_KEY, {})
    try:
        where = str(results_md.resolve().relative_to(repo.resolve()))
    except ValueError:
        where = str(results_md)
    if _git_out(repo, "rev-parse", "--verify", "HEAD") is None:
        return [f"{where}: git is unavailable here, so no section can be checked"]
    out = []
    for section in dict.fromkeys(_BEGIN.findall(results_md.read_text())):
        s = info.get(section, {})
        commit, measures, script = s.get("commit", UNKNOWN), s.get("measures", []), s.get("script") or _writer_of(section, repo)
        head = f"{where} section '{section}'"
        if commit == UNKNOWN:
            out.append(f"{head} has no recorded commit: re-run {script}")
        elif commit.endswith("+dirty"):
            changed = s.get("dirty") or measures
            out.append(f"{head} measured {_short(commit)}, with uncommitted changes to "
                       f"{', '.join(changed) or 'the tree'}: re-run {script} on a commit")
        elif measures and (why := _changed_since(repo, commit, measures)):
            out.append(f"{head} measured {_short(commit)}; {why}: re-run {script}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="check that bench/RESULTS.md still describes the code")
    ap.add_argument("--check", action="store_true", help="list the sections whose measured code changed since they ran")
    ap.add_argument("--strict", action="store_true", help="with --check: exit 1 when any section is stale")
    args = ap.parse_args(argv)
    if not args.check:
        ap.print_help()
        return 0
    warnings = stale_sections()
    for w in warnings:
        print(f"warning: {w}")
    if not warnings:
        print(f"{RESULTS_MD}: every section measured the code as it is now")
    return 1 if warnings and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
