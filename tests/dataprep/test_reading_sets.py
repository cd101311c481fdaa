"""Reading and two-hop data (dataprep/): facts are read off page text and their answers are not the
page's title; chains need the second page; held-out entities never reach a training row or demo
(checked here directly, not through the builder's own leak check); the build is deterministic.

A synthetic corpus of made-up countries and cities, so every expected fact is known up front, and a
real BM25 index and the real SmolLM2 tokenizer (the visibility cut depends on it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dataprep import facts as F
from dataprep.game_demos import quote
from dataprep.reading_sets import build, title_demo_think
from dataprep.demos import validate_demo
from dataprep.leak_check import EvalIndex, check_no_leak
from utils.text import normalize_answer

SYL = ["kor", "lum", "ven", "tar", "mis", "dal", "ron", "pel", "sav", "quin", "bre", "zol"]


def _name(i: int, j: int) -> str:
    return (SYL[i % len(SYL)] + SYL[j % len(SYL)]).capitalize()


def corpus() -> list[dict]:
    """10 countries (capital, largest city, population, region) and 3 cities each (located in the country,
    founded in a year); each country's capital is its first city. 10 rivers in regions that have no page."""
    pages = []
    for c in range(10):
        country = _name(c, c + 3) + "ia"
        cities = [_name(c, k) + " Town" for k in range(3)]
        pages.append({"title": country, "text": f"{country} is a country in {_name(c, 7)} Region. Its capital is "
                      f"{cities[0]}. Its largest city is {cities[1]}. With a population of {c + 2} million, "
                      f"{country} is a member of the league."})
        for k, city in enumerate(cities):
            pages.append({"title": city, "text": f"{city} is a city in {country}. It was founded in {1700 + 10 * c + k} "
                          f"by traders from the coast."})
    for r in range(10):  # pages in no chain: a region is no page
        river = _name(r + 5, r) + " River"
        pages.append({"title": river, "text": f"{river} is a river in {_name(r, 9)} Basin. It was first mapped in "
                      f"{1800 + r} by surveyors."})
    return [{"id": str(i), **p} for i, p in enumerate(pages)]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    from retrieval.build_index import build_index
    from retrieval.retriever import load_retriever

    tmp = tmp_path_factory.mktemp("reading_index")
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"id": p["id"], "contents": f"{p['title']}\n{p['text']}"}) + "\n"
                                              for p in corpus()))
    build_index(tmp / "corpus.jsonl", tmp / "bm25", "bm25")
    return load_retriever(tmp / "bm25")


def _old_eval():
    from inference.data import EvalRow

    c0 = corpus()[0]
    return [EvalRow(question=f"What is the capital of {c0['title']}?", golden_answers=[_name(0, 0) + " Town"],
                    data_source="capitals", id="cap-0", meta={})]


@pytest.fixture(scope="module")
def built(tok, retriever):
    old_train = {"solver_qa": [{"question": "What is the name of the league?", "golden_answers": ["League"],
                                "data_source": "wiki_desc"}],
                 "proposer": [{"answer": corpus()[4]["title"], "search_turns": 2, "data_source": "wiki"}]}
    return build(corpus(), tok, retriever, _old_eval(), old_train, [], seed=0, reading_n=6, twohop_n=5,
                 title_rows=1, mix_demos=40)


def test_facts_are_read_off_the_text_and_are_not_titles(tok):
    pages = corpus()
    facts, titles = F.corpus_facts(pages, tok, 160)
    got = {(f.entity, f.relation): f for f in facts}
    kor = pages[0]["title"]
    assert got[(kor, "capital")].answer == "Korkor Town"
    assert got[(kor, "largest_city")].answer == "Korlum Town"
    assert got[(kor, "population")].answer == "2 million"
    assert got[("Korkor Town", "located_in")].answer == kor
    year = got[("Korkor Town", "year")]
    assert (year.answer, year.question) == ("1700", "Korkor Town was founded in what year by traders from the coast?")
    for f in facts:
        assert normalize_answer(f.answer) != normalize_answer(f.entity)
        assert f.answer in f.sentence and normalize_answer(f.answer) not in normalize_answer(f.question)


def test_the_info_cut_hides_late_sentences(tok):
    text = "Filler words about nothing in particular here. " * 30 + "Its capital is Hidden Town."
    assert "Hidden Town" not in F.visible_text(tok, "Farland", text, 160)
    assert not [f for f in F.page_facts({"id": "0", "title": "Farland", "text": text},
                                         F.visible_text(tok, "Farland", text, 160)) if f.relation == "capital"]
    assert "Hidden Town" in F.visible_text(tok, "Farland", text, 4096)


def test_chains_need_the_bridge_page_and_never_name_it(tok):
    pages = corpus()
    facts, titles = F.corpus_facts(pages, tok, 160)
    chains = F.chains(facts, titles)
    assert chains
    text = {p["title"]: p["text"] for p in pages}
    for c in chains:
        assert normalize_answer(F.strip_parens(c.fact.entity)) not in normalize_answer(c.question)
        assert c.answer in text[c.fact.entity]          # the answer is on the bridge's page
        assert c.answer not in text[c.bridge.entity]    # and not on the start's: one search cannot read it
        assert c.bridge.answer == c.fact.entity or titles[normalize_answer(c.bridge.answer)] == c.fact.entity


def test_held_out_entities_never_reach_training(built):
    held = built.reading_heldout + built.twohop_heldout
    assert len(built.reading_heldout) == 6 and len(built.twohop_heldout) >= 5
    banned = {normalize_answer(e) for r in held for e in r["entities"]}
    for r in built.solver_mix:
        names = set(r.get("entities", [])) | set(r["golden_answers"])
        assert not {normalize_answer(n) for n in names} & banned, r
    for d in built.demos:
        names = set(d.get("entities", [])) | set(d["answer"] if isinstance(d["answer"], list) else [d["answer"]])
        assert not {normalize_answer(n) for n in names} & banned, d["question"]
    for r in built.proposer_mix:
        assert normalize_answer(r["answer"]) not in banned
    finals = {(r["bridge"], r["relation"].split(">")[1]) for r in built.twohop_heldout}
    assert not [r for r in built.solver_mix if r["data_source"] == "reading"
                and (r["entities"][0], r["relation"]) in finals]
    check_no_leak(built.demos, held)  # and the builder's own check agrees


def test_training_never_restates_an_older_eval_pair(built):
    country, capital = corpus()[0]["title"], _name(0, 0) + " Town"
    for r in built.solver_mix:
        pair = {normalize_answer(x) for x in r.get("entities", []) + r["golden_answers"]}
        assert not {normalize_answer(country), normalize_answer(capital)} <= pair, r


def test_demos_quote_the_answer_and_mix_one_and_two_searches(built):
    solver = [d for d in built.demos if d["role"] == "solver"]
    for d in solver:
        validate_demo(d)
        last = d["turns"][-1]["text"]
        thought = last.split("<answer>")[0]
        if d["source"] == "name":   # a description question: the thought names the page it answers with
            assert thought.startswith("<think> Doc ") and f"is about {d['answer'][0]}:" in thought, last
        else:                       # a fact: the thought quotes the sentence that holds the answer
            assert " is about " not in thought and d["answer"][0] in thought, last
    assert not [d for d in solver if d["source"] != "twohop" and d["turns"][0]["text"].startswith("<think>")]
    searches = {sum(t["kind"] == "info" for t in d["turns"]) for d in solver}
    assert searches == {1, 2}
    two = [d for d in solver if d["source"] == "twohop"]
    for d in two:  # the bridge is named before the second search, and that search looks it up
        assert d["turns"][0]["text"].startswith("<think> First I need the ")   # a plan: a second search follows
        bridge = d["entities"][1]
        assert bridge in d["turns"][2]["text"].split("<search>")[0] and bridge in d["turns"][2]["text"].split("<search>")[1]


def test_every_demo_fits_the_protocol_it_was_built_for(built, tok, retriever):
    """Issue 31: demos a rollout under the protocol could never write taught the proposer to run out of turns.
    Checked here by counting tokens and turns directly, not through the builder's own misfit()."""
    from dataprep.protocol import Protocol

    def fits(d, proto):
        turns = [t["text"] for t in d["turns"] if t["kind"] == "model"]
        return len(turns) <= proto.max_turns and all(
            len(tok(t, add_special_tokens=False)["input_ids"]) <= proto.max_tokens_per_turn for t in turns)

    assert built.demos and all(fits(d, Protocol()) for d in built.demos)
    tight = Protocol(max_tokens_per_turn=28)
    small = build(corpus(), tok, retriever, _old_eval(), {"solver_qa": [], "proposer": []}, [], seed=0, reading_n=6,
                  twohop_n=5, title_rows=1, mix_demos=40, proto=tight)
    assert small.demos and all(fits(d, tight) for d in small.demos)
    # a cut turn still quotes the answer: the quote is shortened around it, not dropped
    assert any("..." in t["text"] for d in small.demos for t in d["turns"] if t["kind"] == "model")
    assert sum(v for k, v in small.stats.items() if "fits the protocol" in k or "fit the turn" in k
               or "over the cap" in k) > 0, small.stats


def test_proposer_demos_search_the_answer_then_what_a_solver_would(built, tok):
    """Both kinds: search the answer, quote what came back (inside the rollout's cut), search what the question's
    solver would search, and ask a question the game's filter accepts."""
    from dataprep.game_demos import block_text
    from dataprep.protocol import Protocol
    from inference.filters import FilterConfig, check_question

    props = [d for d in built.demos if d["role"] == "proposer"]
    assert {d["source"] for d in props} == {"proposer_fact", "proposer_name"}
    for d in props:
        validate_demo(d)
        m = [t["text"] for t in d["turns"] if t["kind"] == "model"]
        info = [t["docs"] for t in d["turns"] if t["kind"] == "info"]
        assert len(m) == 3 and d["n_searches"] == 2 and m[0] == f"<search> {d['answer']} </search>"
        quoted = re.sub(r"^<think> (Doc \d+: )?", "", m[1].split(" </think>")[0]).strip()
        if d["source"] == "proposer_name":   # the thought quotes and no more: naming the page led to searching it again
            assert not quoted.startswith("Doc ") and d["answer"] not in m[1].split("<search>")[1]
        shown = " ".join(block_text(tok, info[0], Protocol()).split())
        assert all(" ".join(p.split()) in shown for p in quoted.split("...") if p.strip()), (quoted, shown)
        assert d["answer"] in quoted or d["source"] == "proposer_name"
        query = m[1].split("<search>")[1].split("</search>")[0].strip()
        if d["source"] == "proposer_fact":    # the page the question is about, by name, comes back first
            assert query in d["question"] and info[1][0]["contents"].split("\n")[0] == d["entities"][0]
        else:                                 # the description the question gives finds the page
            assert query in d["question"] and d["entities"][0] in [x["contents"].split("\n")[0] for x in info[1]]
        q = m[2].split("<question>")[1].split("</question>")[0].strip()
        assert q == d["question"] and check_question(q, d["answer"], ["a b", query], info, 2,
                                                     FilterConfig(min_words=4)) is None


def test_proposer_rows_mix_answer_kinds(built):
    from collections import Counter

    kinds = Counter(r["data_source"] for r in built.proposer_mix)
    assert kinds["fact"] > 0 and kinds["chain_end"] > 0
    assert kinds["name"] <= kinds["fact"] + kinds["chain_end"]      # names are no longer nearly all of them
    assert all(r["search_turns"] == 2 for r in built.proposer_mix)    # the protocol's max_turns - 1


def test_few_chains_are_repeated_to_their_share_of_the_mix(built):
    """Chains are scarce (the real corpus keeps ~25 chain demos for training): with one copy each, 3% of
    the solver demos searched twice and the SFT start never searched twice on the two-hop set."""
    from collections import Counter

    from dataprep.reading_sets import CHAIN_DEMO_COPIES

    two = [d for d in built.demos if d["source"] == "twohop"]
    per_chain = Counter(d["question"] for d in two)
    assert per_chain and max(per_chain.values()) <= CHAIN_DEMO_COPIES
    assert len(two) == min(len(per_chain) * CHAIN_DEMO_COPIES, 40 // 10)   # mix_demos=40: a tenth is 4
    assert max(per_chain.values()) - min(per_chain.values()) <= 1      # every chain once before any twice


def test_build_is_deterministic(built, tok, retriever):
    again = build(corpus(), tok, retriever, _old_eval(), {"solver_qa": [], "proposer": []}, [], seed=0, reading_n=6,
                  twohop_n=5, title_rows=1, mix_demos=40)
    assert json.dumps(again.reading_heldout) == json.dumps(built.reading_heldout)
    assert json.dumps(again.twohop_heldout) == json.dumps(built.twohop_heldout)


def test_entity_rows_ban_entities_not_answers():
    idx = EvalIndex([{"question": "Korkor Town was founded in what year?", "golden_answers": ["1700"], "id": "r",
                      "entities": ["Korkor Town"]}])
    assert idx.overlaps({"question": "Lumtar Town was founded in what year?", "answer": ["1700"]}) == []
    assert idx.overlaps({"question": "Where is it?", "answer": ["Korkor Town"]})
    assert idx.overlaps({"question": "Q?", "answer": ["x"], "entities": ["Korkor Town"]})


def test_quote_and_title_thought(tok):
    from dataprep.protocol import Protocol

    s = " ".join(f"w{i}" for i in range(40)) + " answer here"
    q = quote(s, "answer", 22)
    assert "answer" in q and len(q.split()) <= 24
    demo = {"role": "solver", "answer": ["Korkor Town"], "question": "q", "turns": [
        {"kind": "model", "text": "<search> x </search>"},
        {"kind": "info", "docs": [{"id": "1", "contents": "Korkor Town\nKorkor Town is a city in Korkia. More.", "score": 1}]},
        {"kind": "model", "text": "<think> Doc 1 is about Korkor Town. </think>\n<answer> Korkor Town </answer>"}]}
    # a description question: the thought names the page it answers with, then quotes its first sentence
    assert title_demo_think(demo, tok, Protocol())["turns"][-1]["text"] == (
        "<think> Doc 1 is about Korkor Town: Korkor Town is a city in Korkia. </think>\n<answer> Korkor Town </answer>")
    # a span mentioned in a doc: the sentence that holds it is quoted
    span = {**demo, "answer": ["Korkia"], "turns": demo["turns"][:2] + [
        {"kind": "model", "text": "<think> Doc 1 mentions Korkia. </think>\n<answer> Korkia </answer>"}]}
    assert title_demo_think(span, tok, Protocol())["turns"][-1]["text"] == (
        "<think> Doc 1: Korkor Town is a city in Korkia. </think>\n<answer> Korkia </answer>")
    assert title_demo_think(demo, tok, Protocol(max_tokens_per_turn=8)) is None     # nothing fits 8 tokens


def test_a_game_demo_whose_question_equals_an_eval_question_is_dropped_up_front(tok, retriever, built):
    """A name demo asks for a page by its first sentence, so its question can equal an eval question about another
    page (CI's smoke build hit "What is the name of a municipality in central Vietnam?"). The builder drops it up
    front; the final guard (check_no_leak) would otherwise stop the whole data step."""
    from inference.data import EvalRow

    asked = [d["question"] for d in built.demos if d["role"] == "proposer" and d["source"] == "proposer_name"]
    assert asked, "the fixture's mix has no name demo to collide with"
    clash = EvalRow(question=asked[0], golden_answers=["Nowhere Else"], data_source="wiki_desc", id="clash-0", meta={})
    old_train = {"solver_qa": [{"question": "What is the name of the league?", "golden_answers": ["League"],
                                "data_source": "wiki_desc"}],
                 "proposer": [{"answer": corpus()[4]["title"], "search_turns": 2, "data_source": "wiki"}]}
    b = build(corpus(), tok, retriever, _old_eval() + [clash], old_train, [], seed=0, reading_n=6, twohop_n=5,
              title_rows=1, mix_demos=40)
    assert normalize_answer(asked[0]) not in {normalize_answer(d["question"]) for d in b.demos}
    assert b.stats["name proposer demos dropped: overlap an eval row"] >= 1
    check_no_leak(b.demos, _old_eval() + [clash] + b.reading_heldout + b.twohop_heldout)
