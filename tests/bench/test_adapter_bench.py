"""`jet bench adapter --quick` on the tiny model: both sides step, the adapter's version and checkpoint are
the smaller, a version goes through Redis and is loaded, and a backend serving two adapter models of one
base is measured against one serving one model (fresh processes, peak RSS)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner


@pytest.mark.slow
def test_bench_adapter_quick_reports_both_sides(tiny_model):
    from jet.bench.adapter import cli

    result = CliRunner().invoke(cli, ["--model", str(tiny_model), "--quick", "--r", "2", "--repeats", "2", "--team", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["params"]["adapter"]["trainable"] < report["params"]["full"]["trainable"] / 5
    assert len(report["step_s"]["full"]) == len(report["step_s"]["adapter"]) == 2
    assert all(s > 0 for side in report["step_s"].values() for s in side)
    assert 0 < report["version_bytes"]["fraction"] < 0.2 and 0 < report["checkpoint_bytes"]["fraction"] < 0.2
    assert [x["chunks"] for x in report["redis"]] == [2, 2] and all(x["fetch_and_load_s"] > 0 for x in report["redis"])
    assert [x["version"] for x in report["announce_to_serving"]["versions"]] == [1, 2]
    assert all(0 < x["seconds"] < 60 for x in report["announce_to_serving"]["versions"])
    team = report["team"]
    assert [r["slots"] for r in team["runs"]["one"]] == [1, 1] and [r["slots"] for r in team["runs"]["shared"]] == [2, 2]
    assert [r["slots"] for r in team["runs"]["base"]] == [0, 0] and team["rss_ratio_shared_over_base"]["mean"] > 0
    assert all(r["peak_rss_mib"] > 50 and r["generated_tokens"] > 0 for side in team["runs"].values() for r in side)
    assert all(r["lora_mib"] > 0 for r in team["runs"]["shared"]) and team["runs"]["base"][0]["lora_mib"] is None
    assert team["rss_ratio_shared_over_one"]["mean"] > 0
