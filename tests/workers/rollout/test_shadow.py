"""Shadow mode (docs/swarm.md): `jet worker env --shadow` plays every new task next to the live workers.

Real processes on a real server. Checked: shadow trajectories land only in
`shadow:<model>` (tagged shadow, from the shadow consumer), the live workers
still process every task exactly once into `traj:<model>`, a failing episode is
retried and dead-lettered by the live workers only, `jet status` shows the
shadow group while it runs, and a clean exit deletes the shadow group (so it
never holds back trimming of the tasks stream).
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from jet.keys import GROUP_ENV_SHADOW
from jet.queues import admin, codec
from jet.queues.connect import connect
from jet.wire import Trajectory
from tests.workers.conftest import HOST, MODEL, enqueue, trajectories, wait_for, write_config


async def groups_of(r, stream: str) -> set[str]:
    try:
        return {g["name"].decode() for g in await r.xinfo_groups(stream)}
    except Exception:  # noqa: BLE001 - no stream yet
        return set()


async def shadow_trajs(r, keys) -> list[Trajectory]:
    return [Trajectory.from_payload(codec.decode(f)) for _, f in await r.xrange(keys.shadow(MODEL))]


@pytest.mark.slow
@pytest.mark.anyio
async def test_shadow_worker_records_every_task_without_taking_any_from_the_live_workers(
        redis_url, keys, tiny_model, procs):
    write_config(procs.cfg_path, keys.run, tiny_model, [{"name": "chat", "workflow": "tests.workers.flows:chat",
                                                         "group_size": 1, "max_retries": 1}])
    r = await connect(redis_url)
    procs.start("infer")
    procs.start("env", "--slot", "0")
    shadow = procs.start("env", "--shadow")
    stream = keys.tasks("chat")
    await wait_for(lambda: _has_group(r, stream, GROUP_ENV_SHADOW), timeout=60)
    rows = [{"turns": 1, "max_tokens": 3}] * 5 + [{"turns": 2, "boom": True}]
    await enqueue(redis_url, keys, "chat", rows, group_size=1)
    # 6 tasks + the live workers' retry copy of the failing one: 7 episodes on each side.
    await wait_for(lambda: _n(trajectories(redis_url, keys), 7), timeout=90)
    await wait_for(lambda: _n(shadow_trajs(r, keys), 7), timeout=60)
    report = await admin.report(r, keys, redis_url)
    live, shadowed = await trajectories(redis_url, keys), await shadow_trajs(r, keys)
    # Live: every task once, the failing one retried then dead-lettered, nothing from the shadow.
    assert {t.meta["worker"] for t in live} == {f"{HOST}-env-chat-0"}
    assert not [t for t in live if t.meta.get("shadow")]
    assert Counter((t.group_id, t.attempt, t.failed) for t in live) == Counter(
        [(f"g{i}", 0, False) for i in range(5)] + [("g5", 0, True), ("g5", 1, True)])
    assert (await r.xinfo_stream(stream))["entries-added"] == 7 and await r.xlen(keys.dead) == 1
    # Shadow: the same episodes, tagged, in its own stream; failures recorded, never retried.
    assert {t.meta["worker"] for t in shadowed} == {f"{HOST}-env-shadow-chat-0"}
    assert all(t.meta["shadow"] is True and t.meta["code_version"] for t in shadowed)
    assert sorted((t.group_id, t.attempt) for t in shadowed) == sorted((t.group_id, t.attempt) for t in live)
    assert [t.retry for t in shadowed if t.failed] == [False, False]
    assert (await r.xpending(stream, "env"))["pending"] == 0
    live_consumers = {c["name"].decode() for c in await r.xinfo_consumers(stream, "env")}
    assert live_consumers == {f"{HOST}-env-chat-0"}
    # `jet status` shows the shadow group (best-effort: its lag never holds back trimming).
    [tasks_row] = [s for s in report["streams"] if s["name"] == "tasks:chat"]
    assert {g["name"] for g in tasks_row["groups"]} == {"env", GROUP_ENV_SHADOW}
    # A clean exit deletes the shadow group; the live group stays.
    shadow.send_signal(signal.SIGTERM)
    assert shadow.wait(30) == 0, procs.dump()
    assert await groups_of(r, stream) == {"env"}
    await r.aclose()


async def _has_group(r, stream, group):
    return group in await groups_of(r, stream)


async def _n(coro, n):
    got = await coro
    return got if len(got) >= n else None
