"""Group assembly: complete, failed, retried, timed-out, small, late and duplicate members; staleness."""

from __future__ import annotations

import anyio
import pytest

from jet.trainer.groups import Assembler, Entry, staleness
from tests.trainer.helpers import call, traj


def asm(min_size=2, timeout_s=10.0, max_staleness=4):
    return Assembler(min_size=min_size, timeout_s=timeout_s, max_staleness=max_staleness)


def add(a, t, version=0, now=0.0):
    e = Entry(f"{t.group_id}-{t.index}-{t.attempt}-{t.failed}", t)
    a.add(e, version, now)
    return e


def test_a_complete_group_is_taken_and_its_members_trained():
    a = asm()
    for i in range(3):
        add(a, traj("g", i))
    assert a.take(8, 0, 1.0) == []  # 3 of 4
    add(a, traj("g", 3))
    [g] = a.take(8, 0, 1.0)
    assert [t.index for t in g.trajectories()] == [0, 1, 2, 3]
    assert {e.outcome for e in a.trained(g)} == {"trained"} and a.counts["trained"] == 4
    assert a.waiting == 0 and a.pop_decided() == []


def test_failed_members_are_left_out_and_retried_ones_keep_their_slot():
    a = asm()
    add(a, traj("g", 0))
    add(a, traj("g", 1, failed=True, retry=True))  # another attempt will come
    add(a, traj("g", 2, failed=True))  # failed for good
    add(a, traj("g", 3))
    assert a.take(8, 0, 1.0) == []  # member 1 is still open
    add(a, traj("g", 1))
    [g] = a.take(8, 0, 1.0)
    assert sorted(g.members) == [0, 1, 3]
    assert sorted(e.outcome for e in a.trained(g)) == ["failed", "retried", "trained", "trained", "trained"]


def test_a_group_below_min_size_is_dropped_and_counted():
    a = asm(min_size=3)
    add(a, traj("g", 0))
    add(a, traj("g", 1))
    add(a, traj("g", 2, failed=True))
    add(a, traj("g", 3, failed=True))
    assert a.take(8, 0, 1.0) == []
    assert sorted(e.outcome for e in a.pop_decided()) == ["failed", "failed", "small_group", "small_group"]
    assert a.counts["groups_dropped"] == 1 and a.counts["small_group"] == 2


def test_an_incomplete_group_times_out_instead_of_stalling():
    a = asm(timeout_s=10.0)
    add(a, traj("g", 0), now=0.0)
    add(a, traj("g", 1), now=3.0)
    add(a, traj("h", 0), now=5.0)
    assert a.take(8, 0, 9.9) == [] and a.next_timeout(9.9) == pytest.approx(0.1)
    [g] = a.take(8, 0, 10.0)  # g: 2 of 4 after 10 s, enough for min_size 2
    assert (g.group_id, sorted(g.members)) == ("g", [0, 1]) and a.counts["timeouts"] == 1
    assert a.take(8, 0, 15.0) == []  # h: 1 member at its timeout: dropped
    assert [e.outcome for e in a.pop_decided()] == ["small_group"]


def test_late_and_duplicate_members_are_decided_at_once():
    a = asm()
    for i in range(4):
        add(a, traj("g", i))
    dup = add(a, traj("g", 2))
    assert dup.outcome == "duplicate"
    [g] = a.take(8, 0, 0.0)
    late = add(a, traj("g", 1))
    assert late.outcome == "late" and [e.outcome for e in a.pop_decided()] == ["duplicate", "late"]


def test_take_returns_at_most_n_groups_oldest_first():
    a = asm()
    for name in ("a", "b", "c"):
        for i in range(2):
            add(a, traj(name, i, size=2))
    assert [g.group_id for g in a.take(2, 0, 0.0)] == ["a", "b"]
    assert [g.group_id for g in a.take(2, 0, 0.0)] == ["c"]


def test_staleness_is_the_version_gap_to_the_oldest_token():
    t = traj(calls=[call([1], [2], version=3), call([1, 2, 5], [6], version=5)])
    assert staleness(t, 7) == 4 and staleness(traj(failed=True), 7) == 0


def test_stale_members_are_dropped_on_arrival_and_when_the_version_moves():
    a = asm(max_staleness=1)
    add(a, traj("g", 0, size=3, version=2), version=4)  # 2 behind: stale at once
    add(a, traj("g", 1, size=3, version=3), version=4)
    add(a, traj("g", 2, size=3, version=4), version=4)
    assert a.counts["stale"] == 1
    assert a.take(8, 5, 0.0) == []  # at version 5 member 1 is 2 behind too: 1 fresh member left
    assert sorted(e.outcome for e in a.pop_decided()) == ["small_group", "stale", "stale"]


def test_max_staleness_zero_admits_only_the_current_version():
    a = asm(max_staleness=0)
    add(a, traj("old", 0, size=2, version=0), version=1)
    add(a, traj("old", 1, size=2, version=1), version=1)
    add(a, traj("new", 0, size=2, version=1), version=1)
    add(a, traj("new", 1, size=2, version=1), version=1)
    [g] = a.take(8, 1, 0.0)
    assert g.group_id == "new" and a.counts["stale"] == 1


def test_a_sample_without_a_reward_for_its_agent_is_malformed():
    t = traj("g", 0, size=2, reward={"other": 1.0})
    assert add(asm(), t).outcome == "malformed"


@pytest.mark.parametrize("skip", [False, True])
def test_skip_no_signal_drops_the_groups_whose_advantages_are_all_zero(skip):
    a = Assembler(min_size=2, timeout_s=10.0, max_staleness=4, skip_no_signal=skip)
    for i, r in enumerate([1.0, 1.0, 1.0, 1.0]):
        add(a, traj("flat", i, reward=r))
    for i, r in enumerate([0.0, 1.0, 0.0, 0.0]):
        add(a, traj("mixed", i, reward=r))
    for i, r in enumerate([0.0, 0.0, 0.0]):  # a failed member does not make the rest a signal
        add(a, traj("flat-failed", i, reward=r))
    add(a, traj("flat-failed", 3, failed=True))
    # one agent's rewards differ: that agent's members have an advantage, so the group has a signal
    for i, r in enumerate([{"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 0.0}]):
        add(a, traj("agents", i, reward=r))
    taken = [g.group_id for g in a.take(8, 0, 1.0)]
    if not skip:
        assert taken == ["flat", "mixed", "flat-failed", "agents"] and a.pop_decided() == []
        assert a.counts["groups_no_signal"] == 0
        return
    assert taken == ["mixed", "agents"]
    decided = sorted((e.traj.group_id, e.outcome) for e in a.pop_decided())
    assert decided == sorted([("flat", "no_signal")] * 4 + [("flat-failed", "no_signal")] * 3
                             + [("flat-failed", "failed")])
    assert a.counts["groups_no_signal"] == 2 and a.counts["no_signal"] == 7 and a.counts["groups_trained"] == 2


@pytest.mark.slow
def test_a_trainer_with_skip_no_signal_steps_only_on_groups_with_a_signal(tiny_model, redis_url, keys, tmp_path):
    """The setting reaches the trainer's assembler: all-equal groups first in the stream are decided
    `no_signal` (and acked), and the step trains the two groups after them."""
    import time

    from jet.config import load_file
    from jet.runs import read_metrics
    from jet.trainer import loop
    from tests.trainer.helpers import MODEL
    from tests.trainer.rollouts import produce_sync, stream_state, write_config

    flat = [traj(f"flat{g}", i, size=2, reward=float(g)) for g in range(2) for i in range(2)]
    mixed = [traj(f"mixed{g}", i, size=2, reward=float(i)) for g in range(2) for i in range(2)]
    produce_sync(redis_url, keys, flat + mixed)
    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=1,
                                 checkpoint_every=1, skip_no_signal=True))
    deadline = time.monotonic() + 60
    assert loop.run(cfg, MODEL, redis_url, lambda: time.monotonic() > deadline).step == 1
    [row] = read_metrics(cfg.run_dir / "trainer" / MODEL / "metrics.jsonl")
    assert row["rollout/groups"] == 2 and row["rollout/no_signal_frac"] == 0
    assert (row["counts/groups_no_signal"], row["counts/no_signal"], row["counts/trained"]) == (2, 4, 4)
    assert anyio.run(stream_state, redis_url, keys)["pending"] == 0  # the dropped ones are acked too
