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
from dataprep.demos import read_jsonl, validate_demo
from dataprep.game_demos import QUOTE_WORDS, block_text, fact_proposer_demos, name_demos, quote, search_all
from dataprep.leak_check import EvalIndex, check_no_leak, load_eval_files
from dataprep.protocol import Protocol, add_protocol_args, fit_turn, misfit, protocol_of, read_protocol, write_protocol
from inference.filters import FilterConfig
from utils import assets
from utils.logging import write_jsonl_atomic
from utils.text import contains_answer, normalize_answer

NAMED_RELATIONS = {"capital", "largest_city", "official_language", "located_in", "capital_of", "founded_by",
                   "directed_by", "written_by", "named_after", "discovered_by", "born_in"}
MAX_PER_RELATION = 0.3  # no relation fills more than this share of the training facts (located_in would)
# Chains are few (the corpus yields ~340, and the held-out set takes 150): each training chain's demo is
# repeated up to this many times to fill the mix's two-search share (a fifth of the mix). With one copy,
# 3% of solver demos searched twice and the SFT start never did (two-hop searches/question 1.00).
CHAIN_DEMO_COPIES = 6


def _clean(docs: list[dict]) -> list[dict]:
    return [{"id": str(d.get("id")), "contents": d.get("contents", ""), "score": float(d.get("score", 0.0))}
            for d in docs]


def _demo(question: str, answer: str, source: str, steps: list[tuple[str, list[dict], tuple[str, str, str]]],
          entities: list[str], tok: Any, proto: Protocol, plan: str = "") -> dict | None:
    """steps: (query, docs, (sentence to quote after them, the words the quote must keep, what the thought adds
    after the quote)); the last thought precedes the answer. plan: a thought before the first search (chains:
    which entity must be found first). Each quote is cut (fit_turn) until its turn fits the protocol's token
    cap; None when a turn cannot fit."""
    cap = proto.max_tokens_per_turn
    turns = [{"kind": "model", "text": (f"<think> {plan} </think>\n" if plan else "") + f"<search> {steps[0][0]} </search>"}]
    for i, (_, docs, (sentence, keep, after)) in enumerate(steps):
        turns.append({"kind": "info", "docs": _clean(docs)})
        tail = f"<answer> {answer} </answer>" if i == len(steps) - 1 else f"<search> {steps[i + 1][0]} </search>"
        text = fit_turn(tok, lambda w: f"<think> {quote(sentence, keep, w)}{after} </think>\n{tail}", cap, QUOTE_WORDS)
        if text is None:
            return None
        turns.append({"kind": "model", "text": text})
    demo = {"role": "solver", "question": question, "answer": [answer], "source": source, "turns": turns,
            "entities": entities}
    return None if misfit(demo, tok, proto) else demo


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


def title_demo_think(demo: dict, tok: Any, proto: Protocol) -> dict | None:
    """A coldstart.jsonl solver demo with its templated last thought rewritten to fit the protocol: "Doc k is
    about X" (a description question: the answer is the page's name) becomes "Doc k is about <title>: <its first
    sentence>", so the thought names the page it answers with; "Doc k mentions X" (FanOutQA: a span) becomes a
    quote of the sentence of Doc k that holds the answer. None when no such sentence exists or none fits."""
    last = demo["turns"][-1]["text"]
    m = re.match(r"<think> Doc (\d+) (is about|mentions) .*? </think>\n", last)
    if not m:
        return demo if not misfit(demo, tok, proto) else None
    docs = demo["turns"][-2]["docs"]
    k = int(m.group(1))
    title, _, text = str(docs[k - 1]["contents"]).partition("\n") if 0 < k <= len(docs) else ("", "", "")
    ans = demo["answer"] if isinstance(demo["answer"], str) else demo["answer"][0]
    sents = sentences(text)
    if m.group(2) == "is about":
        first, head = (sents or [""])[0], f"Doc {k} is about {title.strip()}: "
    else:
        first, head = next((x for x in sents if normalize_answer(ans) in normalize_answer(x)), ""), f"Doc {k}: "
    if not first:
        return None
    text = fit_turn(tok, lambda w: f"<think> {head}{quote(first, ans, w)} </think>\n" + last[m.end():],
                    proto.max_tokens_per_turn, QUOTE_WORDS)
    out = {**demo, "turns": demo["turns"][:-1] + [{"kind": "model", "text": text}]} if text else None
    return out if out and not misfit(out, tok, proto) else None


@dataclasses.dataclass
class Built:
    reading_heldout: list[dict]
    twohop_heldout: list[dict]
    solver_mix: list[dict]
    proposer_mix: list[dict]
    demos: list[dict]
    stats: Counter


def build(pages: list[dict], tok: Any, retriever: Any, old_eval: list[Any], old_train: dict[str, list[dict]],
          old_demos: list[dict], seed: int = 0, reading_n: int = 330, twohop_n: int = 150, proto: Protocol = Protocol(),
          title_rows: int = 250, mix_demos: int = 960) -> Built:
    """proto: the rollout protocol (and the game's question filter) every demo must fit, dataprep/protocol.py."""
    rng = random.Random(seed)
    stats: Counter = Counter()
    facts, titles = corpus_facts(pages, tok, proto.max_info_tokens)
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
    demos, dropped = [], Counter()
    for f, hit in zip(train_facts, r_fact):
        d = _demo(f.question, f.answer, "reading", [(hit[0], hit[1], (f.sentence, f.answer, ""))], [f.entity], tok,
                  proto) if hit else None
        dropped["reading demo dropped: its page is not Doc 1 for its name" if not hit
                else "reading demo dropped: no quote fits the protocol's turn"] += d is None
        demos += [d] if d else []
    for c, h1, h2 in zip(train_chains, r_c1, r_c2):
        d = None
        if h1 and h2:
            (q1, d1), (q2, d2) = h1, h2
            np_ = BRIDGE_NP[c.bridge.relation].format(strip_parens(c.bridge.entity))
            # the plan names what the first search must find, so the thought after it knows a second one follows
            d = _demo(c.question, c.answer, "twohop", [(q1, d1, (c.bridge.sentence, c.bridge.answer,
                                                                 f" So {np_} is {strip_parens(c.fact.entity)}.")),
                                                       (q2, d2, (c.fact.sentence, c.answer, ""))],
                      [c.bridge.entity, c.fact.entity], tok, proto, plan=f"First I need {np_}.")
        dropped["two-hop demo dropped: a page is not Doc 1 for its name" if not (h1 and h2)
                else "two-hop demo dropped: no quote fits the protocol's turn"] += d is None
        demos += [d] if d else []
    stats.update(dropped)

    # older demos (coldstart.jsonl): drop any that touch a held-out entity; their thought says which document is
    # about the answer (description questions) or quotes the sentence that holds it (FanOutQA); their proposer
    # demos are replaced by the game's (dataprep/game_demos.py)
    new_eval = [fact_row(f, f"reading-{i}", "reading_heldout") for i, f in enumerate(held_facts)]
    new_eval += [chain_row(c, f"twohop-{i}", "twohop_heldout") for i, c in enumerate(held_chains)]
    new_idx = EvalIndex(new_eval)
    old_kept = [d for d in old_demos if d["role"] == "solver" and not new_idx.overlaps(d)]
    stats["older demos dropped: touch a held-out entity"] = sum(bool(new_idx.overlaps(d)) for d in old_demos
                                                               if d["role"] == "solver")
    title_d = [t for d in old_kept if (t := title_demo_think(d, tok, proto))]
    stats["older demos dropped: no thought fits the protocol's turn"] = len(old_kept) - len(title_d)

    # the game's kinds (dataprep/game_demos.py): proposer questions about a fact read off a page, or asking for a
    # page's name by its first sentence; solver demos answering with a page's name. Pages of the name kind are
    # free of held-out entities and eval rows, and the two roles get different pages.
    fcfg = FilterConfig(min_words=proto.min_question_words, min_searches=proto.min_searches)
    used = {normalize_answer(a) for d in old_demos for a in ([d["answer"]] if isinstance(d["answer"], str) else d["answer"])}
    name_pages = [p for p in pages if free(p["title"]) and normalize_answer(strip_parens(p["title"])) not in used
                  and not old_idx.overlaps({"question": "", "answer": [strip_parens(p["title"]), p["title"]]})
                  and not new_idx.overlaps({"question": "", "answer": [strip_parens(p["title"]), p["title"]]})]
    rng.shuffle(name_pages)
    # a proposer turn is the harder one to learn (it picks what to ask, then asks it): 35% of the mix, half of each
    # kind; an SFT start with 25% (120 fact, 80 name) wrote a valid question in 1 of 80 rollouts
    n_prop, n_name = 7 * mix_demos // 20, 3 * mix_demos // 32
    half = len(name_pages) // 2
    name_sol = name_demos(name_pages[:min(half, 3 * n_name)], retriever, tok, proto, fcfg, stats, "solver")
    name_prop = name_demos(name_pages[half:half + 3 * n_prop], retriever, tok, proto, fcfg, stats, "proposer")
    fact_prop = fact_proposer_demos(train_facts, retriever, tok, proto, fcfg, stats)
    # a written question may still equal an eval question about another page ("What is the name of a municipality
    # in central Vietnam?"): drop it here, as the builder does every other overlap, so the final guard never trips
    def clean(ds: list[dict], kind: str) -> list[dict]:
        kept = [d for d in ds if not (old_idx.overlaps(d) or new_idx.overlaps(d))]
        stats[f"{kind} demos dropped: overlap an eval row"] = len(ds) - len(kept)
        return kept
    name_sol, name_prop, fact_prop = clean(name_sol, "name solver"), clean(name_prop, "name proposer"), clean(fact_prop, "fact proposer")

    read_d = [d for d in demos if d["source"] == "reading"]
    two_d = [d for d in demos if d["source"] == "twohop"]
    n_two = min(len(two_d) * CHAIN_DEMO_COPIES, mix_demos // 10)
    two_d = [d for _ in range(CHAIN_DEMO_COPIES) for d in two_d]  # each chain once before any twice
    n_fact = min(len(fact_prop), n_prop // 2)
    props = fact_prop[:n_fact] + name_prop[:n_prop - n_fact]
    n_title, n_name = min(len(title_d), n_name), min(len(name_sol), n_name)
    n_read = min(len(read_d), mix_demos - n_two - len(props) - n_title - n_name)
    stats["two-hop demos in the mix (each chain's demo repeated up to CHAIN_DEMO_COPIES times)"] = n_two
    mix = two_d[:n_two] + read_d[:n_read] + title_d[:n_title] + name_sol[:n_name] + props
    rng.shuffle(mix)

    # RL rows: facts and chains not used by a demo first (the demos teach the form, RL the rest), then titles
    rows = [fact_row(f, f"fact-{i}", "reading") for i, f in enumerate(train_facts)]
    rows += [chain_row(c, f"chain-{i}", "twohop") for i, c in enumerate(train_chains)]
    title_q = [r for r in old_train.get("solver_qa", []) if not new_idx.overlaps({"question": r["question"],
                                                                                   "answer": r["golden_answers"]})]
    rows += title_q[:title_rows]
    rng.shuffle(rows)
    # the proposer's answers, of the kinds the solver is trained and measured on: answers read off a page's text
    # (facts), the ends of two-hop chains, and page names (the demo pool's titles), the names no more than the rest
    # A fact answer is kept when searching it shows some page's text holding it inside the cut, as the proposer's
    # first search would (e.g. "1998": a page that says "... completed in 1998"); names always find their page.
    n = proto.max_searches
    seen_a: set[str] = set()
    cands = []
    for a, kind in [(c.answer, "chain_end") for c in train_chains] + [(f.answer, "fact") for f in train_facts]:
        if normalize_answer(a) not in seen_a and free(a):
            seen_a.add(normalize_answer(a))
            cands.append((a, kind))
    shown = [block_text(tok, d, proto) for d in search_all(retriever, [a for a, _ in cands])]
    prop = [{"answer": a, "search_turns": n, "data_source": kind} for (a, kind), text in zip(cands, shown)
            if contains_answer(re.sub(r"Doc \d+ \(Title: [^)]*\)", " ", text), a)]
    stats["proposer fact answers dropped: their search shows no text holding them"] = len(cands) - len(prop)
    names = [r for r in old_train.get("proposer", []) if free(r["answer"]) and normalize_answer(r["answer"]) not in seen_a]
    prop += [{"answer": r["answer"], "search_turns": n, "data_source": "name"} for r in names[:len(prop)]]
    rng.shuffle(prop)
    stats["proposer answers that are no page title"] = sum(normalize_answer(r["answer"]) not in titles for r in prop)
    return Built(new_eval[:len(held_facts)], new_eval[len(held_facts):], rows, prop, mix, stats)


def summary(b: Built) -> list[str]:
    kinds = Counter((d["role"], d["source"]) for d in b.demos)
    searches = Counter(sum(t["kind"] == "info" for t in d["turns"]) for d in b.demos if d["role"] == "solver")
    title_ans = sum(1 for d in b.demos if d["role"] == "solver" and d["source"] in ("wiki_desc", "name"))
    lines = [f"held-out: reading {len(b.reading_heldout)} (relations "
             f"{dict(Counter(r['relation'] for r in b.reading_heldout).most_common())}), two-hop {len(b.twohop_heldout)}",
             f"solver_mix: {len(b.solver_mix)} rows {dict(Counter(r['data_source'] for r in b.solver_mix))}",
             f"proposer_mix: {len(b.proposer_mix)} answers {dict(Counter(r.get('data_source') for r in b.proposer_mix))}",
             f"coldstart_mix: {len(b.demos)} demos {dict(sorted(kinds.items()))}; solver searches {dict(sorted(searches.items()))}; "
             f"solver demos answered with a title {title_ans} of {sum(v for (r, _), v in kinds.items() if r == 'solver')}"]
    return lines + [f"  {k}: {v}" for k, v in sorted(b.stats.items())]


def main(argv: list[str] | None = None) -> int:
    data = assets.DATA
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=data / "corpus" / "wiki.jsonl")
    p.add_argument("--index", type=Path, default=data / "indexes" / "bm25", help="BM25 index the demos search")
    p.add_argument("--tokenizer", type=Path, default=data / "models" / "SmolLM2-135M-Instruct",
                   help="the policy's tokenizer: decides what the --max_info_tokens cut leaves visible")
    add_protocol_args(p)   # the rollout protocol every demo must fit: keep it the RL and eval flags
    p.add_argument("--reading_n", type=int, default=330, help="held-out reading questions (one per entity)")
    p.add_argument("--twohop_n", type=int, default=150, help="held-out two-hop questions (at least)")
    p.add_argument("--mix_demos", type=int, default=960, help="demos in the cold-start mix (coldstart_mix.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if every output exists")
    a = p.parse_args(argv)
    out = {"reading_heldout": data / "eval" / "reading_heldout.jsonl", "twohop_heldout": data / "eval" / "twohop_heldout.jsonl",
           "solver_mix": data / "train" / "solver_mix.jsonl", "proposer_mix": data / "train" / "proposer_mix.jsonl",
           "demos": data / "train" / "coldstart_mix.jsonl"}
    proto = protocol_of(a)
    if not a.force and all(f.exists() for f in out.values()):
        built_for = read_protocol(out["demos"])
        if built_for == proto:
            print(f"reading sets: reusing {', '.join(str(f) for f in out.values())} (built for {proto})")
            return 0
        print(f"reading sets: {out['demos']} was built for {built_for or 'an unrecorded protocol'}, not {proto}: rebuilding")
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
              read_jsonl(data / "train" / "coldstart.jsonl"), a.seed, a.reading_n, a.twohop_n, proto, mix_demos=a.mix_demos)
    if len(b.reading_heldout) < a.reading_n or len(b.twohop_heldout) < a.twohop_n:
        print(f"reading sets: only {len(b.reading_heldout)} reading / {len(b.twohop_heldout)} two-hop held-out questions "
              f"(asked for {a.reading_n} / {a.twohop_n})", file=sys.stderr)
        return 1
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    for d in b.demos:
        validate_demo(d)
        if why := misfit(d, tok, proto):   # the builder cuts or drops what does not fit: this is the guard
            raise ValueError(f"a {d['role']} demo does not fit {proto}: {why}: {d['turns']}")
    every_eval = load_eval_files(old_eval_files) + b.reading_heldout + b.twohop_heldout
    check_no_leak(b.demos, every_eval)
    check_no_leak([{"question": r["question"], "answer": r["golden_answers"], "entities": r.get("entities", [])}
                   for r in b.solver_mix], every_eval)
    check_no_leak([{"answer": r["answer"]} for r in b.proposer_mix], every_eval)
    for key, f in out.items():
        write_jsonl_atomic(f, getattr(b, key))
    write_protocol(out["demos"], proto)
    for line in summary(b):
        print(line)
    print(f"leak check: demos, solver_mix and proposer_mix vs {len(every_eval)} eval rows: 0 overlaps")
    print(f"wrote {', '.join(str(f) for f in out.values())} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
