"""Seed-level statistics for the learning ladder (issue 41): how sure a difference between two arms is, with the
training seed counted as the noise it is.

An arm is a list of seeds; a seed is one RL run, read as a 0/1 EM array over a fixed question set (the same
questions, in the same order, for every seed of every arm: `align` builds the arrays from eval.py's examples).
Two sources of noise sit in a difference of mean EM between two arms:
  - the training seed: sampling, data order and game seeds differ between runs (seed std 0.5-2.1 points on the
    ladder, as large as the effects it measured);
  - the questions: a finite draw from the questions one could have asked.
The question-level bootstrap (`question_bootstrap`, the ladder's old interval) averages each question over the
seeds first and resamples questions only, so it holds the seeds fixed: it covers the second source alone and is
kept only as a second column. The seed-level statistics cover the first:
  - `two_level_bootstrap`: each replicate resamples each arm's seeds with replacement and then the questions; the
    question draw is shared by every seed of both arms, so each question stays paired with itself and its
    difficulty cancels from the difference (a fresh draw per seed would add the spread of question difficulty,
    which pairing removes). It covers both sources. With few seeds it is too narrow: resampling n seeds
    shrinks their variance by (n - 1) / n and can never show a seed that was not run, so with 3 seeds its
    interval is not to be trusted alone;
  - `seed_permutation_test`: exact over every relabelling of the per-seed scores between the two arms, two-sided.
    It assumes nothing about the scores' distribution, only that under the null the labels are exchangeable. Its
    smallest p is fixed by the seed counts (`smallest_p`): 2 / C(6, 3) = 0.10 with 3 seeds an arm, so 3 seeds can
    never reach 0.05; 2 / C(10, 5) = 0.0079 with 5;
  - `sign_flip_test`: an arm against one fixed model (the SFT start, evaluated once, greedy): exact over the 2^n
    sign flips of the per-seed gains, two-sided; its smallest p is 2 / 2^n (0.0625 with 5 seeds, 0.031 with 6).
Every function takes and returns the units it is given (0/1 EM in, fractions out): the report multiplies by 100.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Sequence

import numpy as np

MAX_RELABELLINGS = 2_000_000  # exact tests enumerate; beyond this many relabellings they refuse


class Interval(NamedTuple):
    """A difference of means (a - b) and the bounds of its interval."""
    diff: float
    lo: float
    hi: float


def _matrix(x, what: str) -> np.ndarray:
    """(seeds, questions) float array from a list of per-seed 0/1 arrays (or one array: one seed)."""
    m = np.asarray(x, dtype=float)
    if m.ndim == 1:
        m = m[None, :]
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise ValueError(f"{what}: expected a non-empty list of per-seed EM arrays of equal length, got shape {m.shape}")
    return m


def _pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    A, B = _matrix(a, "a"), _matrix(b, "b")
    if A.shape[1] != B.shape[1]:
        raise ValueError(f"the two arms are read on different question sets ({A.shape[1]} and {B.shape[1]} questions)")
    return A, B


def _bounds(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def two_level_bootstrap(a: Sequence, b: Sequence, n_boot: int = 10000, seed: int = 0,
                        level: float = 0.95) -> Interval:
    """mean(a) - mean(b) with a bootstrap interval over seeds and questions. a, b: per-seed lists of per-question 0/1
    EM arrays over the same questions (the arms may have different seeds and different seed counts; an arm of one
    seed, such as the SFT start, contributes no seed noise). Each replicate draws the questions once with
    replacement, shared by both arms (paired by question), then each arm's seeds with replacement, and takes the
    difference of the arms' means over their drawn seeds of the per-seed means over the drawn questions.
    -> Interval(observed difference, lower, upper) at `level` (percentile interval)."""
    A, B = _pair(a, b)
    q = A.shape[1]
    rng = np.random.default_rng(seed)
    diffs = np.empty(n_boot)
    chunk = max(1, min(n_boot, 4_000_000 // q))
    for start in range(0, n_boot, chunk):
        k = min(chunk, n_boot - start)
        w = rng.multinomial(q, np.full(q, 1.0 / q), size=k) / q   # (k, q): each question's share of the draw
        ma, mb = w @ A.T, w @ B.T                                   # (k, seeds): per-seed means on the drawn questions
        ia = rng.integers(0, A.shape[0], (k, A.shape[0]))
        ib = rng.integers(0, B.shape[0], (k, B.shape[0]))
        diffs[start:start + k] = (np.take_along_axis(ma, ia, 1).mean(1) - np.take_along_axis(mb, ib, 1).mean(1))
    return Interval(float(A.mean() - B.mean()), *_bounds(diffs, level))


def question_bootstrap(a: Sequence, b: Sequence, n_boot: int = 10000, seed: int = 0,
                       level: float = 0.95) -> Interval:
    """The question-level paired bootstrap (the second column): each question's EM averaged over each arm's seeds
    first, the per-question differences resampled with replacement. The seeds are held fixed, so the interval
    leaves out training noise. -> Interval(observed difference, lower, upper)."""
    A, B = _pair(a, b)
    d = A.mean(0) - B.mean(0)
    means = d[np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))].mean(axis=1)
    return Interval(float(d.mean()), *_bounds(means, level))


def _count(n: int, k: int) -> int:
    total = math.comb(n, k)
    if total > MAX_RELABELLINGS:
        raise ValueError(f"{total} relabellings: too many to enumerate exactly")
    return total


def seed_permutation_test(a_scores: Sequence[float], b_scores: Sequence[float]) -> float:
    """Exact two-sided permutation test of mean(a) = mean(b) over seeds: the share of all C(n_a + n_b, n_a) ways to
    label n_a of the pooled per-seed scores "a" whose |mean(a) - mean(b)| is at least the observed one (the
    observed labelling included, so p >= 1 / C)."""
    a, b = [float(x) for x in a_scores], [float(x) for x in b_scores]
    if not a or not b:
        raise ValueError("seed_permutation_test: each arm needs at least one seed")
    pooled, na, nb = a + b, len(a), len(b)
    _count(na + nb, na)
    total = sum(pooled)
    observed = abs(sum(a) / na - sum(b) / nb)
    tol = 1e-9 * max(1.0, observed)
    hits = n = 0
    for idx in itertools.combinations(range(na + nb), na):
        sa = sum(pooled[i] for i in idx)
        n += 1
        hits += abs(sa / na - (total - sa) / nb) >= observed - tol
    return hits / n


def sign_flip_test(diffs: Sequence[float]) -> float:
    """Exact two-sided sign-flip test of mean(diffs) = 0: per-seed gains of an arm over one fixed model (the SFT
    start), the share of the 2^n sign patterns whose |mean| is at least the observed one."""
    d = [float(x) for x in diffs]
    if not d:
        raise ValueError("sign_flip_test: no seeds")
    if 2 ** len(d) > MAX_RELABELLINGS:
        raise ValueError(f"2^{len(d)} sign patterns: too many to enumerate exactly")
    observed = abs(sum(d))
    tol = 1e-9 * max(1.0, observed)
    flips = list(itertools.product((1.0, -1.0), repeat=len(d)))
    return sum(abs(sum(s * x for s, x in zip(signs, d))) >= observed - tol for signs in flips) / len(flips)


def smallest_p(n_a: int, n_b: int | None = None) -> float:
    """The smallest two-sided p the exact tests can return with these seed counts (all scores distinct): with
    n_b, the permutation test's 2 / C(n_a + n_b, n_a) (1 / C when the counts differ: the mirrored labelling is not
    a relabelling then); without, the sign-flip test's 2 / 2^n_a."""
    if n_b is None:
        return 2 / 2 ** n_a
    return (2 if n_a == n_b else 1) / math.comb(n_a + n_b, n_a)


def align(a: Sequence[dict], b: Sequence[dict]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Per-seed {question id: EM} dicts of two arms -> (the ids every seed of both arms answered, sorted; the two
    (seeds, questions) arrays in that order)."""
    if not a or not b:
        raise ValueError("align: each arm needs at least one seed")
    ids = sorted(set.intersection(*(set(x) for x in [*a, *b])))
    if not ids:
        raise ValueError("align: the two arms share no question ids")
    return ids, np.array([[x[i] for i in ids] for x in a], float), np.array([[x[i] for i in ids] for x in b], float)
