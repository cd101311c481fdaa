"""Training rows, cold-start demos and held-out sets that copying a title cannot pass.

    python -m dataprep.reading_sets            # after scripts/prepare_data.py and python -m dataprep.coldstart
    python -m dataprep.reading_sets --force    # rebuild

Reads the corpus facts of dataprep/facts.py and writes (all under data/, git-ignored, each file
written whole or not at all; the same inputs and --seed give byte-identical files):

  data/eval/reading_heldout.jsonl   one question per entity, >= --reading_n entities no training row or demo
                                    touches (one-hop: the answer is a span of the entity's page text)
  data/eval/twohop_heldout.jsonl    >= --twohop_n chains from start entities no training row or demo touches
  data/train/solver_mix.jsonl       rung 1's QA rows: reading facts, two-hop chains and a minority of the
                                    description rows of solver_qa.jsonl (answers that are titles)
  data/train/proposer_mix.jsonl     the proposer's answer pool: proposer.jsonl's titles plus facts' answers
                                    that are no page's title (places, people, languages)
  data/train/coldstart_mix.jsonl    demos: one-search reading demos, two-search chain demos (each
                                    repeated up to CHAIN_DEMO_COPIES times: chains are few), and the
                                    title and proposer demos of coldstart.jsonl, shuffled together

Held-out rows carry "entities" (the entity asked about; for a chain, its start and its bridge), and
training rows and demos carry theirs too: the leak check (dataprep/leak_check.py EvalIndex) bans
every held-out entity from being a training row's entity or answer, on top of its question checks.
A chain's entity is its start; its final fact (bridge, relation) is never also a training question. Facts that restate an
older eval row (a capital asked of the same country, either way round) are dropped.

Demonstrations quote the sentence that holds the answer; in a chain they quote the sentence that
names the bridge entity and name it before the second search. A demo is kept only when each search
(the entity's name, as a solver can copy it from the question) returns the page it reads as Doc 1,
so the quoted sentence is inside the --max_info_tokens cut the rollout applies.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dataprep.facts import BRIDGE_NP, Chain, Fact, chains, corpus_facts, read_corpus
from dataprep.clues import sentences, strip_parens
from dataprep.coldstart import read_jsonl, validate_demo, write_jsonl_atomic
from dataprep.leak_check import EvalIndex, check_no_leak, load_eval_files
from utils.text import normalize_answer

NAMED_RELATIONS = {"capital", "largest_city", "official_language", "located_in", "capital_of", "founded_by",
                   "directed_by", "written_by", "named_after", "discovered_by", "born_in"}
QUOTE_WORDS = 22  # a quoted sentence longer than this is cut to a window around the answer: a turn is 64 tokens
MAX_PER_RELATION = 0.3  # no relation fills more than this share of the training facts (located_in would)
# Chains are few (the corpus yields ~340, and the held-out set takes 150): each training chain's demo is
# repeated up to this many times to fill the mix's two-search share (a fifth of the mix). With one copy,
# 3% of solver demos searched twice and the SFT start never did (two-hop searches/question 1.00).
CHAIN_DEMO_COPIES = 6


def quote(sentence: str, answer: str, max_words: int = QUOTE_WORDS) -> str:
    """The sentence, or a window of it around the answer when it is long."""
    words = sentence.split()
    if len(words) <= max_words:
        return sentence
    na = normalize_answer(answer).split()
    at = next((i for i in range(len(words)) if normalize_answer(" ".join(words[i:i + len(na)])).split() == na), 0)
    lo = max(0, min(at - max_words // 2, len(words) - max_words))
    return ("... " if lo else "") + " ".join(words[lo:lo + max_words]) + (" ..." if lo + max_words < len(words) else "")


def _clean(docs: list[dict]) -> list[dict]:
    return [{"id": str(d.get("id")), "contents": d.get("contents", ""), "score": float(d.get("score", 0.0))}
            for d in docs]


def _demo(question: str, answer: str, source: str, steps: list[tuple[str, list[dict], str]], entities: list[str],
          plan: str = "") -> dict:
    """steps: (query, docs, think before the next action); the last think precedes the answer. plan: a thought
    before the first search (chains: which entity must be found first)."""
    turns, think = [], f"<think> {plan} </think>\n" if plan else ""
    for query, docs, after in steps:
        turns.append({"kind": "model", "text": f"{think}<search> {query} </search>"})
        turns.append({"kind": "info", "docs": _clean(docs)})
        think = f"<think> {after} </think>\n"
    turns.append({"kind": "model", "text": f"{think}<answer> {answer} </answer>"})
    return {"role": "solver", "question": question, "answer": [answer], "source": source, "turns": turns,
            "entities": entities}


def fact_row(f: Fact, rid: str, source: str) -> dict:
    return {"id": rid, "question": f.question, "golden_answers": [f.answer], "data_source": source,
            "relation": f.relation, "entities": [f.entity]}


def chain_row(c: Chain, rid: str, source: str) -> dict:
    """A chain's entity is its start: the bridge (often a country) may be read in training, but never
    for the chain's final relation (see build)."""
    return {"id": rid, "question": c.question, "golden_answers": [c.answer], "data_source": source,
            "relation": f"{c.bridge.relation}>{c.fact.relation}", "entities": [c.bridge.entity],
            "bridge": c.fact.entity}


def restates_eval(f: Fact, old: list[tuple[str, set[str]]]) -> bool:
    """True if an older eval row asks the same pair either way round ("What is the capital of Rwanda?"
    against Kigali's "Of which place is Kigali the capital?")."""
    ne, na = f" {normalize_answer(strip_parens(f.entity))} ", normalize_answer(f.answer)
    return any((na in golden and ne in q) or (ne.strip() in golden and f" {na} " in q) for q, golden in old)


def title_demo_think(demo: dict) -> dict:
    """A coldstart.jsonl title or proposer demo with its templated "Doc k is about X" thought replaced
    by the first sentence of the doc it names (the sentence a reader would quote)."""
    last = demo["turns"][-1]["text"]
    m = re.match(r"<think> Doc (\d+) (?:is about|mentions) .*? </think>\n", last)
    if not m:
        return demo
    docs = demo["turns"][-2]["docs"]
    k = int(m.group(1))
    text = str(docs[k - 1]["contents"]).partition("\n")[2] if 0 < k <= len(docs) else ""
    first = (sentences(text) or [""])[0]
    if not first:
        return demo
    ans = demo["answer"] if isinstance(demo["answer"], str) else demo["answer"][0]
    turns = demo["turns"][:-1] + [{"kind": "model", "text": f"<think> {quote(first, ans)} </think>\n" + last[m.end():]}]
    return {**demo, "turns": turns}


@dataclasses.dataclass
class Built:
    reading_heldout: list[dict]
    twohop_heldout: list[dict]
    solver_mix: list[dict]
    proposer_mix: list[dict]
    demos: list[dict]
    stats: Counter


def build(pages: list[dict], tok: Any, retriever: Any, old_eval: list[Any], old_train: dict[str, list[dict]],
          old_demos: list[dict], seed: int = 0, reading_n: int = 330, twohop_n: int = 150, max_info_tokens: int = 160,
          title_rows: int = 250, mix_demos: int = 800) -> Built:
    rng = random.Random(seed)
    stats: Counter = Counter()
    facts, titles = corpus_facts(pages, tok, max_info_tokens)
    doc_of = {p["title"]: p["id"] for p in pages}
    old_idx = EvalIndex(old_eval)
    old_pairs = [(f" {normalize_answer(r.question)} ", {normalize_answer(a) for a in r.golden_answers}) for r in old_eval]

    def clean(f: Fact, count: bool = True) -> bool:
        """A training fact must not overlap an older eval set (dataprep/leak_check.py EvalIndex) nor restate one."""
        row = {"question": f.question, "answer": [f.answer]}
        if old_idx.overlaps(row) or restates_eval(f, old_pairs):
            stats["training fact dropped: overlaps an older eval set"] += count
            return False
        return True

    # Held-out rows may share knowledge with the older eval sets (both are eval), but never repeat one of
    # their questions; training rows may do neither (clean, below).
    facts = [f for f in facts if normalize_answer(f.question) not in old_idx.questions]
    all_chains = chains(facts, titles)
    # Held-out entities are drawn first; the older rows and demos that touch one are dropped below.
    # held-out: start entities for chains first (fewer), then one reading fact per entity
    by_start: dict[str, list[Chain]] = {}
    for c in all_chains:
        by_start.setdefault(c.bridge.entity, []).append(c)
    # Held-out chains start first from entities whose chains training could not use anyway (a bridge that
    # restates an older eval row, e.g. a capital: eval may share knowledge with eval), two per start at most.
    trainable = {x for x, cs in by_start.items() if any(clean(c.bridge, count=False) and clean(c.fact, count=False)
                                                       for c in cs)}
    starts = sorted(by_start)
    rng.shuffle(starts)
    starts.sort(key=lambda x: x in trainable)
    held_chains: list[Chain] = []
    for x in starts:
        if len(held_chains) >= twohop_n:
            break
        cs = sorted(by_start[x], key=lambda c: (c.fact.relation, c.question))
        held_chains += rng.sample(cs, min(2, len(cs), twohop_n - len(held_chains)))
    reserved = {c.bridge.entity for c in held_chains}
    held_final = {(c.fact.entity, c.fact.relation) for c in held_chains}
    by_entity: dict[str, list[Fact]] = {}
    for f in facts:
        by_entity.setdefault(f.entity, []).append(f)
    # reading entities come from pages no chain starts at or bridges through, so training keeps its chains
    in_chains = {c.bridge.entity for c in all_chains} | {c.fact.entity for c in all_chains}
    ents = sorted(e for e in by_entity if e not in reserved and e not in in_chains)
    rng.shuffle(ents)
    held_facts = [rng.choice(sorted(by_entity[e], key=lambda f: (f.relation, f.question))) for e in ents[:reading_n]]
    reserved |= {f.entity for f in held_facts}
    banned = {normalize_answer(e) for e in reserved} | {normalize_answer(strip_parens(e)) for e in reserved}

    def free(*names: str) -> bool:
        return not any(normalize_answer(n) in banned or normalize_answer(strip_parens(n)) in banned for n in names)

    train_facts = [f for f in facts if free(f.entity, f.answer) and (f.entity, f.relation) not in held_final
                   and clean(f)]
    train_chains = [c for c in all_chains if free(c.bridge.entity, c.fact.entity, c.answer)
                    and (c.fact.entity, c.fact.relation) not in held_final and clean(c.bridge) and clean(c.fact)]
    stats["held-out reading"], stats["held-out two-hop"] = len(held_facts), len(held_chains)
    stats["training facts (before the per-relation cap)"] = len(train_facts)
    rng.shuffle(train_facts)
    cap, per_rel, capped = int(MAX_PER_RELATION * len(train_facts)), Counter(), []
    for f in train_facts:
        if per_rel[f.relation] < cap:
            per_rel[f.relation] += 1
            capped.append(f)
    train_facts = capped

    # demos: one search per fact, two per chain; each search must return its page as Doc 1. The query is
    # the entity's name as the question writes it, or failing that its full title ("Georgia (country)").
    def find(titles_: list[str]) -> list[tuple[str, list[dict]] | None]:
        qs = [strip_parens(t) for t in titles_]
        res = retriever.search(qs, 3) if qs else []
        out: list[tuple[str, list[dict]] | None] = [(q, d) if top(d, t) else None for t, q, d in zip(titles_, qs, res)]
        again = [i for i, (t, q) in enumerate(zip(titles_, qs)) if out[i] is None and t != q]
        for i, d in zip(again, retriever.search([titles_[i] for i in again], 3) if again else []):
            if top(d, titles_[i]):
                out[i] = (titles_[i], d)
                stats["demo searches by full title (the name alone missed)"] += 1
        return out

    top = lambda docs, title: bool(docs) and str(docs[0].get("id")) == doc_of.get(title)  # noqa: E731
    found = find([f.entity for f in train_facts] + [c.bridge.entity for c in train_chains]
                 + [c.fact.entity for c in train_chains])
    n_f, n_c = len(train_facts), len(train_chains)
    r_fact, r_c1, r_c2 = found[:n_f], found[n_f:n_f + n_c], found[n_f + n_c:]
    demos = []
    for f, hit in zip(train_facts, r_fact):
        if hit:
            demos.append(_demo(f.question, f.answer, "reading", [(hit[0], hit[1], quote(f.sentence, f.answer))],
                               [f.entity]))
        else:
            stats["reading demo dropped: its page is not Doc 1 for its name"] += 1
    for c, h1, h2 in zip(train_chains, r_c1, r_c2):
        if h1 and h2:
            (q1, d1), (q2, d2) = h1, h2
            y = strip_parens(c.fact.entity)
            bridge_think = (f"{quote(c.bridge.sentence, c.bridge.answer)} So "
                            f"{BRIDGE_NP[c.bridge.relation].format(strip_parens(c.bridge.entity))} is {y}.")
            # the plan names what the first search must find, so the thought after it knows a second one follows
            plan = f"First I need {BRIDGE_NP[c.bridge.relation].format(strip_parens(c.bridge.entity))}."
            demos.append(_demo(c.question, c.answer, "twohop", [(q1, d1, bridge_think),
                                                                (q2, d2, quote(c.fact.sentence, c.answer))],
                               [c.bridge.entity, c.fact.entity], plan))
        else:
            stats["two-hop demo dropped: a page is not Doc 1 for its name"] += 1

    # older demos: drop any that touch a held-out entity, replace "Doc k is about X" by a quoted sentence
    new_eval = [fact_row(f, f"reading-{i}", "reading_heldout") for i, f in enumerate(held_facts)]
    new_eval += [chain_row(c, f"twohop-{i}", "twohop_heldout") for i, c in enumerate(held_chains)]
    new_idx = EvalIndex(new_eval)
    old_kept = [title_demo_think(d) for d in old_demos if not new_idx.overlaps(d)]
    stats["older demos dropped: touch a held-out entity"] = len(old_demos) - len(old_kept)
    read_d = [d for d in demos if d["source"] == "reading"]
    two_d = [d for d in demos if d["source"] == "twohop"]
    title_d = [d for d in old_kept if d["role"] == "solver"]
    prop_d = [d for d in old_kept if d["role"] == "proposer"]
    n_two = min(len(two_d) * CHAIN_DEMO_COPIES, mix_demos // 5)
    two_d = [d for _ in range(CHAIN_DEMO_COPIES) for d in two_d]  # each chain once before any twice
    n_prop = min(len(prop_d), mix_demos // 5)
    n_title = min(len(title_d), mix_demos // 8)
    n_read = min(len(read_d), mix_demos - n_two - n_prop - n_title)
    stats["two-hop demos in the mix (each chain's demo repeated up to CHAIN_DEMO_COPIES times)"] = n_two
    mix = two_d[:n_two] + read_d[:n_read] + title_d[:n_title] + prop_d[:n_prop]
    rng.shuffle(mix)

    # RL rows: facts and chains not used by a demo first (the demos teach the form, RL the rest), then titles
    rows = [fact_row(f, f"fact-{i}", "reading") for i, f in enumerate(train_facts)]
    rows += [chain_row(c, f"chain-{i}", "twohop") for i, c in enumerate(train_chains)]
    title_q = [r for r in old_train.get("solver_qa", []) if not new_idx.overlaps({"question": r["question"],
                                                                                   "answer": r["golden_answers"]})]
    rows += title_q[:title_rows]
    rng.shuffle(rows)
    reading_ans = sorted({f.answer for f in train_facts if f.relation in NAMED_RELATIONS
                          and normalize_answer(f.answer) not in titles}, key=normalize_answer)
    prop = [r for r in old_train.get("proposer", []) if free(r["answer"])]
    prop += [{"answer": a, "search_turns": rng.choice([2, 3]), "data_source": "wiki_reading"} for a in reading_ans]
    rng.shuffle(prop)
    stats["proposer answers that are no page title"] = len(reading_ans)
    return Built(new_eval[:len(held_facts)], new_eval[len(held_facts):], rows, prop, mix, stats)


def summary(b: Built) -> list[str]:
    kinds = Counter((d["role"], d["source"]) for d in b.demos)
    searches = Counter(sum(t["kind"] == "info" for t in d["turns"]) for d in b.demos if d["role"] == "solver")
    title_ans = sum(1 for d in b.demos if d["role"] == "solver" and d["source"] not in ("reading", "twohop"))
    lines = [f"held-out: reading {len(b.reading_heldout)} (relations "
             f"{dict(Counter(r['relation'] for r in b.reading_heldout).most_common())}), two-hop {len(b.twohop_heldout)}",
             f"solver_mix: {len(b.solver_mix)} rows {dict(Counter(r['data_source'] for r in b.solver_mix))}",
             f"proposer_mix: {len(b.proposer_mix)} answers {dict(Counter(r.get('data_source') for r in b.proposer_mix))}",
             f"coldstart_mix: {len(b.demos)} demos {dict(sorted(kinds.items()))}; solver searches {dict(sorted(searches.items()))}; "
             f"solver demos answered with a title {title_ans} of {sum(v for (r, _), v in kinds.items() if r == 'solver')}"]
    return lines + [f"  {k}: {v}" for k, v in sorted(b.stats.items())]


def main(argv: list[str] | None = None) -> int:
    from utils import assets

    data = assets.DATA
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=data / "corpus" / "wiki.jsonl")
    p.add_argument("--index", type=Path, default=data / "indexes" / "bm25", help="BM25 index the demos search")
    p.add_argument("--tokenizer", type=Path, default=data / "models" / "SmolLM2-135M-Instruct",
                   help="the policy's tokenizer: decides what the --max_info_tokens cut leaves visible")
    p.add_argument("--max_info_tokens", type=int, default=160, help="keep it the RL and eval --max_info_tokens")
    p.add_argument("--reading_n", type=int, default=330, help="held-out reading questions (one per entity)")
    p.add_argument("--twohop_n", type=int, default=150, help="held-out two-hop questions (at least)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if every output exists")
    a = p.parse_args(argv)
    out = {"reading_heldout": data / "eval" / "reading_heldout.jsonl", "twohop_heldout": data / "eval" / "twohop_heldout.jsonl",
           "solver_mix": data / "train" / "solver_mix.jsonl", "proposer_mix": data / "train" / "proposer_mix.jsonl",
           "demos": data / "train" / "coldstart_mix.jsonl"}
    if not a.force and all(f.exists() for f in out.values()):
        print(f"reading sets: reusing {', '.join(str(f) for f in out.values())}")
        return 0
    need = {"corpus": a.corpus, "proposer rows": data / "train" / "proposer.jsonl",
            "solver QA rows": data / "train" / "solver_qa.jsonl", "cold-start demos": data / "train" / "coldstart.jsonl",
            "index": a.index / "manifest.json"}
    for what, f in need.items():
        if not f.exists():
            p.error(f"{what} {f} is missing: run `python scripts/prepare_data.py`, build the BM25 index and "
                    "`python -m dataprep.coldstart` first")
    t0 = time.time()
    from transformers import AutoTokenizer

    from retrieval.retriever import load_retriever

    old_eval_files = [f for f in sorted((data / "eval").glob("*.jsonl")) if f not in (out["reading_heldout"], out["twohop_heldout"])]
    b = build(read_corpus(a.corpus), AutoTokenizer.from_pretrained(a.tokenizer), load_retriever(a.index),
              load_eval_files(old_eval_files),
              {"proposer": read_jsonl(data / "train" / "proposer.jsonl"), "solver_qa": read_jsonl(data / "train" / "solver_qa.jsonl")},
              read_jsonl(data / "train" / "coldstart.jsonl"), a.seed, a.reading_n, a.twohop_n, a.max_info_tokens)
    if len(b.reading_heldout) < a.reading_n or len(b.twohop_heldout) < a.twohop_n:
        print(f"reading sets: only {len(b.reading_heldout)} reading / {len(b.twohop_heldout)} two-hop held-out questions "
              f"(asked for {a.reading_n} / {a.twohop_n})", file=sys.stderr)
        return 1
    for d in b.demos:
        validate_demo(d)
    every_eval = load_eval_files(old_eval_files) + b.reading_heldout + b.twohop_heldout
    check_no_leak(b.demos, every_eval)
    check_no_leak([{"question": r["question"], "answer": r["golden_answers"], "entities": r.get("entities", [])}
                   for r in b.solver_mix], every_eval)
    check_no_leak([{"answer": r["answer"]} for r in b.proposer_mix], every_eval)
    for key, f in out.items():
        write_jsonl_atomic(f, getattr(b, key))
    for line in summary(b):
        print(line)
    print(f"leak check: demos, solver_mix and proposer_mix vs {len(every_eval)} eval rows: 0 overlaps")
    print(f"wrote {', '.join(str(f) for f in out.values())} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
