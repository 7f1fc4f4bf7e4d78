"""`jet bench trl`: the statistics (exact McNemar, Wilcoxon, t intervals, the alternating order), the
jet-lora arm's config, the summary, table and plot of four arms' (made-up) runs, and the Jet arms of a real
(tiny) run on the multi-turn task with its report. The TRL arm runs in CI's TRL tier
(tests/bench/test_trl_side.py, in a venv with trl)."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from jet.bench.trl import cli, order_of, plot, summarise, table
from jet.bench.trl_arms import MODEL, Lora, Shared, jet_config, tree_rss


def test_repeats_alternate_the_order_of_the_arms():
    assert [order_of(["jet", "jet-flat", "trl"], r) for r in range(3)] == [
        ["jet", "jet-flat", "trl"], ["trl", "jet-flat", "jet"], ["jet", "jet-flat", "trl"]]
    four = ["jet", "jet-flat", "trl", "jet-lora"]
    assert [order_of(four, r) for r in range(2)] == [four, ["jet-lora", "trl", "jet-flat", "jet"]]


def test_the_jet_lora_arm_is_the_jet_arm_training_an_adapter_at_its_own_lr(tmp_path):
    from jet.config import load

    s, rows = Shared(lr=3e-5), tmp_path / "rows.jsonl"
    rows.write_text("")
    jet = jet_config(s, "jet", "model", rows, tmp_path, 1)
    lora = jet_config(s, "jet-lora", "model", rows, tmp_path, 1, Lora(r=8, alpha=16.0, lr=4e-4))
    policy = lora["models"][0]
    assert policy.pop("adapter") == {"r": 8, "alpha": 16.0, "target_modules": "all-linear"}
    assert policy.pop("trainer") == {"lr": 4e-4} and lora == jet, "otherwise the jet arm's config"
    cfg = load(jet_config(s, "jet-lora", "model", rows, tmp_path, 1, Lora(r=8, alpha=16.0, lr=4e-4)))
    a = cfg.models[0].adapter
    assert (a.r, a.alpha, a.target_modules, a.publish) == (8, 16.0, "all-linear", "adapter")
    assert cfg.trainer_of(MODEL).lr == 4e-4 and cfg.trainer.lr == 3e-5, "the shared section keeps the shared lr"
    full = load(jet)
    assert full.models[0].adapter is None and full.trainer_of(MODEL).lr == 3e-5, "the jet arm trains every weight"
    default = load(jet_config(s, "jet-lora", "model", rows, tmp_path, 1))  # Lora(): r 16, alpha 32, 10x the lr
    assert (default.models[0].adapter.r, default.models[0].adapter.alpha) == (16, 32.0)
    assert default.trainer_of(MODEL).lr == pytest.approx(3e-4)


def test_jet_set_overrides_jet_only_settings_and_refuses_shared_ones(tmp_path):
    from jet.config import load
    from jet.errors import ConfigError

    s, rows = Shared(lr=3e-5), tmp_path / "rows.jsonl"
    cfg = load(jet_config(s, "jet", "model", rows, tmp_path, 1, jet_set=("trainer.skip_no_signal=true",)))
    assert cfg.trainer.skip_no_signal is True and cfg.trainer.lr == 3e-5 and cfg.trainer.max_staleness == 1
    assert load(jet_config(s, "jet", "model", rows, tmp_path, 1)).trainer.skip_no_signal is False
    for shared in ("trainer.lr=1e-3", "tasks.0.group_size=4", "trainer.max_staleness=2"):
        with pytest.raises(ConfigError, match=re.escape(f"--jet-set {shared}")):
            jet_config(s, "jet", "model", rows, tmp_path, 1, jet_set=(shared,))
    # a typo or a bad value stops the bench before its first run, naming the key
    (tmp_path / "config.json").write_text("{}")  # a model folder as --model checks it; never loaded
    for bad, named in (("trainer.skip_no_signl=true", "skip_no_signl"), ("trainer.skip_no_signal=maybe",
                                                                          "skip_no_signal")):
        result = CliRunner().invoke(cli, ["--arms", "jet", "--model", str(tmp_path), "--jet-set", bad,
                                          "--out", str(tmp_path / "out")])
        assert result.exit_code == 2 and named in result.output and "--jet-set" in result.output, result.output
        assert not list((tmp_path / "out").glob("r1-*")), "no run started"


def fake_run(arm: str, repeat: int, position: int, rate: float, results: list[int]) -> dict:
    return {"arm": arm, "repeat": repeat, "position": position, "trajectories_per_min": rate,
            "steady_trajectories_per_min": rate, "completion_tokens_per_trajectory": 10.0,
            "forward_tokens_per_trajectory": 100.0, "prefill_tokens_per_trajectory": None, "peak_rss_mib": 900.0,
            "load_mean": 1.5, "reward_curve": [[1.0, 0.1], [2.0, 0.2]],
            "eval": {"accuracy": sum(results) / len(results), "results": results}}


def test_summary_table_and_plot_of_four_arms(tmp_path):
    arms = ["jet", "jet-flat", "trl", "jet-lora"]
    rates = {"jet": 40.0, "jet-flat": 30.0, "trl": 10.0, "jet-lora": 50.0}
    held = {"jet": [1, 1, 0, 1], "jet-flat": [1, 0, 0, 1], "trl": [0, 0, 0, 1], "jet-lora": [1, 1, 1, 1]}
    runs = [fake_run(a, r, i, rates[a] + r, held[a]) for r in range(2) for i, a in enumerate(order_of(arms, r))]
    base = {"n": 4, "accuracy": 0.25, "ci95": [0.05, 0.7], "results": [0, 0, 0, 1]}
    summary = summarise(runs, base, arms)
    assert summary["ratios"]["jet-lora/jet"]["trajectories_per_min"]["per_repeat"] == [50 / 40, 51 / 41]
    assert summary["ratios"]["jet-lora/trl"]["trajectories_per_min"]["per_repeat"] == [50 / 10, 51 / 11]
    assert summary["paired"]["jet-lora_vs_jet"] == {"test": "mcnemar", "x_only": 0, "y_only": 1, "p": 1.0}
    assert {"jet-lora_vs_base", "jet_vs_trl", "jet_vs_jet-flat", "jet-flat_vs_trl"} < set(summary["paired"])
    report = {"task": "add", "model": "/m/smollm2", "budget_s": 60.0, "repeats": 2, "runs": runs, "base": base,
              "summary": summary, "unmatched": {}, "versions": {}, "threads": {},
              "lora": Lora(r=16, alpha=32.0, lr=2e-4).as_dict()}
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(table(report))
    text = console.export_text()
    assert "jet-lora" in text and "jet-lora/jet trajectories_per_min: 1.25x" in text and "lr 0.0002" in text
    plot(report, tmp_path / "reward.png")
    assert (tmp_path / "reward.png").stat().st_size > 1000


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


def test_swarm_counters_keep_a_workers_last_heartbeat_once_its_hash_is_gone(embedded, tmp_path):
    """The prefill counters are cumulative: a worker whose hash expired while the run drained still counts
    with its last heartbeat, instead of turning the run's reading to 0 (the jet arms' prefill < prompt)."""
    import redis

    from jet.bench.trl_arms import SwarmCounters

    counters = SwarmCounters(tmp_path / "no-server", "swarmcount", MODEL, every=60)
    client = redis.Redis.from_url(embedded.url)
    try:
        k = counters.keys
        for name, prompt, prefill in (("infer-a", 300, 40), ("infer-b", 100, 20)):
            client.zadd(k.workers, {name: 1.0})
            client.hset(k.worker(name), mapping={"role": "infer", "model": MODEL, "prompt_tokens": prompt,
                                                 "prefill_tokens": prefill})
        client.xadd(k.traj(MODEL), {"t": "1"})
        assert counters.read(client) == {"prompt_tokens": 400, "prefill_tokens": 60, "trajectories": 1}
        client.hset(k.worker("infer-a"), mapping={"prompt_tokens": 500, "prefill_tokens": 50})
        client.delete(k.worker("infer-b"))  # expired: its name still in the registry, its hash gone
        client.xadd(k.traj(MODEL), {"t": "2"})
        assert counters.read(client) == {"prompt_tokens": 600, "prefill_tokens": 70, "trajectories": 2}
    finally:
        counters.stop()
        client.close()


@pytest.mark.slow
def test_bench_trl_jet_arms_on_the_multi_turn_task(tmp_path):
    """Both Jet arms on tally with the random tiny model: every step trains whole groups, the default arm
    forwards fewer tokens per trajectory than one sample per call (merging and group trees) and its
    engine prefills fewer than the prompts hold (prefix reuse); held-out evals and paired tests come out."""
    from jet.models import init_model

    model = init_model(tmp_path / "tiny", max_position=1024, seed=0)
    args = ["--task", "tally", "--arms", "jet,jet-flat", "--model", str(model), "--budget-s", "35", "--eval-n", "3",
            "--group-size", "2", "--batch-groups", "2", "--max-tokens", "3", "--lr", "1e-3", "--repeats", "1",
            "--seed", "7", "--mark-every-s", "12", "--out", str(tmp_path / "out"), "--json",
            # KL on: every sample is forwarded (without it the samples with no gradient are not, and which
            # groups of 2 on a random model have a signal differs by arm), so the tokens compare the sharing
            "--jet-set", "trainer.kl_coef=0.001"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.output[result.output.index("{"):])
    assert [r["arm"] for r in report["runs"]] == ["jet", "jet-flat"] and report["arms"] == ["jet", "jet-flat"]
    for run in report["runs"]:
        assert run["steps"] > 0 and run["trajectories"] == 4 * run["steps"], run  # whole groups, 2 x 2 a step
        assert len(run["reward_curve"]) == run["steps"] and all(0 <= r <= 1 for _, r in run["reward_curve"])
        assert "/weights/policy/v" in run["weights"] and run["peak_rss_mib"] > 100 and run["load_mean"] >= 0
        assert run["prefill_tokens_per_trajectory"] < run["prompt_tokens_per_trajectory"], run
        e = run["eval"]
        assert e["n"] == 3 and len(e["results"]) == 3 and all(v in (0, 0.25, 0.5, 0.75, 1) for v in e["results"])
        # the weights kept at 12, 24 and 35 s: versions published by then (in order), evaluated after the run
        assert [m["mark_s"] for m in run["marks"]] == [12, 24, 35] and run["seed"] == 7
        assert [p["t"] for p in run["curve"]] == [0, 12, 24, 35] and run["curve"][-1]["accuracy"] == e["accuracy"]
        kept = [m["version"] for m in run["marks"]]
        assert kept == sorted(kept) and kept[-1] >= 1 and all(m["weights_time_s"] <= m["mark_s"] for m in run["marks"])
        assert run["swarm"]["trajectories"] >= run["trajectories"], "from the swarm's counters in Redis"
    jet, flat = report["runs"]
    assert jet["forward_tokens_per_trajectory"] < flat["forward_tokens_per_trajectory"] / 2, (jet, flat)
    ratio = report["summary"]["ratios"]["jet/jet-flat"]
    assert ratio["forward_tokens_per_trajectory"]["per_repeat"] == [
        pytest.approx(jet["forward_tokens_per_trajectory"] / flat["forward_tokens_per_trajectory"])]
    assert set(report["summary"]["paired"]) == {"jet_vs_base", "jet-flat_vs_base", "jet_vs_jet-flat"}
    assert report["shared"]["task"] == "tally" and report["shared"]["max_turns"] == 4
    assert report["versions"]["jet"]["torch"].startswith("2.")
    assert (tmp_path / "out" / "report.json").is_file() and (tmp_path / "out" / "reward.png").is_file()
    assert (tmp_path / "out" / "accuracy.png").is_file() and set(report["time_to_accuracy"]["bands"]) == {
        "jet", "jet-flat"}
    assert [p["t"] for p in report["time_to_accuracy"]["bands"]["jet"]] == [0, 12, 24, 35]
    # --resume after the fact (as after a crash in the report): the finished runs and every evaluation kept
    again = CliRunner().invoke(cli, [*args, "--resume"])
    assert again.exit_code == 0, again.output[-3000:]
    resumed = json.loads(again.output[again.output.index("{"):])
    for before, after in zip(report["runs"], resumed["runs"]):
        assert after["curve"] == before["curve"] and after["trajectories"] == before["trajectories"]
        assert after["eval"]["seconds"] == before["eval"]["seconds"], "reused, not evaluated again"
    assert resumed["base"] == report["base"] and len(list((tmp_path / "out" / "evals").glob("*.json"))) >= 2
