"""`jet bench rollout --quick --json`: the report's shape (every mode, both comparisons with a ratio), not speed."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from jet.bench.rollout import GOALS, cli, workload


@pytest.mark.slow
def test_bench_rollout_quick_json_has_every_comparison_with_its_ratio():
    result = CliRunner().invoke(cli, ["--quick", "--json", "--backend", "hf"])
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.output[result.output.index("{"):])
    [hf] = report["backends"]
    assert hf["backend"] == "hf" and set(hf["modes"]) == {"continuous", "batch_synchronous", "full_path"}
    tokens = {m["tokens"] for m in hf["modes"].values()}
    assert len(tokens) == 1 and tokens.pop() > 0  # the same workload, generated in full, every way
    names = [c["comparison"] for c in report["comparisons"]]
    assert names == ["full_path_vs_direct", "continuous_vs_batch_synchronous"]
    for c in report["comparisons"]:
        assert c["ratio"] == pytest.approx(c["tokens_per_s"] / c["baseline_tokens_per_s"], rel=1e-2)
        assert c["goal"] == GOALS[c["comparison"]] and c["ratio"] > 0


def test_workload_is_heavy_tailed_and_seeded():
    reqs = workload(400, 192, 24, 512)
    lengths = sorted(r.max_tokens for r in reqs)
    assert workload(400, 192, 24, 512) == reqs
    assert lengths[0] >= 4 and lengths[-1] <= 192
    assert lengths[len(lengths) // 2] <= 10 and lengths[-1] >= 8 * lengths[len(lengths) // 2]  # median << max
