"""parse_action: targeted cases, a brute-force reference, and a 10,000-case fuzz that it never raises."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.parser import (
    ACTION_KINDS, MAX_CONTENT_CHARS, MAX_QUERY_CHARS, PROPOSER_KINDS, SOLVER_KINDS, Action, all_contents,
    find_blocks, model_text, parse_action,
)


@pytest.mark.parametrize("text, kind, content", [
    ("<think>hm</think><search>capital of France</search>", "search", "capital of France"),
    ("<answer> Paris </answer>", "answer", "Paris"),
    ("<question>Which city is the capital of France?</question>", "question", "Which city is the capital of France?"),
    # the last complete action wins, whatever its kind
    ("<search>a</search> more <answer>b</answer>", "answer", "b"),
    ("<answer>b</answer> more <search>a</search>", "search", "a"),
    ("<search>first</search><search>second</search>", "search", "second"),
    # an unclosed last tag does not count; the earlier complete one does
    ("<answer>x</answer> then <answer>y", "answer", "x"),
    ("<search>never closed", "none", ""),
    # nested openings: the innermost (nearest) opening wins
    ("<search>outer <search>inner</search>", "search", "inner"),
    # a closing tag with no opening before it is skipped
    ("</search> junk <search>ok</search> </search>", "search", "ok"),
    # query whitespace collapsed; answers keep inner newlines but are stripped
    ("<search>  capital \n\t of   France </search>", "search", "capital of France"),
    ("<answer>\n line1\nline2 \n</answer>", "answer", "line1\nline2"),
    # empty contents are still actions (the loop decides what an empty query means)
    ("<search></search>", "search", ""),
    ("<answer>   </answer>", "answer", ""),
    # case and spacing variants are not the protocol (the stop strings would not fire either)
    ("<Search>x</Search>", "none", ""),
    ("< search >x</ search >", "none", ""),
    ("", "none", ""),
    ("no tags at all", "none", ""),
])
def test_targeted(text, kind, content):
    a = parse_action(text)
    assert (a.kind, a.content) == (kind, content)
    if kind != "none":
        assert text[:a.end].endswith(f"</{kind}>")


def test_kinds_filter_per_role():
    text = "<answer>x</answer><question>q?</question>"
    assert parse_action(text, SOLVER_KINDS) == Action("answer", "x", len("<answer>x</answer>"))
    assert parse_action(text, PROPOSER_KINDS).kind == "question"
    assert parse_action("<answer>x</answer>", PROPOSER_KINDS).kind == "none"


def test_caps_and_cleaning():
    huge = "word " * 10_000
    a = parse_action(f"<search>{huge}</search>")
    assert a.kind == "search" and 0 < len(a.content) <= MAX_QUERY_CHARS and a.content == a.content.strip()
    b = parse_action(f"<answer>{'x' * 10_000}</answer>")
    assert len(b.content) == MAX_CONTENT_CHARS
    c = parse_action("<search>caf\u00e9\x00 \ud800na\u200bme\x07</search>")
    assert c.content == "caf\u00e9 na\u200bme"  # NUL, BEL and the lone surrogate are gone; zero-width space stays (Cf)
    c.content.encode("utf-8")  # must be encodable for the HTTP client


def test_non_string_input_is_no_action():
    assert parse_action(None).kind == "none"  # type: ignore[arg-type]
    assert parse_action(b"<answer>x</answer>").kind == "none"  # type: ignore[arg-type]


def test_find_blocks_and_all_contents():
    t = "a<information>d1</information>b<information>d2"
    assert find_blocks(t, "information") == [(1, 30), (31, len(t))]
    assert all_contents("<search>q1</search> x <search> q2 </search><search>open", "search") == ["q1", "q2"]


def _reference(text: str, kinds) -> tuple[str, str] | None:
    """Brute force: scan every position for a closing tag with an opening before it; keep the last."""
    best = None
    for kind in kinds:
        o, c = f"<{kind}>", f"</{kind}>"
        open_at = [i for i in range(len(text)) if text.startswith(o, i)]
        prev_close_end = 0
        for j in range(len(text)):
            if text.startswith(c, j) and j >= prev_close_end:
                opens = [i for i in open_at if prev_close_end <= i and i + len(o) <= j]
                if opens and (best is None or j + len(c) > best[0]):
                    best = (j + len(c), kind, text[opens[-1] + len(o): j])
                prev_close_end = j + len(c)
    return None if best is None else (best[1], best[2])


# Tag pieces plus odd characters (NUL, lone surrogate, zero-width space, RTL mark, emoji, CJK,
# combining accent). Drawing from a fixed pool keeps 10,000 cases fast; st.text() adds free text.
FRAGMENTS = [f"<{k}>" for k in ACTION_KINDS] + [f"</{k}>" for k in ACTION_KINDS] + [
    "<think>", "</think>", "<information>", "</information>", "<", ">", "/", " ", "\n", "\t", "\x00", "\ud800",
    "é", "日本", "\u200b", "\u202e", "🙂", "e\u0301", "search", "answer", "q", "Paris",
]
texts = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
    st.text(max_size=40),
)


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(text=texts, kinds=st.sampled_from([ACTION_KINDS, SOLVER_KINDS, PROPOSER_KINDS]))
def test_fuzz_never_raises_and_matches_reference(text, kinds):
    a = parse_action(text, kinds)
    assert isinstance(a, Action) and isinstance(a.content, str)
    assert a.kind in (*kinds, "none")
    ref = _reference(text, kinds)
    if ref is None:
        assert a.kind == "none" and a.content == ""
    else:
        assert a.kind == ref[0]
        # the content is the reference span, cleaned
        expected = parse_action(f"<{ref[0]}>{ref[1]}</{ref[0]}>", (ref[0],)).content
        assert a.content == expected
        assert len(a.content) <= (MAX_QUERY_CHARS if a.kind == "search" else MAX_CONTENT_CHARS)
    a.content.encode("utf-8")


def test_model_text_joins_around_a_removed_block_with_a_space():
    """One stripper serves rewards and rollout. The rollout's copy glued the pieces ("" join), the rewards'
    copy put a space: a block between two half-tags or two words must not make a tag or a word the model never wrote."""
    assert model_text("a<information>d</information>b") == "a b"
    assert model_text("x<information>unclosed") == "x "
    split_tag = "<ans<information>d</information>wer>Paris</answer>"
    assert "<answer>" not in model_text(split_tag)  # glued, it read as an answer the model never wrote
    assert parse_action(model_text(split_tag), kinds=("answer",)).kind != "answer"
    # self-search records the queries written around the model's own information blocks
    query = "<search>new<information>doc</information>york</search>"
    assert all_contents(model_text(query), "search") == ["new york"]  # glued it was "newyork"
