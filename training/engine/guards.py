"""Run guards: stop a run that would otherwise go on training on failures.

The trainer calls each guard once per step, on every rank, with global numbers (already
all-reduced), so every rank raises at the same step and none hangs in a collective:

    failures = FailureGuard(threshold=cfg.max_failed_share, window=cfg.failed_share_window)
    nonfinite = NonFiniteGuard(max_in_a_row=cfg.max_nonfinite_steps)
    ...
    failures.update(n_excluded_groups, n_groups)     # raises RuntimeError past the threshold
    if nonfinite.update(not math.isfinite(loss)):    # True: skip this update; raises after N in a row
        ...
    nonfinite.update_skipped(step_metrics)           # the same, from the actor's and critic's skipped steps

Both are pure Python, and their state_dict() holds plain types for the checkpoint.
"""

from __future__ import annotations

from collections import deque


class FailureGuard:
    """Stops the run when too large a share of the groups is left out of the loss.

    The game (inference/game.py) leaves out a group whose judging or search failed, rather
    than let an outage pay the proposer (a failed judge counted as "wrong" gives 1 - acc = 1)
    or show the solver "Search failed" as if it were evidence. A few such groups are noise;
    most of them means the judge or the retriever is down or misconfigured, and the run is
    then training on a biased remainder. The share is taken over the last `window` steps
    (over the steps seen so far until the window is full, so a judge that is wrong from the
    start stops the run after its first step).
    """

    def __init__(self, threshold: float = 0.5, window: int = 5):
        """
        threshold: the largest tolerated share of left-out groups over the window; the run stops
            when the share is strictly above it. 1.0 never stops.
        window: steps the share is taken over; 5 rides out a short outage of one or two steps.
        """
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"FailureGuard threshold must be a share in [0, 1], got {threshold}")
        if window < 1:
            raise ValueError(f"FailureGuard window must be >= 1 step, got {window}")
        self.threshold, self.window = float(threshold), int(window)
        self.counts: deque[tuple[int, int]] = deque(maxlen=self.window)  # (excluded, total) per step

    @property
    def share(self) -> float:
        """Left-out share over the window; 0.0 while the window holds no groups."""
        total = sum(t for _, t in self.counts)
        return sum(e for e, _ in self.counts) / total if total else 0.0

    def update(self, n_excluded: int | float, n_total: int | float, by_reason: dict | None = None) -> float:
        """Add one step's global counts; returns the share over the window, or raises RuntimeError past the threshold.

        by_reason: optional {"judge_failed": n, "search_failed": n}, quoted in the error message.
        """
        e, t = int(round(n_excluded)), int(round(n_total))
        if t < 0 or not 0 <= e <= t:
            raise ValueError(f"FailureGuard.update needs 0 <= n_excluded <= n_total, got {n_excluded}, {n_total}")
        self.counts.append((e, t))
        share = self.share
        if share > self.threshold:
            excl, total = sum(x for x, _ in self.counts), sum(x for _, x in self.counts)
            why = ""
            if by_reason:
                why = " (this step: " + ", ".join(f"{k} {int(round(v))}" for k, v in sorted(by_reason.items())) + ")"
            raise RuntimeError(
                f"stopping: {excl} of {total} groups ({share:.0%}) were left out of the loss over the last "
                f"{len(self.counts)} step(s){why}, above the threshold of {self.threshold:.0%} "
                f"(--max_failed_share, window --failed_share_window {self.window}). Groups are left out when "
                "their judging or their search failed, so the judge or the search backend is down or "
                "misconfigured: check the judge server (--judge_url, --judge_model, OPENAI_API_KEY; "
                "judge/failures in metrics.jsonl) and the retriever or simulator (its URL and logs; "
                "search_fn warnings in the log). The last checkpoint holds the run to resume from."
            )
        return share

    def state_dict(self) -> dict:
        return {"threshold": self.threshold, "window": self.window, "counts": [list(c) for c in self.counts]}

    def load_state_dict(self, state: dict) -> None:
        """Restores the window's counts; threshold and window stay as constructed (flags may change on resume)."""
        try:
            counts = [(int(e), int(t)) for e, t in state["counts"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a FailureGuard state dict ({type(err).__name__}: {err})") from err
        self.counts = deque(counts[-self.window:], maxlen=self.window)


class NonFiniteGuard:
    """Skips steps whose loss or gradient norm is not finite, and stops after `max_in_a_row` in a row.

    One NaN step (a rare overflow) is skipped and the run goes on; several in a row mean the
    weights or the optimiser state are already broken, and every later step would be too.
    """

    def __init__(self, max_in_a_row: int = 3):
        """max_in_a_row: consecutive non-finite steps that stop the run; 3 tolerates isolated overflows."""
        if max_in_a_row < 1:
            raise ValueError(f"NonFiniteGuard max_in_a_row must be >= 1, got {max_in_a_row}")
        self.max_in_a_row = int(max_in_a_row)
        self.in_a_row = 0
        self.total = 0   # non-finite steps over the whole run (skipped)

    def update(self, is_nonfinite: bool, what: str = "loss or gradient norm") -> bool:
        """True when this step must be skipped (it was non-finite); raises RuntimeError on the N-th in a row."""
        if not is_nonfinite:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.max_in_a_row:
            raise RuntimeError(
                f"stopping: the {what} was not finite (NaN or inf) in {self.in_a_row} steps in a row "
                f"(--max_nonfinite_steps {self.max_in_a_row}; {self.total} such steps in this run). The weights "
                "or optimiser state are likely broken: check the learning rate, the dtype (fp16/bf16 overflow), "
                "and the rewards and log-probs of the last steps in metrics.jsonl, then resume from a checkpoint "
                "taken before the first non-finite step."
            )
        return True

    def update_skipped(self, metrics: dict) -> bool:
        """update() from a step's metrics: non-finite when the actor's or the critic's update skipped an
        optimizer step (`<role>/skipped_steps`, training.algorithm.update.optimizer_step); a role that did not train is absent."""
        keys = [k for k in ("actor/skipped_steps", "critic/skipped_steps") if metrics.get(k, 0.0) > 0]
        return self.update(bool(keys), what=f"loss inputs, log-probs or gradient norm ({', '.join(keys)})")

    def state_dict(self) -> dict:
        return {"max_in_a_row": self.max_in_a_row, "in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        try:
            self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a NonFiniteGuard state dict ({type(err).__name__}: {err})") from err
