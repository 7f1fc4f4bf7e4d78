"""The study statistics against values computed by hand (the working is in the comments)."""

from __future__ import annotations

import math

import pytest

from jet.study import stats


def test_summaries():
    curve = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 10.0)]
    assert stats.summarise(curve, "final", 2) == 6.5  # (3 + 10) / 2
    assert stats.summarise(curve, "auc", 2) == 4.0  # (1 + 2 + 3 + 10) / 4
    assert stats.summarise(curve, "best", 2) == 6.5  # max(1.5, 2.5, 6.5)
    assert stats.summarise(curve, "final", 2, upto=3) == 2.5  # (2 + 3) / 2: the curve cut at step 3
    assert stats.summarise(curve, "final", 9) == 4.0  # a window longer than the curve: all of it
    assert stats.summarise(list(reversed(curve)), "final", 1) == 10.0  # points are sorted by step
    assert stats.summarise(curve, "final", 2, upto=0) is None


def test_paired_differences_are_signed_by_mode():
    t = {0: 1.0, 1: 2.0, 2: 5.0}
    c = {1: 1.5, 2: 3.0, 3: 9.0}
    assert stats.paired(t, c) == ([1, 2], [0.5, 2.0])  # only seeds both arms have
    assert stats.paired(t, c, mode="min") == ([1, 2], [-0.5, -2.0])  # smaller is better: flipped


def test_exact_bootstrap_interval():
    # Resamples of [1, 2, 3]: 27 equally likely ordered triples; their sums 3..9 occur
    # 1, 3, 6, 7, 6, 3, 1 times, so the CDF of the mean at 1, 4/3, 5/3, 2, 7/3, 8/3, 3 is
    # 1/27, 4/27, 10/27, 17/27, 23/27, 26/27, 1.
    # 80%: q = 0.1 -> first CDF >= 0.1 is 4/27 (mean 4/3); q = 0.9 -> 26/27 (mean 8/3).
    lo, hi = stats.bootstrap_ci([1.0, 2.0, 3.0], confidence=0.8)
    assert lo == pytest.approx(4 / 3) and hi == pytest.approx(8 / 3)
    # 95%: q = 0.025 -> 1/27 >= 0.025 (mean 1); q = 0.975 -> only 1 >= 0.975 (mean 3).
    assert stats.bootstrap_ci([1.0, 2.0, 3.0], confidence=0.95) == (pytest.approx(1.0), pytest.approx(3.0))
    # One value: every resample is that value.
    assert stats.bootstrap_ci([0.25]) == (0.25, 0.25)


def test_monte_carlo_bootstrap_is_seeded_and_brackets_the_mean():
    diffs = [0.1 * i for i in range(20)]  # above EXACT_MAX: sampled
    a, b = stats.bootstrap_ci(diffs, seed=3), stats.bootstrap_ci(diffs, seed=3)
    assert a == b
    assert a[0] < sum(diffs) / len(diffs) < a[1]


def test_wilcoxon_exact():
    # |d| ranks: 0.3->1, 0.5->2, 0.8->3, 1.2->4, 2.0->5; W+ = 2+4+3+5 = 14 of 15.
    # Sign assignments (32) with W+ >= 14: all positive (15) and all but rank 1 (14): p = 2/32.
    d = [0.5, 1.2, -0.3, 0.8, 2.0]
    assert stats.wilcoxon_p(d, "greater") == pytest.approx(2 / 32)
    assert stats.wilcoxon_p(d) == pytest.approx(4 / 32)  # two-sided: both tails
    assert stats.wilcoxon_p([1.0] * 0) == 1.0
    assert stats.wilcoxon_p([0.0, 0.0]) == 1.0  # zeros are dropped: nothing left to test
    # Eight positive differences: two-sided p = 2 / 2^8.
    assert stats.wilcoxon_p([0.1 * (i + 1) for i in range(8)]) == pytest.approx(2 / 256)


def test_wilcoxon_with_ties_is_exact_over_sign_permutations():
    # d = [2, 3, -1, 3]: ranks of |d| are 2 -> 2, 3 -> 3.5 (twice), 1 -> 1; W+ = 2 + 3.5 + 3.5 = 9 of 10.
    # Subsets of {1, 2, 3.5, 3.5} with sum >= 9: the whole set (10) and the set without 1 (9): 2 of 16.
    assert stats.wilcoxon_p([2.0, 3.0, -1.0, 3.0], "greater") == pytest.approx(2 / 16)


def test_holm():
    # Sorted: 0.01 * 3 = 0.03; 0.03 * 2 = 0.06; 0.04 * 1 = 0.04 -> raised to the running max 0.06.
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert stats.holm([0.5]) == [0.5]
    assert stats.holm([0.9, 0.8]) == [1.0, 1.0]  # capped at 1


def test_verdicts():
    up = [0.1 * (i + 1) for i in range(8)]  # mean 0.45
    e = stats.evidence(list(range(8)), up, "better", 0.0)
    assert e.mean == pytest.approx(0.45) and e.p == pytest.approx(2 / 256)
    assert stats.judge(e, e.p, "better", 0.0, 0.05) == "supported"
    assert stats.judge(e, 0.2, "better", 0.0, 0.05) == "inconclusive"  # Holm took it above alpha
    down = [-x for x in up]
    e = stats.evidence(list(range(8)), down, "better", 0.0)
    assert stats.judge(e, e.p, "better", 0.0, 0.05) == "refuted"
    # Non-inferiority, margin 0.5: differences around -0.1 are all above -0.5 -> supported.
    small = [-0.1, 0.05, -0.2, 0.0, 0.1, -0.15, -0.05, 0.02]
    e = stats.evidence(list(range(8)), small, "no_worse", 0.5)
    # d + 0.5 are all positive: p = 2/256; the interval lies within [-0.2, 0.1], above -0.5.
    assert e.p == pytest.approx(2 / 256)
    assert stats.judge(e, e.p, "no_worse", 0.5, 0.05) == "supported"
    # ... but with a margin of 0.1 it is not decided either way.
    e = stats.evidence(list(range(8)), small, "no_worse", 0.1)
    assert stats.judge(e, e.p, "no_worse", 0.1, 0.05) == "inconclusive"
    # Four seeds can never reach p < 0.05 two-sided (the smallest exact p is 2/16).
    e = stats.evidence([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0], "better", 0.0)
    assert e.p == pytest.approx(2 / 16) and stats.judge(e, e.p, "better", 0.0, 0.05) == "inconclusive"
    assert math.isnan(stats.evidence([], [], "better", 0.0).mean)
