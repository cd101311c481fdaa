"""Issue 41 (3): the game's levers, each a flag.

  --rag_verify retrieval | policy+retrieval   a question is answerable when one search of the question itself (the
                                              solver's back-end and topk) returns the answer; no model to fool
  --shortcut_filter title | queries | both    refuse a question whose own top-1 result is the answer's page, or whose
                                              proposer searched for its answer; reward 0, never the format penalty
  --proposer_seed articles                    proposer rows drawn from the corpus, the same on every rank and resume

Both round schedules must make the same checks with the same verdicts, the question's search once per question on a
lockstep group's first rank.
"""

from __future__ import annotations

import threading

import pytest

from inference.data import ArticleRows, ProposerRow, mix_search_turns
from inference.filters import FILTER_REASONS, SHORTCUT_REASONS
from inference.game import GameConfig, play_round, question_searcher, score
from inference.judge import Judge
from inference.pipeline import filter_reason
from inference.rag_check import search_questions, searched_verdict
from inference.rollout import RolloutConfig
from inference.trajectory import GameMeta, Trajectory
from tests.inference.test_pipeline import _same_round
from tests.scripted_policy import LINCOLN, LINCOLN_QUERIES, Q_LINCOLN, READ_TITLE, ScriptedPolicy
from utils.errors import InputError

pytestmark = pytest.mark.timeout(600)

# answer -> (the proposer's two queries, its question); against the 300-document BM25 index of tests' conftest:
SCRIPT = {
    # its question's top-1 result is "Abraham Lincoln" (a title shortcut) and it searched "Lincoln" (a query one)
    "Abraham Lincoln": (LINCOLN_QUERIES, Q_LINCOLN),
    # top-1 "Algerian War", whose text names Algeria: retrievable, no shortcut
    "Algeria": (["North Africa country", "war of independence France"],
                "Which North African country won a war of independence against France in 1962?"),
    # nonsense words: what the search returns never holds "Abuja" (retrieval refuses it)
    "Abuja": (["Nigeria capital city", "planned city Nigeria"],
              "Which zqxv wibble frobnicate glorp snark quux blarg florp city?"),
}
ROWS = [ProposerRow(LINCOLN, 2), ProposerRow("Algeria", 2), ProposerRow("Abuja", 2)]


def lever_policy(tokenizer):
    """Plays from SCRIPT: a proposer searches its two queries, then asks its question. A solver searches "Lincoln",
    then answers the title of Doc 1 of the first block it read; so does the policy's RAG check, whose draws thus
    show in its verdict."""
    return ScriptedPolicy(tokenizer, solver_answer=READ_TITLE, proposers=SCRIPT)


class Counted:
    """A search back-end whose `uncounted` entry (what the game's question checks and probe use) records each call."""

    def __init__(self, search):
        self.search, self.asked, self.topks = search, [], []

    def __call__(self, queries, topk):
        return self.search(queries, topk)

    def uncounted(self, queries, topk):
        self.asked.append(list(queries))
        self.topks.append(topk)
        return self.search(queries, topk)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def no_probe(monkeypatch):
    """The round's stats probe searches the valid questions too; off, so the counts are the checks' alone."""
    monkeypatch.setattr("inference.game.one_search_answerable", lambda *a, **k: None)


def _round(engine, search, rag, shortcut, schedule, seed=5):
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify=rag, shortcut_filter=shortcut, rag_distractors=1,
                     min_searches=2, format_penalty=-1.0, seed=seed)
    rcfg = RolloutConfig(max_turns=4, max_tokens_per_turn=32, max_info_tokens=128, topk=2, seed=3, schedule=schedule)
    return play_round(engine, ROWS, {"proposer": search.search, "solver": search}, Judge(), cfg, rcfg, step=4)


SQ, ST, RF = "shortcut_queries", "shortcut_title", "rag_failed"
ALL = list(SCRIPT)
CASES = [  # (--rag_verify, --shortcut_filter, each proposer's reason, the answers whose questions the checks search)
    ("retrieval", "off", [None, None, None, None, RF, RF], ALL),
    ("off", "title", [ST, ST, None, None, None, None], ALL),
    ("off", "queries", [SQ, SQ, None, None, None, None], []),
    ("retrieval", "both", [SQ, SQ, None, None, RF, RF], ["Algeria", "Abuja"]),
    ("policy+retrieval", "title", [ST, ST, None, None, RF, RF], ALL),
]


@pytest.mark.parametrize("rag, shortcut, reasons, searched", CASES, ids=[f"{r}-{s}" for r, s, _, _ in CASES])
def test_both_schedules_make_the_same_checks_once_per_question(tokenizer, bm25, no_probe, rag, shortcut, reasons,
                                                               searched):
    played, asked = [], []
    for schedule in ("turn", "trajectory"):
        search = Counted(bm25.search)
        played.append(_round(lever_policy(tokenizer), search, rag, shortcut, schedule))
        asked.append(search)
    _same_round(*played)
    props = [t for t in played[1].trajectories if t.role == "proposer"]
    got = [t.outcome.filter_reason for t in props]
    assert got[:2] == reasons[:2] and got[4:] == reasons[4:]
    assert got[2:4] == reasons[2:4] or rag == "policy+retrieval"   # the policy may refuse Algeria's: both did alike
    for t, why in zip(props, got):   # a shortcut scores 0, any other refusal the format penalty
        if why is not None:
            assert t.reward == (0.0 if why in SHORTCUT_REASONS else -1.0), (why, t.reward)
    for reason in (SQ, ST, RF):
        assert played[1].stats[f"game/filter/{reason}"] == got.count(reason)
    # the checks' search: the solver's topk, each candidate question once, one call each (in waves too)
    questions = sorted(SCRIPT[a][1] for a in searched for _ in range(2))   # proposer_n = 2
    for search in asked:
        assert sorted(q for call in search.asked for q in call) == questions and set(search.topks) <= {2}
    assert len(asked[0].asked) == len(asked[1].asked) == len(questions)
    if rag != "off":
        verdicts = {i: t.outcome.rag for i, t in enumerate(props) if got[i] not in (SQ, ST)}
        assert all(v is (got[i] is None) for i, v in verdicts.items()), verdicts


def test_the_policy_is_not_asked_about_a_question_retrieval_refused(tokenizer, bm25, no_probe):
    """policy+retrieval: Abuja's question fails its search, so the policy never reads it (no RAG answer recorded)."""
    res = _round(lever_policy(tokenizer), Counted(bm25.search), "policy+retrieval", "off", "trajectory")
    props = [t for t in res.trajectories if t.role == "proposer"]
    assert [t.outcome.rag_answer is not None for t in props] == [True, True, True, True, False, False]


def test_a_failed_question_search_decides_nothing(tokenizer, bm25, no_probe):
    """The search back-end fails for the checks: the questions pass undecided (verdict None), never refused, and
    mark_excluded leaves their proposer groups out of the loss; both schedules alike."""
    class Down(Counted):
        def uncounted(self, queries, topk):
            raise ConnectionError("retriever down")

    played = [_round(lever_policy(tokenizer), Down(bm25.search), "retrieval", "title", s)
              for s in ("turn", "trajectory")]
    _same_round(*played)
    props = [t for t in played[1].trajectories if t.role == "proposer"]
    assert [t.outcome.filter_reason for t in props] == [None] * 6
    assert [t.outcome.rag for t in props] == [None] * 6 and all(t.outcome.excluded for t in props)


def test_the_question_search_runs_on_the_first_rank_only(tokenizer, bm25, no_probe):
    from tests.inference.test_rollout_schedule import GroupRank, ThreadGroup

    group = ThreadGroup()
    ranks = [GroupRank(lever_policy(tokenizer), group, r) for r in (0, 1)]
    searches = [Counted(bm25.search), Counted(bm25.search)]
    out = [None, None]

    def go(r):
        out[r] = _round(ranks[r], searches[r], "policy+retrieval", "both", "trajectory")

    threads = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert out[0] is not None and out[1] is not None, "a rank failed or hung"
    assert searches[0].asked and searches[1].asked == []
    _same_round(out[0], out[1], pipelined=(1.0, 1.0))


def test_a_simulated_search_cannot_serve_the_question_checks():
    class Simulated:
        wants_context = True

        def search(self, queries, topk, contexts=None):
            return [[] for _ in queries]

    rcfg = RolloutConfig(max_turns=4, max_tokens_per_turn=32, topk=2)
    for rag, shortcut in (("retrieval", "off"), ("policy+retrieval", "off"), ("off", "title"), ("off", "both")):
        cfg = GameConfig(rag_verify=rag, shortcut_filter=shortcut)
        for solver in (Simulated().search, None):
            with pytest.raises(ValueError, match=r"--rag_verify retrieval\|policy\+retrieval and --shortcut_filter "
                                                 r"title\|both .* need --solver_search retriever"):
                play_round(None, ROWS, {"proposer": None, "solver": solver}, Judge(), cfg, rcfg)
    with pytest.raises(ValueError, match="shortcut_filter must be one of"):
        GameConfig(shortcut_filter="always")


def _traj(question, answer, queries=("q one", "q two")):
    return Trajectory("proposer", "g", [1], [1], [-1.0], question=question, answer=answer, stop_reason="question",
                      queries=list(queries),
                      docs=[[{"id": "1", "contents": "T\nsome text"}]] * len(queries), meta=GameMeta(search_turns=2))


def test_search_questions_reads_title_and_text_and_the_verdicts():
    docs = {"q1": [{"id": "1", "contents": "Paris\nThe capital of France."}],
            "q2": [{"id": "2", "contents": "Seine\nA river that runs through Paris."}],
            "q3": [{"id": "3", "contents": "Lyon\nA city."}]}
    got = search_questions(["q1", "q2", "q3"], ["Paris", ["Paris", "City of Light"], "Paris"],
                           lambda qs, k: [docs[q] for q in qs], 3)
    assert [g[0] for g in got] == [True, True, False]   # the title line counts, and the text
    t = _traj("a question", "Paris")
    title = GameConfig(rag_verify="retrieval", shortcut_filter="title")
    assert searched_verdict(t, got[0], title) == ("shortcut_title", True)
    assert searched_verdict(t, got[1], title) == (None, True)
    assert searched_verdict(t, got[2], title) == (None, False)
    assert searched_verdict(t, got[2], GameConfig(shortcut_filter="title")) == (None, True)   # no retrieval: no verdict
    assert searched_verdict(t, None, title) == (None, None)   # the search failed: undecided


def test_a_shortcut_refusal_scores_zero_every_other_the_format_penalty():
    reasons = [*FILTER_REASONS, "rag_failed"]
    assert {"shortcut_queries", "shortcut_title"} <= set(reasons)   # counted as game/filter/<reason>
    props = [_traj("a question", "Paris") for _ in reasons]
    score(props, reasons, [], Judge(), GameConfig(rag_verify="off", format_penalty=-1.0))
    assert {r: t.reward for r, t in zip(reasons, props)} == \
        {r: 0.0 if r in ("shortcut_queries", "shortcut_title") else -1.0 for r in reasons}


def test_the_retrieval_check_needs_the_solvers_search():
    """The question checks take the solver's back-end (game.question_searcher, as play_round builds them): without
    one, the retrieval check is refused, not skipped; with one, a question whose search finds its answer passes."""
    t = _traj("Which city on the Seine is the capital of France and its largest city?", "Paris")
    cfg = GameConfig(rag_verify="retrieval")
    with pytest.raises(ValueError, match="--solver_search retriever"):
        question_searcher(cfg, None)
    found = [[{"id": "1", "contents": "Paris\nThe capital."}]]
    search = question_searcher(cfg, lambda qs, k: found * len(qs))
    assert filter_reason(t, cfg) is None
    assert searched_verdict(t, search_questions([t.question], [t.answer], search, 1)[0], cfg) == (None, True)


# ---- --proposer_seed articles --------------------------------------------------------------------------

def test_article_rows_are_a_function_of_seed_and_position(bm25_dir):
    from retrieval.corpus import DocStore

    docs = DocStore(bm25_dir)
    a, b, other = ArticleRows(docs, 7, 2), ArticleRows(DocStore(bm25_dir), 7, 2), ArticleRows(docs, 8, 2)
    assert len(a) == len(docs) == 300   # a small corpus: one row per document per epoch
    rows = [a[k] for k in range(40)]
    assert [(r.answer, r.meta) for r in rows] == [(b[k].answer, b[k].meta) for k in range(40)]   # rank, resume
    assert [r.answer for r in rows] != [other[k].answer for k in range(40)]
    titles = {docs.get(i)["contents"].split("\n")[0].strip().strip('"') for i in range(len(docs))}
    assert all(r.answer in titles and r.search_turns == 2 and r.data_source == "articles" for r in rows)
    assert len({r.answer for r in rows}) > 20   # drawn, not one page
    # --search_turns_mix draws their n as it draws a file's
    mixed = mix_search_turns(rows, 0, "1:1:1", 7, 1, 3)
    assert {r.search_turns for r in mixed} == {1, 2, 3} and [r.answer for r in mixed] == [r.answer for r in rows]
    with pytest.raises(IndexError):
        a[300]


def test_article_rows_skip_untitled_documents_and_refuse_a_corpus_without_titles():
    class Docs:
        def __init__(self, contents):
            self.contents = contents

        def __len__(self):
            return len(self.contents)

        def get(self, i):
            return {"id": str(i), "contents": self.contents[i]}

    rows = ArticleRows(Docs(["no title line", '"Paris"\nThe capital.']), 0, 2)
    assert {rows[k].answer for k in range(2)} == {"Paris"}   # wiki-18's quotes stripped, the untitled one skipped
    with pytest.raises(InputError, match="no title line"):
        ArticleRows(Docs(["plain text"]), 0, 2)[0]


def test_training_rows_draw_articles_from_the_index(bm25_dir, tmp_path):
    from training.settings.config import Config
    from training.engine.setup import training_rows

    cfg = Config()
    cfg.search.index, cfg.selfplay.proposer_seed, cfg.optimisation.seed = str(bm25_dir), "articles", 3
    cfg.selfplay.min_searches, cfg.rollout.max_turns = 2, 4
    rows = training_rows(cfg, [ProposerRow("never read", 2)])
    assert isinstance(rows, ArticleRows) and rows[5].answer == ArticleRows(rows.docs, 3, 2)[5].answer
    assert all(rows[k].search_turns == 2 for k in range(10))
