"""Real worker processes under real faults: SIGKILL mid-batch / mid-episode, SIGTERM drains with -n N."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from jet.queues.connect import connect
from tests.workers.conftest import HOST, MODEL, enqueue, trajectories, wait_for, write_config


async def pending_of(r, stream: str, group: str, consumer: str) -> list[str]:
    try:
        rows = await r.xpending_range(stream, group, "-", "+", 100, consumername=consumer)
    except Exception:  # noqa: BLE001 - the group does not exist yet
        return []
    return [row["message_id"].decode() for row in rows]


def assert_each_member_once(trajs, n_groups, group_size):
    counts = Counter((t.group_id, t.index) for t in trajs)
    assert sorted(counts) == [(f"g{i}", j) for i in range(n_groups) for j in range(group_size)]
    assert max(counts.values()) == 1 and not [t.error for t in trajs if t.failed]


@pytest.mark.slow
@pytest.mark.anyio
async def test_sigkilled_inference_worker_mid_batch_loses_no_episode(redis_url, keys, tiny_model, procs):
    write_config(procs.cfg_path, keys.run, tiny_model, [{"name": "chat", "workflow": "tests.workers.flows:chat",
                                                         "concurrency": 8}], lease_ms=1500)
    await enqueue(redis_url, keys, "chat", [{"turns": 3, "max_tokens": 40}] * 6)
    r = await connect(redis_url)
    a_name = f"{HOST}-infer-{MODEL}-0"
    a = procs.start("infer", "--slot", "0")
    procs.start("env")
    in_flight = await wait_for(lambda: pending_of(r, keys.gen(MODEL), "infer", a_name), timeout=60, every=0.01)
    a.send_signal(signal.SIGKILL)  # it holds a batch it has not committed
    a.wait()
    requests = {i.decode(): f for i, f in await r.xrange(keys.gen(MODEL))}
    killed = [requests[i][b"i"].decode() for i in in_flight]
    procs.start("infer", "--slot", "1")
    trajs = await wait_for(lambda: _at_least(redis_url, keys, 12), timeout=90)
    assert_each_member_once(trajs, 6, 2)
    assert all(t.meta["calls"] == 3 for t in trajs)
    # The killed batch was reclaimed and answered by the other worker (its markers are set).
    assert killed and all([await r.exists(keys.done_marker("infer", m)) for m in killed])
    assert (await r.xpending(keys.gen(MODEL), "infer"))["pending"] == 0
    await r.aclose()


@pytest.mark.slow
@pytest.mark.anyio
async def test_sigkilled_env_worker_tasks_are_rerun_elsewhere(redis_url, keys, tiny_model, procs):
    write_config(procs.cfg_path, keys.run, tiny_model, [{"name": "chat", "workflow": "tests.workers.flows:chat",
                                                         "concurrency": 4}], lease_ms=1500)
    await enqueue(redis_url, keys, "chat", [{"turns": 2, "sleep": 3}] * 2)
    r = await connect(redis_url)
    procs.start("infer")
    a = procs.start("env", "--slot", "0")
    a_name, b_name = f"{HOST}-env-chat-0", f"{HOST}-env-chat-1"
    taken = await wait_for(lambda: pending_of(r, keys.tasks("chat"), "env", a_name), timeout=60, every=0.05)
    a.send_signal(signal.SIGKILL)  # mid-episode: every episode sleeps 3 s first
    a.wait()
    rerun = {f[b"i"].decode() for i, f in await r.xrange(keys.tasks("chat")) if i.decode() in taken}
    procs.start("env", "--slot", "1")
    trajs = await wait_for(lambda: _at_least(redis_url, keys, 4), timeout=90)
    assert_each_member_once(trajs, 2, 2)
    assert taken and len(rerun) == len(taken) and {t.meta["worker"] for t in trajs} == {b_name}
    assert all(t.meta["deliveries"] >= 2 for t in trajs if t.episode_id in rerun)
    assert (await r.xpending(keys.tasks("chat"), "env"))["pending"] == 0
    await r.aclose()


@pytest.mark.slow
@pytest.mark.anyio
async def test_n_processes_serve_and_drain_on_sigterm(redis_url, keys, tiny_model, procs):
    write_config(procs.cfg_path, keys.run, tiny_model, [{"name": "chat", "workflow": "tests.workers.flows:chat",
                                                         "concurrency": 2}], lease_ms=60_000)
    await enqueue(redis_url, keys, "chat", [{"turns": 2, "sleep": 1}] * 4)
    r = await connect(redis_url)
    infer = procs.start("infer", "-n", "2")
    env = procs.start("env", "-n", "2", "--drain-timeout", "20")
    await wait_for(lambda: _at_least(redis_url, keys, 1), timeout=60)
    env.send_signal(signal.SIGTERM)  # mid-run: in-flight episodes finish, nothing new is taken
    assert env.wait(40) == 0, procs.dump()
    done = await trajectories(redis_url, keys)
    assert (await r.xpending(keys.tasks("chat"), "env"))["pending"] == 0  # finished or released, none held
    consumers = {c["name"].decode() for c in await r.xinfo_consumers(keys.tasks("chat"), "env")}
    assert consumers == {f"{HOST}-env-chat-0", f"{HOST}-env-chat-1"}
    assert not [t for t in done if t.failed]
    consumers = {c["name"].decode() for c in await r.xinfo_consumers(keys.gen(MODEL), "infer")}
    assert consumers == {f"{HOST}-infer-{MODEL}-0", f"{HOST}-infer-{MODEL}-1"}
    # A supervisor killed outright: its workers notice and drain by themselves.
    kids = children(infer.pid)
    assert len(kids) == 2
    infer.send_signal(signal.SIGKILL)
    infer.wait()
    await wait_for(lambda: _all_gone(kids), timeout=30)
    await r.aclose()


def children(pid: int) -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d))
    return out


async def _all_gone(pids: list[int]) -> bool:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return not alive


async def _at_least(url, keys, n):
    trajs = await trajectories(url, keys)
    return trajs if len(trajs) >= n else None
