"""The question pool (issue 31 §2): what it admits, how it draws, what a clear keeps, what a checkpoint keeps.

A measured run recycled unsolved questions: every valid question was admitted whatever its solve rate, and a
draw with replacement let one never-solved question fill 7 of 8 slots in a step. Now a fresh valid question
joins only when its solver group's solve rate lies in [pool_min_solve_rate, pool_max_solve_rate], a draw
never repeats a question, and every pool_clear_every steps the game's questions go (seeded rows stay).
The full round (admission with the round's own solve rates) is in tests/inference/test_game.py.
"""

from __future__ import annotations

import json

import pytest

from inference.game import (SEED_STEP, GameConfig, QuestionPool, admit_to_pool, is_count, mark_excluded,
                            pool_clear_due, score)
from inference.judge import Judge
from inference.trajectory import GameMeta, Trajectory

RATES = (0.0, 0.25, 0.5, 1.0)   # right answers out of G_s = 4, one question each


def _round(rates=RATES, excluded=()):
    """Valid proposer trajectories, one per rate, and G_s = 4 solver answers each with that share right; scored by
    score() (exact match), so outcome.solver_acc is the game's own. `excluded`: questions whose solver search failed."""
    props, sols = [], []
    for i, s in enumerate(rates):
        q = f"Which number did the puzzle number {i} in this hand-made round ask for here?"
        props.append(Trajectory("proposer", f"s0-p{i}", [1, 2], [0, 1], [0.0, -1.0], question=q, answer=f"n{i}",
                                stop_reason="question", meta=GameMeta(row=i)))
        for k in range(4):
            sols.append(Trajectory("solver", f"s0-q{i}", [1, 2], [0, 1], [0.0, -0.5], question=q, answer=f"n{i}",
                                   response_text=f"<answer> {f'n{i}' if k < round(4 * s) else 'wrong'} </answer>",
                                   meta=GameMeta(proposer=i, source="proposer"), search_failed=int(i in excluded)))
    score(props, [None] * len(props), sols, Judge(), GameConfig(rag_verify="off"))
    mark_excluded(props, sols, {i: True for i in range(len(props))})
    return props, sols


def _admit(cfg, rates=RATES, excluded=()):
    props, sols = _round(rates, excluded)
    assert [t.outcome.solver_acc for t in props] == list(rates)          # the hand-made rates, as score() read them
    pool = QuestionPool(16, seed=0)
    n = admit_to_pool(pool, props, sols, range(len(props)), {i: {"queries": [f"q{i}"], "docs": []}
                                                              for i in range(len(props))}, cfg, step=6)
    assert n == len(pool) == sum(t.outcome.pool_admitted for t in props)
    return [it["solve_rate"] for it in pool.to_list()], pool


SSP_WINDOW = {"pool_min_solve_rate": 0.0, "pool_max_solve_rate": 1.0}   # SSP's train_ssp.sh: every valid question


@pytest.mark.parametrize("window, admitted", [
    ({}, [0.25, 0.5]),                                  # defaults, the recipe's 0.01-0.99: never and always solved out
    (SSP_WINDOW, [0.0, 0.25, 0.5, 1.0]),
    ({**SSP_WINDOW, "pool_min_solve_rate": 0.25}, [0.25, 0.5, 1.0]),   # s = 0 refused when min > 0
    ({**SSP_WINDOW, "pool_min_solve_rate": 0.01}, [0.25, 0.5, 1.0]),
    ({**SSP_WINDOW, "pool_max_solve_rate": 0.5}, [0.0, 0.25, 0.5]),    # s = 1 refused when max < 1
    ({**SSP_WINDOW, "pool_max_solve_rate": 0.99}, [0.0, 0.25, 0.5]),
    ({"pool_min_solve_rate": 0.3, "pool_max_solve_rate": 0.6}, [0.5]),
    ({"pool_min_solve_rate": 0.5, "pool_max_solve_rate": 0.5}, [0.5]),      # the bounds are inclusive
])
def test_admission_window(window, admitted):
    got, pool = _admit(GameConfig(rag_verify="off", **window))
    assert got == admitted
    assert all(it["step"] == 6 and it["qcp"]["queries"] for it in pool.to_list())


def test_a_question_whose_solve_rate_was_not_measured_stays_out():
    # the solver search of question 2 failed: its group is left out of the loss and s = 0.5 is not a measurement
    got, _ = _admit(GameConfig(rag_verify="off", **SSP_WINDOW), excluded=(2,))
    assert got == [0.0, 0.25, 1.0]


def test_a_question_the_pool_holds_is_not_admitted_twice():
    props, sols = _round((0.5, 0.5))
    props[1].question = props[0].question.upper()                      # the same after normalising
    pool = QuestionPool(16, seed=0)
    assert admit_to_pool(pool, props, sols, [0, 1], {0: {}, 1: {}}, GameConfig(rag_verify="off"), 0) == 1
    assert [t.outcome.pool_admitted for t in props] == [True, False] and len(pool) == 1


def test_the_window_is_checked():
    for bad in ({"pool_min_solve_rate": 0.6, "pool_max_solve_rate": 0.5}, {"pool_max_solve_rate": 1.5},
                {"pool_min_solve_rate": -0.1}):
        with pytest.raises(ValueError, match="pool_min_solve_rate <= pool_max_solve_rate"):
            GameConfig(**bad)
    with pytest.raises(ValueError, match="pool_clear_every must be >= 0"):
        GameConfig(pool_clear_every=-1)


def _filled(n: int, seed: int = 0) -> QuestionPool:
    pool = QuestionPool(64, seed=seed)
    for i in range(n):
        pool.add(f"Pool question number {i}?", f"a{i}", step=i)
    return pool


def test_a_draw_never_repeats_and_returns_what_the_pool_holds():
    for seed in range(30):
        got = _filled(3, seed).sample(8)
        assert len(got) == 3 and len({g["question"] for g in got}) == 3, seed   # k > len: len distinct items
        got = _filled(10, seed).sample(7)
        assert len(got) == 7 and len({g["question"] for g in got}) == 7, seed
    assert QuestionPool(4).sample(3) == [] and _filled(3).sample(0) == []
    # seeded: the same seed draws the same questions; another seed, other ones
    draws = lambda seed: [[g["question"] for g in p.sample(4)] for p in [_filled(10, seed)] for _ in range(5)]  # noqa: E731
    assert draws(1) == draws(1) and draws(1) != draws(2)


def test_clearing_removes_what_the_game_admitted_and_keeps_the_seeded_rows():
    pool = QuestionPool(8, seed=0)
    pool.add("Seeded question one from the user's file?", ["x"], step=SEED_STEP)
    pool.add("Game question admitted at step zero?", "y", step=0, solve_rate=0.5)
    pool.add("Seeded question two from the user's file?", "z", step=SEED_STEP)
    pool.add("Game question admitted at step four?", "w", step=4, qcp={"queries": ["q"], "docs": []}, solve_rate=0.0)
    assert pool.clear_admitted() == 2
    assert [it["question"] for it in pool.to_list()] == ["Seeded question one from the user's file?",
                                                         "Seeded question two from the user's file?"]
    assert pool.clear_admitted() == 0 and len(pool) == 2
    assert pool.add("Game question admitted at step zero?", "y", step=11)   # a cleared question may come back
    for i in range(10):                                                    # the bound holds after a clear
        pool.add(f"Later question {i}?", "v", step=12)
    assert len(pool) == pool.max_size == 8


def test_clearing_is_due_every_n_steps_from_the_step_alone():
    assert [s for s in range(31) if pool_clear_due(s, 10)] == [10, 20, 30]   # never at step 0
    assert [s for s in range(4) if pool_clear_due(s, 1)] == [1, 2, 3]
    assert not any(pool_clear_due(s, 0) for s in range(50))                    # 0 = never
    assert GameConfig().pool_clear_every == 10                                 # SSP's train_ssp.sh
    # the step metrics sum both counts over ranks (the trainer's reduction reads is_count)
    assert is_count("game/pool_admitted") and is_count("game/pool_cleared")


def test_to_list_from_list_keeps_solve_rate_step_qcp_and_serve_count():
    pool = QuestionPool(8, seed=0)
    pool.add("Seeded question from the user's file?", ["x", "X"], step=SEED_STEP)
    pool.add("Game question with a known solve rate?", "y", step=3, qcp={"queries": ["q1", "q2"], "docs": [[]]},
             solve_rate=0.25)
    pool.add("Game question that nobody solved yet?", "z", step=4, solve_rate=0.0)
    pool.items[1]["served"] = 3                                     # play_round's count (issue 41: pool servings)
    items = json.loads(json.dumps(pool.to_list()))                  # what a checkpoint holds, through a text format
    back = QuestionPool.from_list(items, max_size=8)
    assert back.to_list() == pool.to_list()
    assert [it.get("solve_rate") for it in back.to_list()] == [None, 0.25, 0.0]
    assert back.to_list()[1]["qcp"]["queries"] == ["q1", "q2"]
    assert back.clear_admitted() == 2 and len(back) == 1               # the seeded row's step survives the trip too
