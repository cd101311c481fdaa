"""No arrow in the import graph runs from a library folder into an entry script (issue 24).

Entry scripts are the .py files at the repo root (train.py, eval.py): they parse a command line and
wire the libraries together, so a library that imports one drags a CLI into every importer (the
trainer once imported eval.py for its periodic eval; the loop now lives in inference/evaluate.py).

Library folders are the top-level packages, the folders holding an __init__.py: training, inference,
retrieval, utils, dataprep. bench/, scripts/ and tests/ are entry points too (scripts run by path, and
the tests drive the entry scripts on purpose), so they may import train or eval; any other top-level
folder of .py files must be put in one camp or the other here before it passes.

Every .py file of a library folder is parsed with `ast`, so imports inside functions count, and so do
the string forms: importlib.import_module("eval"), __import__("eval"), runpy.run_module("eval") and
runpy.run_path("eval.py").
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY_FOLDERS = {"bench", "scripts", "tests"}
KNOWN_LIBRARIES = {"training", "inference", "retrieval", "utils", "dataprep"}
STRING_IMPORTS = {"import_module", "__import__", "run_module"}  # first argument: a module name


def python_files() -> list[str]:
    """Tracked .py files plus untracked ones git does not ignore, relative to the root."""
    out = []
    for extra in ([], ["--others", "--exclude-standard"]):
        res = subprocess.run(["git", "ls-files", "-z", *extra, "--", "*.py"], cwd=ROOT, capture_output=True, check=True)
        out += [p for p in res.stdout.decode().split("\0") if p]
    return sorted({p for p in out if (ROOT / p).is_file()})


def entry_imports(source: str, entries: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every import of a module in `entries` (or below it) in this source."""
    def hit(name: str | None) -> bool:
        return bool(name) and name.split(".")[0] in entries

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if hit(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and hit(node.module):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            arg = node.args[0].value
            if (fn in STRING_IMPORTS and hit(arg)) or (fn == "run_path" and Path(arg).suffix == ".py"
                                                       and hit(Path(arg).stem)):
                found.append((node.lineno, f"{fn}({arg!r})"))
    return found


def test_the_finder_sees_every_form():
    src = ("import os\nimport eval\nimport training.trainer\nfrom train import main\n"
           "def f():\n    from eval import evaluate\n    import importlib, runpy\n"
           "    importlib.import_module('eval')\n    __import__('train')\n    runpy.run_path('eval.py')\n"
           "    from . import eval_helpers\n    import evaluation\n")
    assert [line for line, _ in entry_imports(src, {"train", "eval"})] == [2, 4, 6, 8, 9, 10]


def test_no_library_imports_an_entry_script():
    files = python_files()
    entries = {Path(p).stem for p in files if "/" not in p}
    assert {"train", "eval"} <= entries, entries
    folders = {p.split("/")[0] for p in files if "/" in p}
    libraries = {d for d in folders if (ROOT / d / "__init__.py").is_file()}
    assert KNOWN_LIBRARIES <= libraries, libraries
    undecided = folders - libraries - ENTRY_FOLDERS
    assert not undecided, f"top-level folders neither a package nor an entry folder: {sorted(undecided)}"
    bad = [f"{p}:{line}: {what}" for p in files if p.split("/")[0] in libraries
           for line, what in entry_imports((ROOT / p).read_text(encoding="utf-8"), entries)]
    assert not bad, "library modules import an entry script (move what they need into a library):\n" + "\n".join(bad)
