"""The question filters, one failure reason at a time, with string and list answers."""

from __future__ import annotations

import pytest

from inference.filters import FILTER_REASONS, FilterConfig, check_question, distinct_queries, retrieved_text

GOOD_Q = "Which river flows through the city where the 1900 Summer Olympics were held?"
DOCS = [[{"id": "1", "contents": "1900 Summer Olympics\nHeld in Paris.", "score": 1.0}],
        [{"id": "2", "contents": "Paris\nThe Seine flows through Paris.", "score": 0.9}]]
QUERIES = ["1900 Summer Olympics host city", "river through Paris"]
CFG = FilterConfig()


def check(question=GOOD_Q, answer="Seine", queries=QUERIES, docs=DOCS, n=2, cfg=CFG):
    return check_question(question, answer, queries, docs, n, cfg)


def test_good_question_passes_str_and_list_answers():
    assert check() is None
    assert check(answer=["Seine", "River Seine", "La Seine"]) is None


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(question=None), "no_question"),
        (dict(question="   "), "no_question"),
        (dict(question="Why?"), "too_short"),
        (dict(question="x" * 1001), "too_long"),
        (dict(question="Which river flows through that city in France?"), "too_few_words"),
        (dict(answer="Olympics"), "answer_in_question"),
        (dict(queries=["one query"]), "too_few_searches"),
        (dict(queries=["river Paris", "River  paris?", ""]), "too_few_searches"),  # duplicates after normalising
        (dict(docs=[[], [{"id": "3", "contents": "  ", "score": 0.0}]]), "empty_retrieval"),
        (dict(docs=[]), "empty_retrieval"),
    ],
)
def test_each_reason(kwargs, reason):
    assert reason in FILTER_REASONS
    assert check(**kwargs) == reason


def test_list_answer_leak_any_alias():
    # SSP's `ground_truth.lower() in question.lower()` raises on a list; here every alias is checked
    assert check(answer=["Seine", "1900 Summer Olympics"]) == "answer_in_question"
    assert check(answer=["Seine", "Olymp"]) is None   # a word fragment is no leak
    assert check(answer=("Seine", "Olympics")) == "answer_in_question"


def test_leak_is_normalised():
    q = "Which city, the host of the 1900 Summer Olympics, has the river Seine flowing through it?"
    assert check(question=q, answer="The Seine!") == "answer_in_question"


def test_min_chars_and_words_boundaries():
    ten_words = "a b c d e f g h i jj"          # 10 words, 20 chars
    assert check(question=ten_words, answer="zz") is None
    assert check(question=ten_words.rsplit(" ", 1)[0], answer="zz") == "too_few_words"
    assert check(question="x" * 1000 + " y", answer="zz", cfg=FilterConfig(min_words=1, max_chars=1002)) is None


def test_min_searches_config_and_required_n():
    three = ["a query", "b query", "c query"]
    assert check(queries=three, n=3) is None
    assert check(queries=QUERIES, n=3) is None  # default: fixed minimum of 2
    at_n = FilterConfig(searches_at_least_n=True)
    assert check(queries=QUERIES, n=3, cfg=at_n) == "too_few_searches"
    assert check(queries=three, n=3, cfg=at_n) is None
    assert check(queries=["only one"], n=1, cfg=FilterConfig(min_searches=1)) is None


def test_helpers():
    assert distinct_queries(["A b", "a B.", "", None, "c"]) == ["A b", "c"]
    assert retrieved_text(DOCS).startswith("1900 Summer Olympics")
    assert retrieved_text([[{"id": "x"}]]) == ""


def test_bad_config():
    with pytest.raises(ValueError, match="min_chars"):
        FilterConfig(min_chars=20, max_chars=10)


def test_answer_that_is_not_the_first_searchs_doc1_title_passes():
    """Issue 21: with --min_searches 2 the proposer's path holds two searches; a question whose answer is a
    span of the second search's text (not the first search's Doc 1 title) must stay valid."""
    docs = [[{"contents": "Abuja\nAbuja is the capital city of Nigeria."}],
            [{"contents": "Nigeria\nWith a population of more than 242 million, Nigeria is the most populous."}]]
    q = "What is the population of the place whose capital is Abuja?"
    cfg = FilterConfig(min_searches=2)
    assert check_question(q, "242 million", ["Abuja", "Nigeria"], docs, 2, cfg) is None
    assert check_question(q, "242 million", ["Abuja", "Abuja"], docs, 2, cfg) == "too_few_searches"


def test_shortcut_queries_refuses_a_proposer_that_searched_for_its_answer():
    """--shortcut_filter queries|both (SSP's search-terms filter): any query holding the answer (any alias, whole
    normalised words) refuses the question, after every other check; off by default."""
    on = FilterConfig(shortcut_queries=True)
    assert check(queries=["1900 Summer Olympics host city", "the Seine river"]) is None   # off: passes
    assert check(queries=["1900 Summer Olympics host city", "the Seine river"], cfg=on) == "shortcut_queries"
    assert check(answer=["La Seine", "seine"], queries=["SEINE?", "river through Paris"], cfg=on) == "shortcut_queries"
    assert check(queries=["Seineside towns", "river through Paris"], cfg=on) is None   # a word fragment is no leak
    assert check(queries=["the Seine", "the Seine."], cfg=on) == "too_few_searches"     # the earlier check wins
    assert check(cfg=on) is None
    assert "shortcut_queries" in FILTER_REASONS and "shortcut_title" in FILTER_REASONS
