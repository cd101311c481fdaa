"""Self-search (SSRL, "Self-Search Reinforcement Learning"): the policy is its own search engine.

There is no tool call. After each <search> query </search> the model writes, in the same turn,
what a search would return inside <information> ... </information>, from its own knowledge,
and goes on until <answer>. The rollout loop (inference/rollout.py, RolloutConfig.self_search=True
with search_fn=None) gives the tokens of those self-written blocks mask 0, like retrieved
documents: the model is trained on how it searches and answers, not on the "documents".

This module holds the pieces around that loop:
  * `build_self_search_prompt`: the solver prompt that asks for self-written results;
  * `format_reward` / `shaped_reward` / `shape_solver_rewards`: an optional format bonus (SSRL uses one so the model
    keeps the tag structure the masking relies on): 0.9 * exact match + 0.1 * format.
"""

from __future__ import annotations

import re
from typing import Any

from inference.prompts import encode_prompt, render_chat
from inference.rewards import SPAM_DIVISOR

SELF_SEARCH_INSTRUCTION = (
    "Find the answer to the question below. Reason step by step inside <think> and </think>. "
    "You have no search engine, but you can search your own memory: when a fact is missing, write a "
    "short query as <search> query </search>, then write right after it the results a search engine "
    "would return for it, as a few short passages between <information> and </information>, using "
    "only what you know. Search as often as you need, one query at a time, each search followed by "
    "its <information> block. Once you are sure, give only the final short answer inside <answer> "
    "and </answer>, for example <answer> Marie Curie </answer>."
)


def self_search_user_message(question: str) -> str:
    question = str(question).strip()
    if not question:
        raise ValueError("self-search question is empty; every solver row needs a question")
    return f"{SELF_SEARCH_INSTRUCTION}\n\nQuestion: {question}"


def build_self_search_prompt(tokenizer: Any, question: str, template: str = "auto") -> list[int]:
    """Token ids of the self-search solver prompt for `question` (templates as in inference.prompts)."""
    return encode_prompt(tokenizer, render_chat(tokenizer, self_search_user_message(question), template), template)


# --- format reward -----------------------------------------------------------------------------

KNOWN_TAGS = ("think", "search", "information", "answer")
# End-of-sequence markers that may be left in decoded text (ChatML, Llama-3, GPT-2/Qwen, Llama-2).
EOS_STRINGS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>")
# Anything shaped like an opening or closing tag; "a < b" or "x<3" are not tags.
_TAG = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9_\-]*)>")


def _strip_ends(text: str, eos: tuple[str, ...]) -> str:
    text = text.strip()
    changed = True
    while changed:  # "...</answer><|im_end|>\n<|endoftext|>" loses every trailing marker
        changed = False
        for e in eos:
            if e and text.endswith(e):
                text = text[: -len(e)].rstrip()
                changed = True
    return text


def format_reward(text: str, eos: tuple[str, ...] = EOS_STRINGS) -> float:
    """1.0 when the response is well formed, else 0.0.

    Well formed: after stripping whitespace and trailing EOS markers it starts with <think> and
    ends with </answer>; every tag is one of KNOWN_TAGS; tags come in open/close pairs that do
    not nest (the protocol is a flat sequence of blocks: a <search> inside <think> is a lapse);
    and no block is empty or whitespace-only.
    """
    if not isinstance(text, str):
        return 0.0
    text = _strip_ends(text, eos)
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return 0.0
    open_tag, open_end = None, 0
    for m in _TAG.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if name not in KNOWN_TAGS:
            return 0.0
        if not closing:
            if open_tag is not None:  # nested or unclosed
                return 0.0
            open_tag, open_end = name, m.end()
        else:
            if open_tag != name:  # stray or mismatched close
                return 0.0
            if not text[open_end: m.start()].strip():
                return 0.0
            open_tag = None
    return 1.0 if open_tag is None else 0.0


def shaped_reward(em: float, fmt: float) -> float:
    """SSRL-style mix: 0.9 * exact match (0/1) + 0.1 * format (0/1)."""
    return 0.9 * float(em) + 0.1 * float(fmt)


def shape_solver_rewards(trajs, spam_divisor: float = SPAM_DIVISOR) -> None:
    """SSRL's shaping of self-search solvers' rewards, in place: 0.9 * correctness + 0.1 * format, divided by
    `spam_divisor` (GameConfig's default, SPAM_DIVISOR, unless the caller passes the run's) where game.score
    recorded a spammed answer, so the shaping replaces the reward without dropping the spam penalty. Proposer
    trajectories are left alone."""
    for t in trajs:
        if t.role == "solver":
            t.outcome.format_reward = fmt = format_reward(t.response_text)
            t.reward = shaped_reward(float(t.outcome.correct or 0.0), fmt)
            if t.outcome.spam:
                t.reward /= spam_divisor
