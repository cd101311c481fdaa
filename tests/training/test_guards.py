"""training/engine/guards.py: the failure-share and non-finite guards, against a plain-loop reference."""

from __future__ import annotations

import json
import random

import pytest

from training.engine.guards import FailureGuard, NonFiniteGuard


def test_failure_guard_stops_past_the_threshold_over_the_window():
    g = FailureGuard(threshold=0.5, window=3)
    assert g.update(0, 10) == 0.0
    assert g.update(5, 10) == pytest.approx(5 / 20)
    assert g.update(10, 10) == pytest.approx(15 / 30)       # exactly at the threshold: goes on
    with pytest.raises(RuntimeError) as err:
        g.update(10, 10, by_reason={"judge_failed": 7, "search_failed": 3})  # window (5,10),(10,10),(10,10): 25/30
    msg = str(err.value)
    for part in ("25 of 30 groups", "83%", "last 3 step", "50%", "--max_failed_share", "--judge_url", "OPENAI_API_KEY",
                 "retriever", "judge_failed 7", "search_failed 3"):
        assert part in msg, (part, msg)


def test_failure_guard_rides_out_a_short_outage_and_forgets_old_steps():
    g = FailureGuard(threshold=0.5, window=4)
    for e in (0, 0, 8, 0, 0, 8, 0, 0, 8):   # one bad step in three: share over any 4 steps <= 16/32
        g.update(e, 8)
    assert g.share == pytest.approx(16 / 32)   # the last 4 steps: 8, 0, 0, 8
    with pytest.raises(RuntimeError):   # with a window of one step, one bad step is enough
        FailureGuard(threshold=0.5, window=1).update(5, 8)


def test_failure_guard_wrong_from_the_start_stops_at_step_one():
    with pytest.raises(RuntimeError, match="over the last 1 step"):
        FailureGuard(threshold=0.5, window=5).update(16, 16)


def test_failure_guard_threshold_one_never_stops_and_empty_steps_count_nothing():
    g = FailureGuard(threshold=1.0, window=2)
    for _ in range(5):
        g.update(4, 4)
    g = FailureGuard(threshold=0.0, window=2)
    assert g.update(0, 0) == 0.0 and g.update(0, 3) == 0.0
    with pytest.raises(RuntimeError):
        g.update(1, 3)


def test_failure_guard_matches_a_plain_loop():
    rng = random.Random(0)
    for trial in range(200):
        window, threshold = rng.randint(1, 6), rng.choice([0.0, 0.25, 0.5, 0.9, 1.0])
        steps = []
        for _ in range(rng.randint(1, 12)):
            t = rng.randint(0, 10)
            steps.append((rng.randint(0, t), t))
        g = FailureGuard(threshold, window)
        for k, (e, t) in enumerate(steps):
            last = steps[max(0, k + 1 - window): k + 1]
            tot = sum(x for _, x in last)
            want = sum(x for x, _ in last) / tot if tot else 0.0
            if want > threshold:
                with pytest.raises(RuntimeError):
                    g.update(e, t)
                break
            assert g.update(e, t) == pytest.approx(want)


def test_failure_guard_state_round_trips_through_json():
    g = FailureGuard(threshold=0.5, window=3)
    g.update(1, 4)
    g.update(2, 4)
    state = json.loads(json.dumps(g.state_dict()))
    h = FailureGuard(threshold=0.5, window=3)
    h.load_state_dict(state)
    assert h.share == g.share == 3 / 8
    with pytest.raises(RuntimeError):   # the resumed window still holds the earlier steps: 7/12
        h.update(4, 4)
    small = FailureGuard(threshold=0.5, window=1)  # a smaller window on resume keeps the newest steps
    small.load_state_dict(state)
    assert small.share == 2 / 4
    with pytest.raises(ValueError, match="not a FailureGuard state"):
        h.load_state_dict({"window": 3})


@pytest.mark.parametrize("args", [(-0.1, 5), (1.5, 5), (0.5, 0)])
def test_failure_guard_bad_arguments(args):
    with pytest.raises(ValueError):
        FailureGuard(*args)


def test_failure_guard_bad_counts():
    g = FailureGuard()
    for e, t in ((3, 2), (-1, 2), (0, -1)):
        with pytest.raises(ValueError):
            g.update(e, t)


def test_nonfinite_guard_skips_then_stops_after_n_in_a_row():
    g = NonFiniteGuard(max_in_a_row=3)
    assert g.update(False) is False
    assert g.update(True) is True and g.update(True) is True
    assert g.update(False) is False            # a finite step resets the streak
    assert g.update(True) is True and g.update(True) is True
    with pytest.raises(RuntimeError) as err:
        g.update(True, what="loss")
    msg = str(err.value)
    assert "3 steps in a row" in msg and "--max_nonfinite_steps 3" in msg and "5 such steps" in msg and "loss" in msg


def test_nonfinite_guard_one_means_no_skipping_and_state_round_trips():
    with pytest.raises(RuntimeError):
        NonFiniteGuard(max_in_a_row=1).update(True)
    g = NonFiniteGuard(max_in_a_row=2)
    g.update(True)
    h = NonFiniteGuard(max_in_a_row=2)
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert h.in_a_row == 1 and h.total == 1
    with pytest.raises(RuntimeError):   # the streak survives a resume
        h.update(True)
    with pytest.raises(ValueError):
        NonFiniteGuard(max_in_a_row=0)
    with pytest.raises(ValueError, match="not a NonFiniteGuard state"):
        h.load_state_dict({})


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_nonfinite_guard_reads_the_critics_skipped_steps_as_the_actors(role):
    """A step's metrics (reduced over ranks): a skipped optimizer step of either role counts, also when the
    other role's key is missing (--critic_warmup: the critic alone trains)."""
    g = NonFiniteGuard(max_in_a_row=2)
    assert g.update_skipped({"actor/skipped_steps": 0.0, "critic/skipped_steps": 0.0}) is False
    assert g.update_skipped({}) is False
    assert g.update_skipped({f"{role}/skipped_steps": 1.0}) is True and g.in_a_row == 1
    with pytest.raises(RuntimeError) as err:
        g.update_skipped({f"{role}/skipped_steps": 2.0, "actor/grad_norm": 1.0})
    assert "2 steps in a row" in str(err.value) and f"{role}/skipped_steps" in str(err.value), err.value
