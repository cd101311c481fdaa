"""Cold-start demos of the self-play game's two question kinds, written to fit the rollout protocol (issue 31).

A run of the old mix showed why the game never played: most proposer rollouts ended with no question (their
demos searched 3 times and ran past the 64-token turn), 13 of 15 valid questions asked for the first search's
page title by a garbled description, and the solver, taught almost only to quote a sentence and copy a span,
never answered with a page's name. The demos here teach two kinds, for both roles:

  fact   the answer is read off a page's text ("What is the population of Nairobi?" -> "4.4 million").
         Proposer: search the answer; quote the sentence of a retrieved page that holds it; search that
         page's name, as a solver would, and see it come back as Doc 1 with the sentence inside the cut;
         ask the page's fact question. Solver: dataprep/reading_sets.py's reading demos.
  name   the answer is a page's name, asked for by what its first sentence says ("What is the name of a
         red supergiant star in the constellation of Orion?" -> "Betelgeuse"). Proposer: search the
         answer; quote its page's first sentence; search that description, as a solver would, and see the
         page come back; ask for the name. Solver: search the description; say which document is about
         what ("Doc 2 is about Betelgeuse: ..."); answer with the page's name.

Every search of a demo returns what the demo reads inside the protocol's --max_info_tokens cut of the whole
block (`block_text`), and every model turn fits --max_tokens_per_turn (the quote is cut until it does, or the
demo is dropped and counted). Proposer questions pass the RL game's cheap filter with the filter settings
given.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from dataprep.clues import article_clues, clue_query, compose_question, sentences, strip_parens
from dataprep.facts import Fact
from dataprep.protocol import Protocol, fit_turn
from inference.filters import FilterConfig, check_question
from inference.prompts import format_docs
from inference.rollout import info_block_tokens
from utils.text import normalize_answer

QUOTE_WORDS = 22   # the longest quote tried; fit_turn shortens it until the turn fits the protocol
TOPK = 3


def block_text(tok: Any, docs: Sequence[dict], proto: Protocol) -> str:
    """The documents as a rollout shows them: the formatted block cut to --max_info_tokens."""
    return tok.decode(info_block_tokens(tok, format_docs(list(docs)), proto.max_info_tokens), skip_special_tokens=True)


def quote(sentence: str, answer: str, max_words: int) -> str:
    """The sentence, or a window of max_words of it around the answer (marked with "...")."""
    words = sentence.split()
    if len(words) <= max_words:
        return sentence
    na = normalize_answer(answer).split()
    at = next((i for i in range(len(words)) if normalize_answer(" ".join(words[i:i + len(na)])).split() == na), 0)
    lo = max(0, min(at - max_words // 2, len(words) - max_words))
    return ("... " if lo else "") + " ".join(words[lo:lo + max_words]) + (" ..." if lo + max_words < len(words) else "")


def _clean(docs: Sequence[dict]) -> list[dict]:
    return [{"id": str(d.get("id")), "contents": d.get("contents", ""), "score": float(d.get("score", 0.0))}
            for d in docs]


def _position(docs: Sequence[dict], doc_id: str) -> int | None:
    ids = [str(d.get("id")) for d in docs]
    return ids.index(doc_id) + 1 if doc_id in ids else None


def _shown(tok: Any, docs: Sequence[dict], proto: Protocol, text: str) -> bool:
    """`text` (a quote, "..." marks dropped) lies inside what the rollout shows of these documents."""
    seen = " ".join(block_text(tok, docs, proto).split())
    return all(" ".join(part.split()) in seen for part in text.split("...") if part.strip())


def proposer_demo(answer: str, kind: str, question: str, turns: list[dict], **extra) -> dict:
    return {"role": "proposer", "answer": answer, "n_searches": sum(t["kind"] == "info" for t in turns),
            "source": f"proposer_{kind}", "question": question, "turns": turns, **extra}


def search_all(retriever: Any, queries: list[str]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for i in range(0, len(queries), 128):
        out += retriever.search(queries[i:i + 128], TOPK)
    return out


def fact_proposer_demos(facts: Sequence[Fact], retriever: Any, tok: Any, proto: Protocol, fcfg: FilterConfig,
                        stats: Counter) -> list[dict]:
    """Proposer demos of the fact kind, one per fact at most (see the module docstring)."""
    first = search_all(retriever, [f.answer for f in facts])
    keep = []
    for f, d1 in zip(facts, first):
        k = _position(d1, f.doc_id)
        if k is None:
            stats["proposer fact: the answer's search misses the fact's page"] += 1
            continue
        keep.append((f, d1, k))
    second = search_all(retriever, [strip_parens(f.entity) for f, _, _ in keep])
    demos = []
    for (f, d1, k), d2 in zip(keep, second):
        name = strip_parens(f.entity)
        if _position(d2, f.doc_id) != 1:
            stats["proposer fact: the page is not Doc 1 for its name"] += 1
            continue
        t2 = fit_turn(tok, lambda w: (f"<think> Doc {k}: {quote(f.sentence, f.answer, w)} </think>\n"
                                      f"<search> {name} </search>")
                      if _shown(tok, d1, proto, quote(f.sentence, f.answer, w))
                      and _shown(tok, d2, proto, quote(f.sentence, f.answer, w)) else None,
                      proto.max_tokens_per_turn, QUOTE_WORDS)
        if t2 is None:
            stats["proposer fact: the sentence is past the cut or no quote fits the turn"] += 1
            continue
        t3 = f"<question> {f.question} </question>"
        why = check_question(f.question, f.answer, [f.answer, name], [d1, d2], 2, fcfg)
        if why or fit_turn(tok, lambda w: t3, proto.max_tokens_per_turn, 1, 1) is None:
            stats[f"proposer fact: {why or 'the question turn is over the cap'}"] += 1
            continue
        turns = [{"kind": "model", "text": f"<search> {f.answer} </search>"}, {"kind": "info", "docs": _clean(d1)},
                 {"kind": "model", "text": t2}, {"kind": "info", "docs": _clean(d2)}, {"kind": "model", "text": t3}]
        demos.append(proposer_demo(f.answer, "fact", f.question, turns, entities=[f.entity], relation=f.relation))
    return demos


def name_clue(page: dict, answers: list[str]) -> tuple[str, str] | None:
    """(first sentence, its predicate as a clue) of a page, when the first sentence says what the page is
    ("Betelgeuse is a red supergiant star ..." -> "a red supergiant star ..."); None otherwise."""
    sents = sentences(page["text"])
    clues = article_clues(page["text"], strip_parens(page["title"]), answers)
    return (sents[0], clues[0]) if sents and clues else None


def _name_think(k: int, title: str, first: str, name: str, w: int) -> str:
    return f"<think> Doc {k} is about {title}: {quote(first, name, w)} </think>\n"


def name_demos(pages: Sequence[dict], retriever: Any, tok: Any, proto: Protocol, fcfg: FilterConfig,
               stats: Counter, role: str) -> list[dict]:
    """Demos of the name kind for `role` ("solver" or "proposer"), one per page at most: the question asks for
    the page's name by its first sentence's predicate, and searching that predicate returns the page."""
    cands = []
    for p in pages:
        name = strip_parens(p["title"])
        answers = [name] + ([p["title"]] if p["title"] != name else [])
        got = name_clue(p, answers)
        if not got:
            stats[f"{role} name: no first sentence that says what the page is"] += 1
            continue
        cands.append((p, name, answers, *got))
    by_clue = search_all(retriever, [clue_query(c) for *_, c in cands])
    by_name = search_all(retriever, [name for _, name, *_ in cands]) if role == "proposer" else [None] * len(cands)
    demos = []
    for (p, name, answers, first, clue), dc, dn in zip(cands, by_clue, by_name):
        k = _position(dc, p["id"])
        if k is None:
            stats[f"{role} name: searching the description misses the page"] += 1
            continue
        question = compose_question([clue])
        if role == "solver":
            t2 = fit_turn(tok, lambda w: _name_think(k, p["title"], first, name, w) + f"<answer> {name} </answer>"
                          if _shown(tok, dc, proto, quote(first, name, w)) else None,
                          proto.max_tokens_per_turn, QUOTE_WORDS)
            t1 = f"<search> {clue_query(clue)} </search>"
            if t2 is None or fit_turn(tok, lambda w: t1, proto.max_tokens_per_turn, 1, 1) is None:
                stats["solver name: the first sentence is past the cut or a turn is over the cap"] += 1
                continue
            demos.append({"role": "solver", "question": question, "answer": answers, "source": "name",
                          "turns": [{"kind": "model", "text": t1}, {"kind": "info", "docs": _clean(dc)},
                                    {"kind": "model", "text": t2}], "entities": [p["title"]]})
            continue
        kn = _position(dn, p["id"])
        if kn is None:
            stats["proposer name: searching the answer misses its page"] += 1
            continue
        # the proposer's thought quotes the page's first sentence and no more: a thought that names the page
        # ("Doc 1 is about X") was followed by a second search for X itself (an SFT start searched its answer twice
        # in 1 of 4 rollouts, which the game refuses as too few distinct searches)
        t2 = fit_turn(tok, lambda w: f"<think> {quote(first, name, w)} </think>\n<search> {clue_query(clue)} </search>"
                      if _shown(tok, dn, proto, quote(first, name, w)) else None,
                      proto.max_tokens_per_turn, QUOTE_WORDS)
        t3 = f"<question> {question} </question>"
        why = check_question(question, answers, [name, clue_query(clue)], [dn, dc], 2, fcfg)
        if t2 is None or why or fit_turn(tok, lambda w: t3, proto.max_tokens_per_turn, 1, 1) is None:
            stats[f"proposer name: {why or 'the first sentence is past the cut or a turn is over the cap'}"] += 1
            continue
        turns = [{"kind": "model", "text": f"<search> {name} </search>"}, {"kind": "info", "docs": _clean(dn)},
                 {"kind": "model", "text": t2}, {"kind": "info", "docs": _clean(dc)}, {"kind": "model", "text": t3}]
        demos.append(proposer_demo(name, "name", question, turns, entities=[p["title"]]))
    return demos

