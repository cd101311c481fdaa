"""The rollout protocol a cold-start demo must fit, and the checks and cuts that make it fit.

A demo teaches the exact token sequence a rollout builds (training/loop/sft.py renders it so). A demo that
the RL protocol could never produce teaches the model to fail there: 76 of 160 proposer demos once had a
turn over the ladder's 64-token cap, and 92 searched 3 times where the ladder allows 2 searches before
the question, so most proposer rollouts ended with no question at all (issue 31). The builders
(dataprep/coldstart.py, dataprep/reading_sets.py) take the protocol, cut a demo's quoted sentence until
each turn fits, and drop (and count) what still does not; `misfit` is the one check, and the mix file
records the protocol it was built for (`PROTOCOL_SUFFIX`), so a script that trains under another one
rebuilds it.

    proto = Protocol(max_turns=3, max_tokens_per_turn=64, max_info_tokens=160)   # the ladder's and the demo's
    misfit(demo, tokenizer, proto)    # None, or why the demo cannot be produced under proto
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

PROTOCOL_SUFFIX = ".protocol.json"


@dataclasses.dataclass(frozen=True)
class Protocol:
    """The RL and eval flags of the same names; the defaults are the CPU ladder's and demo's (scripts/
    learning_proof_cpu.sh and scripts/demo_cpu.sh pass --max_turns 3 --max_tokens_per_turn 64
    --max_info_tokens 160)."""
    max_turns: int = 3
    """Generation calls per trajectory: room for max_turns - 1 searches before the answer or question."""
    max_tokens_per_turn: int = 64
    """Tokens one model turn may take (think + action), in the policy's tokenizer."""
    max_info_tokens: int = 160
    """Tokens of one <information> block: what a rollout shows of the documents."""
    min_searches: int = 2
    """The game's --min_searches: a proposer demo searches at least this often (and at most max_turns - 1)."""
    min_question_words: int = 4
    """The game's --min_question_words: every proposer demo's question has at least this many words. SSP's 10
    would refuse the fact questions a 135M solver answers ("What is the capital of Abkhazia?": 6 words)."""

    def __post_init__(self) -> None:
        if self.max_turns < 2 or self.max_tokens_per_turn < 8 or self.max_info_tokens < 16:
            raise ValueError(f"a protocol needs max_turns >= 2 (a search, then the answer), max_tokens_per_turn >= 8 "
                             f"and max_info_tokens >= 16; got {self}")
        if not 1 <= self.min_searches <= self.max_searches or self.min_question_words < 0:
            raise ValueError(f"need 1 <= min_searches <= max_turns - 1 (room for the searches before the question) "
                             f"and min_question_words >= 0; got {self}")

    @property
    def max_searches(self) -> int:
        return self.max_turns - 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def add_protocol_args(p: argparse.ArgumentParser) -> None:
    d = Protocol()
    p.add_argument("--max_turns", type=int, default=d.max_turns,
                   help="the RL protocol's --max_turns: a demo takes at most this many model turns")
    p.add_argument("--max_tokens_per_turn", type=int, default=d.max_tokens_per_turn,
                   help="the RL protocol's --max_tokens_per_turn: every model turn of a demo fits it")
    p.add_argument("--max_info_tokens", type=int, default=d.max_info_tokens,
                   help="the RL protocol's --max_info_tokens: what a demo quotes lies inside this cut")
    p.add_argument("--min_searches", type=int, default=d.min_searches,
                   help="the game's --min_searches: proposer demos search at least this often")
    p.add_argument("--min_question_words", type=int, default=d.min_question_words,
                   help="the game's --min_question_words: proposer demos' questions are at least this long")


def protocol_of(a: argparse.Namespace) -> Protocol:
    return Protocol(a.max_turns, a.max_tokens_per_turn, a.max_info_tokens, a.min_searches, a.min_question_words)


def turn_tokens(tok: Any, text: str) -> int:
    """Tokens a model turn takes, as the rollout samples it (no special tokens)."""
    return len(tok(text, add_special_tokens=False)["input_ids"])


def misfit(demo: dict, tok: Any, proto: Protocol) -> str | None:
    """Why a rollout under `proto` could not produce this demo, or None: too many model turns, or a model turn
    over the token cap."""
    turns = [t["text"] for t in demo.get("turns", []) if t.get("kind") == "model"]
    if len(turns) > proto.max_turns:
        return f"{len(turns)} model turns > max_turns {proto.max_turns}"
    longest = max((turn_tokens(tok, t) for t in turns), default=0)
    if longest > proto.max_tokens_per_turn:
        return f"a turn of {longest} tokens > max_tokens_per_turn {proto.max_tokens_per_turn}"
    return None


def fit_turn(tok: Any, make: Callable[[int], str | None], cap: int, longest: int, shortest: int = 4) -> str | None:
    """The first of make(longest), make(longest - 1), ..., make(shortest) that fits `cap` tokens, or None.
    `make(w)` writes the turn with its quote cut to w words (None: no text at that length)."""
    for w in range(longest, shortest - 1, -1):
        text = make(w)
        if text is not None and turn_tokens(tok, text) <= cap:
            return text
    return None


def write_protocol(mix: Path, proto: Protocol) -> None:
    Path(str(mix) + PROTOCOL_SUFFIX).write_text(json.dumps(proto.to_dict(), sort_keys=True) + "\n")


def read_protocol(mix: Path) -> Protocol | None:
    """The protocol a mix file was built for; None when it records none (built before the protocol was)."""
    f = Path(str(mix) + PROTOCOL_SUFFIX)
    try:
        return Protocol(**json.loads(f.read_text()))
    except (OSError, ValueError, TypeError):
        return None
