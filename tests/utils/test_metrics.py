"""utils/metrics.py: a metric is summed over ranks where the module that makes it declares so, else averaged.

Two ranks are faked with threads (their collectives meet at a barrier), so reduce_over_ranks runs as it does
under torchrun, and its result is checked against a plain sum / mean over the ranks' dicts.
"""

from __future__ import annotations


import pytest

from tests.thread_ranks import ThreadRanks
from utils import dist as D
from utils import metrics as M


@pytest.fixture
def two_ranks(monkeypatch):
    w = ThreadRanks(2)
    monkeypatch.setattr(D, "all_gather_object", w.all_gather_object)
    monkeypatch.setattr(D, "all_reduce_sum", w.all_reduce_sum)
    return w


def naive(per_rank: list[dict]) -> dict:
    keys = sorted(set().union(*per_rank))
    return {k: (sum(m.get(k, 0.0) for m in per_rank) if M.is_summed(k)
                else sum(m[k] for m in per_rank if k in m) / sum(k in m for m in per_rank)) for k in keys}


def test_a_game_filter_count_is_summed_over_two_ranks(two_ranks):
    import inference.game  # noqa: F401 - the game declares its counts where it makes them (inference/game_metrics.py)

    per_rank = [{"game/filter/too_short": 3.0, "game/valid_rate": 0.25, "game/proposer_trajs": 4.0},
                {"game/filter/too_short": 1.0, "game/valid_rate": 0.75, "game/proposer_trajs": 4.0,
                 "game/filter/answer_in_question": 2.0}]
    got = two_ranks.run(lambda r: M.reduce_over_ranks(per_rank[r]))
    assert got[0] == got[1]                                      # every rank gets the same numbers
    assert got[0]["game/filter/too_short"] == 4.0                # a count: the sum, not the mean 2.0
    assert got[0]["game/filter/answer_in_question"] == 2.0       # reported by one rank: still the global count
    assert got[0]["game/proposer_trajs"] == 8.0
    assert got[0]["game/valid_rate"] == 0.5                      # a share: the mean over ranks
    assert got[0] == naive(per_rank)


def test_a_mean_is_over_the_ranks_that_report_it(two_ranks):
    import training.algorithm.update  # noqa: F401 - declares the *_loss shares (alone, this file never imported it)

    per_rank = [{"x/undeclared_mean": 2.0, "actor/pg_loss": 0.5}, {"actor/pg_loss": 0.25}]
    got = two_ranks.run(lambda r: M.reduce_over_ranks(per_rank[r]))[0]
    assert got == {"actor/pg_loss": 0.75, "x/undeclared_mean": 2.0} == naive(per_rank)


def test_every_metric_the_trainer_summed_is_declared_where_it_is_made():
    """The keys the trainer's SUM_KEYS list used to name, the *_loss shares and the game's counts: after the
    trainer's imports each is summed; the shares and means are not."""
    import training.loop.trainer  # noqa: F401 - imports every module that makes a step metric
    from inference.game import COUNT_KEYS, COUNT_PREFIXES

    formerly = ("actor/num_tokens", "search/sim_failures", "search/sim_docs", "game/flat_solver_groups",
                "train/proposer_tokens", "train/solver_tokens", "search/calls", "search/failures", "search/queries")
    assert all(M.is_summed(k) for k in formerly + tuple(COUNT_KEYS))
    assert all(M.is_summed(p + "x") for p in COUNT_PREFIXES)
    assert all(M.is_summed(k) for k in ("actor/pg_loss", "actor/kl_loss", "critic/value_loss", "distill/kl_loss"))
    assert not any(M.is_summed(k) for k in ("game/valid_rate", "solver/acc", "actor/lr", "judge/calls",
                                            "search/sim_noise_p", "train/solver_reward_mean", "timing_s/step"))


def test_one_rank_passes_through():
    m = {"game/filter/too_short": 2.0, "solver/acc": 0.5}
    assert M.reduce_over_ranks(m) == m


def test_a_tp_group_counts_its_games_once_and_keeps_the_loss_shares(two_ranks, monkeypatch):
    """At --vllm_tp 2 both ranks of the group play the same games (training/loop/trainer.py sets the replicas): the
    reduced counts equal one copy's, not twice that, and a loss (each rank's share of it, normalised by a global
    count that held both copies) sums to the one copy's loss. Reference: one rank alone with the whole game."""
    import inference.game  # noqa: F401 - declares the game's counts
    import training.algorithm.update  # noqa: F401 - declares actor/num_tokens and the *_loss shares

    monkeypatch.setattr(M, "_replicas", 1)  # restored after the test
    alone = {"game/proposer_trajs": 4.0, "game/filter/too_short": 3.0, "actor/num_tokens": 120.0,
             "actor/pg_loss": 0.5, "game/valid_rate": 0.25}
    copy = dict(alone, **{"actor/pg_loss": 0.25})   # sum(copy's loss terms) / (2 x 120 tokens): half of it
    M.set_replicas(2)
    got = two_ranks.run(lambda r: M.reduce_over_ranks(dict(copy)))
    assert got[0] == got[1] == alone
    M.set_replicas(1)
    assert two_ranks.run(lambda r: M.reduce_over_ranks(dict(copy)))[0]["game/proposer_trajs"] == 8.0
    with pytest.raises(ValueError):
        M.set_replicas(0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_rounds_played_read_the_same_at_any_tp(two_ranks, monkeypatch, replicas):
    """Issue 40 (6): both ranks played 2 rounds. At --vllm_tp 2 (replicas 2) game/rounds read 1: it was counted on
    rank 0 alone, summed, then divided by the group's copies."""
    import inference.game  # noqa: F401 - declares the game's counts
    from inference.game import GameResult
    from training.loop.rounds import merge_rounds

    monkeypatch.setattr(M, "_replicas", replicas)
    games = [merge_rounds([GameResult([], {"game/proposer_trajs": 2.0})] * 2) for _ in range(2)]
    got = two_ranks.run(lambda r: M.reduce_over_ranks(games[r].stats))
    assert got[0]["game/rounds"] == 2.0
    assert got[0]["game/proposer_trajs"] == 8.0 / replicas   # a count: 2 rounds x 2 on each rank, copies once


def test_a_rank_without_loss_tokens_leaves_no_nan(two_ranks):
    """Issue 40 (6): a rank whose refill left it no loss tokens made every token-weighted actor and critic mean NaN,
    and the mean over ranks with it."""
    import torch

    from training.algorithm.critic import _reduce
    from training.algorithm.loss import reduce_metrics

    def actor(n, frac):
        return {"actor/num_tokens": torch.tensor(float(n)), "actor/pg_loss": torch.tensor(0.0),
                "actor/clipfrac_high": torch.tensor(frac), "actor/ratio_max": torch.tensor(1.5)}

    def critic(n, frac):
        return {"critic/value_loss": 0.0, "critic/num_tokens": float(n), "critic/vf_clipfrac": frac,
                "critic/values_mean": 0.5}

    per_rank = [{**reduce_metrics([actor(10, 0.2)]), **_reduce([[critic(10, 0.4)]])},
                {**reduce_metrics([actor(0, 0.0)]), **_reduce([[critic(0, 0.0)]])}]
    got = two_ranks.run(lambda r: M.reduce_over_ranks(per_rank[r]))[0]
    assert all(v == v for v in got.values()), got                  # no NaN anywhere
    assert got["actor/clipfrac_high"] == pytest.approx(0.2) and got["critic/vf_clipfrac"] == pytest.approx(0.4)
    assert got["actor/ratio_max"] == 1.5


def test_the_game_per_slot_is_read_off_counts_summed_over_two_ranks(two_ranks):
    """Issue 41 §2: rank 0 plays tests/inference/test_game_metrics.py's hand round (4 proposer slots: 1 fresh
    informative, 1 pool replay, 2 empty), rank 1 the same with its pool question served 5 times: the trainer's
    shares, made from the summed counts, read as one round's (not a mean of per-rank shares)."""
    from inference.game import shares
    from tests.inference.test_game_metrics import hand_round

    per_rank = [hand_round(served=3), hand_round(served=5)]
    per_rank[1]["game/solver_slots"] += 4                     # rank 1 also had 4 more slots, all empty
    per_rank[1]["game/empty_slots"] += 4
    got = two_ranks.run(lambda r: M.reduce_over_ranks({k: float(v) for k, v in per_rank[r].items()}))[0]
    assert (got["game/solver_slots"], got["game/empty_slots"], got["game/informative_groups/fresh"]) == (12, 8, 2)
    assert got["game/pool_served_max"] == 4.0                 # per-rank maxes 3 and 5: their mean over ranks
    sh = shares(got)
    assert sh["game/informative_per_slot"] == pytest.approx(2 / 12)   # the mean of per-rank shares would say 3/16
    assert sh["game/empty_slot_share"] == pytest.approx(8 / 12)
    assert sh["game/pool_served_mean"] == 4.0                 # (3 + 5) servings over 2 served questions
    assert sh["game/valid_rate/name"] == 0.5
    one = two_ranks.run(lambda r: M.reduce_over_ranks({k: float(v) for k, v in hand_round().items()}))[0]
    assert shares(one)["game/informative_per_slot"] == 0.25 and one["game/empty_slots"] == 4
