"""The multi-task cocktail: `jet.trainer.mix.allocate` keeps the configured ratio by groups, and the trainer
(against a real Redis) trains two tasks 3:1 whatever the stream offers, waits up to `mix_wait_s` for a
task that is late, and keeps stepping when a task stops producing.

Stated tolerance: when every task has a group ready (or is waited for), each task's cumulative trained
groups stay within 1 group of its share `w_t / W * T` after every step, over any number of steps.
"""

from __future__ import annotations

import random
import threading
import time

import anyio
import msgspec
import pytest

from jet.config import load_file
from jet.runs import read_metrics as read
from jet.trainer.mix import allocate
from tests.trainer.helpers import MODEL, traj
from tests.trainer.rollouts import produce_sync, synthetic_group, write_config

TOLERANCE = 1.0  # groups a task may be off its share after any step


def run_steps(steps: int, n: int, weights: dict[str, float], arrivals, *, wait: bool) -> list[dict[str, int]]:
    """Simulate `steps` trainer steps: each poll, `arrivals()` adds ready groups; returns cumulative counts."""
    ready = {t: 0 for t in weights}
    trained = {t: 0 for t in weights}
    history = []
    for _ in range(steps):
        taken = 0
        while taken < n:
            for t, k in arrivals().items():
                ready[t] += k
            hold = set(weights) if wait else set()
            for t, k in allocate(n - taken, ready, weights, trained, hold).items():
                assert k <= ready[t], "never more groups than are ready"
                ready[t] -= k
                trained[t] += k
                taken += k
        history.append(dict(trained))
    return history


def off_share(counts: dict[str, int], weights: dict[str, float]) -> float:
    total, w = sum(counts.values()), sum(weights.values())
    return max(abs(counts[t] - weights[t] / w * total) for t in weights)


def test_plenty_ready_keeps_every_step_within_one_group_of_the_ratio():
    weights = {"guess": 3.0, "arith": 1.0, "other": 2.0}
    history = run_steps(500, 4, weights, lambda: {t: 5 for t in weights}, wait=False)
    assert max(off_share(c, weights) for c in history) <= TOLERANCE
    assert sum(history[-1].values()) == 2000


def test_random_arrivals_with_waiting_keep_the_ratio_within_tolerance():
    rng = random.Random(0)
    weights = {"a": 3.0, "b": 1.0}
    # b arrives three times as often as a: without the mix the trainer would train mostly b
    history = run_steps(400, 8, weights, lambda: {"a": int(rng.random() < 0.25), "b": int(rng.random() < 0.75)},
                        wait=True)
    assert max(off_share(c, weights) for c in history) <= TOLERANCE
    assert history[-1]["a"] == pytest.approx(0.75 * 3200, abs=TOLERANCE)


def test_without_waiting_the_other_tasks_fill_the_step_then_the_ratio_catches_up():
    weights = {"a": 1.0, "b": 1.0}
    trained = {"a": 0, "b": 0}
    assert allocate(4, {"a": 5}, weights, trained) == {"a": 4}  # b has nothing and is not waited for
    assert allocate(4, {"a": 5}, weights, trained, hold={"b"}) == {"a": 1}  # b is next: wait for it
    assert allocate(4, {"a": 5, "b": 1}, weights, trained, hold={"b"}) == {"a": 2, "b": 1}
    assert allocate(6, {"a": 5, "b": 5}, weights, {"a": 4, "b": 0}) == {"a": 1, "b": 5}  # b catches up


def test_weight_zero_only_fills_what_nobody_else_can_and_unknown_tasks_weigh_one():
    assert allocate(3, {"z": 5, "a": 1}, {"z": 0.0, "a": 1.0}, {}) == {"a": 1, "z": 2}
    assert allocate(3, {"z": 5}, {"z": 0.0, "a": 1.0}, {}, hold={"a"}) == {}
    assert allocate(4, {"x": 9, "y": 9}, {}, {}) == {"x": 2, "y": 2}
    assert allocate(0, {"x": 9}, {}, {}) == {}


# ---- against a real Redis: the trainer's batch assembly


def cocktail_config(tmp_path, keys, tiny_model, weights: dict[str, float], **trainer):
    path = write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", **trainer)
    import yaml

    data = yaml.safe_load(path.read_text())
    data["tasks"] = [{"name": t, "workflow": "jet.tasks.guess:workflow", "dataset": "guess", "group_size": 2,
                      "weight": w} for t, w in weights.items()]
    path.write_text(yaml.safe_dump(data))
    return load_file(path)


def groups_of(task: str, n: int, rng: random.Random) -> list:
    return [msgspec.structs.replace(t, task=task) for g in range(n) for t in synthetic_group(f"{task}{g}", 2, rng)]


def metric_rows(cfg) -> list[dict]:
    return read(cfg.run_dir / "trainer" / MODEL / "metrics.jsonl")


def train(cfg, url, timeout: float):
    from jet.trainer import loop

    deadline = time.monotonic() + timeout
    return loop.run(cfg, MODEL, url, lambda: time.monotonic() > deadline)


@pytest.mark.slow
def test_the_trainer_mixes_two_tasks_three_to_one_whatever_the_stream_offers(tiny_model, redis_url, keys, tmp_path):
    rng = random.Random(1)
    cfg = cocktail_config(tmp_path, keys, tiny_model, {"a": 3.0, "b": 1.0}, steps=6, batch_groups=4,
                          checkpoint_every=3, mix_wait_s=5)
    a, b = groups_of("a", 24, rng), groups_of("b", 24, rng)
    produce_sync(redis_url, keys, [t for pair in zip(a, b) for t in pair])  # offered 1:1, interleaved
    state = train(cfg, redis_url, 60)
    assert state.step == 6
    rows = metric_rows(cfg)
    for r in rows:  # every step: within TOLERANCE groups of 3:1
        trained = {"a": r["train/a/groups"], "b": r.get("train/b/groups", 0)}
        assert off_share(trained, {"a": 3.0, "b": 1.0}) <= TOLERANCE, r
        assert "rollout/a/reward_mean" in r
    assert (rows[-1]["train/a/groups"], rows[-1]["train/b/groups"]) == (18, 6)


@pytest.mark.slow
def test_the_trainer_waits_for_a_late_task_but_not_for_one_that_stopped(tiny_model, redis_url, keys, tmp_path):
    rng = random.Random(2)
    cfg = cocktail_config(tmp_path, keys, tiny_model, {"a": 3.0, "b": 1.0}, steps=4, batch_groups=4,
                          checkpoint_every=2, mix_wait_s=3)
    produce_sync(redis_url, keys, groups_of("a", 16, rng))
    late_b = groups_of("b", 1, rng)
    threading.Timer(1.0, produce_sync, (redis_url, keys, late_b)).start()  # b is late, then stops for good
    started = time.monotonic()
    state = train(cfg, redis_url, 60)
    elapsed = time.monotonic() - started
    assert state.step == 4, "a task that stopped producing must not stall the others"
    rows = metric_rows(cfg)
    assert (rows[0]["train/a/groups"], rows[0]["train/b/groups"]) == (3, 1), "step 1 waited for late b"
    assert (rows[-1]["train/a/groups"], rows[-1]["train/b/groups"]) == (15, 1)
    # b's silence costs at most mix_wait_s per step (3 steps after its last group), not the whole run
    assert elapsed < 30, elapsed


def test_decisions_made_while_waiting_reach_the_feeders_admission(tiny_model, redis_url, keys, tmp_path):
    """A resumed trainer's stale backlog is decided in `gather`, without a step: its counts must reach
    `Keys.rollout` then, or the feeder (holding the window for them) and the trainer (waiting for fresh
    groups) wait for each other for ever (a compose-test run stalled so after the trainer's SIGKILL)."""
    import orjson

    from jet.queues.connect import connect
    from jet.trainer.groups import Assembler
    from jet.trainer.intake import Intake
    from jet.trainer.link import Link

    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=1))
    old = [traj("old", i, size=2, version=0) for i in range(2)]  # version 0, the trainer is at 5
    produce_sync(redis_url, keys, old)

    async def counts():
        r = await connect(redis_url)
        try:
            return orjson.loads((await r.hget(keys.rollout(MODEL), "counts")) or b"{}")
        finally:
            await r.aclose()

    with Link.for_trainer(cfg, MODEL, redis_url) as link:
        intake = Intake(link, Assembler(min_size=2, timeout_s=60, max_staleness=2))
        deadline = time.monotonic() + 10
        stop = lambda: anyio.run(counts).get("stale") == 2 or time.monotonic() > deadline  # noqa: E731
        assert intake.gather(1, 5, 0, stop) is None
        assert anyio.run(counts).get("stale") == 2, "the stale members were decided but never reported"
        assert sorted(c["outcome"] for c in intake.take_consumed()) == ["stale", "stale"]
