"""Which step metrics are summed over ranks, declared where each metric is made.

A metric is a mean over the ranks that report it, unless the module that makes it declares it summed:

    summed("search/calls", "search/queries")         # exact keys
    summed(prefixes=("game/filter/",))               # a family of counts
    summed(suffixes=("_loss",))                      # a naming convention (a rank's share of a global loss)

Summed are the counts (tokens, calls, failures, questions: a global count is the ranks' sum) and the
per-rank shares of a loss normalised by the global token count. The declaration sits next to the code that
makes the metric, so a new count is declared where it is born rather than in a list in the trainer;
`reduce_over_ranks` reads it. Pure Python apart from utils.dist's collectives.
"""

from __future__ import annotations

from utils import dist as D

_KEYS: set[str] = set()
_PREFIXES: set[str] = set()
_SUFFIXES: set[str] = set()


def summed(*keys: str, prefixes: tuple[str, ...] | frozenset = (), suffixes: tuple[str, ...] = ()) -> None:
    """Declare metrics summed over ranks: these keys, every key with one of these prefixes or suffixes."""
    _KEYS.update(keys)
    _PREFIXES.update(prefixes)
    _SUFFIXES.update(suffixes)


def is_summed(key: str) -> bool:
    """True when a declaration makes `key` a sum over ranks; every other metric is a mean over ranks."""
    return key in _KEYS or key.startswith(tuple(_PREFIXES)) or key.endswith(tuple(_SUFFIXES))


def reduce_over_ranks(m: dict) -> dict:
    """Each metric of this rank's `m` reduced over ranks (collective: every rank calls it): summed where
    declared (`summed`), else averaged over the ranks that report it. Keys come out sorted."""
    keys = sorted(set().union(*D.all_gather_object(sorted(m))))
    vals = D.all_reduce_sum([m.get(k, 0.0) for k in keys] + [float(k in m) for k in keys])
    n = len(keys)
    return {k: (vals[i] if is_summed(k) else vals[i] / max(vals[n + i], 1.0)) for i, k in enumerate(keys)}
