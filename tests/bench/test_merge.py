"""`jet bench merge` runs end to end (quick shapes) and reports sane numbers."""

from __future__ import annotations

import orjson
from click.testing import CliRunner

from jet.bench.merge import QUICK, cli, theoretical_minimum, tiny_model, workloads
from jet.timeline import Call


def test_quick_bench_reports_tokens_times_and_goals():
    result = CliRunner().invoke(cli, ["--quick", "--json"])
    assert result.exit_code == 0, result.output
    report = orjson.loads(result.stdout)
    names = [w["name"] for w in report["workloads"]]
    assert names == ["linear-3", "linear-10", "two-agent", "grpo-4", "subagents"]
    for w in report["workloads"]:
        tokens = w["tokens"]
        assert tokens["min"] <= tokens["tree"] <= tokens["exact"] <= tokens["none"], w["name"]
        assert all(w["seconds"][m] > 0 for m in ("none", "exact", "tree"))
        assert w["speedup"]["exact"] == w["seconds"]["none"] / w["seconds"]["exact"]
        if w["linear"]:
            assert tokens["exact"] == tokens["min"] < tokens["none"]
        else:
            assert tokens["tree"] <= 1.05 * tokens["min"]
    grpo = report["workloads"][3]["tokens"]
    assert grpo["tree"] < grpo["exact"], "a group sharing its prompt must share it in tree mode"
    assert report["goals"]["exact_is_min_on_linear"] and report["goals"]["tree_within_5pct_on_branching"]
    assert report["model"]["hidden"] == QUICK.hidden
    assert report["model"]["params"] == sum(p.numel() for p in tiny_model(QUICK).parameters())


def test_table_lists_every_workload_and_the_model_shape():
    result = CliRunner().invoke(cli, ["--quick", "--no-time"])
    assert result.exit_code == 0, result.output
    for word in ("linear-3", "linear-10", "two-agent", "grpo-4", "subagents", "tree/min", "hidden 64"):
        assert word in result.stdout


def test_theoretical_minimum_counts_distinct_positions_per_model():
    a = Call([1, 2, 3], [4], [-1.0], 0, "m")
    b = Call([1, 2, 5], [6], [-1.0], 0, "m")
    c = Call([1, 2], [3], [-1.0], 0, "other")
    assert theoretical_minimum([a, b, c]) == 6 + 3
    assert len(workloads(QUICK, 0)) == 5
