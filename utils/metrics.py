"""Which step metrics are summed over ranks, declared where each metric is made.

A metric is a mean over the ranks that report it, unless the module that makes it declares it summed:

    summed("search/calls", "search/queries")         # exact keys
    summed(prefixes=("game/filter/",))               # a family of counts
    summed(suffixes=("_loss",), shares=True)         # a naming convention (a rank's share of a global loss)

Summed are the counts (tokens, calls, failures, questions: a global count is the ranks' sum) and the
per-rank shares of a loss normalised by the global token count. The declaration sits next to the code that
makes the metric, so a new count is declared where it is born rather than in a list in the trainer;
`reduce_over_ranks` reads it. Pure Python apart from utils.dist's collectives.

Replicas: at --vllm_tp N the N ranks of a TP group play the same games (training/loop/trainer.py), so a count summed
over ranks would count each game N times. The trainer calls set_replicas(N) and a summed count is then divided by
N. A share (declared with shares=True: a rank's part of a quantity normalised by a global count, e.g. a loss) is
not: the global count held the copies too, so the copies' shares already add up to the quantity once.
"""

from __future__ import annotations

from utils import dist as D

# (keys, prefixes, suffixes) of the summed counts, and of the summed shares
_COUNTS: tuple[set[str], set[str], set[str]] = (set(), set(), set())
_SHARES: tuple[set[str], set[str], set[str]] = (set(), set(), set())
_replicas = 1


def summed(*keys: str, prefixes: tuple[str, ...] | frozenset = (), suffixes: tuple[str, ...] = (),
           shares: bool = False) -> None:
    """Declare metrics summed over ranks: these keys, every key with one of these prefixes or suffixes.
    shares=True: each rank's part of a quantity normalised by a global count (a loss), which replicas never divide."""
    k, p, s = _SHARES if shares else _COUNTS
    k.update(keys)
    p.update(prefixes)
    s.update(suffixes)


def _declared(key: str, kind: tuple[set[str], set[str], set[str]]) -> bool:
    keys, prefixes, suffixes = kind
    return key in keys or key.startswith(tuple(prefixes)) or key.endswith(tuple(suffixes))


def is_summed(key: str) -> bool:
    """True when a declaration makes `key` a sum over ranks; every other metric is a mean over ranks."""
    return _declared(key, _COUNTS) or _declared(key, _SHARES)


def set_replicas(n: int) -> None:
    """How many ranks hold each game (the --vllm_tp ranks of a TP group): a summed count is divided by it."""
    global _replicas
    if n < 1:
        raise ValueError(f"replicas must be >= 1, got {n}")
    _replicas = n


def _summed_value(key: str, total: float) -> float:
    return total if _declared(key, _SHARES) else total / _replicas


def reduce_over_ranks(m: dict) -> dict:
    """Each metric of this rank's `m` reduced over ranks (collective: every rank calls it): summed where
    declared (`summed`; a count then divided by the replicas, set_replicas), else averaged over the ranks that
    report it. Keys come out sorted."""
    keys = sorted(set().union(*D.all_gather_object(sorted(m))))
    vals = D.all_reduce_sum([m.get(k, 0.0) for k in keys] + [float(k in m) for k in keys])
    n = len(keys)
    return {k: (_summed_value(k, vals[i]) if is_summed(k) else vals[i] / max(vals[n + i], 1.0))
            for i, k in enumerate(keys)}
