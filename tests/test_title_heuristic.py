"""The title-heuristic fields of eval.py's reports (inference/evaluate.py; issue 21) on hand-built records: the
policy converged on answering with the title of the first retrieved document, so every report measures against that."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference.evaluate import SAMPLE_FIELDS, _group_metrics, _question_title_em, _sample_record, markdown_report
from inference.prompts import doc_title


def rec(golden, pred, titles, qt=None, **extra) -> dict:
    """One K = 1 example: its prediction, the titles per search call, the question-title verdict."""
    r = {key: None for key in SAMPLE_FIELDS}
    em = float(pred is not None and pred.lower().strip(" .").removeprefix("the ") == golden[0].lower())
    r.update(golden_answers=golden, pred=pred, doc_titles=titles, searches=len(titles), em=em, f1=em, sub_em=em,
             judge_correct=bool(em), judge_failed=False, turns=len(titles) + 1, question_title_em=qt, **extra)
    return r


RECS = [
    # first search's Doc 1 is right (baseline 1); the answer copies Doc 2 of the last search
    rec(["Paris"], "Paris", [["Paris", "France"], ["Lyon", "Paris", "Nice"]], qt=True),
    # copies Doc 1 of its only search, which is wrong; no title is right
    rec(["Shakespeare"], "Hamlet", [["Hamlet", "Macbeth"]], qt=False),
    # no search, no answer
    rec(["4"], None, [], qt=False),
    # four docs in the last search: copy@4 (normalised: "The Berlin." == "Berlin"); an empty title never counts
    rec(["Berlin"], "The Berlin.", [["Bonn", ""], ["X", "Y", "Z", "Berlin"]]),
]


def test_doc_title_is_the_first_line_the_model_reads():
    assert doc_title({"contents": "  Paris \nThe capital of France."}) == "Paris"
    assert doc_title({"contents": "no newline: all text"}) == ""     # format_docs shows "(Title: )"
    assert doc_title("Bare\nstring doc") == "Bare" and doc_title({}) == ""


def test_sample_record_keeps_titles_per_search_call():
    t = SimpleNamespace(num_turns=3, num_searches=2, stop_reason="answer", response_text="..",
                        queries=["a", "b"], docs=[[{"contents": "Paris\nx"}, {"contents": "y"}], []])
    v = SimpleNamespace(correct=True, source="em", judge_failed=False)
    r = _sample_record(["Paris"], t, "Paris", v)
    assert set(r) == set(SAMPLE_FIELDS) and r["doc_titles"] == [["Paris", ""], []]


def test_group_metrics_title_fields_by_hand():
    m = _group_metrics(RECS)
    assert m["em"] == 0.5                                    # the existing fields are untouched
    assert m["title_baseline_em"] == 0.25                    # only the first record's first Doc 1 is right
    assert m["title_copy_at"] == {"1": 0.25, "2": 0.25, "3": 0.0, "4": 0.25}
    assert m["title_copy_any"] == 0.75 and m["title_ceiling"] == 0.5
    assert m["searches_hist"] == {"0": 0.25, "1": 0.25, "2": 0.5}
    assert m["question_title_em"] == pytest.approx(1 / 3, abs=1e-4)   # over the questions that have it
    # without a search tool: no question-title verdicts, and copy@1..3 still reported
    m0 = _group_metrics([rec(["4"], "4", []), rec(["5"], None, [])])
    assert m0["question_title_em"] is None and m0["title_copy_at"] == {"1": 0.0, "2": 0.0, "3": 0.0}
    assert m0["searches_hist"] == {"0": 1.0} and m0["title_copy_any"] == m0["title_ceiling"] == 0.0


def test_group_metrics_title_fields_over_samples():
    """K = 2: two questions, the shares run over the 4 samples; question_title_em over the 2 questions."""
    a, b, c, d = RECS
    k2 = []
    for x, y, qt in ((a, b, True), (c, d, False)):
        q = {key: [x[key], y[key]] for key in SAMPLE_FIELDS}
        # golden answers belong to the question: give both samples the first record's
        k2.append({**q, "golden_answers": x["golden_answers"], "question_title_em": qt})
    m = _group_metrics(k2, 2)
    assert m["n"] == 2 and m["pass@2"] == 1.0
    assert m["title_baseline_em"] == 0.25                    # Paris: sample 1's Doc 1; Hamlet sample is wrong for Paris
    assert m["title_copy_at"] == {"1": 0.25, "2": 0.25, "3": 0.0, "4": 0.25}
    assert m["title_ceiling"] == 0.25                        # "Paris" was retrieved in sample 1 only ("Berlin" is not "4")
    assert m["searches_hist"] == {"0": 0.25, "1": 0.25, "2": 0.5} and m["question_title_em"] == 0.5


def test_question_title_baseline_searches_each_question_once():
    from inference.data import EvalRow

    rows = [EvalRow("capital of France?", ["Paris"], "a", "1"), EvalRow("who wrote Hamlet?", ["Shakespeare"], "a", "2"),
            EvalRow("nothing", ["x"], "a", "3")]
    calls = []

    def search(queries, topk):
        calls.append((list(queries), topk))
        return [[{"contents": "Paris\n.."}, {"contents": "Shakespeare\n.."}], [{"contents": "Hamlet\n.."}], []]

    assert _question_title_em(search, rows, 3) == [True, False, False]
    assert calls == [([r.question for r in rows], 3)]
    assert _question_title_em(None, rows, 3) == [None] * 3

    def broken(queries, topk):
        raise ConnectionError("down")

    assert _question_title_em(broken, rows, 3) == [None] * 3   # logged, the eval goes on


def test_markdown_report_has_the_title_table():
    res = {"overall": _group_metrics(RECS), "per_source": {"a": _group_metrics(RECS[:2]), "b": _group_metrics(RECS[2:])},
           "samples": 1}
    md = markdown_report({"model": "m"}, res)
    title = md[md.index("## Title heuristic"):]
    assert "| copy@1 | copy@2 | copy@3 | copy@4 |" in title
    assert "| **overall** | 4 | 0.500 | 0.250 | 0.333 | 0.250 | 0.250 | 0.000 | 0.250 | 0.750 | 0.500 | 0:0.25 1:0.25 2:0.50 |" in title
    assert "| b | 2 | 0.500 | 0.000 | 0.000 | 0.000 | 0.000 | 0.000 | 0.500 | 0.500 | 0.500 | 0:0.50 2:0.50 |" in title
    res["overall"]["question_title_em"] = None                # no search tool: the column says so
    assert "| **overall** | 4 | 0.500 | 0.250 | - |" in markdown_report({}, res)
