"""Every markdown note the repo cites is a file of the repo (issue 20).

Comments, docstrings, scripts and requirement files cite notes by path ("bench/RESULTS.md",
"docs/PLATFORM_NOTES.md, vLLM weight sync"). A citation of a note kept outside the repository
cannot be followed by a user, so every `*.md` name in a tracked (or untracked, not ignored) text
file must resolve to a markdown file of the repo:

  * relative to the repo root or to the citing file's folder, or
  * as a bare file name ("RESULTS.md") that some file of the repo carries (bench/RESULTS.md).

URLs are not checked. Citations of docs/PLATFORM_NOTES.md that name a section after a comma must
name one of its headings.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTES = "docs/PLATFORM_NOTES.md"
CITATION = re.compile(r"(?<![\w./-])[\w./-]+\.md\b")
# Markdown files the code *writes* rather than cites: not notes, and not in the repo by design.
GENERATED = {
    "results.md": "eval.py writes it into --out_dir",
    "notes.md": "a user's own file in a run folder (tests/training/test_checkpoint.py)",
}


def repo_files() -> list[str]:
    """Tracked files plus untracked files git does not ignore, relative to the root."""
    out = []
    for extra in ([], ["--others", "--exclude-standard"]):
        res = subprocess.run(["git", "ls-files", "-z", *extra], cwd=ROOT, capture_output=True, check=True)
        out += [p for p in res.stdout.decode().split("\0") if p]
    return sorted(set(out))


def read_text(rel: str) -> str | None:
    """The file's text, or None for a binary or missing (deleted in the work tree) file."""
    try:
        data = (ROOT / rel).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _token_around(text: str, start: int, end: int) -> str:
    """The whitespace-delimited run of characters holding text[start:end]."""
    a = start
    while a > 0 and not text[a - 1].isspace():
        a -= 1
    b = end
    while b < len(text) and not text[b].isspace():
        b += 1
    return text[a:b]


def resolves(cited: str, citing: str, files: set[str], basenames: set[str]) -> bool:
    """Whether a cited .md path names a markdown file of the repo (see the module docstring)."""
    if cited.startswith("/"):
        return False  # an absolute path points outside the repository
    if "/" not in cited and cited in basenames:
        return True
    for base in (ROOT, (ROOT / citing).parent):
        target = (base / cited).resolve()
        try:
            rel = target.relative_to(ROOT).as_posix()
        except ValueError:
            continue
        if rel in files:
            return True
    return False


def unresolved_citations(citing: str, text: str, files: set[str], basenames: set[str]) -> list[str]:
    """'file:line: name' for every .md citation in `text` that does not resolve."""
    bad = []
    for m in CITATION.finditer(text):
        cited = m.group(0)
        if "http" in _token_around(text, m.start(), m.end()):
            continue  # a URL: not a repo note
        name = cited.rsplit("/", 1)[-1]
        if name in GENERATED:
            continue
        cited = cited[2:] if cited.startswith("./") else cited
        if not resolves(cited, citing, files, basenames):
            bad.append(f"{citing}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    return bad


def notes_headings() -> list[str]:
    text = (ROOT / NOTES).read_text()
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


def unknown_sections(citing: str, text: str, headings: list[str]) -> list[str]:
    """'file:line: text' for every "<notes file>, <section>" whose section is not a heading."""
    lowered = [h.lower() for h in headings]
    bad = []
    for m in re.finditer(re.escape(NOTES), text):
        # Join a citation wrapped over comment or docstring lines: drop the newline and the markers.
        rest = re.sub(r"\s*\n\s*(?:#+|//|\*)?\s*", " ", text[m.end():m.end() + 200])
        sec = re.match(r",\s*(.+)", rest)
        if sec and not any(sec.group(1).lower().startswith(h) for h in lowered):
            bad.append(f"{citing}:{text.count(chr(10), 0, m.start()) + 1}: {sec.group(1)[:60]!r}")
    return bad


def test_the_notes_file_is_in_the_repo():
    assert NOTES in repo_files(), f"{NOTES} is not tracked (nor untracked and unignored)"
    headings = notes_headings()
    for section in ("DeepSpeed gradient accumulation", "vLLM weight sync", "vLLM sleep mode",
                    "transformers packed sequences", "Hybrid engine rules", "bm25s and JAX on a GPU machine"):
        assert section in headings, section


def test_every_cited_markdown_note_is_a_repo_file():
    files = repo_files()
    md = {f for f in files if f.endswith(".md")}
    basenames = {f.rsplit("/", 1)[-1] for f in md}
    bad = []
    for rel in files:
        text = read_text(rel)
        if text is not None:
            bad += unresolved_citations(rel, text, md, basenames)
    assert not bad, ("markdown notes cited but not in the repo (put the facts in the repo, e.g. in "
                     f"{NOTES}, and cite that file and section):\n" + "\n".join(bad))


def test_every_cited_notes_section_exists():
    headings = notes_headings()
    bad = []
    for rel in repo_files():
        text = read_text(rel)
        if text is not None and NOTES in text:
            bad += unknown_sections(rel, text, headings)
    assert not bad, f"sections of {NOTES} cited but not among its headings:\n" + "\n".join(bad)


def test_the_checker_refuses_outside_notes_and_accepts_repo_ones():
    """The scan itself, on made-up text: a bare or shared/ note name that no repo file carries fails."""
    md = {"bench/RESULTS.md", NOTES, "README.md"}
    basenames = {f.rsplit("/", 1)[-1] for f in md}
    outside = "PLATFORM" + ".md"  # spelt in two parts so that this file cites no outside note itself
    for text in (f"# see {outside}", f"(shared/{outside})", f"({outside}, 'the trap')", f"/work/shared/{outside}",
                 "docs/MISSING" + ".md", "rEADME" + ".md"):
        assert unresolved_citations("training/x.py", text, md, basenames), text
    assert unresolved_citations("x.py", "../README.md", md, basenames)  # outside the repository
    for text in ("see bench/RESULTS.md", "the RESULTS.md section", f"({NOTES}, vLLM weight sync)",
                 "./README.md", "../README.md", "https://github.com/o/r/blob/main/DESIGN.md",
                 "writes results.md into --out_dir", "the .mdx file foo.mdx"):
        citing = "bench/x.py" if text == "../README.md" else "x.py"
        assert not unresolved_citations(citing, text, md, basenames), text
    headings = ["vLLM weight sync", "CPU dtype"]
    assert not unknown_sections("x.py", f"({NOTES}, vLLM weight sync)", headings)
    assert not unknown_sections("x.py", f"({NOTES},\n    # CPU dtype)", headings)
    assert not unknown_sections("x.py", f"see {NOTES}.", headings)
    assert unknown_sections("x.py", f"({NOTES}, the trap)", headings)
