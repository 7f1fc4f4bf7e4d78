"""The statistics of a study, as pure functions: curve summaries, paired differences, intervals, tests, verdicts.

What it is: numbers in, numbers out, no I/O, so every function is checked
against hand-computed values (tests/study/test_stats.py).
- `summarise`: a run's curve [(step, value)] -> one number (final window mean,
  area under the curve as the mean over steps, best moving average);
- `paired`: per-seed differences treatment - control over the seeds both arms
  have, signed so that > 0 always means "treatment better";
- `bootstrap_ci`: percentile interval of the mean difference. Up to
  EXACT_MAX differences it enumerates every resample (each multiset of the
  n values with its multinomial weight), so the interval is exact and
  deterministic; above, it draws `resamples` seeded resamples. Quantiles are
  inverse-CDF: the smallest mean whose cumulative weight reaches q;
- `wilcoxon_p`: Wilcoxon signed-rank test (scipy): exact null distribution
  when there are no ties, exhaustive sign permutations when there are ties
  (n <= 16), the normal approximation beyond; zero differences are dropped;
- `holm`: Holm's step-down adjustment across hypotheses;
- `judge`: the verdict of one hypothesis from its differences, its adjusted
  p-value and its interval.

The verdict rule (two-sided test of "the mean difference equals the margin
point", Holm-adjusted across hypotheses, with the interval on the same side):
- claim 'better' (margin m >= 0, point m): supported when p_holm < alpha and
  the interval lies above m; refuted when p_holm < alpha and it lies below m;
- claim 'no_worse' (margin m > 0, point -m): supported when p_holm < alpha
  and the interval lies above -m; refuted when it lies below -m;
- otherwise inconclusive (too few seeds, or an effect the data cannot place).

What it is not: a planner or a pruner (they use these functions).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

EXACT_MAX = 9  # exact bootstrap up to this many differences: C(17, 9) = 24310 distinct resamples


def summarise(curve: list[tuple[int, float]], how: str, window: int, upto: int | None = None) -> float | None:
    """One number for a run's curve (points sorted by step), using the points at steps <= `upto`.

    'final': mean of the last `window` points; 'auc': mean over all points (the area under the
    curve per step); 'best': the largest mean of `window` consecutive points (the caller flips the
    sign for metrics where smaller is better). None when no point qualifies.
    """
    values = [v for s, v in sorted(curve) if upto is None or s <= upto]
    if not values:
        return None
    if how == "final":
        tail = values[-window:]
        return sum(tail) / len(tail)
    if how == "auc":
        return sum(values) / len(values)
    if how == "best":
        w = min(window, len(values))
        return max(sum(values[i:i + w]) / w for i in range(len(values) - w + 1))
    raise ValueError(f"unknown summary {how!r}")


def paired(treatment: dict[int, float], control: dict[int, float], mode: str = "max") -> tuple[list[int], list[float]]:
    """(seeds, differences) over the seeds both arms have, sorted by seed; > 0 = treatment better."""
    sign = 1.0 if mode == "max" else -1.0
    seeds = sorted(set(treatment) & set(control))
    return seeds, [sign * (treatment[s] - control[s]) for s in seeds]


def _quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, q * cum[-1] - 1e-12, side="left"))
    return float(values[order][min(i, len(values) - 1)])


def bootstrap_ci(diffs: list[float], confidence: float = 0.95, resamples: int = 20_000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `diffs` (exact for up to EXACT_MAX values)."""
    x = np.asarray(diffs, dtype=float)
    n = len(x)
    if n == 0:
        return (math.nan, math.nan)
    tail = (1 - confidence) / 2
    if n <= EXACT_MAX:
        means, weights = [], []
        log_fact_n = math.lgamma(n + 1)
        for combo in itertools.combinations_with_replacement(range(n), n):
            counts = np.bincount(combo, minlength=n)
            means.append(float(counts @ x) / n)
            weights.append(math.exp(log_fact_n - sum(math.lgamma(c + 1) for c in counts) - n * math.log(n)))
        m, w = np.asarray(means), np.asarray(weights)
    else:
        rng = np.random.default_rng(seed)
        m = x[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
        w = np.ones(resamples)
    return _quantile(m, w, tail), _quantile(m, w, 1 - tail)


def wilcoxon_p(diffs: list[float], alternative: str = "two-sided") -> float:
    """p-value of the Wilcoxon signed-rank test that the differences are centred on 0."""
    from scipy import stats

    x = [d for d in diffs if d != 0.0]
    n = len(x)
    if n == 0:
        return 1.0
    ties = len({round(abs(d), 12) for d in x}) < n
    if not ties:
        method = "exact"
    elif n <= 16:
        method = stats.PermutationMethod(n_resamples=2 ** n)  # every sign assignment: exact with ties
    else:
        method = "asymptotic"
    return float(stats.wilcoxon(x, alternative=alternative, method=method).pvalue)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@dataclass(frozen=True)
class Evidence:
    """The evidence on one hypothesis before correction (`evidence`)."""

    seeds: list[int]
    diffs: list[float]
    mean: float  # mean difference (> 0: treatment better)
    ci: tuple[float, float]  # bootstrap interval of the mean difference
    p: float  # two-sided Wilcoxon p of the differences against the margin point
    dz: float  # standardised effect: mean / sd of the differences (nan with < 2 seeds or sd 0)


def point(claim: str, margin: float) -> float:
    """The value a hypothesis's mean difference is tested against."""
    return margin if claim == "better" else -margin


def evidence(seeds: list[int], diffs: list[float], claim: str, margin: float, confidence: float = 0.95,
         seed: int = 0) -> Evidence:
    """Interval, test and effect size of one hypothesis's paired differences."""
    if not diffs:
        return Evidence(seeds, diffs, math.nan, (math.nan, math.nan), 1.0, math.nan)
    mean = sum(diffs) / len(diffs)
    sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0
    at = point(claim, margin)
    return Evidence(seeds, diffs, mean, bootstrap_ci(diffs, confidence, seed=seed),
                wilcoxon_p([d - at for d in diffs]), mean / sd if sd > 0 else math.nan)


def judge(t: Evidence, p_holm: float, claim: str, margin: float, alpha: float) -> str:
    """'supported', 'refuted' or 'inconclusive' (see the module docstring for the rule)."""
    at = point(claim, margin)
    lo, hi = t.ci
    if not t.diffs or p_holm >= alpha:
        return "inconclusive"
    if lo > at:
        return "supported"
    if hi < at:
        return "refuted"
    return "inconclusive"
