"""One scripted policy for the game's tests: both roles played from a script on the real tokenizer, no model.

It has generate() only (the game's StepLoop drives it through GenerateStepper), and reads each prompt as the
policy would: a proposer's prompt says "You set puzzles" and names its answer; how many search results a prompt
holds says which turn it is at.
"""

from __future__ import annotations

import re
import time
from typing import Any

from inference.engine_api import GenOutput, SamplingConfig, per_prompt_sampling
from inference.rollout import INFO_OPEN

LINCOLN = ["Abraham Lincoln", "Lincoln"]
Q_LINCOLN = "Which American president was shot at a theatre in Washington in April of 1865?"
LINCOLN_QUERIES = ["Lincoln president", "Lincoln theatre"]
SHORT_ALGERIA = {"Algeria": (["Algeria", "Algeria country"], "Capital?")}
"""A proposer for "Algeria" searches twice, then asks a question too short to pass the filters."""
READ_TITLE = "<the title of Doc 1 of the first block read>"
"""solver_answer: answer the title of Doc 1 of the first search results the prompt holds, so which documents a
solver (or the policy's RAG check) was shown appears in its answer."""


def is_rag_check(sampling: SamplingConfig) -> bool:
    """Whether a prompt comes from the policy's RAG check (inference/rag_check.rag_sampling: greedy, stopped at
    </answer> alone), not from a rollout (sampled at its temperature, stopped at </search> too when it may search)."""
    return sampling.temperature == 0.0 and list(sampling.stop) == ["</answer>"]


def reply_output(tokenizer: Any, reply: str) -> GenOutput:
    """`reply` as an engine returns it when a stop string ended it."""
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    return GenOutput(ids, [-1.0] * len(ids), reply, "stop", reply[reply.rfind("</"):])


class ScriptedPolicy:
    """Plays both roles from a script on the real tokenizer.

    A proposer whose prompt names an answer of `proposers` (answer -> (its queries, its question)) searches that
    entry's queries, one a turn, then asks its question; any other proposer searches LINCOLN_QUERIES, then asks
    `question`. The default entry is SHORT_ALGERIA.
    A solver searches "Lincoln" `solver_searches` times, then answers `solver_answer` (READ_TITLE: what it read).
    The policy's RAG check reads as a solver that has searched: it gets the solver's answer, or `reader`'s reply
    when a reader (an engine) is given.
    log: (time, "proposer" | "solver" | "rag_check", search results held) of every prompt it generated for.
    """

    def __init__(self, tokenizer: Any, solver_answer: str = "Lincoln", question: str = Q_LINCOLN,
                 solver_searches: int = 1, proposers: dict[str, tuple[list[str], str]] | None = None,
                 reader: Any = None):
        self.tokenizer, self.solver_answer, self.question = tokenizer, solver_answer, question
        self.solver_searches, self.reader = solver_searches, reader
        self.proposers = SHORT_ALGERIA if proposers is None else proposers
        self.max_model_len = reader.max_model_len if reader is not None else 4096
        self.log: list[tuple[float, str, int]] = []

    def generate(self, prompts: list[list[int]], sampling: Any) -> list[GenOutput]:
        outs = []
        for p, s in zip(prompts, per_prompt_sampling(sampling, len(prompts))):
            text = self.tokenizer.decode(p)
            k = text.count(INFO_OPEN)
            proposer, rag = "You set puzzles" in text, is_rag_check(s)
            self.log.append((time.perf_counter(), "proposer" if proposer else "rag_check" if rag else "solver", k))
            if self.reader is not None and rag:
                outs += self.reader.generate([p], s)
                continue
            outs.append(reply_output(self.tokenizer, self.propose(text, k) if proposer else self.solve(text, k)))
        return outs

    def propose(self, text: str, k: int) -> str:
        head = text.split(INFO_OPEN)[0]   # the prompt, before any search result
        queries, question = next((v for a, v in self.proposers.items() if a in head),
                                 (LINCOLN_QUERIES, self.question))
        return f"<search> {queries[k]} </search>" if k < len(queries) else f"<question> {question} </question>"

    def solve(self, text: str, k: int) -> str:
        if k < self.solver_searches:
            return "<search> Lincoln </search>"
        answer = self.solver_answer
        if answer == READ_TITLE:
            title = re.search(r"Doc 1 \(Title: ([^)]*)\)", text[text.find(INFO_OPEN):])
            answer = title.group(1) if title else "none"
        return f"<answer> {answer} </answer>"
