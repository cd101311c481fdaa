"""Dynamic sampling with refill (DAPO, https://arxiv.org/abs/2503.14476 section 3.2; veRL's
algorithm.filter_groups): within one SSP step, play more rounds of the game until the step holds enough
solver groups that carry a gradient.

    rounds = [play(0)]
    while informative solver groups of all rounds, summed over ranks, < N  and  len(rounds) < R:
        rounds.append(play(len(rounds)))       # the next proposer rows (and QA rows), fresh group ids
    game = merge_rounds(rounds)                 # trajectories joined, counts summed, means re-weighted

A solver group whose rewards are all equal has group advantage 0 (GRPO, RLOO, Dr. GRPO): it only dilutes
the loss normaliser, and drop_flat_solver_groups leaves it out of the loss; refilling plays new games in
its place. Every rank decides from the same all-reduced count, so every rank plays the same number of
rounds, calls the same collectives and moves the data cursors alike (a checkpoint's cursors resume the
run exactly). Ranks then hold unequal numbers of trajectories and of informative groups: the update
equalises micro-batch counts with empty work (training/update.pack_equal) and normalises the loss by the
global token count, so the step's gradient is still the whole batch's (tests/training/test_update.py,
the uneven phase).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from inference.game import GameResult, is_count
from utils.metrics import summed

ROUND_SEED_STRIDE = 104_729
"""Round k >= 1 of a step samples with rollout seed + k x this (a prime that is no multiple of the 1009 a step
adds, so (step, data-parallel rank, round) seeds stay apart for any run under 802 data-parallel ranks)."""


def informative_groups(game: GameResult) -> float:
    """This rank's solver groups of one round whose rewards are not all equal and that are not left out
    (inference.game.signal_counts, re-counted by the trainer after any reward shaping)."""
    return float(game.stats.get("game/informative_groups", 0.0))


def play_rounds(play: Callable[[int], GameResult], min_informative: int, max_rounds: int,
                total: Callable[[float], float]) -> list[GameResult]:
    """Round 0, then more rounds while the informative groups of the rounds so far, summed over ranks by
    `total` (collective: the same value on every rank), are fewer than `min_informative` and fewer than
    `max_rounds` rounds were played. play(k) plays round k on the next rows. min_informative 0 (off) plays
    one round and calls no collective, so a run without refill is what it was."""
    rounds = [play(0)]
    if min_informative <= 0:
        return rounds
    have = total(informative_groups(rounds[0]))
    while have < min_informative and len(rounds) < max_rounds:
        rounds.append(play(len(rounds)))
        have += total(informative_groups(rounds[-1]))
    return rounds


def round_rollout_cfg(rollout_cfg: dict, k: int) -> dict:
    """The per-role RolloutConfigs of round k: round 0's as they are, later rounds' seeds moved on (new rows
    would do, but a row can come back in the same step at the end of an epoch)."""
    if k == 0:
        return rollout_cfg
    return {role: c if c.seed is None else dataclasses.replace(c, seed=c.seed + k * ROUND_SEED_STRIDE)
            for role, c in rollout_cfg.items()}


# How a per-round mean stat of inference.game (the keys test_game_metrics lists as means) is combined over
# rounds: weighted by a count of the round, by its solver trajectories, or the last round's (a snapshot).
BY_PROPOSER_TRAJS = ("game/valid_rate", "game/filter_pass_rate", "proposer/reward_mean", "proposer/searches_mean")
BY_SOLVER_TRAJS = ("solver/acc", "solver/reward_mean", "solver/spam_rate", "solver/turns_mean",
                   "solver/searches_mean")
MEAN_WEIGHT = {**{k: "game/proposer_trajs" for k in BY_PROPOSER_TRAJS}, **{k: "solver" for k in BY_SOLVER_TRAJS},
               "game/rag_pass_rate": "game/rag_checked"}
LAST = ("game/pool_size", "game/pipelined")
MAX = ("game/pool_served_max",)   # the most-served pool question of the step's rounds
SUMMED_PREFIXES = ("judge/",)
"""Per-round differences of the judge's counters: summed over rounds here (the trainer averages them over ranks)."""


def merge_stats(stats: Sequence[dict], n_solver: Sequence[int]) -> dict:
    """One step's game stats from its rounds' (n_solver: each round's solver trajectories): counts
    (inference.game.is_count) and judge/* summed, means weighted by what they are means over (a round with
    nothing to average adds nothing), game/pool_size the last round's, MAX's the largest. A stat none of these
    names is averaged over the rounds that have it (tests/training/test_rounds.py checks a real round has none).
    No share is merged: the trainer makes the shares (inference.game.shares: game/informative_per_slot,
    game/valid_rate/<kind>, ...) from the merged counts once they are summed over ranks, so they hold over rounds."""
    out: dict = {}
    for k in dict.fromkeys(k for s in stats for k in s):
        have = [(s, n) for s, n in zip(stats, n_solver) if k in s]
        if is_count(k) or k.startswith(SUMMED_PREFIXES):
            out[k] = sum(s[k] for s, _ in have)
        elif k in LAST:
            out[k] = have[-1][0][k]
        elif k in MAX:
            out[k] = max(s[k] for s, _ in have)
        elif k in MEAN_WEIGHT:
            w = [float(n if MEAN_WEIGHT[k] == "solver" else s.get(MEAN_WEIGHT[k], 0.0)) for s, n in have]
            out[k] = sum(wi * s[k] for wi, (s, _) in zip(w, have)) / sum(w) if sum(w) else 0.0
        else:
            out[k] = sum(s[k] for s, _ in have) / len(have)
    return out


def merge_rounds(rounds: Sequence[GameResult]) -> GameResult:
    """The step's game from its rounds: every round's proposer trajectories, then every round's solver
    trajectories (GameResult's order), and merge_stats's stats, plus game/rounds: the rounds played. Every rank
    plays the same number (decided together), so it is a mean over ranks, not a count: counted on one rank and
    summed, it read half the rounds at --vllm_tp 2, where summed counts are divided by the group's copies."""
    trajs = [t for role in ("proposer", "solver") for g in rounds for t in g.trajectories if t.role == role]
    stats = merge_stats([g.stats for g in rounds],
                        [sum(t.role == "solver" for t in g.trajectories) for g in rounds])
    stats["game/rounds"] = float(len(rounds))
    return GameResult(trajs, stats)


summed("game/flat_solver_groups")  # drop_flat_solver_groups' count, summed over ranks (utils/metrics.py)


def drop_flat_solver_groups(trajs) -> tuple[list, int]:
    """(trajectories without the solver groups whose rewards are all equal, how many such groups).
    A solver group lives on one rank, so this needs no collective."""
    rewards: dict = {}
    for t in trajs:
        if t.role == "solver":
            rewards.setdefault(t.group_id, set()).add(float(t.reward))
    flat = {g for g, r in rewards.items() if len(r) == 1}
    return [t for t in trajs if not (t.role == "solver" and t.group_id in flat)], len(flat)
