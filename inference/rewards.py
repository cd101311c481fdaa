"""Reward formulas of the self-play game: pure functions of text and numbers.

Solver: 1 if its final answer is right (exact match first, else the judge),
divided by `spam_divisor` when the answer tag is spammed.
Proposer: a function of its question's solver group, `1 - acc` (SSP default:
harder is better) or `4 s (1 - s)` (peaks when half the group succeeds), and
a flat penalty when its question was invalid.

Spam, precisely: the number of `<answer>` opening tags the model wrote itself
(text inside `<information>...</information>` is the environment's and is not
counted) is above `max_answer_tags` (default 1). The solver stops at its first
`</answer>`, so spam shows as repeated openings, e.g. `<answer><answer>x</answer>`,
or an `<answer>` left in an earlier turn that went on to search.
"""

from __future__ import annotations

from typing import Sequence

from inference.parser import model_text, parse_action

PROPOSER_REWARD_KINDS = ("1-acc", "4s(1-s)")


def count_answer_tags(response: str) -> int:
    """`<answer>` opening tags written by the model (see the module docstring)."""
    return model_text(response).count("<answer>")


def is_answer_spam(response: str, max_answer_tags: int = 1) -> bool:
    return count_answer_tags(response) > max_answer_tags


def extract_answer(response: str) -> str | None:
    """The content of the last complete `<answer>...</answer>` the model wrote; None if there is none.

    The parser's rules apply (exact tag spelling, innermost opening wins), so
    with spammed openings (`<answer><answer>x</answer>`) the answer is "x" and
    the spam is penalised by the divisor, not also by a garbled answer.
    """
    action = parse_action(model_text(response), kinds=("answer",))
    return action.content if action.kind == "answer" else None


SPAM_DIVISOR = 4.0
"""The default divisor of a spammed answer's reward (GameConfig.spam_divisor, self_search's shaping)."""


def solver_reward(correct: bool, spam: bool, spam_divisor: float = SPAM_DIVISOR) -> float:
    """1 or 0, divided by `spam_divisor` when the answer tag was spammed (a wrong answer stays 0)."""
    if spam_divisor <= 0:
        raise ValueError(f"spam_divisor must be > 0, got {spam_divisor}")
    r = 1.0 if correct else 0.0
    return r / spam_divisor if spam else r


def proposer_reward(solver_correct: Sequence[float], kind: str = "1-acc") -> float:
    """Reward of a valid question from its solver group's correctness (each 0 or 1).

    "1-acc":   1 - s, where s is the group's success rate (SSP's default).
    "4s(1-s)": 4 s (1 - s): 0 for questions that are always or never solved,
               1 at s = 0.5; it keeps the proposer away from unanswerable questions.
    Correctness, not the spam-divided solver reward, measures difficulty: a
    spammed right answer still shows the question could be solved.
    """
    if kind not in PROPOSER_REWARD_KINDS:
        raise ValueError(f"unknown proposer reward kind {kind!r}; use one of {PROPOSER_REWARD_KINDS}")
    if len(solver_correct) == 0:
        raise ValueError("proposer_reward needs at least one solver result for the question")
    s = sum(float(c) for c in solver_correct) / len(solver_correct)
    if kind == "1-acc":
        return 1.0 - s
    return 4.0 * s * (1.0 - s)
