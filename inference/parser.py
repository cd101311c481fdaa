"""Read the model's next action out of one turn of generated text.

The tag protocol (inference/prompts.py) has three action tags: <search>query</search>,
<answer>text</answer> (solver) and <question>text</question> (proposer). The model
may write anything: unclosed, nested or repeated tags, empty or huge contents, odd
unicode. `parse_action` therefore never raises and always returns an `Action`.

Rules, each chosen so the rollout does what the stop strings imply:
  * Only complete tags count (`<x>...</x>`, exact lower-case spelling, which is
    also what the stop strings match).
  * The LAST complete action wins: generation stops right after the closing tag,
    so the last one is the one that stopped it. Earlier tags were the model
    talking to itself.
  * For nested openings (`<search>a <search>b</search>`) the innermost one wins:
    the content is what follows the nearest opening tag before the close. A closing
    tag with no opening since the previous closing tag is stray and ignored.
  * Contents are stripped, cleaned of control characters and lone surrogates
    (which break JSON / HTTP encoders downstream) and capped in length; search
    queries also have their whitespace collapsed to single spaces.

Pure python and linear time (str.rfind only, no backtracking regex), so a
runaway 100k-character turn costs microseconds.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

ACTION_KINDS = ("search", "answer", "question")
SOLVER_KINDS = ("search", "answer")
PROPOSER_KINDS = ("search", "question")

# Queries longer than this are not real queries; BM25 and dense encoders truncate anyway.
MAX_QUERY_CHARS = 256
# Answers and questions: long enough for any sane question, short enough to log.
MAX_CONTENT_CHARS = 2048


@dataclass(frozen=True)
class Action:
    kind: str          # "search" | "answer" | "question" | "none"
    content: str = ""  # cleaned content of the tag ("" for "none")
    end: int = -1      # index in the text just after the closing tag (-1 for "none")


NO_ACTION = Action("none", "", -1)


def _clean(s: str, max_chars: int, collapse_ws: bool) -> str:
    # Drop control/format characters and surrogates: they carry no meaning in a
    # query and make json/utf-8 encoding of the HTTP request fail.
    out = []
    for ch in s:
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cs", "Co", "Cn") and ch not in "\n\t ":
            continue
        out.append(ch)
    s = "".join(out)
    if collapse_ws:
        s = " ".join(s.split())
    else:
        s = s.strip()
    return s[:max_chars].strip()


def last_complete_tag(text: str, tag: str) -> tuple[int, int, int] | None:
    """(open_start, content_start, close_end) of the last complete `<tag>..</tag>`.

    A closing tag pairs with the nearest opening tag after the previous closing tag;
    a closing tag with no such opening is stray and skipped.
    """
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    close_at = text.rfind(close_t)
    while close_at != -1:
        prev = text.rfind(close_t, 0, close_at)
        lo = 0 if prev == -1 else prev + len(close_t)
        open_at = text.rfind(open_t, lo, close_at)
        if open_at != -1:
            return open_at, open_at + len(open_t), close_at + len(close_t)
        close_at = prev
    return None


def parse_action(
    text: str,
    kinds: tuple[str, ...] | list[str] = ACTION_KINDS,
    max_query_chars: int = MAX_QUERY_CHARS,
    max_content_chars: int = MAX_CONTENT_CHARS,
) -> Action:
    """The last complete action tag among `kinds` in `text`, or Action("none"). Never raises."""
    try:
        if not isinstance(text, str) or not text:
            return NO_ACTION
        best: tuple[int, str, int] | None = None  # (close_end, kind, content_start)
        for kind in kinds:
            hit = last_complete_tag(text, kind)
            if hit is not None and (best is None or hit[2] > best[0]):
                best = (hit[2], kind, hit[1])
        if best is None:
            return NO_ACTION
        close_end, kind, start = best
        raw = text[start: close_end - len(f"</{kind}>")]
        if kind == "search":
            content = _clean(raw, max_query_chars, collapse_ws=True)
        else:
            content = _clean(raw, max_content_chars, collapse_ws=False)
        return Action(kind, content, close_end)
    except Exception:  # noqa: BLE001 - the contract is "never raises"; a bad turn is just no action
        return NO_ACTION


def find_blocks(text: str, tag: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of every `<tag>...</tag>` block, left to right, closing tag included.

    An opening tag with no closing tag extends to the end of the text (a block the
    model was still writing when it stopped). Used to mask self-written
    <information> blocks in self-search mode.
    """
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    spans, pos = [], 0
    while True:
        s = text.find(open_t, pos)
        if s == -1:
            return spans
        e = text.find(close_t, s + len(open_t))
        if e == -1:
            spans.append((s, len(text)))
            return spans
        spans.append((s, e + len(close_t)))
        pos = e + len(close_t)


def model_text(text: str) -> str:
    """The text without the environment's `<information>` blocks (an unclosed one runs to the end).

    The pieces around a removed block are joined with a space, not glued: a block
    between two words or two half-tags must not make one word or one tag the model
    never wrote (`<ans<information>d</information>wer>` is no `<answer>`). Used by
    the rewards (answer tags, spam count) and by the rollout (self-search queries).
    """
    out, pos = [], 0
    for start, end in find_blocks(text, "information"):
        out.append(text[pos:start])
        pos = end
    out.append(text[pos:])
    return " ".join(out)


def all_contents(text: str, tag: str, max_chars: int = MAX_QUERY_CHARS) -> list[str]:
    """Cleaned contents of every complete `<tag>...</tag>` block, in order (innermost opening wins)."""
    out, pos = [], 0
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    while True:
        e = text.find(close_t, pos)
        if e == -1:
            return out
        s = text.rfind(open_t, pos, e)
        if s != -1:
            out.append(_clean(text[s + len(open_t): e], max_chars, collapse_ws=(tag == "search")))
        pos = e + len(close_t)
