"""Cold-start SFT data: the leak check refuses overlapping sets, and the builder writes
well-formed demos for both roles from a real (tiny) BM25 index over real wiki summaries; every
proposer demo is one the RL game would accept (its filter, its search range) and writes its
question from what it retrieved."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference.filters import FILTER_REASONS, FilterConfig, check_question
from inference.game import GameConfig
from inference.parser import parse_action
from dataprep import coldstart
from dataprep.clues import article_clues, compose_question, desc_phrase, sentences
from dataprep.coldstart import build_demos, summary_lines, wiki_candidates
from dataprep.demos import find_answer_doc, validate_demo
from dataprep.leak_check import LeakError, check_no_leak, load_eval_files
from training.settings.config import RolloutArgs, SelfPlayArgs
from utils.text import normalize_answer

REPO = Path(__file__).resolve().parents[2]
N_ARTICLES = 150
# The trainer's defaults, read here and not from the builder: the demos must pass what RL runs.
RL_FILTER = GameConfig(min_searches=SelfPlayArgs.min_searches).filter_config()
RL_N = range(SelfPlayArgs.min_searches, RolloutArgs.max_turns)  # clamp_search_turns' [min_searches, max_turns - 1]
PROPOSER_DROPS = {"answer_not_retrieved", "first_sentence_unusable", "too_few_clue_sentences",
                  "clue_search_misses_answer", "duplicate", "eval overlap in turn text"} | {f"filter:{r}" for r in FILTER_REASONS}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def wiki() -> dict:
    """The first N articles of the real wiki summaries asset (same source as the real build)."""
    from utils.assets import wiki_summaries

    src = json.loads(wiki_summaries().read_text())
    return {k: src[k] for k in sorted(src)[:N_ARTICLES]}


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, wiki) -> Path:
    from retrieval.build_index import build_index

    tmp = tmp_path_factory.mktemp("cs_index")
    rows = [{"id": f"d{i}", "contents": f"{a.get('title') or k}\n{' '.join(a['extract'].split())}"}
            for i, (k, a) in enumerate(sorted(wiki.items())) if (a.get("extract") or "").strip()]
    build_index(_write_jsonl(tmp / "corpus.jsonl", rows), tmp / "bm25", "bm25")
    return tmp / "bm25"


@pytest.fixture(scope="module")
def retriever(index_dir):
    from retrieval.retriever import load_retriever

    return load_retriever(index_dir)


@pytest.fixture(scope="module")
def doll_question(wiki) -> str:
    return next(c["question"] for c in wiki_candidates(wiki) if c["name"] == "A Doll's House")


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory, doll_question) -> Path:
    """An eval set that bans one answer (ABBA), one question (A Doll's House), and two FanOutQA
    top-level questions (one by a sub-question id, one by its own id)."""
    rows = [
        {"id": "e1", "question": "Which band sang Waterloo in 1974?", "golden_answers": ["ABBA"], "data_source": "t"},
        {"id": "e2", "question": doll_question, "golden_answers": ["Nora"], "data_source": "t"},
        {"id": "s2b", "question": "In which year was that novella published?", "golden_answers": ["1843"],
         "data_source": "fanoutqa_single"},
        {"id": "t3", "question": "How many paintings did the painter make?", "golden_answers": ["70"],
         "data_source": "fanoutqa"},
    ]
    return _write_jsonl(tmp_path_factory.mktemp("cs_eval") / "tiny_eval.jsonl", rows)


@pytest.fixture(scope="module")
def fanout_dev() -> list[dict]:
    # FanOutQA's dev-file shape: nested decompositions, answers of any type.
    def sub(i, q, a, children=()):
        return {"id": i, "question": q, "answer": a, "decomposition": list(children), "depends_on": [], "evidence": {}}

    return [
        {"id": "t1", "question": "top 1", "answer": "x", "decomposition": [
            sub("s1", "Who directed 2001: A Space Odyssey?", "Stanley Kubrick"),
            sub("s1b", "Which films came out in 1968?", ["a", "b"])]},
        {"id": "t2", "question": "top 2", "answer": "y", "decomposition": [
            sub("s2a", "Who wrote A Christmas Carol?", "Charles Dickens", [sub("s2b", "When was it published?", "1843")])]},
        {"id": "t3", "question": "top 3", "answer": "z", "decomposition": [
            sub("s3", "Who painted A Sunday Afternoon on the Island of La Grande Jatte?", "Georges Seurat")]},
    ]


@pytest.fixture(scope="module")
def built(retriever, wiki, fanout_dev, eval_file):
    return build_demos(retriever, wiki, fanout_dev, load_eval_files([eval_file]), solver_n=25, proposer_n=12, seed=3)


# ------------------------------------------------------------------ leak check
def _solver(q, answers, query=None):
    return {"role": "solver", "question": q, "answer": answers, "source": "t",
            "turns": [{"kind": "model", "text": f"<search> {query or q} </search>"}, {"kind": "info", "docs": []},
                      {"kind": "model", "text": f"<answer> {answers[0]} </answer>"}]}


def _proposer(answer, q):
    return {"role": "proposer", "answer": answer, "n_searches": 1, "source": "t", "question": q,
            "turns": [{"kind": "model", "text": f"<search> {answer} </search>"}, {"kind": "info", "docs": []},
                      {"kind": "model", "text": f"<question> {q} </question>"}]}


def test_leak_check_refuses_overlaps_and_passes_clean(eval_file):
    rows = load_eval_files([eval_file])
    clean = [_solver("What is the name of the burrowing mammal native to Africa?", ["Aardvark"]),
             _proposer("Abacus", "What is the name of the calculating tool?")]
    report = check_no_leak(clean, rows)
    assert report["overlaps"] == 0 and report["demos"] == 2 and report["eval_rows"] == 4

    cases = {
        "question": _solver("which band sang WATERLOO in 1974", ["Someone"]),        # normalised question equality
        "answer": _solver("What is the name of the Swedish pop group?", ["The Group", "Abba."]),  # an alias
        "written question": _proposer("Agnetha", "Which band sang Waterloo in 1974?"),
        "proposer answer": _proposer("abba", "What is the name of the Swedish pop group?"),
        "contains": _solver("Who sang it?", ["Someone"], query="Which band sang Waterloo in 1974? lyrics"),
    }
    for name, demo in cases.items():
        with pytest.raises(LeakError) as e:
            check_no_leak(clean + [demo], rows)
        msg = str(e.value)
        assert "1 of 3 demos" in msg and "demo #2" in msg and "tiny_eval.jsonl:e1" in msg, (name, msg)
        assert ("answer" in msg) if "answer" in name else ("question" in msg), (name, msg)
    with pytest.raises(LeakError, match="5 of 7 demos"):
        check_no_leak(clean + list(cases.values()), rows)


def test_answer_lookup_is_word_bounded_and_grounded():
    docs = [{"id": "1", "contents": "Leadership\nA leader leads.", "score": 2.0},
            {"id": "2", "contents": "Stadium\nStadiums host the various codes of rugby.", "score": 1.0},
            {"id": "3", "contents": "Lead\nLead is a chemical element.", "score": 0.5}]
    assert find_answer_doc(docs, ["Lead"]) == (3, True)          # own article, not "leader"
    assert find_answer_doc(docs[:2], ["Lead"]) is None
    q = "What is the current home stadium of the Spain national football team?"
    assert find_answer_doc(docs[1:2], ["Various"]) == (1, False)  # a bare mention counts without a question
    assert find_answer_doc(docs[1:2], ["Various"], q) is None     # but not as grounding for that question
    assert desc_phrase("American writer (1890–1937)", "H. P. Lovecraft was an American writer") == "American writer (1890–1937)"
    assert desc_phrase("Chemical element with atomic number 82", "Lead is a chemical element") == "chemical element with atomic number 82"


# ------------------------------------------------------------------ the builder
def _check_proposer_demo(d: dict, wiki: dict, fcfg: FilterConfig = RL_FILTER) -> None:
    """A proposer demo the RL game accepts, whose question is written from its own retrieved article."""
    turns, n = d["turns"], d["n_searches"]
    queries = [parse_action(t["text"]).content for t in turns[:-1:2]]
    docs = [t["docs"] for t in turns[1::2]]
    assert n in RL_N and len(queries) == n and len(turns) == 2 * n + 1, d
    assert parse_action(turns[-1]["text"]).content == d["question"]
    # the RL game's cheap filter, with the trainer's defaults and with the prompt's n required
    assert check_question(d["question"], d["answer"], queries, docs, n, fcfg) is None, d["question"]
    assert check_question(d["question"], d["answer"], queries, docs, n,
                          FilterConfig(**{**vars(fcfg), "searches_at_least_n": True})) is None
    # the first search finds the answer's article, and every later search (a clue) leads back to it
    cand = next(c for c in wiki_candidates(wiki) if c["name"] == d["answer"])
    art = next(x for x in docs[0] if x["contents"].split("\n")[0] == cand["title"])
    assert all(art["id"] in {x["id"] for x in ds} for ds in docs[1:]), d
    # every word of the question is in that retrieved article (the template's words aside): it is not
    # the Wikidata description question ("What is the name of the <description>?"), in no document
    words = set(normalize_answer(d["question"]).split()) - set(normalize_answer(compose_question(["x", "y"])).split())
    missing = words - set(normalize_answer(art["contents"]).split())
    assert not missing, (d["question"], missing)
    assert d["question"] != cand["question"]


def test_builder_writes_well_formed_grounded_clean_demos(built, retriever, wiki, eval_file, doll_question):
    demos, stats = built
    by_role = {r: [d for d in demos if d["role"] == r] for r in ("solver", "proposer")}
    assert len(by_role["solver"]) == 25 and len(by_role["proposer"]) == 12, stats
    for d in demos:
        validate_demo(d)
        turns = d["turns"]
        for i in range(1, len(turns) - 1, 2):
            # info turns hold exactly what the retriever returns for the query the model turn wrote
            act = parse_action(turns[i - 1]["text"])
            assert act.kind == "search" and turns[i - 1]["text"].endswith("</search>")
            got = turns[i]["docs"]
            assert [x["id"] for x in got] == [x["id"] for x in retriever.search([act.content], 3)[0]]
            assert got and all(set(x) == {"id", "contents", "score"} for x in got)
        blob = " ".join(f" {normalize_answer(x['contents'])} " for t in turns if t["kind"] == "info" for x in t["docs"])
        if d["role"] == "solver":
            assert parse_action(turns[-1]["text"]) .kind == "answer"
            assert any(f" {normalize_answer(a)} " in blob for a in d["answer"]), d
        else:
            _check_proposer_demo(d, wiki)
        for t in turns:
            if t["kind"] == "model":  # short turns: at most one <think> and one action
                assert t["text"].count("<think>") <= 1 and len(t["text"]) < 400
    check_no_leak(demos, load_eval_files([eval_file]))
    assert "ABBA" not in {a for d in demos for a in ([d["answer"]] if isinstance(d["answer"], str) else d["answer"])}
    assert normalize_answer(doll_question) not in {normalize_answer(d["question"]) for d in demos}
    fan = {d["question"] for d in demos if d["source"] == "fanoutqa_sub"}
    assert fan == {"Who directed 2001: A Space Odyssey?"}, (fan, stats)
    assert stats[("solver", "fanoutqa_sub", "top-level question has an eval row")] == 3
    assert stats[("solver", "fanoutqa_sub", "non-scalar answer")] == 1
    # the two roles never share an article
    sol = {normalize_answer(d["answer"][0]) for d in by_role["solver"]}
    assert not sol & {normalize_answer(d["answer"]) for d in by_role["proposer"]}
    # an equal share of demos for each n the RL rows ask for (prepare_data draws n uniformly)
    assert sorted(d["n_searches"] for d in by_role["proposer"]) == sorted(list(RL_N) * (12 // len(RL_N)))
    # the proposer's dropped candidates are counted by reason, and printed
    drops = {why: k for (role, _, why), k in stats.items() if role == "proposer"}
    assert drops and set(drops) <= PROPOSER_DROPS and drops.get("too_few_clue_sentences", 0) > 0, stats
    printed = "\n".join(summary_lines(demos, stats, {"solver": 25, "proposer": 12}))
    assert "too_few_clue_sentences" in printed and f"proposer searches n: { {n: 12 // len(RL_N) for n in RL_N} }" in printed


def test_builder_drops_what_the_filter_refuses_and_keeps_n_in_range(retriever, wiki, fanout_dev, eval_file, monkeypatch):
    """The builder asks the real filter (here made stricter) and counts its refusals; n follows the arguments."""
    rows = load_eval_files([eval_file])
    demos, stats = build_demos(retriever, wiki, fanout_dev, rows, solver_n=0, proposer_n=4, seed=1,
                               min_searches=3, max_turns=4)
    assert len(demos) == 4 and {d["n_searches"] for d in demos} == {3}
    for d in demos:
        _check_proposer_demo(d, wiki)
    strict = FilterConfig(min_words=22)
    monkeypatch.setattr(coldstart, "rl_filter_config", lambda min_searches: strict)
    demos, stats = build_demos(retriever, wiki, fanout_dev, rows, solver_n=0, proposer_n=2, seed=1)
    assert stats[("proposer", "wiki_extract", "filter:too_few_words")] > 0, stats
    for d in demos:
        assert len(d["question"].split()) >= 22
        _check_proposer_demo(d, wiki, strict)
    for lo, turns in ((0, 4), (3, 3), (2, 2)):
        with pytest.raises(ValueError, match="min_searches"):
            build_demos(retriever, wiki, fanout_dev, rows, solver_n=0, proposer_n=1, min_searches=lo, max_turns=turns)


def test_article_clues_read_the_answer_off_its_own_sentences():
    text = ("Betelgeuse (from Arabic) is a red supergiant star in the equatorial constellation of Orion. "
            "It is usually the tenth-brightest star in the night sky. Betelgeuse was named by H. P. Someone. "
            "It is thought that it will explode. The star is large. Betelgeuse has the formula Al2Si2O5(OH)4 "
            "in St. Louis.")
    assert sentences(text)[0] == "Betelgeuse is a red supergiant star in the equatorial constellation of Orion."
    assert sentences(text)[2] == "Betelgeuse was named by H. P. Someone."
    clues = article_clues(text, "Betelgeuse", ["Betelgeuse"])
    # "It is thought that" is no fact about the answer; "The star ..." does not name it
    assert clues == ["a red supergiant star in the equatorial constellation of Orion",
                     "is usually the tenth-brightest star in the night sky", "was named by H. P. Someone",
                     "has the formula Al2Si2O5(OH)4 in St. Louis"]
    assert compose_question(clues[:2]) == ("What is the name of a red supergiant star in the equatorial "
                                           "constellation of Orion that is usually the tenth-brightest star in the night sky?")
    assert compose_question(["a tool that cuts", "is old", "is sharp"]) == "What is the name of a tool that cuts and is old and is sharp?"
    # a clue naming the answer is skipped; a long one is cut at a clause break; no copula, no clues
    assert article_clues("Lead is a metal. It is called lead by chemists. It is soft.", "Lead", ["Lead"]) == ["a metal", "is soft"]
    long = "Kelly was an American dancer, actor, singer, director and choreographer of many well known films of the golden age of Hollywood."
    assert article_clues(long + " Kelly starred in films.", "Gene Kelly", ["Gene Kelly"]) == ["an American dancer", "starred in films"]
    assert article_clues("In 1990 the band toured.", "The Band", ["The Band"]) == []


def test_builder_is_deterministic(built, retriever, wiki, fanout_dev, eval_file):
    again, _ = build_demos(retriever, wiki, fanout_dev, load_eval_files([eval_file]), solver_n=25, proposer_n=12, seed=3)
    assert again == built[0]


@pytest.mark.timeout(120)
def test_cli_end_to_end(tmp_path, index_dir, wiki, fanout_dev, eval_file):
    wiki_path, dev_path, out = tmp_path / "wiki.json", tmp_path / "dev.json", tmp_path / "out" / "cs.jsonl"
    wiki_path.write_text(json.dumps(wiki))
    dev_path.write_text(json.dumps(fanout_dev))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dataprep.coldstart", "--index", str(index_dir), "--eval", str(eval_file),
           "--wiki", str(wiki_path), "--fanoutqa", str(dev_path), "--solver_n", "6", "--proposer_n", "4",
           "--out", str(out), "--min_searches", "2", "--max_turns", "4", "--max_tokens_per_turn", "0"]
    # a held-out description set, kept away from the demos and from the RL rows' answers
    cands = wiki_candidates(wiki)
    train = _write_jsonl(tmp_path / "proposer.jsonl", [{"answer": c["name"], "search_turns": 2} for c in cands[::2]])
    held_path = tmp_path / "held.jsonl"
    cmd += ["--heldout_n", "5", "--heldout_out", str(held_path), "--train_files", str(train)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10 and sum(d["role"] == "solver" for d in rows) == 6
    assert not (out.parent / "cs.jsonl.tmp").exists()
    assert "leak check: 10 demos vs 9 eval rows from tiny_eval.jsonl, held.jsonl: 0 overlaps" in r.stdout, r.stdout
    assert "proposer searches n: {2: 2, 3: 2}" in r.stdout and "dropped:" in r.stdout, r.stdout
    held = [json.loads(line) for line in held_path.read_text().splitlines()]
    banned = {c["name"] for c in cands[::2]}
    demo_answers = {a for d in rows for a in ([d["answer"]] if isinstance(d["answer"], str) else d["answer"])}
    demo_questions = {d.get("question") for d in rows}
    assert len(held) == 5 and all(h["data_source"] == "wiki_desc_heldout" for h in held)
    for h in held:
        assert not set(h["golden_answers"]) & (banned | demo_answers) and h["question"] not in demo_questions

    # --check: the clean file passes, a file with an eval answer is refused with the reason
    check = [sys.executable, "-m", "dataprep.coldstart", "--eval", str(eval_file), "--check"]
    assert subprocess.run(check + [str(out)], cwd=REPO, env=env, capture_output=True, text=True).returncode == 0
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows + [_solver("Name the Swedish pop group", ["ABBA"])])
    r = subprocess.run(check + [str(bad)], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "1 of 11 demos" in r.stderr and "'ABBA'" in r.stderr, r.stderr
    # a search range the RL game cannot play is refused before anything is built
    r = subprocess.run(cmd + ["--min_searches", "3", "--max_turns", "3"], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "--min_searches" in r.stderr, r.stderr


# sha256 of the two files the builder's CLI writes for the inputs of the test below, produced by
# training/coldstart_data.py at commit 4375359, before issue 24 split it into dataprep/: the split (and any
# later move) must not change a byte. Checked equal across two processes with different PYTHONHASHSEED.
# Regenerate only on purpose, when the builder's output is meant to change, and say why in the commit.
PRE_SPLIT_SHA256 = {"cs.jsonl": "c2d983717610d2d1f79dc17a42a9ef1fba6798ef5e83d919f73b55f098794d24",
                    "held.jsonl": "937edc6f0c8abdd1f7a2d1b3819bdb46b54f632d89ff41a70f08b09cf17f25ab"}


@pytest.mark.timeout(120)
def test_outputs_byte_identical_to_the_pre_split_builder(tmp_path, index_dir, wiki, fanout_dev, eval_file):
    """The CLI (in-process) on 150 real wiki summaries, a real BM25 index, a FanOutQA-shaped dev file and the
    tiny eval set: 29 demos for both roles (n = 1..3 searches), 7 held-out rows, the leak check on the way."""
    wiki_path, dev_path = tmp_path / "wiki.json", tmp_path / "dev.json"
    wiki_path.write_text(json.dumps(wiki))
    dev_path.write_text(json.dumps(fanout_dev))
    cands = wiki_candidates(wiki)
    train = _write_jsonl(tmp_path / "proposer.jsonl", [{"answer": c["name"], "search_turns": 2} for c in cands[::3]])
    out, held = tmp_path / "cs.jsonl", tmp_path / "held.jsonl"
    rc = coldstart.main(["--index", str(index_dir), "--eval", str(eval_file), "--wiki", str(wiki_path),
                         "--fanoutqa", str(dev_path), "--solver_n", "20", "--proposer_n", "9", "--seed", "5",
                         "--min_searches", "1", "--max_turns", "4", "--max_tokens_per_turn", "0", "--out", str(out),
                         "--heldout_n", "7",
                         "--heldout_out", str(held), "--train_files", str(train)])
    assert rc == 0
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out, held)}
    assert got == PRE_SPLIT_SHA256


def test_builder_drops_demos_over_the_protocols_turn_cap(retriever, wiki, fanout_dev, eval_file, smollm2_dir):
    """Issue 31: demos with a turn longer than --max_tokens_per_turn (or more turns than --max_turns) taught the
    proposer rollouts that run out of room. With the protocol given, every demo kept fits it (counted here with
    the tokenizer directly) and the dropped ones are counted by reason."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rows = load_eval_files([eval_file])
    cap = 40
    demos, stats = build_demos(retriever, wiki, fanout_dev, rows, solver_n=10, proposer_n=6, seed=3, min_searches=2,
                               max_turns=3, tok=tok, max_tokens_per_turn=cap)
    assert demos
    for d in demos:
        turns = [t["text"] for t in d["turns"] if t["kind"] == "model"]
        assert len(turns) <= 3 and max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in turns) <= cap
    assert all(d["n_searches"] == 2 for d in demos if d["role"] == "proposer")
    assert any("does not fit the protocol" in why and k > 0 for (_, _, why), k in stats.items()), stats
    loose, _ = build_demos(retriever, wiki, fanout_dev, rows, solver_n=10, proposer_n=6, seed=3, min_searches=2,
                           max_turns=3)                          # no tokenizer: no cap, longer proposer turns kept
    assert max(len(tok(t["text"], add_special_tokens=False)["input_ids"]) for d in loose for t in d["turns"]
               if t["kind"] == "model") > cap
