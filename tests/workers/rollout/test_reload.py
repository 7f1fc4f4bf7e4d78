"""Live code iteration (docs/swarm.md): `jet worker env -n 2` rolls onto new workflow code on SIGHUP.

Real processes on a real server: a steady stream of tasks, the workflow's
source is changed mid-run and the supervisor is sent SIGHUP. Checked: every
task gives exactly one successful trajectory, nothing stays pending, the
trajectories carry both code versions (old code from the old consumers,
new code from the new generation's `<slot>.1` consumers), and no gap between
consecutive trajectories around the reload reaches the drain timeout.
"""

from __future__ import annotations

import signal
from collections import Counter

import anyio
import pytest

from jet.queues import codec
from jet.queues.connect import connect
from jet.wire import Trajectory
from tests.workers.conftest import HOST, MODEL, enqueue, wait_for, write_config
from tests.workers.test_faults import children

DRAIN_S = 10.0

FLOW = '''
import anyio

VERSION = "{version}"


async def flow(task, llm):
    await llm.chat([{{"role": "user", "content": "Say something."}}], max_tokens=2)
    await anyio.sleep(task.row.get("sleep", 0))
    llm.info["flow"] = VERSION
    return 1.0
'''


async def stamped(url, keys, stream) -> list[tuple[int, Trajectory]]:
    """(ms timestamp of the entry id, trajectory) of every entry of `stream`."""
    r = await connect(url)
    try:
        return [(int(i.decode().split("-")[0]), Trajectory.from_payload(codec.decode(f)))
                for i, f in await r.xrange(stream)]
    finally:
        await r.aclose()


@pytest.mark.slow
@pytest.mark.anyio
async def test_sighup_rolls_env_workers_onto_new_code_without_losing_or_repeating_a_task(
        redis_url, keys, tiny_model, procs, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    src = code / "reloadflow.py"
    src.write_text(FLOW.format(version="old"))
    write_config(procs.cfg_path, keys.run, tiny_model,
                 [{"name": "live", "workflow": "reloadflow:flow", "concurrency": 2, "group_size": 1,
                   "runtime": {"cwd": str(code)}}])
    procs.start("infer")
    env = procs.start("env", "-n", "2", "--drain-timeout", str(DRAIN_S))
    sent = []

    async def feed(stop: anyio.Event) -> None:
        k = 0
        while not stop.is_set():
            sent.extend(await enqueue(redis_url, keys, "live", [{"sleep": 0.5}], group_size=1, prefix=f"b{k}-"))
            k += 1
            await anyio.sleep(0.25)

    async def with_code(flow: str, n: int):
        got = await stamped(redis_url, keys, keys.traj(MODEL))
        return got if sum(1 for _, t in got if t.meta["info"].get("flow") == flow) >= n else None

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed, stop)
        await wait_for(lambda: with_code("old", 4), timeout=90)
        src.write_text(FLOW.format(version="new, longer"))
        env.send_signal(signal.SIGHUP)
        await wait_for(lambda: with_code("new, longer", 6), timeout=60)
        stop.set()
    await wait_for(lambda: _all_done(redis_url, keys, len(sent)), timeout=60)
    await wait_for(lambda: _n_children(env.pid, 2), timeout=30)  # the old generation has exited
    env.send_signal(signal.SIGTERM)
    assert env.wait(40) == 0, procs.dump()

    got = await stamped(redis_url, keys, keys.traj(MODEL))
    trajs = [t for _, t in got]
    counts = Counter((t.group_id, t.index) for t in trajs)
    assert sorted(counts) == sorted((t.group_id, t.index) for t in sent) and max(counts.values()) == 1
    assert not [t.error for t in trajs if t.failed]
    r = await connect(redis_url)
    assert (await r.xpending(keys.tasks("live"), "env"))["pending"] == 0
    await r.aclose()
    # Two code versions, each from its own generation of consumers.
    versions = {t.meta["info"]["flow"]: set() for t in trajs}
    workers = {t.meta["info"]["flow"]: set() for t in trajs}
    for t in trajs:
        versions[t.meta["info"]["flow"]].add(t.meta["code_version"])
        workers[t.meta["info"]["flow"]].add(t.meta["worker"])
    assert len(versions["old"]) == 1 and len(versions["new, longer"]) == 1
    assert versions["old"] != versions["new, longer"]
    assert workers["old"] <= {f"{HOST}-env-live-0", f"{HOST}-env-live-1"}
    assert workers["new, longer"] <= {f"{HOST}-env-live-0.1", f"{HOST}-env-live-1.1"}
    # Trajectories kept coming: no gap around the reload as long as the drain timeout.
    stamps = [ms for ms, _ in got]
    gaps = [(b - a) / 1000 for a, b in zip(stamps, stamps[1:])]
    print(f"largest gap between trajectories: {max(gaps):.2f}s")
    assert max(gaps) < DRAIN_S, gaps


async def _all_done(url, keys, n):
    got = await stamped(url, keys, keys.traj(MODEL))
    return got if len(got) >= n else None


async def _n_children(pid, n):
    return len(children(pid)) == n
