"""Every shell line of the docs works as written: each line of a ```bash block in README.md and docs/*.md,
run on CPU in its cheapest form that still fails when the line is wrong (issue 42).

The lines are read from the docs at test time, so a changed or new line is checked as it stands. Each is
split at `&&` / `;` / `|` (a trailing `&` is dropped), its `VAR=value` prefix kept, and run by kind:

  * `bash scripts/X.sh` of a script that takes DRY_RUN (itself or the script it sources): run with
    DRY_RUN=1, a stand-in `deepspeed` on PATH recording what the launcher would get; those train.py flags
    and the launcher's are then parsed as below. A script that takes PRINT (setup_gpu.sh) runs with PRINT=1.
  * any other script: `bash -n` on it. The demo, the learning proof and the retriever run whole in
    tests/test_demo_script.py, tests/test_learning_proof_script.py and tests/test_readme_gpu_quickstart.py;
    scripts/test.sh is the suite itself; scripts/build_index.sh takes minutes and no cheap mode.
  * `python F.py ...`, `python -m M ...`, `torchrun ... F.py ...`, `deepspeed ... F.py ...`: the launcher's
    flags through the launcher's own parser, and the entry point's flags through its own (the script runs
    as __main__ until its first ArgumentParser.parse_args, which parses and stops it): an unknown or
    renamed flag fails. `...` in a line stands for "more flags" and is dropped.
  * `source VENV/bin/activate`: a setup script creates that virtualenv by default.
  * `pip install -r F`: F exists. Anything else: `bash -n`.
Every line: the repo files it names (scripts/, training/, ..., train.py, requirements*.txt) exist.

The variables the docs ask a user to set ($MODEL, $HOSTFILE, $RUN, ...) get stand-ins; a new variable
without one fails the test, naming it. The heavy end-to-end runs live elsewhere and are not repeated here:
tests/test_readme_gpu_quickstart.py (the GPU quick start, whole), tests/test_scripts.py (each per-size
script through the real launcher), tests/test_demo_script.py (the demo).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from utils.dist import free_port

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(?:bash|sh|shell)[ \t]*\n(.*?)^\1```", re.M | re.S)
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
REPO_PATH = re.compile(r"^(?:scripts|training|inference|retrieval|dataprep|utils|bench|tests|docs)/|"
                       r"^(?:train|eval)\.py$|^requirements[\w-]*\.txt$")


@dataclass
class DocLine:
    where: str   # file:line
    text: str


def doc_lines(docs: list[Path] = DOCS, root: Path = REPO) -> list[DocLine]:
    """The shell lines of every ```bash block (continuations joined, comment-only lines left out)."""
    out = []
    for doc in docs:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            first_line = text[:m.start(2)].count("\n") + 1
            buf, start = "", None
            for i, raw in enumerate(m.group(2).splitlines()):
                line = raw[len(m.group(1)):] if raw.startswith(m.group(1)) else raw.lstrip()
                start = first_line + i if start is None else start
                line = line.lstrip() if buf else line
                if line.rstrip().endswith("\\"):
                    buf += line.rstrip()[:-1].rstrip() + " "
                    continue
                buf += line
                if shlex.split(buf, comments=True):
                    out.append(DocLine(f"{doc.relative_to(root)}:{start}", buf.strip()))
                buf, start = "", None
    return out


def commands(line: str) -> list[list[str]]:
    """The simple commands of a line: its words split at && ; | (a background & dropped), quotes removed."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split, lex.commenters = True, "#"
    out, cur = [], []
    for tok in lex:
        if tok and set(tok) <= set(";&|"):
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [c for c in out + [cur] if c]


_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand(word: str, env: dict, missing: set) -> str:
    """$X, ${X} and ${X:-default} from `env` (a stand-in for what a user sets); an unknown one is noted."""
    def sub(m):
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        missing.add(name)
        return f"<{name}>"
    return _VAR.sub(sub, word)


# ----------------------------------------------------------------------------- stand-ins

def standin_run(root: Path, index: str, retriever_url: str, hf: Path | None = None, **rollout) -> Path:
    """A finished train.py run folder: its config.json (a retriever at `retriever_url`, the index `index`),
    checkpoints/step_000001/hf (the model `hf`, else an HF config only) and checkpoints/latest."""
    from training.settings.config import Config

    cfg = Config()
    cfg.model.dtype, cfg.search.index, cfg.search.retriever_url = "fp32", index, retriever_url
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    ck = root / "checkpoints" / "step_000001"
    ck.mkdir(parents=True)
    if hf is None:
        (ck / "hf").mkdir()
        (ck / "hf" / "config.json").write_text('{"model_type": "llama"}\n')
    else:
        (ck / "hf").symlink_to(hf, target_is_directory=True)
    (root / "checkpoints" / "latest").write_text("step_000001")
    (root / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    return root


def stopped_url() -> str:
    """A retriever URL at which nothing answers: a free port, as the demo's 8765 after it exits."""
    return f"http://127.0.0.1:{free_port()}"


def standins(tmp: Path) -> tuple[dict, dict]:
    """({variable: value} for what the docs ask a user to set, {literal path in a doc: its stand-in})."""
    (tmp / "hostfile").write_text("localhost slots=8\n")
    judge = tmp / "judge"
    judge.mkdir()
    (judge / "config.json").write_text('{"model_type": "qwen2"}\n')
    index = tmp / "bm25"
    index.mkdir()
    (index / "manifest.json").write_text("{}\n")
    run = standin_run(tmp / "run", str(index), stopped_url())
    env = {"SR1": str(tmp / "searchr1"), "E5": str(tmp / "e5-base-v2"), "IDX": str(tmp / "e5_wiki18"),
           "JUDGE": str(judge), "MODEL": "Qwen/Qwen2.5-7B-Instruct", "ROWS": str(tmp / "rows.jsonl"),
           "HOSTFILE": str(tmp / "hostfile"), "RUN": str(run)}
    literal = {"hostfile": str(tmp / "hostfile"), "runs/demo_cpu": str(run)}
    return env, literal


def fake_launcher(tmp: Path) -> tuple[Path, Path]:
    """A `deepspeed` that writes its arguments (NUL-separated) to a file and exits 0: (its folder, that file)."""
    bin_dir, record = tmp / "fakebin", tmp / "deepspeed.argv"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > {record}\n')
    (bin_dir / "deepspeed").chmod(0o755)
    return bin_dir, record


# ----------------------------------------------------------------------------- parsing with the real parsers

# Runs in one child process: each job's launcher flags through the launcher's parser, then the entry point
# run as __main__ until its first ArgumentParser.parse_args, which parses (an unknown flag exits 2) and stops.
PARSER = r'''
import argparse, contextlib, io, json, os, runpy, sys
repo, jobs = sys.argv[1], json.load(sys.stdin)
class Parsed(Exception):
    pass
real = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_then_stop
def attempt(fn):
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            fn()
    except Parsed:
        return None
    except SystemExit as e:
        return None if e.code in (0, None) else f"exit {e.code}: {err.getvalue().strip()[-1500:]}"
    except BaseException as e:
        return f"{type(e).__name__}: {e} {err.getvalue().strip()[-1000:]}"
    return "it ended without parsing a command line (no ArgumentParser.parse_args reached)"
def launcher(job):
    argv = job["launcher_args"] + [job["path"] or job["module"]] + job["args"]
    if job["launcher"] == "torchrun":
        from torch.distributed.run import get_args_parser
        get_args_parser().parse_args(argv)
    else:
        from deepspeed.launcher.runner import parse_args
        parse_args(argv)
def entry(job):
    argv, path = sys.argv[:], sys.path[:]
    try:
        sys.argv = [job["path"] or job["module"], *job["args"]]
        if job["module"]:
            sys.path[0] = repo
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.join(repo, job["path"]))
            runpy.run_path(os.path.join(repo, job["path"]), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
out = []
for job in jobs:
    err = attempt(lambda: launcher(job)) if job["launcher"] else None
    if err:
        err = job["launcher"] + "'s flags: " + err
    else:
        err = attempt(lambda: entry(job))
        err = err and (job["path"] or job["module"]) + "'s flags: " + err
    out.append(err)
sys.__stdout__.write("\nPARSED " + json.dumps(out) + "\n")
'''


def parse_job(words: list[str], launcher: str | None = None) -> dict | str:
    """A parse job for `[launcher flags...] (F.py | -m M) flags...` (the words after python/torchrun/deepspeed),
    or why none can be made."""
    i = 0
    launcher_args = []
    if launcher:
        while i < len(words) and not words[i].endswith(".py") and words[i] not in ("-m", "--module"):
            launcher_args.append(words[i])
            i += 1
    if i < len(words) and words[i] in ("-m", "--module") and i + 1 < len(words):
        path, module, i = None, words[i + 1], i + 2
    elif i < len(words) and words[i].endswith(".py"):
        path, module, i = words[i], None, i + 1
    else:
        return f"no entry point (F.py or -m M) in {' '.join(words)!r}"
    return {"launcher": launcher, "launcher_args": launcher_args, "path": path, "module": module,
            "args": [w for w in words[i:] if w != "..."]}


def run_parse_jobs(jobs: list[dict]) -> list[str | None]:
    if not jobs:
        return []
    r = subprocess.run([sys.executable, "-c", PARSER, str(REPO)], input=json.dumps(jobs), cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1"))
    assert "\nPARSED " in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.rsplit("\nPARSED ", 1)[1])


def _takes(script: Path, var: str) -> bool:
    """Whether a script reads `var` (DRY_RUN, PRINT), itself or in a script it sources."""
    text = script.read_text()
    sourced = re.findall(r"^\s*(?:source|\.)\s+.*?(\w+\.sh)", text, re.M)
    return any(re.search(rf"\$\{{{var}\b|\${var}\b", (script.parent / s).read_text() if s != script.name else text)
               for s in [script.name, *sourced] if (script.parent / s).is_file())


def _venv_defaults() -> set[str]:
    """The virtualenv folders the setup scripts create by default."""
    return {m for f in (REPO / "scripts").glob("setup_*.sh") for m in re.findall(r"VENV=\$\{VENV:-([^}]+)\}", f.read_text())}


# ----------------------------------------------------------------------------- the test

def check_doc_lines(lines: list[DocLine], tmp: Path) -> tuple[list[str], dict[str, list[str]]]:
    """(failures as 'file:line: line -> why', {kind: [file:line, ...]})."""
    env_vars, literal = standins(tmp)
    bin_dir, record = fake_launcher(tmp)
    base_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DS_ACCELERATOR="cpu",
                    PY=sys.executable, PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                                             f"{os.environ['PATH']}")  # the stand-ins only expand the line
    base_env.pop("DRY_RUN", None)
    base_env.pop("PRINT", None)
    failures, kinds, jobs = [], {}, []   # jobs: (doc line, parse job), parsed together at the end

    def fail(dl: DocLine, why: str) -> None:
        failures.append(f"{dl.where}: {dl.text}\n    -> {why}")

    def run_script(argv: list[str], assigns: dict) -> tuple[str, dict | None, str | None]:
        """`bash scripts/X.sh ...` in its cheap form: (kind, the launcher's parse job or None, why it failed)."""
        script = REPO / argv[0]
        dry, printed = _takes(script, "DRY_RUN"), _takes(script, "PRINT")
        if not (dry or printed):
            r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            return "bash -n", None, f"bash -n {argv[0]}: {r.stderr.strip()}" if r.returncode else None
        record.unlink(missing_ok=True)
        env = {**base_env, "OUT_DIR": str(tmp / f"eval_{time.monotonic_ns()}"), **assigns,
               **({"DRY_RUN": "1"} if dry else {"PRINT": "1"})}
        r = subprocess.run(["bash", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        kind = "DRY_RUN=1" if dry else "PRINT=1"
        if r.returncode:
            return kind, None, f"exit {r.returncode}: {(r.stdout + r.stderr)[-2000:]}"
        if not record.exists():
            return kind, None, None
        # what the stand-in launcher got: its flags and train.py's, parsed with the rest
        job = parse_job(record.read_text().split("\0")[:-1], launcher="deepspeed")
        return (kind, None, f"the launcher got {job}") if isinstance(job, str) else (kind, job, None)

    for dl in lines:
        r = subprocess.run(["bash", "-n", "-c", dl.text], capture_output=True, text=True)
        if r.returncode:
            fail(dl, f"bash -n: {r.stderr.strip()}")
            continue
        for words in commands(dl.text):
            missing: set = set()
            assigns = {}
            while words and ASSIGN.match(words[0]):
                k, v = words.pop(0).split("=", 1)
                assigns[k] = literal.get(v, expand(v, env_vars, missing))
            words = [literal.get(w, w) for w in (expand(w, env_vars, missing) for w in words)]
            if missing:
                fail(dl, f"no stand-in for ${', $'.join(sorted(missing))}: add one to standins()")
                continue
            for w in words:  # the repo files a line names (also as --flag=FILE)
                path = w.split("=", 1)[-1]
                if REPO_PATH.match(path) and not (REPO / path).exists():
                    fail(dl, f"{path} does not exist")
            if not words:
                continue
            cmd, rest = words[0], words[1:]
            if cmd in ("python", "python3") and rest[:2] == ["-m", "pip"]:
                cmd, rest = "pip", rest[2:]
            if cmd == "bash" and rest and rest[0].startswith("scripts/"):
                if (REPO / rest[0]).is_file():  # a missing one is named above
                    kind, job, why = run_script(rest, assigns)
                    kinds.setdefault(kind, []).append(dl.where)
                    if why:
                        fail(dl, why)
                    elif job:
                        jobs.append((dl, job))
            elif cmd in ("python", "python3", "torchrun", "deepspeed"):
                kinds.setdefault("flags parsed", []).append(dl.where)
                job = parse_job(rest, launcher=None if cmd.startswith("python") else cmd)
                if isinstance(job, str):
                    fail(dl, job)
                else:
                    jobs.append((dl, job))
            elif cmd in ("source", "."):
                kinds.setdefault("virtualenv", []).append(dl.where)
                m = re.fullmatch(r"(.+)/bin/activate", rest[0] if rest else "")
                if not m or m.group(1) not in _venv_defaults():
                    fail(dl, f"{rest} is no virtualenv a scripts/setup_*.sh creates ({sorted(_venv_defaults())})")
            elif cmd in ("pip", "apt-get", "apt"):
                kinds.setdefault("install", []).append(dl.where)
                for f in (a for i, a in enumerate(rest) if i and rest[i - 1] in ("-r", "--requirement")):
                    if not (REPO / f).is_file():
                        fail(dl, f"{f} does not exist")
            else:
                kinds.setdefault("bash -n", []).append(dl.where)
    for (dl, job), err in zip(jobs, run_parse_jobs([j for _, j in jobs])):
        if err:
            fail(dl, err)
    return failures, kinds


def test_doc_lines_are_found(tmp_path):
    """Continuations joined, comment lines dropped, a list item's indented block read, other languages not."""
    md = tmp_path / "x.txt"
    md.write_text("text\n```bash\n# a comment\nA=1 bash scripts/eval.sh   # why\npython train.py --a 1 \\\n"
                  "    --b 2\n```\n1. item\n   ```bash\n   python -m m --c\n   ```\n```python\nx = 1\n```\n")
    assert [(d.where, d.text) for d in doc_lines([md], tmp_path)] == [
        ("x.txt:4", "A=1 bash scripts/eval.sh   # why"), ("x.txt:5", "python train.py --a 1 --b 2"),
        ("x.txt:10", "python -m m --c")]
    assert commands("a=1 b && c d & e; f | g") == [["a=1", "b"], ["c", "d"], ["e"], ["f"], ["g"]]
    found = {d.where.split(":")[0] for d in doc_lines()}
    assert {"README.md", "docs/training.md", "docs/retrieval.md"} <= found, found


@pytest.mark.timeout(300)
def test_every_doc_shell_line_runs_in_its_cheap_form(tmp_path):
    lines = doc_lines()
    failures, kinds = check_doc_lines(lines, tmp_path)
    assert not failures, f"{len(failures)} doc line(s) fail:\n" + "\n".join(failures)
    # every kind of check ran: the flags of python / torchrun / deepspeed lines, the DRY_RUN scripts, the install
    assert {"flags parsed", "DRY_RUN=1", "PRINT=1", "virtualenv"} <= set(kinds), kinds


def test_a_wrong_doc_line_fails(tmp_path):
    """The checks bite: a renamed flag, a missing script, an unknown variable, a bad launcher flag."""
    bad = [DocLine("x:1", "python train.py --model_pathh m"), DocLine("x:2", "bash scripts/no_such.sh"),
           DocLine("x:3", "python eval.py --model m --no_such_flag"), DocLine("x:4", "MODEL=$NOPE bash scripts/eval.sh"),
           DocLine("x:5", "torchrun --nproc_per_gpu 2 train.py"),
           DocLine("x:6", "DRY_RUN=1 bash scripts/train_qwen2.5_7b_base.sh $HOSTFILE --no_such_flag 1"),
           DocLine("x:7", "python -m retrieval.build_index --corpuss c")]
    failures, _ = check_doc_lines(bad, tmp_path)
    by_line = {f.split(":")[1]: f for f in failures}
    assert sorted(by_line) == ["1", "2", "3", "4", "5", "6", "7"], "\n".join(failures)
    assert "--model_pathh" in by_line["1"] and "scripts/no_such.sh does not exist" in by_line["2"]
    assert "no stand-in for $NOPE" in by_line["4"] and "torchrun's flags" in by_line["5"]
    assert "train.py's flags" in by_line["6"] and "--no_such_flag" in by_line["6"]


# ----------------------------------------------------------------------------- the fixes behind the lines

def test_eval_sh_on_a_run_whose_retriever_stopped(tmp_path, tiny_model_dir):
    """README's `MODEL=runs/demo_cpu bash scripts/eval.sh`: the demo's retriever (port 8765) is gone once the
    demo exits, so eval.py searches the run's index instead of waiting 300 s for it, and says so."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(line for _, line in zip(range(40), (REPO / "data/corpus/wiki.jsonl").open())))
    subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(corpus), "--out",
                    str(tmp_path / "bm25"), "--kind", "bm25"], cwd=REPO, check=True, capture_output=True)
    url = stopped_url()
    run = standin_run(tmp_path / "run", str(tmp_path / "bm25"), url, hf=tiny_model_dir, max_turns=2,
                      max_tokens_per_turn=8, max_total_tokens=512, max_model_len=1024)
    env = dict(os.environ, MODEL=str(run), ENGINE="hf", LIMIT="1", DATA="data/eval/capitals.jsonl",
               OUT_DIR=str(tmp_path / "eval"), PY=sys.executable, OMP_NUM_THREADS="1")
    t0 = time.time()
    r = subprocess.run(["bash", "scripts/eval.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert time.time() - t0 < 200 and f"nothing answers at the run's retriever {url}" in out
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    s = res["settings"]
    assert res["overall"]["n"] == 1 and "bm25 index at" in res["protocol"]["retriever"]
    assert s["index"] == {"value": str(tmp_path / "bm25"), "source": f"run config.json (its retriever_url {url} did not answer)"}
    assert "retriever_url" not in s
    # a run whose index is not here either: one message at once, naming the fixes
    gone = standin_run(tmp_path / "gone", str(tmp_path / "no_index"), url)
    r = subprocess.run(["bash", "scripts/eval.sh"], cwd=REPO, env=dict(env, MODEL=str(gone), DRY_RUN="1", OUT_DIR=str(tmp_path / "eval2")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--retriever_url URL or --index DIR" in r.stderr, r.stdout + r.stderr


def test_eval_sh_uses_the_venv_it_is_given(tmp_path):
    """scripts/eval.sh runs VENV's python, else the active virtualenv's (the GPU quick start's .venv-gpu)."""
    def venv(name: str) -> Path:
        b = tmp_path / name / "bin"
        b.mkdir(parents=True)
        (b / "python").write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path / name}.log\nexec {sys.executable} "$@"\n')
        (b / "python").chmod(0o755)
        return tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in ("PY", "VENV", "VIRTUAL_ENV")}
    (tmp_path / "bm25").mkdir()
    (tmp_path / "bm25" / "manifest.json").write_text("{}\n")
    env.update(DRY_RUN="1", DATA="data/eval/capitals.jsonl", OUT_DIR=str(tmp_path / "ev"), MODEL=str(tmp_path),
               INDEX=str(tmp_path / "bm25"))
    for extra, name in (({"VENV": str(venv("a"))}, "a"), ({"VIRTUAL_ENV": str(venv("b"))}, "b")):
        r = subprocess.run(["bash", "scripts/eval.sh"], cwd=REPO, env={**env, **extra},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "eval.sh: dry run: ok" in r.stdout and "fall_back_from_a_stopped_retriever" in (tmp_path / f"{name}.log").read_text()


# ----------------------------------------------------------------------------- what the GPU install holds

BUILTIN_MARKS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
PLUGIN_OF_MARK = {"timeout": "pytest-timeout"}


def _requirement_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[<>=!~\[; ]", line, 1)[0].lower().replace("_", "-"))
    return names


def test_the_gpu_install_can_run_the_gpu_tests(tmp_path):
    """scripts/gpu_check.sh runs `pytest -m gpu` in the venv scripts/setup_gpu.sh makes: that install holds
    pytest and the plugin of every marker the GPU test files use (pytest.ini's --strict-markers refuses an
    unknown one)."""
    r = subprocess.run(["bash", "scripts/setup_gpu.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PRINT="1", VENV=str(tmp_path / "venv-gpu")))
    assert r.returncode == 0, r.stderr
    files = re.findall(r"install (?:--no-deps )?-r (\S+)", r.stdout)
    assert "requirements.txt" in files, r.stdout
    have = set().union(*(_requirement_names(REPO / f) for f in files))
    registered = set(re.findall(r"^\s+(\w+):", (REPO / "pytest.ini").read_text().split("markers =", 1)[1], re.M))
    gpu_files = [f for f in (REPO / "tests").rglob("test_*.py") if "pytest.mark.gpu" in f.read_text()]
    assert gpu_files
    marks = set().union(*(re.findall(r"pytest\.mark\.(\w+)", f.read_text()) for f in gpu_files))
    unknown = marks - BUILTIN_MARKS - registered - set(PLUGIN_OF_MARK)
    assert not unknown, f"markers with no known plugin: {unknown}; add them to PLUGIN_OF_MARK"
    need = {"pytest"} | {PLUGIN_OF_MARK[m] for m in marks & set(PLUGIN_OF_MARK)}
    assert need <= have, f"the GPU install ({', '.join(files)}) lacks {sorted(need - have)}"
