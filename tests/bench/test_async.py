"""`jet bench async --quick`: both runs complete and the report holds what the issue asks for."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from jet.bench.async_ import cli
from jet.config import TrainerConfig


@pytest.mark.slow
def test_bench_async_quick_reports_both_modes(redis_url, tmp_path):
    result = CliRunner().invoke(cli, ["--quick", "--json", "--redis-url", redis_url, "--out", str(tmp_path),
                                      "--seed", "3", "--repeats", "2"])
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.output[result.output.index("{"):])
    assert report["seeds"] == [3, 4] and [x["seed"] for x in report["pairs"]] == [3, 4]
    sync, asyn = report["pairs"][0]["runs"]
    default = TrainerConfig().max_staleness  # the async run is the user's default
    assert (sync["mode"], sync["max_staleness"], asyn["mode"], asyn["max_staleness"]) == ("sync", 0, "async", default)
    for run in (sync, asyn):
        assert run["steps"] == 4 and 0 < run["busy_fraction"] <= 1 and run["steps_per_min"] > 0
        assert run["produced"] >= 4 * 2 * 2 and 0 <= run["eval_reward"] <= 1
        assert (tmp_path / "runs" / run["run"] / "trainer" / "tiny" / "plots" / "reward.png").is_file()
    assert sync["staleness_mean"] == 0, "the synchronous barrier trains only the current version"
    assert report["pairs"][0]["ratio_steps_per_min"] == pytest.approx(asyn["steps_per_min"] / sync["steps_per_min"])
    summary = report["summary"]
    diffs = [x["runs"][1]["eval_reward"] - x["runs"][0]["eval_reward"] for x in report["pairs"]]
    assert summary["pairs"] == 2 and summary["reward_diff"] == pytest.approx(sum(diffs) / 2)
    assert summary["reward_diff_se"] == pytest.approx(abs(diffs[0] - diffs[1]) / 2)  # stdev of two / sqrt(2)
    assert summary["ratio_min"] == min(x["ratio_steps_per_min"] for x in report["pairs"])
    assert report["goal"]["reward_no_worse"] == (summary["reward_diff"] >= -2 * summary["reward_diff_se"])
    assert set(report["goal"]) == {"ratio", "ratio_met", "reward_no_worse"}
