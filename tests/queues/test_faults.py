"""Real faults: SIGKILLed consumer processes, SIGTERM drains, cancelled reads,
and a server restart, each checked for exactly-once outputs and nothing pending."""

import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import pytest

from jet.keys import Keys
from jet.queues import codec
from jet.queues.connect import connect
from jet.queues.producer import Producer
from jet.queues.server import EmbeddedServer
from tests.queues.helpers import close, entry, eventually, make_consumer, read_all, serve

ROOT = Path(__file__).resolve().parents[2]


def spawn(url: str, run: str, slot: int, *args: str, ready: Path | None = None,
          log: Path | None = None) -> subprocess.Popen:
    """A hop worker process; with `ready`, it creates that file once connected; `log` takes its stderr."""
    env = {**os.environ, "JET_READY_FILE": str(ready)} if ready else None
    err = open(log, "ab") if log else None
    try:
        return subprocess.Popen([sys.executable, "-m", "tests.queues.hop_worker", url, run, str(slot), *args],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
    finally:
        if err:
            err.close()


async def wait_ready(files: list[Path], timeout: float = 60) -> None:
    """Until every process made its ready file: a SIGTERM before that would kill it, not drain it."""
    with anyio.fail_after(timeout):
        while not all(f.exists() for f in files):
            await anyio.sleep(0.05)


async def fill(url: str, keys: Keys, n: int) -> None:
    r = await connect(url)
    await Producer(r, url, keys, keys.tasks("src"), maxlen=10 * n).send([entry(i) for i in range(n)])
    await r.aclose()


async def wait_outputs(url: str, keys: Keys, n: int, timeout: float, during=None) -> list:
    r = await connect(url)
    with anyio.fail_after(timeout):
        while await r.xlen(keys.traj("dst")) < n:
            if during:
                during()
            await anyio.sleep(0.1)
    out = await read_all(r, keys.traj("dst"))
    pending = (await r.xpending(keys.tasks("src"), "g"))["pending"]
    await r.aclose()
    return out, pending


async def pending_count(r, keys: Keys) -> int:
    groups = await r.xinfo_groups(keys.tasks("src"))
    return groups[0]["pending"] if groups else 0


async def finish_with(url: str, keys: Keys, n: int, slot: int, *args: str) -> list:
    """A fresh consumer process on `slot` finishes the run: every input out once, none pending."""
    q = spawn(url, keys.run, slot, *args)
    try:
        out, pending = await wait_outputs(url, keys, n, 30)
    finally:
        q.send_signal(signal.SIGTERM)
        q.wait(20)
    assert_exactly_once(out, n)
    assert pending == 0
    return out


def assert_exactly_once(out, n):
    counts = Counter(p.meta["n"] for p in out)
    assert sorted(counts) == list(range(n)), "an input is missing from the output"
    assert max(counts.values()) == 1, f"duplicated: {[k for k, v in counts.items() if v > 1][:10]}"


@pytest.mark.slow
@pytest.mark.anyio
async def test_chaos_sigkill_and_restart_consumers(redis_url, keys, tmp_path):
    n, slots = 3000, 3
    await fill(redis_url, keys, n)
    args = ["--lease-ms", "700", "--sleep", "0.05", "--batch", "10"]
    ready = {s: tmp_path / f"ready-{s}" for s in range(slots)}
    procs = {s: spawn(redis_url, keys.run, s, *args, ready=ready[s]) for s in range(slots)}
    rng, kills, next_kill = random.Random(7), 0, time.monotonic() + 0.5

    def chaos():
        nonlocal kills, next_kill
        if time.monotonic() < next_kill:
            return
        s = rng.randrange(slots)
        procs[s].send_signal(signal.SIGKILL)
        procs[s].wait()
        kills += 1
        ready[s].unlink(missing_ok=True)
        if rng.random() < 0.7:  # usually restart at once under the same name; else later
            procs[s] = spawn(redis_url, keys.run, s, *args, ready=ready[s])
        else:
            procs[s] = spawn(redis_url, keys.run, s + slots * kills, *args, ready=ready[s])
        next_kill = time.monotonic() + rng.uniform(0.3, 0.8)

    try:
        out, _ = await wait_outputs(redis_url, keys, n, 240, during=chaos)
        await wait_ready(list(ready.values()))  # one may have been started a moment ago
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            assert p.wait(30) == 0
        out, pending = await wait_outputs(redis_url, keys, n, 5)
    finally:
        for p in procs.values():
            p.kill()
    assert kills >= 5
    assert_exactly_once(out, n)
    assert pending == 0
    assert len({p.meta["by"] for p in out}) >= 3  # work really moved between processes


@pytest.mark.slow
@pytest.mark.anyio
async def test_sigterm_drains_and_exits_zero(redis_url, keys):
    n = 80
    await fill(redis_url, keys, n)
    # A slow handler (5 s a batch of 10) and a 0.5 s drain deadline: SIGTERM as the second batch
    # starts, so the deadline falls mid-batch. The drain must cut that batch (it is released, not
    # committed) and must not start the batches the fetcher read ahead.
    p = subprocess.Popen([sys.executable, "-m", "tests.queues.hop_worker", redis_url, keys.run, "0", "--sleep", "5",
                          "--batch", "10", "--lease-ms", "60000", "--drain-s", "0.5"],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lines = []
    with anyio.fail_after(60):
        while sum(line.startswith("start") for line in lines) < 2:
            lines.append(await anyio.to_thread.run_sync(p.stdout.readline))
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0
    lines += p.stdout.read().splitlines()
    assert [line.split()[0] for line in lines] == ["start", "done", "start"]  # cut mid-batch, nothing more
    r = await connect(redis_url)
    assert await r.xlen(keys.traj("dst")) == 10  # only the first batch was committed
    # What it did not finish was released (reclaimable now, despite the 60 s lease).
    await finish_with(redis_url, keys, n, 1, "--lease-ms", "60000")
    await r.aclose()


@pytest.mark.slow
@pytest.mark.anyio
async def test_sigkilled_consumer_restarted_under_same_name_finds_its_work(redis_url, keys):
    n = 30
    await fill(redis_url, keys, n)
    args = ["--sleep", "30", "--batch", "10", "--lease-ms", "600000"]  # the reaper could not help
    p = spawn(redis_url, keys.run, 5, *args)
    r = await connect(redis_url)
    with anyio.fail_after(20):
        while not await pending_count(r, keys):
            await anyio.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    out = await finish_with(redis_url, keys, n, 5, "--batch", "10", "--lease-ms", "600000")
    assert {p.meta["deliveries"] for p in out if p.meta["n"] < 10} == {2}
    await r.aclose()


@pytest.mark.anyio
async def test_cancelled_reads_lose_nothing(redis_url, keys):
    src = keys.tasks("src")
    c = await make_consumer(redis_url, keys, src, "me", block_ms=1000, lease_ms=600000, batch=5)
    for i in range(50):
        await c.r.xadd(src, entry(i))
    # The server runs a read whose reply never reaches us (as after a cancelled call) ...
    await c.rb.xreadgroup("g", "me", {src: ">"}, count=5)
    # ... and real cancellations hit fetch at random points.
    seen = []
    for _ in range(30):
        with anyio.move_on_after(random.uniform(0, 0.003)):
            for d in await c.fetch():
                seen.append(d.payload.meta["n"])
                await c.commit([(d, [])])
    await close(c)
    c2 = await make_consumer(redis_url, keys, src, "me", block_ms=200, lease_ms=600000, batch=5)
    while True:
        got = await c2.fetch()
        if not got:
            break
        for d in got:
            seen.append(d.payload.meta["n"])
            await c2.commit([(d, [])])
    assert sorted(set(seen)) == list(range(50))
    assert (await c2.r.xpending(src, "g"))["pending"] == 0
    await close(c2)


def outage_seen(caplog) -> bool:
    """A warning of jet.queues about the lost server: a read reconnecting, or an operation retrying."""
    return any(r.name.startswith("jet.queues") and r.levelno >= logging.WARNING
               and ("reconnecting" in r.getMessage() or "retrying" in r.getMessage()) for r in caplog.records)


@pytest.mark.slow
@pytest.mark.anyio
async def test_server_restart_mid_run_loses_nothing_acknowledged(tmp_path, keys, caplog):
    server = EmbeddedServer(tmp_path / "srv").start()
    url, n = server.url, 2000
    await fill(url, keys, n)
    c = await make_consumer(url, keys, keys.tasks("src"), batch=20, lease_ms=2000)
    dst, stop = keys.traj("dst"), anyio.Event()

    async def handle(batch):
        await anyio.sleep(0.005)
        return [[(dst, codec.encode("out", {"n": d.payload.meta["n"]}))] for d in batch]

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, c, handle, stop)
        probe = await connect(url)
        with anyio.fail_after(30):
            while await probe.xlen(dst) < n // 3:
                await anyio.sleep(0.02)
        before = await probe.xlen(dst)
        await probe.aclose()
        await anyio.to_thread.run_sync(server.stop)  # graceful: AOF flushed
        await eventually(lambda: outage_seen(caplog), 30)  # the consumer ran into the dead server
        server = EmbeddedServer(tmp_path / "srv", port=server.port).start()
        probe = await connect(url)
        assert await probe.xlen(dst) >= before  # every acknowledged output survived
        with anyio.fail_after(60):
            while await probe.xlen(dst) < n:
                await anyio.sleep(0.05)
        stop.set()
    out = await read_all(probe, dst)
    assert_exactly_once(out, n)
    assert (await probe.xpending(keys.tasks("src"), "g"))["pending"] == 0
    await probe.aclose()
    await close(c)
    server.stop()
