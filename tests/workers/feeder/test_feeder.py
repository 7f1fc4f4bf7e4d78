"""jet.workers.feeder.feeder: topping up in the tasks' ratio, and staleness-aware admission against a real server.

The trainer's side of admission is the hash `Keys.rollout(model)`'s `counts` field, which the trainer
rewrites after each step (`jet.trainer.link.Link.report`); these tests write it as the trainer does,
then read what the feeder admitted on the task streams of a real Valkey.
"""

import uuid

import anyio
import orjson
import redis

from jet.workers.feeder.feeder import SIGNAL_SHARE_FLOOR, Feeder, allot, decided, signal_share
from jet.config import load
from jet.keys import Keys


class T:
    def __init__(self, name, model="m", weight=1.0, group_size=4):
        self.name, self.model, self.weight, self.group_size = name, model, weight, group_size


def test_allot_gives_each_task_what_it_wants_without_a_budget():
    tasks = [T("a"), T("b", weight=3.0)]
    assert allot(tasks, {"a": 5, "b": 2}, {}, {}) == {"a": 5, "b": 2}


def test_allot_stays_within_a_models_budget_in_the_weights_ratio():
    tasks = [T("a"), T("b", weight=3.0)]
    out = allot(tasks, {"a": 100, "b": 100}, {"m": 64}, {})  # 16 rows of 4 trajectories
    assert sum(out.values()) * 4 == 64
    assert out == {"a": 4, "b": 12}
    # a task already served its share waits for the other
    assert allot(tasks, {"a": 100, "b": 100}, {"m": 16}, {"a": 0, "b": 400}) == {"a": 4, "b": 0}


def test_allot_budgets_are_per_model_and_a_weight_zero_task_comes_last():
    tasks = [T("a", model="x"), T("b", model="y"), T("z", model="x", weight=0.0)]
    out = allot(tasks, {"a": 3, "b": 3, "z": 3}, {"x": 16}, {})
    assert out == {"a": 3, "b": 3, "z": 1}


def test_decided_counts_only_final_outcomes():
    assert decided({"trained": 10, "stale": 2, "small_group": 3, "failed": 1, "malformed": 1, "poison": 1,
                    "no_signal": 8, "retried": 5, "duplicate": 4, "late": 2, "groups_trained": 7,
                    "groups_no_signal": 1}) == 26


def test_signal_share_counts_one_trained_group_in_advance_and_has_a_floor():
    assert signal_share((0, 0)) == 1.0  # nothing done yet: the window of the batches it trains
    assert signal_share((3, 4)) == 0.5
    assert signal_share((13, 4), (10, 0)) == 0.5  # between two counts
    assert signal_share((0, 1000)) == SIGNAL_SHARE_FLOOR


def config(tmp_path, **trainer):
    data = {"run": f"feed{uuid.uuid4().hex[:8]}", "runs_dir": str(tmp_path),
            "models": [{"name": "m", "path": str(tmp_path / "model")}],
            "tasks": [{"name": "guess", "workflow": "jet.tasks.guess:workflow", "dataset": "guess", "model": "m",
                       "group_size": 4, "concurrency": 32}],
            "trainer": {"batch_groups": 2, "max_staleness": 1, **trainer}}
    return load(data)


def backlog(url, cfg) -> int:
    return redis.Redis.from_url(url).xlen(Keys(cfg.run).tasks("guess"))


def test_admission_holds_the_stream_to_the_window_until_the_trainer_decides(embedded, tmp_path):
    cfg = config(tmp_path)
    feed = Feeder(cfg, embedded.url)
    try:
        assert feed.window("m") == (1 + 1) * 2 * 4
        for _ in range(3):  # nothing consumes: the window, not the backlog target (64+), bounds it
            feed.tick()
        assert backlog(embedded.url, cfg) == 16
        # the trainer decided 8 (one step of 2 groups: 6 trained, 2 stale): 8 more may start
        r = redis.Redis.from_url(embedded.url)
        r.hset(Keys(cfg.run).rollout("m"), "counts", orjson.dumps({"trained": 6, "stale": 2, "retried": 3}))
        feed.tick()
        assert backlog(embedded.url, cfg) == 24
        assert int(r.hget(Keys(cfg.run).rollout("m"), "admitted")) == 24
        assert "m: trained 6, stale 2, dropped 0" in feed.summary()
    finally:
        feed.close()


def test_dead_lettered_admitted_work_reopens_the_window(embedded, tmp_path):
    """Tasks an env worker crash loop dead-letters, and trajectories the trainer's consumer dead-letters
    past max_deliveries, never reach a trainer outcome: the feeder counts them as decided (also after a
    restart of its own), so lost work never closes the admission window for good. The trainer's own
    dead letters (poison) are in its counts already and are not counted twice."""
    from jet.keys import GROUP_ENV, GROUP_TRAINER
    from jet.queues.messages import TRAINER_REASON
    from tests.queues.helpers import close, entry, make_consumer

    cfg = config(tmp_path)
    keys, r = Keys(cfg.run), redis.Redis.from_url(embedded.url)

    async def dead_letter(stream, group, n, reason=None):
        c = await make_consumer(embedded.url, keys, stream, "c0", group=group, max_deliveries=1)
        if stream == keys.traj("m"):
            for i in range(n):
                await c.r.xadd(stream, entry(i))
        got = await c.fetch(n)
        assert len(got) == n
        for d in got if reason else []:  # the trainer's own dead letter
            await c.dead(d.entry_id, d.fields, reason)
        await close(c)
        if not reason:  # crashed; the restarted consumer's re-read is past max_deliveries=1: dead
            c = await make_consumer(embedded.url, keys, stream, "c0", group=group, max_deliveries=1)
            assert await c.fetch(n) == []
            await close(c)

    feed = Feeder(cfg, embedded.url)
    try:
        feed.tick()
        assert backlog(embedded.url, cfg) == 16  # the window is full
        anyio.run(dead_letter, keys.tasks("guess"), GROUP_ENV, 4)
        anyio.run(dead_letter, keys.traj("m"), GROUP_TRAINER, 2, f"{TRAINER_REASON}poison")  # not counted
        feed.tick()
        assert backlog(embedded.url, cfg) == 20  # 4 lost tasks: 4 more admitted
        assert "dropped 4" in feed.summary()
    finally:
        feed.close()
    anyio.run(dead_letter, keys.traj("m"), GROUP_TRAINER, 4)  # while no feeder runs
    feed = Feeder(cfg, embedded.url)
    try:
        feed.tick()
        assert backlog(embedded.url, cfg) == 24  # the restarted feeder counted them from where it stopped
        assert int(r.hget(keys.rollout("m"), "dead")) == 8
    finally:
        feed.close()


def test_admission_off_keeps_the_streams_topped_up(embedded, tmp_path):
    cfg = config(tmp_path, admission="off")
    feed = Feeder(cfg, embedded.url)
    try:
        feed.tick()
        assert backlog(embedded.url, cfg) == feed.target["guess"] > 16
    finally:
        feed.close()


def test_a_trainer_resumed_on_a_fresh_server_opens_a_full_window(embedded, tmp_path):
    cfg = config(tmp_path)
    r = redis.Redis.from_url(embedded.url)
    r.hset(Keys(cfg.run).rollout("m"), "counts", orjson.dumps({"trained": 400}))  # its checkpoint's counts
    feed = Feeder(cfg, embedded.url)
    try:
        feed.tick()
        assert backlog(embedded.url, cfg) == 16  # not 400 + 16 at once
    finally:
        feed.close()


def test_a_model_that_is_not_trained_is_not_held_back(embedded, tmp_path):
    data = config(tmp_path).model_dump()
    data["models"][0]["trainable"] = False
    cfg = load(data)
    feed = Feeder(cfg, embedded.url)
    try:
        feed.tick()
        assert backlog(embedded.url, cfg) == feed.target["guess"]
    finally:
        feed.close()


def test_the_drain_waits_for_a_trainers_longest_micro_batch(embedded, tmp_path):
    """`jet up` sizes its drain from the trainers' heartbeats (micro_batch_s): a stopping trainer may be
    busy with one micro-batch before it checkpoints."""
    import anyio

    from jet.cli.up import DRAIN_S, drain_deadline
    from jet.queues import registry
    from jet.queues.connect import connect

    assert drain_deadline(0.0) == DRAIN_S and drain_deadline(45.0) == DRAIN_S + 90
    cfg = config(tmp_path)
    keys = Keys(cfg.run)

    async def beats():
        r = await connect(embedded.url)
        try:
            await registry.beat(r, keys, "t-1", "trainer", micro_batch_s=12.5)
            await registry.beat(r, keys, "t-2", "trainer", micro_batch_s=3.0)
            await registry.beat(r, keys, "i-1", "infer", micro_batch_s=99.0)  # not a trainer
        finally:
            await r.aclose()

    feed = Feeder(cfg, embedded.url)
    try:
        assert feed.longest_micro_batch_s() == 0.0
        anyio.run(beats)
        assert feed.longest_micro_batch_s() == 12.5
    finally:
        feed.close()


def test_with_skip_no_signal_the_window_widens_by_the_share_of_groups_with_a_signal(embedded, tmp_path):
    """The trainer drops the groups whose rewards are all equal, so a batch takes more groups than it
    trains: the window counts groups it will train. Without that the window fills with groups about to be
    dropped while the trainer steps, and generation waits for every step to end."""
    cfg = config(tmp_path, skip_no_signal=True)
    feed = Feeder(cfg, embedded.url)
    try:
        assert feed.window("m") == 16  # no counts yet: as without skip_no_signal
        for _ in range(3):
            feed.tick()
        assert backlog(embedded.url, cfg) == 16
        # 1 group trained, 2 dropped with no signal (12 trajectories decided): a share of (1 + 1) / (3 + 1)
        r = redis.Redis.from_url(embedded.url)
        counts = {"trained": 4, "no_signal": 8, "groups_trained": 1, "groups_no_signal": 2}
        r.hset(Keys(cfg.run).rollout("m"), "counts", orjson.dumps(counts))
        feed.tick()
        assert feed.window("m", counts) == 32
        assert backlog(embedded.url, cfg) == 16 + 12 + 16  # the decided ones, and 16 more in the wider window
    finally:
        feed.close()
    plain = Feeder(config(tmp_path), embedded.url)  # without skip_no_signal the same counts leave it alone
    try:
        assert plain.window("m", counts) == 16
    finally:
        plain.close()


def test_the_share_follows_the_last_groups_decided_as_the_model_learns(embedded, tmp_path):
    """Over the last 2 x (max_staleness + 1) x batch_groups = 8 groups: a window sized by the share of
    the model's first groups, mostly wrong, would stay wide once it learned and admit more trainable groups
    than the staleness bound lets it train (they would arrive stale)."""
    feed = Feeder(config(tmp_path, skip_no_signal=True), embedded.url)
    try:
        assert feed.recent_share("m", {"groups_trained": 1, "groups_no_signal": 7}) == 2 / 9  # all so far
        assert feed.recent_share("m", {"groups_trained": 9, "groups_no_signal": 7}) == 9 / 9  # the last 8: all
        assert feed.recent_share("m", {"groups_trained": 11, "groups_no_signal": 13}) == 3 / 9
        assert feed.recent_share("m", {"groups_trained": 2, "groups_no_signal": 1}) == 3 / 4  # counts went back
    finally:
        feed.close()
