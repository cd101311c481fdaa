"""The pool of past valid questions: what fills a slot whose proposer wrote no valid question, and how questions
join it (admit_to_pool) and leave it (pool_clear_due, QuestionPool.clear_admitted)."""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Sequence

from inference.trajectory import Trajectory
from utils.text import normalize_answer

POOL_SIZE = 256
"""GameConfig.pool_size's default: the pool's bound (SSP's)."""


def pool_clear_due(step: int, every: int) -> bool:
    """The trainer clears the pool at the start of step `step` (0-based): every `every` steps, never at step 0.
    A function of the step alone, so every rank clears together and a resumed run clears where the original did."""
    return every > 0 and step > 0 and step % every == 0


SEED_STEP = -1
"""The step recorded for rows seeded from a file (--pool_init): the user's cold-start rows, which clearing keeps."""


class QuestionPool:
    """Past valid questions with their answers: bounded FIFO, de-duplicated, serialisable for checkpoints.

    An item: {"question", "answer", "step"} (the step that admitted it; SEED_STEP for seeded rows), plus
    "qcp" (the question's construction path) and "solve_rate" (its solver group's, when admitted) if known,
    and "served" (how many rounds have served it, counted by play_round) once served.
    """

    def __init__(self, max_size: int = POOL_SIZE, seed: int = 0):
        self.max_size = max_size
        self.items: deque[dict] = deque(maxlen=max_size)
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, question: str, answer: Any, step: int = 0, qcp: dict | None = None,
            solve_rate: float | None = None) -> bool:
        """qcp: the question's construction path (qcp_of), kept for the solver's self-distillation teacher.
        solve_rate: its solver group's solve rate in the round that admitted it. False: already held."""
        key = normalize_answer(question)
        if any(normalize_answer(it["question"]) == key for it in self.items):
            return False
        self.items.append({"question": question, "answer": answer, "step": step, **({"qcp": qcp} if qcp else {}),
                           **({"solve_rate": float(solve_rate)} if solve_rate is not None else {})})
        return True

    def sample(self, k: int) -> list[dict]:
        """min(k, len) distinct questions, drawn without replacement. Slots the pool cannot fill stay empty:
        drawing with replacement once let one never-solved question fill 7 of 8 slots in a step."""
        if not self.items or k <= 0:
            return []
        return self.rng.sample(list(self.items), min(k, len(self.items)))

    def shuffled(self) -> list[dict]:
        """Every question, in a random order (the round's FillPlan)."""
        return self.rng.sample(list(self.items), len(self.items))

    def clear_admitted(self) -> int:
        """Remove every question the game admitted; rows seeded from a file (step < 0) stay. Returns how many went."""
        keep = [it for it in self.items if it.get("step", 0) < 0]
        removed = len(self.items) - len(keep)
        self.items = deque(keep, maxlen=self.max_size)
        return removed

    def to_list(self) -> list[dict]:
        return [dict(it) for it in self.items]

    @classmethod
    def from_list(cls, items: Sequence[dict], max_size: int = POOL_SIZE, seed: int = 0) -> "QuestionPool":
        pool = cls(max_size, seed)
        for it in items:
            if pool.add(it["question"], it["answer"], it.get("step", 0), it.get("qcp"), it.get("solve_rate")) \
                    and "served" in it:
                pool.items[-1]["served"] = int(it["served"])   # game/pool_servings counts on after a resume
        return pool



def admit_to_pool(pool: QuestionPool, props: list[Trajectory], sols: list[Trajectory], valid: Sequence[int],
                  qcps: dict[int, dict], cfg: Any, step: int) -> int:
    """Add this round's valid questions whose solve rate s (outcome.solver_acc, set by score()) the pool
    admits (cfg.pool_admits); returns how many joined. A question whose solver group was left out of the
    loss (mark_excluded: its judging or search failed) has no measured s and stays out. Each proposer
    trajectory records outcome.pool_admitted."""
    unmeasured = {t.meta.proposer for t in sols
                  if t.meta.proposer is not None and t.outcome.excluded}
    admitted = 0
    for i in valid:
        t = props[i]
        s = t.outcome.solver_acc
        ok = i not in unmeasured and cfg.pool_admits(s) and pool.add(t.question, t.answer, step, qcps[i], s)
        t.outcome.pool_admitted = bool(ok)
        admitted += bool(ok)
    return admitted
