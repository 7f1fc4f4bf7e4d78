"""jet.stats against values computed by hand (the working is in the comments)."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from jet import stats


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


def test_sign_test_matches_hand_computed_binomial_tails():
    assert stats.sign_test(0, 0) == 1.0  # no discordant pair: no evidence either way
    assert stats.sign_test(0, 1) == 1.0  # 2 * P(X <= 0 | n=1) = 2 * 1/2
    assert stats.sign_test(0, 5) == pytest.approx(2 / 32)  # 2 * (1/2)^5 = 0.0625: five to none is not p < 0.05
    assert stats.sign_test(0, 6) == pytest.approx(2 / 64)  # 0.03125
    assert stats.sign_test(1, 9) == pytest.approx(2 * (1 + 10) / 1024)  # 2 * (C(10,0) + C(10,1)) / 2^10 = 0.021484375
    assert stats.sign_test(9, 1) == stats.sign_test(1, 9)  # two-sided: symmetric
    assert stats.sign_test(3, 3) == 1.0  # 2 * P(X <= 3 | n=6) = 2 * 42/64 > 1, capped
    assert stats.sign_test(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)  # 0.109375
    tail = sum(math.comb(30, i) for i in range(11)) / 2 ** 30
    assert stats.sign_test(10, 20) == pytest.approx(2 * tail)  # 0.0987...


def test_rows_paired_counts_only_discordant_rows():
    x = [1, 1, 0, 0, 1, 0, 1]
    y = [1, 0, 1, 1, 1, 1, 0]
    assert stats.rows_paired(x, y) == {"test": "mcnemar", "x_only": 2, "y_only": 3,
                                       "p": pytest.approx(stats.sign_test(2, 3))}
    with pytest.raises(ValueError, match="length"):
        stats.rows_paired([1], [1, 0])


def test_fractional_rows_get_a_wilcoxon_test():
    from scipy import stats as sp

    x, y = [0.0, 0.25, 0.5, 0.25, 0.0, 0.75], [0.25, 0.5, 0.5, 0.75, 0.25, 1.0]
    p = stats.rows_paired(x, y)
    assert p["test"] == "wilcoxon" and p["mean_diff"] == pytest.approx(0.25)
    assert p["p"] == pytest.approx(sp.wilcoxon([0.25, 0.25, 0.5, 0.25, 0.25], method=sp.PermutationMethod(
        n_resamples=32)).pvalue)


def test_t_intervals_and_the_t_table():
    from scipy import stats as sp

    m = stats.mean_interval([1.0, 2.0, 3.0])
    assert m["mean"] == 2.0 and m["ci95"] == pytest.approx([2 - 4.302653 / math.sqrt(3), 2 + 4.302653 / math.sqrt(3)],
                                                           abs=1e-5)  # the table holds 6 digits
    assert stats.mean_interval([5.0]) == {"mean": 5.0, "ci95": None, "n": 1}
    assert stats.mean_interval([]) == {"mean": None, "ci95": None, "n": 0}
    for df in [*range(1, 40), 60, 100, 1000]:
        assert stats.t975(df) == pytest.approx(float(sp.t.ppf(0.975, df)), abs=1e-4), df


def test_wilson_and_the_interval_of_one_evaluation():
    assert stats.interval([]) == (0.0, 1.0)
    assert stats.interval([1, 0, 0, 1]) == stats.wilson(2, 4)
    lo, hi = stats.interval([0.5, 0.5])  # fractions, no spread: the normal interval is the point
    assert lo == hi == 0.5


def test_the_median_and_its_order_statistic_interval():
    # n = 4: P(all 4 on one side of the median) = 2/16, so the widest interval [x1, x4] covers 87.5%, and no
    # narrower one reaches 95%: the range is reported with its coverage
    m = stats.median_interval([4.0, 1.0, 3.0, 2.0])
    assert m == {"median": 2.5, "ci95": [1.0, 4.0], "coverage": 0.875, "n": 4}
    # n = 9: k = 2 gives 1 - 2 P(B(9, 1/2) < 2) = 1 - 2 * 10/512 = 0.9609 >= 0.95; k = 3: 1 - 2 * 46/512 < 0.95
    m = stats.median_interval([float(v) for v in range(1, 10)])
    assert m["median"] == 5.0 and m["ci95"] == [2.0, 8.0] and m["coverage"] == pytest.approx(1 - 20 / 512)
    # a time never reached within a budget is inf: the median is finite while fewer than half are
    assert stats.median_interval([1.0, 2.0, math.inf])["median"] == 2.0
    assert stats.median_interval([1.0, math.inf, math.inf])["median"] == math.inf
    assert stats.median_interval([])["median"] is None
    one = stats.median_interval([0.7])  # a single value (a bench whose other seeds had no ratio): no interval
    assert one["median"] == 0.7 and one["ci95"] == [0.7, 0.7] and one["coverage"] == 0.0


def test_the_summary_of_differences_paired_by_seed():
    from scipy import stats as sp

    # mean 0.84; d - 0.84 = -0.34, 0.36, -1.14, -0.04, 1.16, whose squares sum to 2.892: sd = sqrt(2.892 / 4)
    d = [0.5, 1.2, -0.3, 0.8, 2.0]
    s = stats.paired_summary(d)
    assert s["n"] == 5 and s["mean"] == pytest.approx(0.84)
    assert s["dz"] == pytest.approx(0.84 / math.sqrt(2.892 / 4))
    half = float(sp.t.ppf(0.975, 4)) * math.sqrt(2.892 / 4) / math.sqrt(5)
    assert s["ci95"] == pytest.approx([0.84 - half, 0.84 + half], abs=1e-5)
    assert s["wilcoxon_p"] == pytest.approx(4 / 32)  # as in test_wilcoxon_exact
    assert s["bootstrap95"] == pytest.approx(list(stats.bootstrap_ci(d)))
    assert s["bootstrap95"][0] < 0.84 < s["bootstrap95"][1]
    # one difference: no spread, no interval, no effect size; none at all: nothing but n
    assert stats.paired_summary([0.25]) == {"mean": 0.25, "ci95": None, "n": 1, "bootstrap95": [0.25, 0.25],
                                            "wilcoxon_p": 1.0, "dz": None}
    assert stats.paired_summary([]) == {"mean": None, "ci95": None, "n": 0, "bootstrap95": None,
                                        "wilcoxon_p": 1.0, "dz": None}


def test_first_reach_of_a_curve():
    curve = [(0.0, 0.1), (30.0, 0.3), (60.0, 0.5), (90.0, 0.45)]
    assert stats.first_reach(curve, 0.3) == 30.0
    assert stats.first_reach(curve, 0.45) == 60.0  # the first, not the last, point at or above it
    assert stats.first_reach(list(reversed(curve)), 0.45) == 60.0  # in order of x, whatever the list's order
    assert stats.first_reach(curve, 0.6) is None  # never within the curve
    assert stats.first_reach(curve, 0.3 + 1e-12) == 30.0  # 3/10 computed two ways still reaches 0.3
    assert stats.first_reach([], 0.0) is None


def test_area_under_a_step_and_a_linear_curve():
    curve = [(0.0, 0.1), (30.0, 0.3), (60.0, 0.5)]
    # held: 0.1 * 30 + 0.3 * 30 + 0.5 * 40 (the last held to 100) = 3 + 9 + 20 = 32
    assert stats.area(curve, 100.0) == pytest.approx(32.0)
    # linear: (0.1 + 0.3) / 2 * 30 + (0.3 + 0.5) / 2 * 30 + 0.5 * 40 = 6 + 12 + 20 = 38
    assert stats.area(curve, 100.0, "linear") == pytest.approx(38.0)
    # cut inside a segment: held 0.1 * 30 + 0.3 * 15 = 7.5; linear to y(45) = 0.4: 6 + (0.3 + 0.4) / 2 * 15 = 11.25
    assert stats.area(curve, 45.0) == pytest.approx(7.5)
    assert stats.area(curve, 45.0, "linear") == pytest.approx(11.25)
    # nothing before the first point; two points at one x add no width
    assert stats.area([(10.0, 1.0), (20.0, 1.0)], 30.0) == pytest.approx(20.0)
    assert stats.area([(0.0, 0.0), (0.0, 1.0), (10.0, 1.0)], 10.0, "linear") == pytest.approx(10.0)
    assert stats.area([], 10.0) == 0.0
    with pytest.raises(ValueError, match="curve shape"):
        stats.area(curve, 10.0, "spline")


def test_the_base_install_has_every_function_but_the_bootstrap_and_wilcoxon(monkeypatch):
    # the base install has no numpy or scipy: importing them fails, as it would there, and the module is
    # loaded afresh under that (an import of either at its top would fail here)
    for name in ("numpy", "scipy", "scipy.stats"):
        monkeypatch.setitem(sys.modules, name, None)
    spec = importlib.util.spec_from_file_location("jet_stats_without_numpy", stats.__file__)
    base = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, base)  # its dataclass looks itself up there
    spec.loader.exec_module(base)
    assert base.wilson(9, 100) == pytest.approx((0.0481, 0.1623), abs=1e-4)
    assert base.interval([0.25, 0.5]) and base.mean_interval([1.0, 2.0])["ci95"]
    assert base.median_interval([1.0, 2.0, 3.0])["median"] == 2.0 and base.sign_test(1, 9) < 0.05
    assert base.rows_paired([1, 0], [1, 1])["test"] == "mcnemar" and base.holm([0.01, 0.02])
    assert base.summarise([(1, 1.0)], "final", 1) == 1.0 and base.paired({0: 1.0}, {0: 0.5}) == ([0], [0.5])
    assert base.first_reach([(0.0, 1.0)], 1.0) == 0.0 and base.area([(0.0, 1.0)], 2.0) == 2.0
    with pytest.raises(ImportError):
        base.bootstrap_ci([1.0, 2.0])
    with pytest.raises(ImportError):
        base.wilcoxon_p([1.0, 2.0])
