"""The import graph of the project's own modules (issues 24 and 34).

Issue 24: no arrow runs from a library folder into an entry script. Entry scripts are the .py files at the
repo root (train.py, eval.py): they parse a command line and wire the libraries together, so a library that
imports one drags a CLI into every importer (the trainer once imported eval.py for its periodic eval; the
loop now lives in inference/evaluate.py). Library folders are the top-level packages, the folders holding an
__init__.py: training, inference, retrieval, utils, dataprep. bench/, scripts/ and tests/ are entry points
too (scripts run by path, and the tests drive the entry scripts on purpose), so they may import train or
eval; any other top-level folder of .py files must be put in one camp or the other here before it passes.
The string forms count there too: importlib.import_module("eval"), __import__("eval"),
runpy.run_module("eval") and runpy.run_path("eval.py").

Issue 34: every project module outside tests/ (the entry scripts, the packages, bench/ and scripts/) is
parsed with `ast`, and every import of a project module is an arrow: at the top or inside a function,
under `if TYPE_CHECKING:`, absolute or relative, `import a.b` or `from a import b` (an arrow to the
submodule a.b when there is one, else to a). On that graph:
  * no cycle: a module that needs its importer's names at call time hides a layering it should show;
  * no private name (one leading underscore) of another project module, imported or reached through a
    module alias (`from training.algorithm import loss; loss._x`): what is shared is public;
  * retrieval/ imports nothing from inference/ or training/: the index and its server know no generation;
  * a project module is imported at the top of its importer, not inside a function, unless importing it
    loads a heavy library (torch, vLLM, DeepSpeed, FAISS, transformers, ...: `HEAVY_LIBS`), which stays
    lazy so the pure parts import anywhere.
The checker takes a root folder, and is shown to catch a planted cycle and a planted private import in a
tiny package written to tmp_path.
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
from dataclasses import dataclass
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
    src = ("import os\nimport eval\nimport training.loop.trainer\nfrom train import main\n"
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


# ----------------------------------------------------------------------------- the module graph (issue 34)

# Importing one of these takes seconds, memory or an optional install, or fixes thread settings (numpy reads
# OMP_NUM_THREADS at import; retrieval/worker.py sets it first): a module that needs one imports it (or the
# project module that does) inside the function that uses it.
HEAVY_LIBS = {"torch", "vllm", "deepspeed", "faiss", "transformers", "triton", "flash_attn", "peft", "datasets",
              "numpy", "fastapi", "uvicorn", "httpx", "bm25s", "Stemmer", "pyarrow", "wandb", "mlflow", "tensorboard"}
SKIP_DIRS = {"tests", "runs", "outputs", "data", "__pycache__"}   # tests, and what git ignores
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass(frozen=True)
class Arrow:
    """One import of a project module: `src` imports `dst` at `path`:`line`."""
    src: str
    dst: str
    path: str
    line: int
    in_function: bool
    private: str = ""   # the private name taken from dst, if any


def module_name(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def walk_python_files(root: Path) -> list[str]:
    """.py files under root, relative, outside tests/, dot folders, symlinks and git-ignored folders."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                             and not os.path.islink(os.path.join(dirpath, d)))
        out += [str(Path(dirpath, f).relative_to(root)) for f in filenames if f.endswith(".py")]
    return sorted(out)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := dotted(node.value)):
        return f"{head}.{node.attr}"
    return None


def scan(root: Path, files: list[str] | None = None) -> list[Arrow]:
    """Every import of a project module by a project module under `root` (files: relative paths to read;
    default: walk_python_files). Heavy-library imports are not arrows; see heavy_modules."""
    root = Path(root)
    files = walk_python_files(root) if files is None else files
    mods = {module_name(f): f for f in files if module_name(f)}

    def known(name: str) -> str | None:   # the longest prefix of `name` that is a project module
        parts = name.split(".")
        return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in mods), None)

    arrows = []
    for src, rel in sorted(mods.items()):
        tree = ast.parse((root / rel).read_text(encoding="utf-8"), rel)
        package = src if rel.endswith("__init__.py") else src.rpartition(".")[0]
        aliases: dict[str, str] = {}   # a local name bound to a project module

        def visit(node: ast.AST, in_fn: bool):
            for child in ast.iter_child_nodes(node):
                yield child, in_fn
                yield from visit(child, in_fn or isinstance(child, FUNCTIONS))

        for node, in_fn in visit(tree, False):
            found: list[tuple[str, str]] = []   # (module, private name)
            if isinstance(node, ast.Import):
                for a in node.names:
                    if dst := known(a.name):
                        found.append((dst, ""))
                        if a.asname:
                            aliases[a.asname] = dst
                        else:   # `import a.b.c` binds a, and a.b.c reads through it
                            parts = a.name.split(".")
                            aliases.update({m: m for i in range(len(parts)) if (m := ".".join(parts[:i + 1])) in mods})
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for a in node.names:
                    sub = f"{module}.{a.name}" if module else a.name
                    if sub in mods:   # `from pkg import module`
                        found.append((sub, ""))
                        aliases[a.asname or a.name] = sub
                    elif dst := known(module):
                        found.append((dst, a.name if is_private(a.name) else ""))
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if fn in STRING_IMPORTS and (dst := known(node.args[0].value)):
                    found.append((dst, ""))
            arrows += [Arrow(src, dst, rel, node.lineno, in_fn, priv) for dst, priv in found if dst != src]
        for node in ast.walk(tree):   # module_alias._private, however the module was imported
            if isinstance(node, ast.Attribute) and is_private(node.attr) and (dst := aliases.get(dotted(node.value))) \
                    and dst != src:
                arrows.append(Arrow(src, dst, rel, node.lineno, False, node.attr))
    return arrows


def cycles(arrows: list[Arrow]) -> list[list[Arrow]]:
    """One cycle (its arrows, in order) per strongly connected group of modules that has one."""
    graph: dict[str, dict[str, Arrow]] = {}
    for a in arrows:
        graph.setdefault(a.src, {}).setdefault(a.dst, a)
        graph.setdefault(a.dst, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def strong(v: str) -> None:   # Tarjan; the graph is a few hundred modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    out = []
    for group in groups:   # the shortest way back to the group's first module
        start = min(group)
        prev: dict[str, Arrow | None] = {start: None}
        frontier, back = [start], None
        while back is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start and back is None:
                        back = graph[v][w]
                    elif w in group and w not in prev:
                        prev[w] = graph[v][w]
                        nxt.append(w)
            frontier = nxt
        path = [back]
        while (a := prev[path[-1].src]) is not None:
            path.append(a)
        out.append(path[::-1])
    return sorted(out, key=lambda c: c[0].src)


def describe(cycle: list[Arrow]) -> str:
    return " -> ".join([a.src for a in cycle] + [cycle[0].src]) + "\n      " + "\n      ".join(
        f"{a.path}:{a.line}: imports {a.dst}{' (inside a function)' if a.in_function else ''}" for a in cycle)


def heavy_modules(root: Path, arrows: list[Arrow], files: list[str] | None = None) -> set[str]:
    """Project modules whose import loads a HEAVY_LIBS library, by their own top-level imports or a project
    module's they import at the top."""
    root = Path(root)
    files = walk_python_files(root) if files is None else files
    heavy = set()
    for rel in files:
        for node in ast.parse((root / rel).read_text(encoding="utf-8")).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            if any(n.split(".")[0] in HEAVY_LIBS for n in names):
                heavy.add(module_name(rel))
    top = [a for a in arrows if not a.in_function]
    while True:
        more = {a.src for a in top if a.dst in heavy} - heavy
        if not more:
            return heavy
        heavy |= more


def lazy_light_imports(root: Path, arrows: list[Arrow], files: list[str] | None = None) -> list[Arrow]:
    heavy = heavy_modules(root, arrows, files)
    return sorted({a for a in arrows if a.in_function and a.dst not in heavy and not a.private},
                  key=lambda a: (a.path, a.line))


@functools.lru_cache(maxsize=1)
def project_arrows() -> tuple[list[str], list[Arrow]]:
    files = [p for p in python_files() if p.split("/")[0] != "tests"]
    return files, scan(ROOT, files)


def test_no_import_cycle():
    files, arrows = project_arrows()
    assert {"train", "training.loop.trainer", "retrieval.server", "bench.learning_proof"} <= {a.src for a in arrows}
    seen = {a.dst for a in arrows} | {a.src for a in arrows}
    assert {"bench.report", "scripts.gpu_check", "dataprep.protocol"} <= seen   # every folder is read
    found = cycles(arrows)
    assert not found, ("import cycles (imports inside functions count; move what both sides need to a module "
                       "below them):\n  " + "\n  ".join(describe(c) for c in found))


def test_no_private_name_crosses_modules():
    _, arrows = project_arrows()
    bad = sorted({f"{a.path}:{a.line}: {a.private} of {a.dst}" for a in arrows if a.private})
    assert not bad, "private names used by another module (make them public):\n  " + "\n  ".join(bad)


def test_retrieval_knows_no_generation_or_training():
    _, arrows = project_arrows()
    bad = [f"{a.path}:{a.line}: imports {a.dst}" for a in arrows
           if a.src.split(".")[0] == "retrieval" and a.dst.split(".")[0] in ("inference", "training")]
    assert not bad, "retrieval/ imports inference/ or training/:\n  " + "\n  ".join(bad)


def test_project_modules_are_imported_at_the_top():
    files, arrows = project_arrows()
    # live: train.py imports the trainer (torch) inside main(), which is allowed because the trainer is heavy
    assert ("train.py", "training.loop.trainer") in {(a.path, a.dst) for a in arrows if a.in_function}
    assert "training.loop.trainer" in heavy_modules(ROOT, arrows, files)
    bad = [f"{a.path}:{a.line}: {a.dst}" for a in lazy_light_imports(ROOT, arrows, files)]
    assert not bad, ("project modules imported inside a function though importing them loads no heavy library "
                     "(HEAVY_LIBS); import them at the top:\n  " + "\n  ".join(bad))


PLANTED = {
    "pkg/__init__.py": "",
    "pkg/a.py": "def f():\n    from pkg import b   # a submodule, inside a function\n    return b\n",
    "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n",
    "pkg/c.py": "import os\nimport pkg.a as first\n_hidden = 1\nvisible = 2\n",
    "pkg/d.py": "from pkg.c import _hidden, visible\n",
    "pkg/e.py": "from pkg import c\nimport pkg.c\nx = c._hidden + pkg.c._hidden + c.visible\n",
    "pkg/f.py": "import torch\n",
    "pkg/g.py": "def f():\n    from pkg import f, d\n",
    "top.py": "def main():\n    from pkg.sub.deep import thing\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/deep.py": "from .. import d\nfrom ..c import visible\nthing = visible\n",
    "tests/test_x.py": "from pkg.c import _hidden\nimport top\n",   # tests/ is not scanned
}


def plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checker_finds_a_planted_cycle_and_private_imports(tmp_path):
    root = plant(tmp_path, PLANTED)
    arrows = scan(root)
    assert {(a.src, a.dst) for a in arrows} == {
        ("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"), ("pkg.d", "pkg.c"), ("pkg.e", "pkg.c"),
        ("pkg.g", "pkg.f"), ("pkg.g", "pkg.d"), ("top", "pkg.sub.deep"), ("pkg.sub.deep", "pkg.d"),
        ("pkg.sub.deep", "pkg.c")}
    [cycle] = cycles(arrows)
    assert [a.src for a in cycle] == ["pkg.a", "pkg.b", "pkg.c"]
    assert describe(cycle).startswith("pkg.a -> pkg.b -> pkg.c -> pkg.a\n      pkg/a.py:2: imports pkg.b (inside")
    assert sorted((a.path, a.line, a.private) for a in arrows if a.private) == [
        ("pkg/d.py", 1, "_hidden"), ("pkg/e.py", 3, "_hidden"), ("pkg/e.py", 3, "_hidden")]
    assert heavy_modules(root, arrows) == {"pkg.f"}
    assert [(a.path, a.dst) for a in lazy_light_imports(root, arrows)] == [
        ("pkg/a.py", "pkg.b"), ("pkg/g.py", "pkg.d"), ("top.py", "pkg.sub.deep")]   # pkg.f loads torch: lazy is right


def test_the_checker_passes_the_same_package_without_the_planted_arrows(tmp_path):
    root = plant(tmp_path, {**PLANTED, "pkg/c.py": "import os\n_hidden = 1\nvisible = 2\n",
                            "pkg/d.py": "from pkg.c import visible\n",
                            "pkg/e.py": "from pkg import c\nx = c.visible\n"})
    arrows = scan(root)
    assert ("pkg.a", "pkg.b") in {(a.src, a.dst) for a in arrows}
    assert cycles(arrows) == [] and not [a for a in arrows if a.private]


# ----------------------------------------------------------------------------- training/'s rooms (issue 43)

def upward_room_arrows(arrows: list[Arrow], package: str, rooms: tuple[str, ...]) -> list[Arrow]:
    """Arrows from one room of `package` to a room later in `rooms` (lowest first), and modules of `package`
    that sit in no room (a module dropped at the package's top, outside every room, is refused too)."""
    order = {r: i for i, r in enumerate(rooms)}

    def room(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[1] if len(parts) > 1 and parts[0] == package else None

    bad = []
    for a in arrows:
        src, dst = room(a.src), room(a.dst)
        if src is None or dst is None:
            continue
        if src not in order or dst not in order or order[dst] > order[src]:
            bad.append(a)
    return bad


def test_no_room_of_training_imports_a_room_above_it():
    from training import ROOMS
    files, arrows = project_arrows()
    rooms = {p.split("/")[1] for p in files if p.startswith("training/") and p.count("/") == 2}
    assert rooms == set(ROOMS), f"training/ holds these rooms: {sorted(rooms)}; training.ROOMS names {ROOMS}"
    loose = [p for p in files if p.startswith("training/") and p.count("/") == 1 and p != "training/__init__.py"]
    assert not loose, f"modules outside every room of training/ (move each into one): {loose}"
    for r in ROOMS:   # each room says in one line what it holds
        doc = ast.get_docstring(ast.parse((ROOT / "training" / r / "__init__.py").read_text()))
        assert doc and "\n" not in doc.strip(), f"training/{r}/__init__.py needs a one-line docstring"
    bad = [f"{a.path}:{a.line}: {a.src} imports {a.dst}" for a in upward_room_arrows(arrows, "training", ROOMS)]
    assert not bad, (f"a room of training/ imports a room above it (order, lowest first: {', '.join(ROOMS)}); "
                     "move the shared part down:\n  " + "\n  ".join(bad))


def test_the_room_check_sees_an_upward_import(tmp_path):
    root = plant(tmp_path, {"pkg/__init__.py": "", "pkg/low/__init__.py": "", "pkg/high/__init__.py": "",
                            "pkg/low/a.py": "def f():\n    from pkg.high import b\n",
                            "pkg/high/b.py": "from pkg.low import a\n", "pkg/high/c.py": "from pkg.high import b\n",
                            "pkg/stray.py": "from pkg.low import a\n"})
    bad = upward_room_arrows(scan(root), "pkg", ("low", "high"))
    assert sorted((a.src, a.dst) for a in bad) == [("pkg.low.a", "pkg.high.b"), ("pkg.stray", "pkg.low.a")]
