"""The unit handed from rollout to training: one trajectory of one role.

Token ids are the source of truth. `token_ids`, `loss_mask` and `logprobs` are
aligned, one entry per token of the whole sequence (prompt + every turn):
  loss_mask[i] = 1  -> token i was sampled by the policy (it carries loss, KL, entropy)
  loss_mask[i] = 0  -> prompt, retrieved <information> text, or template glue
  logprobs[i]       -> the rollout engine's log-prob of token i (0.0 where mask is 0)

Beside the tokens, a trajectory carries what its rollout searched (queries, docs, search_failed, final_action,
cap), what the game tagged its request with (`meta`, a GameMeta) and how the game scored it (`outcome`, an
Outcome). Each is a typed field; a field a stage has not reached yet holds its default (None for the outcome).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

ROLES = ("proposer", "solver")


@dataclass
class GameMeta:
    """What the game tagged a rollout request with (inference/game.py: propose, solve), carried to its trajectory."""
    row: int | None = None           # proposer: index of its prompt row in the round (RAG distractors come from others)
    search_turns: int | None = None  # proposer: the searches its prompt asked for (the filters check them)
    proposer: int | None = None      # solver: index of the proposer trajectory whose question it answers; None: not fresh
    source: str | None = None        # solver: "proposer" (fresh) | "pool" | "qa" (inference/game_metrics.SOURCES)
    qcp: dict | None = None          # solver: the question's construction path, the teacher's privileged context

    @property
    def from_pool(self) -> bool:
        """The question came from the pool of earlier valid questions."""
        return self.source == "pool"


@dataclass
class Outcome:
    """How the game scored a trajectory, and why (inference/game.py); None where that stage has not run."""
    # solver: game.score
    pred: str | None = None            # the extracted answer (None: no answer tag)
    correct: bool | None = None        # the judge's verdict (EM, else the LLM judge)
    judge_source: str | None = None    # which of them decided
    judge_failed: bool = False         # the judge call failed, so `correct` reads "wrong" for no reason
    spam: bool = False                 # the answer tag was spammed (the reward is divided)
    format_reward: float | None = None  # self-search format reward (inference/self_search.shape_solver_rewards)
    # proposer: game.score, rag_check.rag_reply, admit_to_pool
    filter_reason: str | None = None   # why its question is invalid (filters.FILTER_REASONS or "rag_failed")
    valid: bool | None = None          # its question passed every check (filter_reason is None)
    rag: bool | None = None            # the RAG verdict: True pass, False fail, None undecided or not checked
    rag_answer: str | None = None      # the RAG verifier's answer
    solver_acc: float | None = None    # its solver group's accuracy (valid questions)
    pool_admitted: bool | None = None  # the pool took its question (valid questions, when there is a pool)
    # both roles: game.mark_excluded
    excluded: str | None = None        # why it is left out of the loss (game.EXCLUSION_REASONS); None: it counts


_SEARCH_KEYS = ("queries", "docs", "search_failed", "final_action", "cap")
_OUTCOME_KEYS = tuple(f.name for f in fields(Outcome))


def _from_info(info: dict) -> dict:
    """The typed fields of an older dump's free-form `info` dict (every key any version wrote); an unknown key
    is refused rather than dropped."""
    info = dict(info)
    info.pop("from_pool", None)                  # a copy of meta["from_pool"], itself read off meta["source"]
    out: dict[str, Any] = {k: info.pop(k) for k in _SEARCH_KEYS + ("teacher_context",) if k in info}
    if "meta" in info:
        out["meta"] = info.pop("meta")
    outcome = {k: info.pop(k) for k in _OUTCOME_KEYS if k in info}
    if outcome:
        out["outcome"] = outcome
    if info:
        raise ValueError(f"Trajectory.from_dict: unknown info keys {sorted(info)}")
    return out


@dataclass
class Trajectory:
    role: str                      # "proposer" | "solver"
    group_id: str                  # trajectories sharing a group id share a baseline
    token_ids: list[int]           # (T,) prompt + all turns
    loss_mask: list[int]           # (T,) 1 = sampled by the model
    logprobs: list[float]          # (T,) rollout log-prob of each token, 0.0 where mask 0
    prompt_len: int = 0            # tokens of the first prompt (all mask 0)
    reward: float = 0.0
    num_turns: int = 0
    num_searches: int = 0
    response_text: str = ""        # decoded text after the prompt (for logging / parsing only)
    question: str = ""             # solver: the question asked; proposer: the question written
    answer: Any = None             # golden answer(s): str or list[str]
    stop_reason: str = ""          # "answer" | "question" | "eos" | "max_turns" | "max_tokens"
    # what the rollout searched (inference/rollout.py)
    queries: list[str] = field(default_factory=list)        # each search's query, in order
    docs: list[list[dict]] = field(default_factory=list)    # each search's documents ([] where it failed)
    search_failed: int = 0         # searches whose backend failed (the model read "Search failed")
    final_action: dict = field(default_factory=dict)        # {"kind", "content"}: the parser's last complete action
    cap: str | None = None         # stop_reason "max_tokens": which budget ran out, "turn" or "total"
    meta: GameMeta = field(default_factory=GameMeta)        # the game's tag on the request
    outcome: Outcome = field(default_factory=Outcome)       # how the game scored it
    teacher_context: str | None = None  # self-distillation's privileged block (training/algorithm/self_distill.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Trajectory.role must be one of {ROLES}, got {self.role!r}")
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"token_ids/loss_mask/logprobs lengths differ: {n}/{len(self.loss_mask)}/{len(self.logprobs)}"
            )

    @property
    def num_sampled(self) -> int:
        return int(sum(self.loss_mask))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        """The inverse of to_dict; also reads the older form that kept the search record, meta and outcome in a
        free-form `info` dict."""
        d = dict(d)
        if "info" in d:
            d.update(_from_info(d.pop("info")))
        if isinstance(d.get("meta"), dict):
            meta = dict(d["meta"])
            meta.pop("from_pool", None)          # read off source (GameMeta.from_pool)
            d["meta"] = GameMeta(**meta)
        if isinstance(d.get("outcome"), dict):
            d["outcome"] = Outcome(**d["outcome"])
        return cls(**d)
