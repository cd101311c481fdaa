"""Check a user's own files before anything is built or trained (issue 42): each one read whole by the reader
that will read it (docs/data.md), and every problem reported in one message that names the file, the line and
the field, so a typo costs seconds. No torch, no model, no index is loaded.

    python -m dataprep.check_inputs --train_data answers.jsonl --corpus corpus.jsonl \\
        --qa_data qa.jsonl --eval_data dev.jsonl test.jsonl --index runs/mine/index/bm25 --model runs/demo_cpu/sft/hf

scripts/own_data_cpu.sh (CPU) and scripts/train_common.sh (the per-size GPU scripts) run it first, DRY_RUN=1
included. It prints one line per input (rows, a few of them) and exits 0, or prints every problem and exits 2.
With --missing_ok (the GPU scripts' DRY_RUN=1, which may run on a login node) a file not on this machine is listed
as not checked, as train.py --dry_run lists it, instead of refused.
An --index or --model folder that does not exist yet is not a problem (the scripts build the index from
--corpus and the SFT export from the demo's data); one that exists must be finished and, for an index, built
from this --corpus, not another.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from inference.data import load_eval_rows, load_proposer_rows
from retrieval.corpus import iter_corpus
from retrieval.manifest import check_index as check_index_folder
from training.settings.input_checks import model_folder_errors
from utils.errors import InputError, entry_point_error

DOCS = "docs/data.md"
KINDS = {  # flag: (what it is, its section of docs/data.md)
    "--train_data": ("proposer answer rows", "proposer-answer-rows"),
    "--qa_data": ("labelled QA rows", "labelled-qa-rows"),
    "--eval_data": ("an eval set", "eval-sets"),
    "--corpus": ("the corpus", "the-corpus"),
}


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _where(flag: str) -> str:
    what, anchor = KINDS[flag]
    return f"{flag} ({what}, {DOCS}#{anchor})"


def _texts(answer) -> list[str]:
    return [answer] if isinstance(answer, str) else [str(a) for a in answer]


def check_rows(flag: str, path: str, loader) -> tuple[str | None, str | None, list]:
    """(a summary line, None, the rows) or (None, the problem, [])."""
    try:
        rows = loader(path)
    except InputError as e:
        return None, f"{_where(flag)}: {e}", []
    if flag == "--train_data":
        turns = sorted({r.search_turns for r in rows})
        first = ", ".join(repr(_texts(r.answer)[0]) for r in rows[:3])
        return (f"{flag} {path}: {_n(len(rows), 'answer')}, search_turns {turns[0]}-{turns[-1]} (first: {first})",
                None, rows)
    sources = sorted({r.data_source for r in rows})
    first = rows[0]
    return (f"{flag} {path}: {_n(len(rows), 'question')}, data_source {', '.join(sources[:6])}"
            f"{' ...' if len(sources) > 6 else ''} (first: {first.question!r} -> {first.golden_answers[:2]})"), None, rows


def check_corpus(path: str, max_docs: int) -> tuple[str | None, str | None, list[str]]:
    """The first `max_docs` documents read as the index builder reads them (0 = every one): (line, problem, docs)."""
    try:
        docs = list(itertools.islice((c for _, batch in iter_corpus(path) for c in batch), max_docs or None))
    except InputError as e:
        return None, f"{_where('--corpus')}: {e}", []
    if not docs:
        return None, f"{_where('--corpus')}: {path} holds no documents", []
    titled = sum("\n" in d for d in docs)
    note = "" if titled else (" (none has a title line: the title heuristics and --shortcut_filter title read the "
                              "first line as the title)")
    read = "every document" if max_docs == 0 or len(docs) < max_docs else f"the first {len(docs)} documents"
    return f"--corpus {path}: {read} read, {titled} with a title line{note}", None, docs


def answers_found(rows: list, docs: list[str], n: int = 50) -> str:
    """How many of the first n answers occur in the documents read (a hint, never a refusal: the RAG check refuses
    a question its documents cannot answer, so answers the corpus never states give the proposer nothing)."""
    text = "\n".join(docs).lower()
    some = rows[:n]
    found = sum(any(t.lower() in text for t in _texts(r.answer) if t) for r in some)
    hint = "" if found == len(some) else (" (an answer the corpus never states makes every question about it "
                                          "unanswerable: the RAG check refuses it)")
    return f"answers in the corpus: {found} of the first {len(some)} occur in the documents read{hint}"


def check_index(index: str, corpus: str | None) -> str | None:
    """A finished index built from `corpus` (when both are given), or no folder yet."""
    if not Path(index).exists():
        return None
    try:
        m = check_index_folder(index)
    except InputError as e:
        return f"--index {index}: {e}"
    built = m.get("corpus")
    if corpus and built and Path(built).resolve() != Path(corpus).resolve():
        return (f"--index {index} was built from {built}, not from --corpus {corpus}: give another folder (a new OUT),"
                f" or delete {index} to build it again from {corpus}")
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dataprep.check_inputs",
                                 description="read a user's files with the project's own readers, and say what is "
                                             "wrong with each (formats: docs/data.md)")
    ap.add_argument("--train_data", help="proposer answer rows (answer, search_turns)")
    ap.add_argument("--qa_data", help="labelled QA rows (question, golden_answers, data_source)")
    ap.add_argument("--eval_data", nargs="*", default=[], help="eval sets (labelled QA rows), one or more files")
    ap.add_argument("--corpus", help="the corpus (id, contents: title on the first line)")
    ap.add_argument("--corpus_docs", type=int, default=100_000,
                    help="documents of the corpus read here (0 = all; the index build reads every one)")
    ap.add_argument("--index", help="the index folder the run will search (checked when it exists)")
    ap.add_argument("--model", help="the model folder the run will start from (checked when it exists)")
    ap.add_argument("--missing_ok", action="store_true",
                    help="list a file that is not on this machine instead of refusing it (a GPU script's dry run on a "
                         "login node, as train.py --dry_run does)")
    return ap


def check(a: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(summary lines, problems)."""
    lines, errs = [], []

    def take(result):
        line, err, got = result
        lines.extend([line] if line else [])
        errs.extend([err] if err else [])
        return got

    def here(flag: str, path: str | None) -> bool:
        """Whether to read `path`: given, and on this machine (--missing_ok: one that is not is listed, not refused)."""
        if path and a.missing_ok and not Path(path).exists():
            lines.append(f"{flag} {path}: not on this machine, not checked here")
            return False
        return bool(path)

    answers = take(check_rows("--train_data", a.train_data, load_proposer_rows)) \
        if here("--train_data", a.train_data) else []
    if here("--qa_data", a.qa_data):
        take(check_rows("--qa_data", a.qa_data, load_eval_rows))
    for f in a.eval_data:
        if here("--eval_data", f):
            take(check_rows("--eval_data", f, load_eval_rows))
    docs = take(check_corpus(a.corpus, a.corpus_docs)) if here("--corpus", a.corpus) else []
    if answers and docs:
        lines.append(answers_found(answers, docs))
    if a.index:
        err = check_index(a.index, a.corpus)
        errs.extend([err] if err else [])
    if a.model and Path(a.model).exists():
        errs.extend(model_folder_errors(a.model, flag="--model"))
    return lines, errs


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    lines, errs = check(a)
    for line in lines:
        print(f"  ok: {line}")
    if errs:
        return entry_point_error("check_inputs", InputError(
            f"{len(errs)} input(s) cannot be used (formats: {DOCS}):\n  - " + "\n  - ".join(errs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
