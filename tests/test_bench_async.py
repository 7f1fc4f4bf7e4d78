"""`jet bench async --quick`: both runs complete and the report holds what the issue asks for."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from jet.bench.async_ import cli


@pytest.mark.slow
def test_bench_async_quick_reports_both_modes(redis_url, tmp_path):
    result = CliRunner().invoke(cli, ["--quick", "--json", "--redis-url", redis_url, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.output[result.output.index("{"):])
    sync, asyn = report["runs"]
    assert (sync["mode"], sync["max_staleness"], asyn["mode"], asyn["max_staleness"]) == ("sync", 0, "async", 4)
    for run in (sync, asyn):
        assert run["steps"] == 4 and 0 < run["busy_fraction"] <= 1 and run["steps_per_min"] > 0
        assert run["produced"] >= 4 * 2 * 2 and 0 <= run["eval_reward"] <= 1
        assert (tmp_path / "runs" / run["run"] / "trainer" / "tiny" / "plots" / "reward.png").is_file()
    assert sync["staleness_mean"] == 0, "the synchronous barrier trains only the current version"
    assert report["ratio_steps_per_min"] == pytest.approx(asyn["steps_per_min"] / sync["steps_per_min"])
    assert set(report["goal"]) == {"ratio", "ratio_met", "reward_no_worse"}
