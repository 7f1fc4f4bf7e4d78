"""Time to accuracy from curves (jet.bench.trl_curves.compare), on curves of measured runs: pure arithmetic."""

import math

from jet.bench.trl_curves import compare

BASE = {"accuracy": 0.058}
TIMES = [0.0, 60.0, 120.0, 180.0, 240.0, 300.0]


def run(arm: str, repeat: int, accuracies: list[float]) -> dict:
    return {"arm": arm, "repeat": repeat, "seed": repeat,
            "curve": [{"t": t, "accuracy": a} for t, a in zip(TIMES, accuracies, strict=True)]}


def test_seeds_where_trl_gained_nothing_are_set_apart_from_the_times():
    runs = [
        # repeat 0: both gain; Jet reaches TRL's final 0.20 at 60 s, TRL at 240 s
        run("jet", 0, [0.058, 0.20, 0.21, 0.22, 0.22, 0.22]), run("trl", 0, [0.058, 0.06, 0.10, 0.15, 0.20, 0.20]),
        # repeat 1 (seed 0 of the tally round): TRL ends at 0.096, Jet never reaches it nor its half gain 0.077
        run("jet", 1, [0.058, 0.058, 0.071, 0.05, 0.067, 0.046]), run("trl", 1, [0.058, 0.058, 0.058, 0.146, 0.146, 0.096]),
        # repeat 2 (seed 1 of the tally round): TRL ends below the base; its targets lie at or below the base
        run("jet", 2, [0.058, 0.021, 0.017, 0.013, 0.017, 0.017]), run("trl", 2, [0.058, 0.058, 0.058, 0.058, 0.058, 0.033]),
    ]
    c = compare(runs, BASE, "jet", 300.0)
    assert c["pairs"] == 3 and c["no_gain"] == 1
    by = {r["repeat"]: r for r in c["per_seed"]}
    assert [by[k]["no_gain"] for k in range(3)] == [False, False, True]
    assert by[0]["jet_time_to_final"] == 60.0 and by[0]["trl_time_to_final"] == 240.0
    assert by[0]["time_ratio_final"] == 0.25 and by[0]["time_share_of_budget_final"] == 0.2
    assert by[1]["jet_time_to_final"] is None and by[1]["time_ratio_final"] == math.inf
    assert abs(by[1]["target_half_gain"] - 0.077) < 1e-9 and by[1]["trl_time_to_half_gain"] == 180.0
    # the seed without a gain has no time (it once read "reached at t 0: 0.00 of the budget")
    assert by[2]["time_ratio_final"] is None and by[2]["time_share_of_budget_final"] is None
    assert by[2]["jet_time_to_half_gain"] is None
    for name in ("final", "half_gain"):
        assert c[f"time_ratio_{name}"]["n"] == 2 and c[f"not_reached_{name}"] == 1
    assert sorted(c["time_share_of_budget_final"]["ci95"]) == [0.2, math.inf]
    # accuracy at the budget and the area are over every seed, the one without a gain included
    assert c["final_diff"]["n"] == 3
    assert abs(c["final_diff"]["mean"] - ((0.22 - 0.20) + (0.046 - 0.096) + (0.017 - 0.033)) / 3) < 1e-9


def test_no_seed_with_a_gain_leaves_the_times_empty():
    runs = [run("jet", 0, [0.058] * 6), run("trl", 0, [0.058, 0.05, 0.05, 0.04, 0.04, 0.04])]
    c = compare(runs, BASE, "jet", 300.0)
    assert c["no_gain"] == 1 and c["time_ratio_final"]["median"] is None and c["not_reached_final"] == 0


def test_the_report_says_how_many_seeds_were_set_apart():
    from jet.bench.trl import time_to_accuracy_lines

    runs = [run("jet", 0, [0.058, 0.20, 0.21, 0.22, 0.22, 0.22]), run("trl", 0, [0.058, 0.06, 0.10, 0.15, 0.20, 0.20]),
            run("jet", 1, [0.058] * 6), run("trl", 1, [0.058, 0.05, 0.05, 0.04, 0.04, 0.04])]
    lines = "\n".join(time_to_accuracy_lines({"time_to_accuracy": {"jet_vs_trl": compare(runs, BASE, "jet", 300.0)}}))
    assert "1 of 2 seed(s) set apart" in lines
    assert "jet takes 0.20 (95% CI 0.20 to 0.20) of the budget" in lines and "median over 1 seed(s); 0 not reached" in lines
    none = [run("jet", 0, [0.058] * 6), run("trl", 0, [0.058] * 6)]
    lines = "\n".join(time_to_accuracy_lines({"time_to_accuracy": {"jet_vs_trl": compare(none, BASE, "jet", 300.0)}}))
    assert "time to TRL's final accuracy: undefined on every seed" in lines
