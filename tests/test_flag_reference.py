"""docs/flags.md is what scripts/flag_reference.py writes from the flags' declarations (issue 42).

A flag added, renamed or given a new default or help text without regenerating the reference fails here, with
the command that regenerates it. The second test checks the generator itself: every field of every settings
dataclass (train.py's groups, sft.py's own) is a row of its group's table, and eval.py's own flags are there too,
so a walker that dropped a group or a flag would not pass with its own output.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "flags.md"
SCRIPT = ROOT / "scripts" / "flag_reference.py"
REGENERATE = "python scripts/flag_reference.py > docs/flags.md"


def generated() -> str:
    res = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def sections(text: str) -> dict[tuple[str, str], str]:
    """{(entry point, group): that group's table} from the reference's '## entry' / '### group' headings."""
    out, entry = {}, ""
    for block in re.split(r"(?m)^(?=##+ )", text):
        head = block.split("\n", 1)[0]
        if head.startswith("### "):
            out[(entry, head[4:].strip())] = block
        elif head.startswith("## "):
            entry = head[3:].strip()
    return out


def test_flag_reference_is_current():
    text = generated()
    current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    if current != text:
        diff = "".join(list(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                 "docs/flags.md", "generated", n=0))[:40])
        raise AssertionError(f"docs/flags.md is not current; regenerate it with `{REGENERATE}`:\n{diff}")
    res = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_every_declared_flag_is_in_its_groups_table():
    from training.settings.config import GROUPS
    from training.loop.sft import SFT_GROUPS

    secs = sections(DOC.read_text(encoding="utf-8"))
    missing = []
    for entry, groups in (("train.py", GROUPS), ("training/loop/sft.py", SFT_GROUPS)):
        for gname, cls in groups.items():
            table = secs.get((entry, gname), "")
            missing += [f"{entry} {gname}: --{f.name}" for f in fields(cls) if f"| `--{f.name}`" not in table]
    assert not missing, f"flags left out of docs/flags.md: {missing}"
    # the doc names the rows a user looks for: default, choices and help of a known flag
    row = next(line for line in secs[("train.py", "model")].splitlines() if line.startswith("| `--dtype`"))
    assert "`bf16`" in row and "`fp32`" in row and "dtype" in row.split("|")[4]
    # eval.py's own flags (not settings fields) are there, with what they require
    evals = "".join(v for (entry, _), v in secs.items() if entry == "eval.py")
    for flag in ("--model", "--out_dir", "--data", "--judge_url", "--index", "--retriever_url", "--temperature"):
        assert f"| `{flag}`" in evals, flag
    assert re.search(r"\| `--out_dir` \| required \|", evals)
