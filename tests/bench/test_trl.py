"""`jet bench trl`: the exact paired sign test, and the Jet side of a real (tiny) run with its report."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
from click.testing import CliRunner

from jet.bench.trl import paired, sign_test, tree_rss


def test_sign_test_matches_hand_computed_binomial_tails():
    assert sign_test(0, 0) == 1.0  # no discordant pair: no evidence either way
    assert sign_test(0, 1) == 1.0  # 2 * P(X <= 0 | n=1) = 2 * 1/2
    assert sign_test(0, 5) == pytest.approx(2 / 32)  # 2 * (1/2)^5 = 0.0625: five to none is not p < 0.05
    assert sign_test(0, 6) == pytest.approx(2 / 64)  # 0.03125
    assert sign_test(1, 9) == pytest.approx(2 * (1 + 10) / 1024)  # 2 * (C(10,0) + C(10,1)) / 2^10 = 0.021484375
    assert sign_test(9, 1) == sign_test(1, 9)  # two-sided: symmetric
    assert sign_test(3, 3) == 1.0  # 2 * P(X <= 3 | n=6) = 2 * 42/64 > 1, capped
    assert sign_test(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)  # 0.109375
    tail = sum(math.comb(30, i) for i in range(11)) / 2 ** 30
    assert sign_test(10, 20) == pytest.approx(2 * tail)  # 0.0987...


def test_paired_counts_only_discordant_rows():
    x = [1, 1, 0, 0, 1, 0, 1]
    y = [1, 0, 1, 1, 1, 1, 0]
    assert paired(x, y) == {"x_only": 2, "y_only": 3, "p": pytest.approx(sign_test(2, 3))}
    with pytest.raises(ValueError, match="length"):
        paired([1], [1, 0])


@pytest.mark.slow  # it starts a child process
def test_tree_rss_counts_children(tmp_path):
    import os
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 * 2**20); import time; time.sleep(30)"])
    try:
        time.sleep(1.5)
        alone = int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        assert tree_rss(os.getpid()) >= alone + 200 * 2**20  # this process plus the child's 200 MiB
    finally:
        child.kill()
        child.wait()
    assert tree_rss(child.pid) == 0


@pytest.mark.slow
def test_bench_trl_jet_side_on_the_tiny_model(tmp_path):
    from jet.bench.trl import cli
    from jet.models import init_model

    model = init_model(tmp_path / "tiny", seed=0)
    args = ["--model", str(model), "--budget-s", "60", "--eval-n", "7", "--group-size", "2", "--batch-groups", "2",
            "--lr", "1e-3", "--out", str(tmp_path / "out"), "--json"]
    has_trl = importlib.util.find_spec("trl") is not None
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.output[result.output.index("{"):])
    jet = report["sides"]["jet"]
    assert jet["steps"] > 0 and jet["trajectories"] >= 4 * jet["steps"] and jet["tokens_per_s"] > 0
    assert jet["trajectories_per_min"] > 0 and jet["peak_rss_mib"] > 100  # Redis + three torch-or-not roles
    assert len(jet["reward_curve"]) == jet["steps"] and all(0 <= r <= 1 for _, r in jet["reward_curve"])
    assert "/weights/policy/v" in jet["weights"]
    for name in ["base", "jet"] + (["trl"] if has_trl else []):
        e = report["evals"][name]
        assert e["n"] == 7 and len(e["results"]) == 7 and e["correct"] == sum(e["results"])
        assert e["ci95"][0] <= e["accuracy"] <= e["ci95"][1]
    assert set(report["paired"]) >= {"jet_vs_base"}
    assert report["paired"]["jet_vs_base"]["p"] == sign_test(report["paired"]["jet_vs_base"]["base_only"],
                                                             report["paired"]["jet_vs_base"]["jet_only"])
    if not has_trl:
        assert "trl" not in report["sides"] and report["ratios"] == {}
        assert "trl is not importable" in report["skipped"][0]
    assert (tmp_path / "out" / "report.json").is_file() and (tmp_path / "out" / "reward.png").is_file()
