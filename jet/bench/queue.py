"""`jet bench queue`: the raw pipelined XADD rate against the full consumer hop, in one run.

raw  one redis-py asyncio client (`jet.queues.connect`) XADDs pre-encoded codec
     entries in pipelined batches of 100, no transaction. Each fill is also the
     input of the next measurement; the baseline is the best fill of the run.
lua  the issue's reference prototype, in this process: XREADGROUP a batch, then
     one SETTLE script call (ack + marker + produce), no decode, no runtime.
hop  1 or 2 worker processes, each the real consumer runtime in its batch mode
     (`serve_batches`: reaper, lease keeper, decode, marker check, atomic
     ack+produce) with a no-op handler that forwards each entry (same size) to
     an output stream. Workers connect (the runtime's clients and group), signal
     ready and wait for a `start` event (on the run's `events` stream), so
     start-up is not timed; the clock stops when the output holds all N.
each the same with one worker process on the runtime's per-message mode
     (`serve_each`, as many handler calls in flight as the batch size, each
     committed by the runtime's committer as it finishes): the env and
     inference workers' path, for comparison (no goal).
Rates are compared as x raw against the same server in the same run. Every
measurement is repeated (default 2) and the fastest run counts, because other
work on the machine only ever slows a run down; all samples are in --json.
CPU per message (client, and server from INFO cpu) says where the time went.
Not a test: nothing here asserts speed, only that every message came out once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import click

from jet.bench import emit, progress, redis_url_option, server_url
from jet.options import run_jet
from jet.errors import QueueError
from jet.keys import Keys
from jet.supervisor import python_module

GROUP = "bench"
GOALS = {"100B": 0.7, "40KB": 0.5}  # hop/raw the issue asks for
SIZES = {"100B": 100, "40KB": 40_000}  # entry bytes; 40 KB = 10k int32 token ids
DEFAULT_N = {"100B": 50_000, "40KB": 5_000}
QUICK_N = {"100B": 2_000, "40KB": 200}
DEFAULT_BATCH = {"100B": 200, "40KB": 50}  # consumer read/commit batch


@dataclass
class Row:
    payload: str
    entry_bytes: int
    mode: str  # "raw", "lua" (the plain prototype) or "hop"
    consumers: int  # processes reading (raw: 0)
    n: int
    seconds: float
    msgs_s: float
    mb_s: float
    client_cpu_us: float  # client CPU per message (raw, lua: this process; hop: all workers)
    server_cpu_us: float  # server CPU per message (INFO cpu; includes anything else it served)
    samples: list[float] | None = None  # msgs/s of every repeat; the row shows the best
    ratio: float | None = None  # msgs/s over the raw baseline's
    goal: float | None = None  # hop rows only
    met: bool | None = None


def entries(label: str, n: int, wire: bool = False) -> list[dict[bytes, bytes]]:
    """n codec entries of about SIZES[label] bytes each (header + int32 token ids); with `wire`,
    real GenRequests (the inference worker's input), which the hop then validates as such."""
    from jet.queues import codec
    from jet.wire import GenRequest

    def one(i: int, ids) -> dict[bytes, bytes]:
        if wire:
            return GenRequest(reply_to="jet:{bench}:reply:c", model="m", prompt_ids=ids, max_tokens=8,
                              msg_id=f"{i:032x}").to_fields()
        return codec.encode("bench", {"n": i}, ints={"t": ids})

    ids = array("i", range(max(0, (SIZES[label] - codec.entry_size(one(0, []))) // 4)))
    return [one(i, ids) for i in range(n)]


async def infos(r, section: str) -> list[dict]:
    """INFO `section` of the server, or of every primary of a cluster."""
    from jet.queues.connect import is_cluster

    if is_cluster(r):
        return list((await r.info(section, target_nodes=r.PRIMARIES)).values())
    return [await r.info(section)]


async def server_cpu(r) -> float:
    return sum(float(v) for info in await infos(r, "cpu") for k, v in info.items()
               if k in ("used_cpu_user", "used_cpu_sys"))


async def idle_server(r) -> None:
    """Wait out a background AOF rewrite, so it does not land inside one measurement."""
    with anyio.move_on_after(60):
        while any(int(i.get("aof_rewrite_in_progress", 0) or 0) for i in await infos(r, "persistence")):
            await anyio.sleep(0.1)


async def drop_run(r, keys: Keys) -> None:
    """Delete the run's keys (streams and ~N markers), one UNLINK per 5,000 (SCAN: every primary)."""
    found = []
    async for key in r.scan_iter(match=keys.pattern(), count=5000):
        found.append(key)
        if len(found) >= 5000:
            await r.unlink(*found)
            found = []
    if found:
        await r.unlink(*found)


async def raw_fill(r, stream: str, data: list[dict[bytes, bytes]], pipe: int = 100) -> tuple[float, float]:
    """Pipelined XADD of every entry; returns (seconds, client CPU seconds)."""
    t, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(data), pipe):
        async with r.pipeline(transaction=False) as p:
            for fields in data[i:i + pipe]:
                p.xadd(stream, fields)
            await p.execute()
    return time.perf_counter() - t, time.process_time() - cpu


async def lua_hop(r, url: str, keys: Keys, n: int, batch: int) -> tuple[float, float]:
    """The plain prototype: read a batch, one COMMIT call for it. (seconds, CPU seconds)"""
    from jet.queues import scripts
    from jet.queues.connect import connect

    rb = await connect(url, block_ms=1000)
    src, out = keys.tasks("bench"), keys.traj("bench")
    commit = r.register_script(scripts.SETTLE)
    t, cpu, done = time.perf_counter(), time.process_time(), 0
    while done < n:
        got = [e for _, es in await rb.xreadgroup(GROUP, "lua", {src: ">"}, count=batch, block=1000) or []
               for e in es]
        markers = [keys.done_marker(GROUP, f[b"i"].decode()) for _, f in got]
        argv = [GROUP, 21_600, len(got), 0, 0, 1, 0, "b"]  # no dead cap, no room checks; one output stream
        for entry_id, fields in got:
            argv += [entry_id, "c", 1, len(got) + 4, len(fields), *(x for kv in fields.items() for x in kv)]
        await commit(keys=[src, keys.stats, keys.dead, *markers, out], args=argv)
        done += len(got)
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    await rb.aclose()
    return seconds, cpu


def spawn(url: str, run: str, slot: int, batch: int, log: Path, profile: str | None,
          wire: bool = False, each: bool = False) -> subprocess.Popen:
    argv = [*python_module("jet.bench.queue"), "--url", url, "--run", run, "--slot", str(slot),
            "--batch", str(batch)] + (["--profile", f"{profile}.{run}.{slot}"] if profile else [])
    argv += (["--wire"] if wire else []) + (["--each"] if each else [])
    with open(log, "wb") as f:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f)


def tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-15:])


async def hop(r, url: str, keys: Keys, n: int, consumers: int, batch: int, log_dir: Path,
              profile: str | None, wire: bool = False, each: bool = False) -> tuple[float, float]:
    """`consumers` worker processes over the pre-filled input. (seconds, their CPU seconds)"""
    from jet.queues import codec

    logs = [log_dir / f"{keys.run}-{s}.log" for s in range(consumers)]
    procs = [spawn(url, keys.run, s, batch, logs[s], profile, wire, each) for s in range(consumers)]
    out = keys.traj("bench")

    def check_alive() -> None:
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise QueueError(f"bench worker exited with {p.returncode}:\n{tail(log)}")

    try:
        ready, last = 0, "0-0"
        with anyio.fail_after(60):
            while ready < consumers:
                check_alive()
                for _, items in await r.xread({keys.events: last}, block=200) or []:
                    for last, fields in items:
                        ready += codec.decode(fields).meta.get("event") == "ready"
        t = time.perf_counter()
        await r.xadd(keys.events, codec.encode("bench", {"event": "start"}))
        with anyio.fail_after(max(120.0, n / 200)):
            while await r.xlen(out) < n:
                check_alive()
                await anyio.sleep(0.005)
        seconds = time.perf_counter() - t
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # drain and exit 0
        codes = [await anyio.to_thread.run_sync(stop_process, p) for p in procs]
    if any(codes):
        raise QueueError(f"bench workers exited with {codes}:\n{tail(logs[0])}")
    got, pending = await r.xlen(out), (await r.xpending(keys.tasks("bench"), GROUP))["pending"]
    if got != n or pending:
        raise QueueError(f"hop moved {got} of {n} messages, {pending} still pending")
    events = [codec.decode(f).meta for _, f in await r.xrange(keys.events)]
    return seconds, sum(m["cpu_s"] for m in events if m.get("event") == "done")


def stop_process(p: subprocess.Popen) -> int:
    try:
        return p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def rate(label: str, mode: str, consumers: int, n: int, size: int, seconds: float, cpu: float,
         server: float) -> Row:
    return Row(label, size, mode, consumers, n, round(seconds, 4), round(n / seconds, 1),
               round(n * size / seconds / 1e6, 2), round(cpu / n * 1e6, 1), round(server / n * 1e6, 1))


def best(samples: list[Row]) -> Row:
    """The fastest of the repeats (the one least disturbed by the rest of the machine)."""
    top = max(samples, key=lambda x: x.msgs_s)
    top.samples = [x.msgs_s for x in samples]
    return top


async def measure(url: str, ns: dict[str, int], counts: list[int], batch: dict[str, int], repeat: int,
                  log_dir: Path, profile: str | None, say, wire: bool = False) -> list[Row]:
    from jet.queues import codec
    from jet.queues.connect import connect

    r = await connect(url)
    rows: list[Row] = []
    try:
        for label, n in ns.items():
            data = entries(label, n, wire)
            size = codec.entry_size(data[0])
            cases = [("lua", 1)] + [("hop", k) for k in counts] + [("each", 1)]
            raws, runs = [], {case: [] for case in cases}
            for mode, k in cases * repeat:
                keys = Keys(f"bench{uuid.uuid4().hex[:8]}")
                src = keys.tasks("bench")
                await r.xgroup_create(src, GROUP, id="0", mkstream=True)
                await idle_server(r)
                say(f"{label}: raw XADD of {n} entries of {size} B")
                s0 = await server_cpu(r)
                seconds, cpu = await raw_fill(r, src, data)
                raws.append(rate(label, "raw", 0, n, size, seconds, cpu, await server_cpu(r) - s0))
                await idle_server(r)
                say(f"{label}: {mode} with {k} consumer process{'es' if k > 1 else ''}")
                s0 = await server_cpu(r)
                if mode == "lua":
                    seconds, cpu = await lua_hop(r, url, keys, n, batch[label])
                else:
                    seconds, cpu = await hop(r, url, keys, n, k, batch[label], log_dir, profile, wire,
                                             each=mode == "each")
                runs[mode, k].append(rate(label, mode, k, n, size, seconds, cpu, await server_cpu(r) - s0))
                await drop_run(r, keys)
            # One baseline per payload: the best of all fills, so a slow fill cannot flatter the ratios.
            base = best(raws)
            rows.append(base)
            for x in map(best, runs.values()):
                x.ratio = round(x.msgs_s / base.msgs_s, 3)
                if x.mode == "hop":
                    x.goal = GOALS.get(label)
                    x.met = x.goal is not None and x.ratio >= x.goal
                rows.append(x)
    finally:
        await r.aclose()
    return rows


async def server_version(url: str) -> str:
    from jet.queues.connect import connect

    r = await connect(url)
    try:
        info = await r.info("server")
    finally:
        await r.aclose()
    v = info.get("valkey_version") or info.get("redis_version") or "?"
    return f"{'valkey' if 'valkey_version' in info else 'redis'} {v}"


def render(rows: list[Row], header: str):
    from rich.table import Table

    table = Table(title=f"jet bench queue: {header}")
    for col in ("payload", "mode", "procs", "msgs", "msgs/s", "MB/s", "x raw", "goal", "client us/msg",
                "server us/msg"):
        table.add_column(col, justify="right")
    for x in rows:
        goal = "" if x.goal is None else f">= {x.goal} {'met' if x.met else 'NOT met'}"
        table.add_row(x.payload, x.mode, str(x.consumers or "-"), str(x.n), f"{x.msgs_s:,.0f}", f"{x.mb_s:,.1f}",
                      "" if x.ratio is None else f"{x.ratio:.2f}", goal, f"{x.client_cpu_us:.1f}",
                      f"{x.server_cpu_us:.1f}")
    return table


@click.command("queue")
@redis_url_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--quick", is_flag=True, help=f"Small N ({QUICK_N['100B']} / {QUICK_N['40KB']}) for tests; its numbers mean little.")
@click.option("--n-small", type=int, default=None, help=f"Messages of 100 B (default {DEFAULT_N['100B']}).")
@click.option("--n-large", type=int, default=None, help=f"Messages of 40 KB (default {DEFAULT_N['40KB']}).")
@click.option("--consumers", default="1,2", show_default=True, help="Hop consumer process counts to run.")
@click.option("--batch-small", type=int, default=DEFAULT_BATCH["100B"], show_default=True,
              help="Consumer batch for 100 B entries.")
@click.option("--batch-large", type=int, default=DEFAULT_BATCH["40KB"], show_default=True,
              help="Consumer batch for 40 KB entries.")
@click.option("--repeat", type=int, default=None,
              help="Runs of each measurement; the best counts (default 2, --quick 1).")
@click.option("--profile", default=None, hidden=True, help="cProfile each worker to PREFIX.<run>.<slot>.")
@click.option("--wire", is_flag=True, help="Entries are GenRequests, which the hop validates (jet.wire) as it reads.")
def cli(redis_url, as_json, quick, n_small, n_large, consumers, batch_small, batch_large, repeat, profile, wire):
    """Raw pipelined XADD rate vs the full consumer hop (read, decode, handle, ack+produce)."""
    base = QUICK_N if quick else DEFAULT_N
    ns = {"100B": n_small or base["100B"], "40KB": n_large or base["40KB"]}
    counts = [int(x) for x in consumers.split(",") if x.strip()]
    batch = {"100B": batch_small, "40KB": batch_large}
    say = progress(as_json)
    with tempfile.TemporaryDirectory(prefix="jet-bench-") as tmp, server_url(redis_url, Path(tmp) / "server") as url:
        version = run_jet(server_version, url)
        rows = run_jet(measure, url, ns, counts, batch, repeat or (1 if quick else 2), Path(tmp), profile, say, wire)
    embedded = not redis_url
    header = f"{'embedded ' if embedded else ''}{version}, {os.cpu_count()} CPUs"
    if as_json:
        goals = {label: {"goal": g, "met": all(x.met for x in rows if x.payload == label and x.mode == "hop")}
                 for label, g in GOALS.items()}
        emit({"server": {"version": version, "embedded": embedded}, "cpus": os.cpu_count(), "batch": batch,
              "rows": [asdict(x) for x in rows], "goals": goals}, True, lambda report: None)
        return
    from rich.console import Console

    console = Console()
    console.width = max(console.width, 130)
    console.print(render(rows, header))


# -- the worker process ------------------------------------------------------------------


async def work(url: str, run: str, slot: int, batch: int, stop: anyio.Event, wire: bool = False,
               each: bool = False) -> None:
    from jet.queues import codec
    from jet.queues.connect import connect
    from jet.queues.consumer import Settings, consumer_name
    from jet.queues.messages import Commit
    from jet.queues.runtime import Runtime
    from jet.wire import GenRequest

    keys = Keys(run)
    cfg = Settings(batch=batch, block_ms=1000)
    r = await connect(url)
    out = keys.traj("bench")

    async def handle(ds):  # no-op: forward each (already decoded) entry unchanged
        if wire:  # ... once it passed the wire type's validation, as the inference worker does
            for d in ds:
                GenRequest.from_payload(d.payload)
        return [[(out, d.fields)] for d in ds]

    async def handle_one(d):  # the same, one message per call
        if wire:
            GenRequest.from_payload(d.payload)
        return Commit([(out, d.fields)])

    # Connected (its two clients, the group) before it says ready: start-up is not timed.
    async with Runtime(url, keys, keys.tasks("bench"), GROUP, consumer_name("bench", slot), cfg, stop=stop) as rt:
        await r.xadd(keys.events, codec.encode("bench", {"event": "ready", "slot": slot}))
        last, started = "0-0", False
        while not started:
            for _, items in await r.xread({keys.events: last}, block=1000) or []:
                for last, fields in items:
                    started = started or codec.decode(fields).meta.get("event") == "start"
        cpu = time.process_time()
        if each:
            await rt.serve_each(handle_one, stop, concurrency=batch)
        else:
            await rt.serve_batches(handle, stop)
        cpu = time.process_time() - cpu
    await r.xadd(keys.events, codec.encode("bench", {"event": "done", "slot": slot, "cpu_s": cpu}))
    await r.aclose()


@click.command("bench-queue-worker", hidden=True)
@click.option("--url", required=True)
@click.option("--run", required=True)
@click.option("--slot", type=int, required=True)
@click.option("--batch", type=int, required=True)
@click.option("--profile", default=None)
@click.option("--wire", is_flag=True)
@click.option("--each", is_flag=True)
def worker_cli(url, run, slot, batch, profile, wire, each):
    """One hop consumer, started by `jet bench queue`; SIGTERM drains it (exit 0)."""
    from jet.supervisor import run_role

    if not profile:
        run_role(lambda stop: work(url, run, slot, batch, stop, wire, each), "bench-queue-worker")
        return
    import cProfile

    with cProfile.Profile() as prof:
        try:
            run_role(lambda stop: work(url, run, slot, batch, stop, wire, each), "bench-queue-worker")
        finally:
            prof.dump_stats(profile)


if __name__ == "__main__":
    worker_cli()
