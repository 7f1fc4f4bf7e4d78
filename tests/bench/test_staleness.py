"""`jet bench staleness --quick`: every (objective, k) row, paired differences, determinism, bad options."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner

from jet.bench.staleness import cli


def run(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["--quick", "--json", *args])
    assert result.exit_code == 0, result.output[-3000:]
    return json.loads(result.output[result.output.index("{"):])


@pytest.mark.slow
def test_bench_staleness_quick_is_deterministic_and_pairs_by_seed():
    report = run("--seeds", "2", "--staleness", "2")
    rows = {(r["objective"], r["staleness"]): r for r in report["rows"]}
    assert set(rows) == {("ppo", 0), ("ppo", 2), ("decoupled", 0), ("decoupled", 2)}
    for (objective, k), r in rows.items():
        assert len(r["eval_rewards"]) == 2 and all(0 <= x <= 1 for x in r["eval_rewards"])
        assert r["eval_reward"] == pytest.approx(statistics.fmean(r["eval_rewards"]))
        diffs = [a - b for a, b in zip(r["eval_rewards"], rows[(objective, 0)]["eval_rewards"])]
        assert r["diff_vs_0"] == pytest.approx(statistics.fmean(diffs))
    # on fresh batches the decoupled objective's gradient equals PPO's (ratio 1, weight current/behaviour)
    assert rows[("ppo", 0)]["eval_rewards"] == pytest.approx(rows[("decoupled", 0)]["eval_rewards"], abs=0.02)
    again = run("--seeds", "2", "--staleness", "2")  # no clock, no Redis: the same numbers
    assert [r["eval_rewards"] for r in again["rows"]] == [r["eval_rewards"] for r in report["rows"]]


def test_bench_staleness_rejects_a_bad_staleness_list():
    result = CliRunner().invoke(cli, ["--quick", "--staleness", "1,x"])
    assert result.exit_code == 2 and "--staleness" in result.output and "'1,x'" in result.output
