"""Dynamic sampling with refill (training/loop/rounds.py) and the search-count mix, as the trainer plays them.

The round loop runs in SSPTrainer.play on fake ranks: one thread per rank, a real barrier behind the
all-reduce (a rank that called it a different number of times breaks the barrier instead of hanging),
the trainer's own next_batch and cursors, and a scripted play_round whose informative groups per rank
and round are given. A real round (play_round with a scripted engine on the real tokenizer) checks the
group ids of refill rounds and that merge_stats knows every stat a round makes. The trainer's draw of
each row's search count follows the row's stream position (the draw itself: tests/inference/test_data.py).
The update with uneven groups per rank is tests/training/test_update.py's (update_worker.py's uneven phase).
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from inference.data import ProposerRow, draw_search_turns
from inference.game import GameResult, is_count
from inference.rollout import RolloutConfig
from inference.trajectory import Trajectory
from training.settings.config import Config
from training.loop.rounds import (LAST, MAX, MEAN_WEIGHT, ROUND_SEED_STRIDE, SUMMED_PREFIXES, merge_rounds, merge_stats,
                             play_rounds)
# imported before any test patches utils.dist: utils.logging binds utils.dist.is_main when first imported
from training.loop.trainer import SSPTrainer

from tests.scripted_policy import ScriptedPolicy
from tests.thread_ranks import ThreadRanks

ROWS = [ProposerRow(answer=f"a{i}", search_turns=2) for i in range(50)]
QA = [SimpleNamespace(question=f"q{i}?", golden_answers=[f"g{i}"]) for i in range(30)]


def test_the_loop_stops_at_n_or_at_the_cap_and_every_rank_plays_alike():
    def rounds(script: dict[int, list[float]], n: int, cap: int) -> tuple[list[int], list[int]]:
        world = ThreadRanks(len(script))

        def rank(r):
            game = lambda k: GameResult([], {"game/informative_groups": script[r][k]})  # noqa: E731
            return len(play_rounds(game, n, cap, lambda x: world.all_reduce_sum([x])[0]))
        return world.run(rank), world.calls

    # 2 after round 0, 4 after round 1 >= 3: stops at N with the cap still far
    assert rounds({0: [1, 2, 9, 9, 9], 1: [1, 0, 9, 9, 9]}, n=3, cap=5) == ([2, 2], [2, 2])
    # never enough: stops at the cap
    assert rounds({0: [0, 1, 1], 1: [1, 0, 1]}, n=100, cap=3) == ([3, 3], [3, 3])
    # rank 0 alone would stop, rank 1 alone would go on: the summed count decides for both
    assert rounds({0: [5, 0], 1: [0, 0]}, n=4, cap=2) == ([1, 1], [1, 1])
    assert rounds({0: [3, 0], 1: [0, 0]}, n=4, cap=2) == ([2, 2], [2, 2])
    # off: one round and no collective at all
    assert rounds({0: [0, 0], 1: [0, 0]}, n=0, cap=3) == ([1, 1], [0, 0])


def fake_trainer(rank: int, world: int, cfg: Config, seen: list):
    t = SimpleNamespace(cfg=cfg, rows=ROWS, qa_rows=QA, cursor=0, qa_cursor=0, dp_rank=rank, dp_world=world, step=5,
                        search={"proposer": None, "solver": None}, llm=None, judge=None, game_cfg=None, pool=None)
    t.next_batch = lambda: SSPTrainer.next_batch(t)
    t._take = lambda *a: SSPTrainer._take(t, *a)
    t.play = lambda rcfg: SSPTrainer.play(t, rcfg)
    t.seen = seen
    return t


def stream(rows: list, k: int, name: str = "a") -> list[str]:
    """The first k items of a source's global stream (each epoch a seeded permutation: SSPTrainer._take)."""
    t = SimpleNamespace(cfg=Config(), cursor=0)
    return [x.answer if name == "a" else x.question for x in SSPTrainer._take(t, rows, "cursor", k)]


def scripted_play_round(script, world):
    """play_round's stand-in: one solver group per call, `script[rank][round]` informative groups."""
    def play_round(engine, rows, search_fn, judge, cfg, rollout_cfg, pool=None, step=0, qa_questions=(), round_idx=0):
        r = world.rank()
        world.seen[r].append({"round": round_idx, "rows": [x.answer for x in rows],
                              "turns": [x.search_turns for x in rows], "qa": [q["question"] for q in qa_questions],
                              "seed": rollout_cfg["solver"].seed})
        sol = Trajectory("solver", f"s{step}r{round_idx}-q0", [1, 2], [0, 1], [0.0, -0.5], reward=1.0)
        stats = {"game/informative_groups": float(script[r][round_idx]), "game/solver_groups": 1.0,
                 "solver/acc": float(round_idx), "game/pool_size": 10.0 + round_idx, "judge/calls": 2.0}
        return GameResult([sol], stats)
    return play_round


def play_step(monkeypatch, script, n, cap, qa_mix=0.5, mix="", cursors=(0, 0)):
    """SSPTrainer.play on 2 fake ranks at prompts_per_step 4; returns (trainers, games, seen, world)."""
    import training.loop.trainer
    from utils import dist as D

    world = ThreadRanks(2)
    world.seen = [[], []]
    cfg = Config()
    cfg.selfplay.prompts_per_step, cfg.selfplay.qa_mix_fraction, cfg.selfplay.search_turns_mix = 4, qa_mix, mix
    cfg.algorithm.min_informative_groups, cfg.algorithm.max_rounds = n, cap
    cfg.algorithm.drop_flat_solver_groups = True
    monkeypatch.setattr(training.loop.trainer, "play_round", scripted_play_round(script, world))   # imported at its top
    monkeypatch.setattr(D, "all_reduce_sum", world.all_reduce_sum)
    monkeypatch.setattr(D, "is_main", lambda: world.rank() == 0)
    trainers = [fake_trainer(r, 2, cfg, world.seen[r]) for r in range(2)]
    for t in trainers:
        t.cursor, t.qa_cursor = cursors
    rcfg = {role: RolloutConfig(seed=1000) for role in ("proposer", "solver")}
    games = world.run(lambda r: trainers[r].play(rcfg))
    return trainers, games, world.seen, world


def test_the_trainer_refills_on_the_next_rows_and_the_cursors_move_alike(monkeypatch):
    # 1 + 0 informative groups, then 1 + 1: 3 >= N = 3 after round 1 (cap 4)
    trainers, games, seen, world = play_step(monkeypatch, {0: [1, 1, 5, 5], 1: [0, 1, 5, 5]}, n=3, cap=4)
    assert world.calls == [2, 2]
    assert [(t.cursor, t.qa_cursor) for t in trainers] == [(4, 4), (4, 4)]          # 2 rounds x (2 rows, 2 QA)
    # each round a fresh global batch of 2 rows + 2 QA rows: rank 0 its rows, rank 1 its QA rows
    rows, qa = stream(ROWS, 4), stream(QA, 4, "q")
    assert [s["rows"] for s in seen[0]] == [rows[:2], rows[2:]] and [s["qa"] for s in seen[0]] == [[], []]
    assert [s["qa"] for s in seen[1]] == [qa[:2], qa[2:]] and [s["rows"] for s in seen[1]] == [[], []]
    # round k samples with its own seeds; round 0's are the step's as before
    assert [s["seed"] for s in seen[0]] == [1000, 1000 + ROUND_SEED_STRIDE]
    g0, g1 = games
    assert (g0.stats["game/rounds"], g1.stats["game/rounds"]) == (2.0, 2.0)       # the same on every rank: a mean
    assert (g0.stats["game/informative_groups"], g1.stats["game/informative_groups"]) == (2.0, 1.0)
    assert [t.group_id for t in g0.trajectories] == ["s5r0-q0", "s5r1-q0"]
    assert g0.stats["solver/acc"] == 0.5 and g0.stats["game/pool_size"] == 11.0 and g0.stats["judge/calls"] == 4.0

    # the next step resumed from these cursors reads what an uninterrupted run reads next
    _, _, again, _ = play_step(monkeypatch, {0: [1, 9], 1: [0, 9]}, n=3, cap=4, cursors=(4, 4))
    _, _, straight, _ = play_step(monkeypatch, {0: [1, 1, 1, 9], 1: [0, 1, 0, 9]}, n=5, cap=4)
    assert [s["rows"] + s["qa"] for s in again[0]] == [s["rows"] + s["qa"] for s in straight[0][2:]]


def test_without_the_flag_the_step_is_one_round_as_before(monkeypatch):
    trainers, games, seen, world = play_step(monkeypatch, {0: [0, 0], 1: [0, 0]}, n=0, cap=3)
    assert world.calls == [0, 0] and [len(s) for s in seen] == [1, 1]
    assert [(t.cursor, t.qa_cursor) for t in trainers] == [(2, 2), (2, 2)]
    assert "game/rounds" not in games[0].stats and seen[0][0]["seed"] == 1000
    assert set(games[0].stats) == {"game/informative_groups", "game/solver_groups", "solver/acc", "game/pool_size",
                                   "judge/calls"}                          # no proposer/search_turns_mean either


def test_merge_stats_sums_counts_and_weights_means():
    a = {"game/proposer_trajs": 4, "game/valid_rate": 0.5, "game/rag_checked": 0, "game/rag_pass_rate": 0.0,
         "solver/acc": 1.0, "game/pool_size": 3, "judge/calls": 2, "game/informative_groups": 1, "x/other": 1.0}
    b = {"game/proposer_trajs": 2, "game/valid_rate": 1.0, "game/rag_checked": 2, "game/rag_pass_rate": 0.5,
         "solver/acc": 0.0, "game/pool_size": 5, "judge/calls": 1, "game/informative_groups": 2, "x/other": 3.0}
    m = merge_stats([a, b], n_solver=[2, 6])
    assert m["game/proposer_trajs"] == 6 and m["game/informative_groups"] == 3 and m["judge/calls"] == 3
    assert m["game/valid_rate"] == pytest.approx((4 * 0.5 + 2 * 1.0) / 6)
    assert m["game/rag_pass_rate"] == 0.5                       # round a checked nothing: it adds nothing
    assert m["solver/acc"] == pytest.approx(2 / 8)              # by solver trajectories
    assert m["game/pool_size"] == 5 and m["x/other"] == 2.0     # a snapshot: the last; unnamed: the plain mean
    assert merge_stats([{"solver/acc": 0.0}], [0]) == {"solver/acc": 0.0}


def test_the_game_per_slot_holds_over_the_rounds_of_a_step():
    """Issue 41 §2: two rounds of tests/inference/test_game_metrics.py's hand round (4 proposer slots: 1 fresh
    informative, 1 pool replay, 2 empty; its pool question served 3, then 4 times): the counts sum, and the shares
    the trainer makes from them read as one round's."""
    from inference.game import shares
    from tests.inference.test_game_metrics import hand_round

    m = merge_stats([hand_round(served=3), hand_round(served=4)], n_solver=[6, 6])
    assert (m["game/solver_slots"], m["game/empty_slots"], m["game/informative_groups/fresh"]) == (8, 4, 2)
    assert (m["game/pool_servings"], m["game/pool_served_max"]) == (7, 4)        # the max over the rounds
    sh = shares(m)
    assert sh["game/informative_per_slot"] == 0.25 and sh["game/empty_slot_share"] == 0.5
    assert sh["game/pool_served_mean"] == 3.5 and sh["game/valid_rate/name"] == 0.5
    unnamed = {k for k in m if not (is_count(k) or k in MEAN_WEIGHT or k in LAST or k in MAX
                                    or k.startswith(SUMMED_PREFIXES))}
    assert not unnamed, sorted(unnamed)


def test_refill_rounds_get_their_own_group_ids_and_every_stat_merges_by_name(smollm2_dir):
    from transformers import AutoTokenizer

    from inference.game import GameConfig, play_round
    from inference.judge import Judge

    def search(queries, topk):
        return [[{"id": "Lincoln", "contents": "Abraham Lincoln\nLincoln was shot at Ford's Theatre in 1865."}]
                for _ in queries]
    # both roles from a script: the proposer searches twice and asks one question, the solver answers at once
    engine = ScriptedPolicy(AutoTokenizer.from_pretrained(smollm2_dir), "Abraham Lincoln", solver_searches=0)
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify="off")
    rcfg = RolloutConfig(max_turns=4, max_tokens_per_turn=32, max_info_tokens=128, topk=1, seed=3)
    rows = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2)]
    r0, r1 = (play_round(engine, rows, search, Judge(), cfg, rcfg, step=7, round_idx=k) for k in (0, 1))
    # both proposer samples write a valid question: 2 solver groups a round
    assert {t.group_id for t in r0.trajectories} == {"s7-p0", "s7-q0", "s7-q1"}     # round 0: the ids of before
    assert {t.group_id for t in r1.trajectories} == {"s7r1-p0", "s7r1-q0", "s7r1-q1"}
    game = merge_rounds([r0, r1])
    assert [t.role for t in game.trajectories] == ["proposer"] * 4 + ["solver"] * 8
    unnamed = {k for k in r0.stats if not (is_count(k) or k in MEAN_WEIGHT or k in LAST or k in MAX
                                           or k.startswith(SUMMED_PREFIXES))}
    assert not unnamed, f"merge_stats would average these over rounds unweighted; name them: {sorted(unnamed)}"
    assert game.stats["game/proposer_trajs"] == 4 and game.stats["game/valid_questions"] == 4
    assert game.stats["solver/acc"] == 1.0 and game.stats["game/rounds"] == 2


def test_the_trainer_draws_each_rows_n_by_its_stream_position(monkeypatch):
    script = {0: [0, 0, 0], 1: [0, 0, 0]}
    _, games, seen, _ = play_step(monkeypatch, script, n=9, cap=3, qa_mix=0.0, mix="4:3:2:1")
    turns = [t for s in seen[0] + seen[1] for t in s["turns"]]
    assert len(turns) == 12 and set(turns) <= {2, 3}                                # default --max_turns 4: n <= 3
    # rank 0 holds positions 0-1, 4-5, 8-9 of the stream, rank 1 positions 2-3, 6-7, 10-11
    want = {pos: min(max(draw_search_turns([4, 3, 2, 1], 42, pos), 2), 3) for pos in range(12)}
    assert [t for s in seen[0] for t in s["turns"]] == [want[p] for p in (0, 1, 4, 5, 8, 9)]
    assert [t for s in seen[1] for t in s["turns"]] == [want[p] for p in (2, 3, 6, 7, 10, 11)]
    mean = statistics.mean(want.values())
    assert games[0].stats["proposer/search_turns_mean"] == games[1].stats["proposer/search_turns_mean"] == mean
    # resumed at position 4 (the second round's rows): the same n's
    _, _, again, _ = play_step(monkeypatch, script, n=0, cap=3, qa_mix=0.0, mix="4:3:2:1", cursors=(4, 0))
    assert again[0][0]["turns"] == [want[4], want[5]] and again[1][0]["turns"] == [want[6], want[7]]
