"""Jet's statistics, in one place: intervals, paired tests, corrections, curve summaries, verdicts.

What it is: pure functions, numbers in and numbers out, each checked against hand-computed values
(tests/test_stats.py). `jet bench`, `jet study`, `jet dash`, `jet eval` and the evaluator all call these;
nothing else in the package computes an interval or a p-value.

- Intervals of a mean: `t975` (Student's 97.5% quantile, from a table: no scipy, so the base install's
  commands and the dashboard have it), `mean_interval` (a t interval over runs), `wilson` (k of n),
  `interval` (Wilson for 0/1 results, else normal, clipped to [0, 1]: one evaluation's rows);
  `bootstrap_ci`: percentile interval of a mean; up to EXACT_MAX values it enumerates every resample
  (each multiset with its multinomial weight), so it is exact and deterministic, above it draws seeded
  resamples; quantiles are inverse-CDF (the smallest mean whose cumulative weight reaches q);
  `median_interval`: the median and the distribution-free order-statistic interval around it (its exact
  coverage said: with 4 values no such interval reaches 95%, and the range's 87.5% is reported).
- Paired tests: `sign_test` (exact McNemar on discordant pairs), `rows_paired` (per-row results of the
  same rows: McNemar for 0/1, else Wilcoxon), `wilcoxon_p` (signed-rank, scipy: exact without ties,
  every sign permutation with ties up to 16 values, normal beyond; zero differences dropped), `holm`.
- Over runs paired by seed (the first line of every comparison; per-row or per-episode tests are the
  second): `paired` (per-seed differences, > 0 = treatment better), `paired_summary` (mean difference,
  t and bootstrap intervals, Wilcoxon p, effect size dz), `evidence` (the same against a hypothesis's
  margin point) and `judge` (a hypothesis's verdict), `summarise` (a run's curve as one number).
- Curves [(x, y)] (accuracy against wall time, a metric against steps): `first_reach` (the first x at
  which y reaches a target) and `area` (the integral of y, the curve held from each point to the next
  or linear between points).

The verdict rule (two-sided test of "the mean difference equals the margin point", Holm-adjusted across
hypotheses, with the interval on the same side):
- claim 'better' (margin m >= 0, point m): supported when p_holm < alpha and the interval lies above m;
  refuted when p_holm < alpha and it lies below m;
- claim 'no_worse' (margin m > 0, point -m): supported when p_holm < alpha and the interval lies above
  -m; refuted when it lies below -m;
- otherwise inconclusive (too few seeds, or an effect the data cannot place).

What it is not: I/O, or a planner.

Invariant: only `bootstrap_ci` (numpy) and `wilcoxon_p` (scipy), and what calls them (`rows_paired` of
fractional results, `paired_summary`, `evidence`), need more than the standard library, and they import
it inside: the base install (no numpy, no scipy) has every other function.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

EXACT_MAX = 9  # exact bootstrap up to this many values: C(17, 9) = 24310 distinct resamples
Z975 = 1.959964
# Student's t, two-sided 95% (the 97.5% quantile), for 1..30 degrees of freedom (scipy's, to 6 digits);
# beyond, the Cornish-Fisher expansion around the normal's (within 1e-4 from 31 on).
_T975 = [12.7062, 4.30265, 3.18245, 2.77645, 2.57058, 2.44691, 2.36462, 2.306, 2.26216, 2.22814, 2.20099, 2.17881,
         2.16037, 2.14479, 2.13145, 2.11991, 2.10982, 2.10092, 2.09302, 2.08596, 2.07961, 2.07387, 2.06866, 2.0639,
         2.05954, 2.05553, 2.05183, 2.04841, 2.04523, 2.04227]


# ---- intervals


def t975(df: int) -> float:
    """Student's t 97.5% quantile with `df` degrees of freedom (>= 1)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z975
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df * df)


def mean_interval(values: list[float]) -> dict:
    """{mean, ci95, n}: the mean and its 95% Student-t interval (None with fewer than two values)."""
    n = len(values)
    mean = sum(values) / n if n else None
    if n < 2:
        return {"mean": mean, "ci95": None, "n": n}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": n}


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean of `values` (sample sd / sqrt(n)); None with fewer than two."""
    return _sd(values) / math.sqrt(len(values)) if len(values) > 1 else None


def wilson(k: int, n: int, z: float = Z975) -> tuple[float, float]:
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def interval(results: list[float]) -> tuple[float, float]:
    """95% interval of the mean of one evaluation's per-row results in [0, 1]: Wilson's for 0/1 results,
    else the normal one (clipped to [0, 1])."""
    n = len(results)
    if n == 0:
        return 0.0, 1.0
    if all(r in (0, 1) for r in results):
        return wilson(int(sum(results)), n)
    mean = sum(results) / n
    sd = math.sqrt(sum((r - mean) ** 2 for r in results) / max(1, n - 1))
    return max(0.0, mean - Z975 * sd / math.sqrt(n)), min(1.0, mean + Z975 * sd / math.sqrt(n))


def _quantile(values, weights, q: float) -> float:
    import numpy as np

    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, q * cum[-1] - 1e-12, side="left"))
    return float(values[order][min(i, len(values) - 1)])


def bootstrap_ci(values: list[float], confidence: float = 0.95, resamples: int = 20_000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (exact for up to EXACT_MAX values)."""
    import numpy as np

    x = np.asarray(values, dtype=float)
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


def median_interval(values: list[float], confidence: float = 0.95) -> dict:
    """{median, ci95, coverage, n}: the median and the narrowest interval between order statistics
    x_(k) and x_(n+1-k) whose coverage of the true median, 1 - 2 P(Binomial(n, 1/2) < k), is at least
    `confidence`; with too few values for that, the whole range and its (lower) coverage. Values may be
    inf (a time never reached within a budget): the median is then inf if half of them are."""
    x = sorted(values)
    n = len(x)
    if n == 0:
        return {"median": None, "ci95": None, "coverage": None, "n": 0}
    median = x[n // 2] if n % 2 else (x[n // 2 - 1] + x[n // 2]) / 2
    below = [sum(math.comb(n, i) for i in range(k)) / 2 ** n for k in range(n // 2 + 2)]  # P(B < k)
    k = max((k for k in range(1, n // 2 + 1) if 1 - 2 * below[k] >= confidence), default=1)
    return {"median": median, "ci95": [x[k - 1], x[n - k]], "coverage": 1 - 2 * below[k], "n": n}


# ---- paired tests


def sign_test(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: the binomial(b + c, 1/2) sign test on the discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def rows_paired(x: list[float], y: list[float]) -> dict:
    """A paired test of per-row results of the same rows: McNemar when every result is 0/1 (b = x right y
    wrong, c = x wrong y right), else Wilcoxon signed-rank on y - x."""
    if len(x) != len(y):
        raise ValueError(f"paired results differ in length ({len(x)} vs {len(y)})")
    if all(v in (0, 1) for v in (*x, *y)):
        b = sum(1 for i, j in zip(x, y) if i and not j)
        c = sum(1 for i, j in zip(x, y) if j and not i)
        return {"test": "mcnemar", "x_only": b, "y_only": c, "p": sign_test(b, c)}
    diffs = [j - i for i, j in zip(x, y)]
    return {"test": "wilcoxon", "mean_diff": sum(diffs) / len(diffs), "p": wilcoxon_p(diffs)}


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


# ---- over seeds: summaries, evidence, verdicts


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


def _sd(values: list[float]) -> float:
    """The sample standard deviation (0 for fewer than two values)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def paired_summary(diffs: list[float], seed: int = 0) -> dict:
    """{n, mean, ci95, bootstrap95, wilcoxon_p, dz} of per-seed differences: the mean difference, its 95%
    t interval (`mean_interval`) and percentile bootstrap interval (`bootstrap_ci`), the two-sided Wilcoxon
    signed-rank p against 0 and the effect size dz = mean / sd (None where undefined: no differences, one,
    or no spread)."""
    n = len(diffs)
    sd = _sd(diffs)
    return {**mean_interval(diffs), "bootstrap95": list(bootstrap_ci(diffs, seed=seed)) if n else None,
            "wilcoxon_p": wilcoxon_p(diffs), "dz": sum(diffs) / n / sd if sd > 0 else None}


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
    sd = _sd(diffs)
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


# ---- curves


def first_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first x of the curve (its points taken in order of x) at which y >= target, None if it never
    does; y within 1e-9 below the target counts as reaching it (an accuracy of k/n computed two ways)."""
    return next((x for x, y in sorted(curve) if y >= target - 1e-9), None)


def area(curve: list[tuple[float, float]], end: float, how: str = "step") -> float:
    """The integral of the curve's y over x from its first point to `end`. 'step': each y is held from its
    point to the next (the last to `end`): what a user had at each moment, a model being replaced only when
    the next one is ready; 'linear': straight lines between points (the trapezoid rule), the last y held
    to `end`. Points beyond `end` only shape the line up to it; nothing counts before the first point."""
    if how not in ("step", "linear"):
        raise ValueError(f"unknown curve shape {how!r} (expected 'step' or 'linear')")
    pts = sorted(curve)
    total = 0.0
    for (x0, y0), (x1, y1) in zip(pts, [*pts[1:], (math.inf, None)]):
        if x0 >= end:
            break
        right = min(x1, end)
        if right == x0:  # two points at one x: no width
            continue
        if how == "step" or y1 is None:
            total += y0 * (right - x0)
        else:  # the line's height at `right`, then the trapezoid
            total += (y0 + y0 + (y1 - y0) * (right - x0) / (x1 - x0)) / 2 * (right - x0)
    return total
