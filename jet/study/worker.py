"""The study worker (`jet study worker NAME -n N`): executes a study's runs, one at a time per process.

What it is: a consumer of the study's run stream (`Keys.for_study(name).study_runs`,
group `study`). Each request becomes an ordinary Jet run (`jet.study.execution`:
a `jet up` of the resolved config in its own namespace and folder under a
keeper); its result is committed atomically with the request's ack (one Lua
call: ack + idempotency marker + XADD to `study:results`), so a result lands
exactly once however often the request was delivered. A worker that drains
(SIGTERM) stops its run gracefully (the trainer checkpoints) and gives the
request back; a SIGKILLed one's request is reclaimed by any live worker after
the lease (`worker.lease_s` of the study file) and resumes from the run's
last checkpoint, after the old attempt's keeper let go of the run. Workers
scale by process count, on any machine that reaches the Redis and has the
base config at the same path.

While the study is paused (`jet study stop`), a worker holds its next
request without starting it.

What it is not: a planner. It knows nothing of arms or statistics.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import anyio
import click
import orjson

from jet.keys import GROUP_STUDY, Keys
from jet.study import ledger
from jet.study.execution import Finished, Retry, execute
from jet.study.messages import RunRequest

log = logging.getLogger(__name__)

SPEC_WAIT_S = 2.0



async def settings_of(r, url: str, keys: Keys, stop: anyio.Event) -> dict | None:
    """The study's worker settings, written by its runner (waits for a runner to write them)."""
    while not stop.is_set():
        spec = await ledger.get_field(r, url, keys, "spec")
        if spec:
            return orjson.loads(spec)["worker"]
        log.info("waiting for the study's runner to publish it (no spec at %s yet)", keys.study_state)
        with anyio.move_on_after(SPEC_WAIT_S):
            await stop.wait()
    return None


async def handle_one(r, url: str, keys: Keys, delivery, study_dir: Path, name: str, stop: anyio.Event):
    """One request -> a Finished or a Retry outcome."""
    req = RunRequest.from_payload(delivery.payload)
    while await ledger.get_field(r, url, keys, "paused") and not stop.is_set():
        with anyio.move_on_after(1.0):
            await stop.wait()
    if stop.is_set():
        return Retry("the study worker stopped before starting the run")
    log.info("run %s (arm %d, seed %d, attempt %d)", req.run, req.trial, req.seed, delivery.deliveries)
    outcome = await execute(req, r, url, keys, study_dir, name, delivery.deliveries, stop)
    if isinstance(outcome, Finished):
        log.info("run %s: %s %s", req.run, outcome.result.status, outcome.result.reason)
    else:
        log.info("run %s given back: %s", req.run, outcome.why)
    return outcome


async def one_at_a_time(c, handle, stop: anyio.Event) -> None:
    """Fetch one request, run it to its outcome, commit or give it back; the lease keeper renews its
    lease meanwhile and the reaper reclaims the requests of dead workers. Nothing is read ahead: a
    request waits in the stream for whichever worker is free."""
    from jet.errors import ConnectError
    from jet.queues.connect import retry_forever
    from jet.queues.reaper import Reaper
    from jet.queues.serve import lease_keeper, reaper_loop

    await retry_forever(c.ensure_group, url=c.url, what="create the study group")
    inner = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lease_keeper, c, inner)
        tg.start_soon(reaper_loop, Reaper(c), inner, min(5.0, c.cfg.lease_ms / 2000))
        try:
            while not stop.is_set():
                try:
                    for d in await c.fetch(1):
                        outcome = await handle(d)
                        if isinstance(outcome, Finished):
                            await c.commit([(d, [(c.keys.study_results, outcome.result.to_fields())])])
                        else:
                            await c.fail(d, outcome.why)
                except ConnectError as e:
                    log.warning("%s; reconnecting", e)
                    await anyio.sleep(1.0)
                    c.restarted()
        finally:
            inner.set()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                if c.inflight:
                    await c.release()


async def serve(url: str, study: str, slot: int, study_dir: Path, stop: anyio.Event) -> None:
    from jet.queues.connect import connect
    from jet.queues.consumer import Consumer, Settings, consumer_name

    keys = Keys.for_study(study)
    r = await connect(url)
    rb = await connect(url, block_ms=2000)
    try:
        ws = await settings_of(r, url, keys, stop)
        if ws is None:
            return
        name = consumer_name("study", slot)
        settings = Settings(lease_ms=int(ws["lease_s"] * 1000), max_deliveries=100, block_ms=2000, batch=1,
                            marker_ttl_s=30 * 86_400)
        c = Consumer(r, rb, url, keys, keys.study_runs, GROUP_STUDY, name, settings)
        await one_at_a_time(c, lambda d: handle_one(r, url, keys, d, study_dir, name, stop), stop)
    finally:
        with anyio.CancelScope(shield=True):
            await r.aclose()
            await rb.aclose()


@click.command("worker")
@click.argument("study")
@click.option("-n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option("--slot", type=int, default=None, help="Run one worker with this slot (consumer name host-study-SLOT).")
@click.option("--redis-url", envvar="JET_REDIS_URL", default=None, help="The study's Redis (default: $JET_REDIS_URL).")
@click.option("--dir", "study_dir", default=None, help="Folder of this study's runs here (default studies/STUDY).")
def cli(study, n, slot, redis_url, study_dir) -> None:
    """Execute STUDY's runs (each an ordinary `jet up`), one at a time per process."""
    from jet.cliopts import resolve_url
    from jet.workers.processes import run_until_signal, supervise

    url = resolve_url(redis_url)
    folder = Path(study_dir or Path("studies") / study)
    if slot is None and n > 1:
        import sys

        base = [sys.executable, "-m", "jet.study.worker", study, "--redis-url", url, "--dir", str(folder)]
        raise SystemExit(supervise(lambda i: base + ["--slot", str(i)], n))

    async def main(stop: anyio.Event) -> None:
        await serve(url, study, slot or 0, folder, stop)

    run_until_signal(main)


if __name__ == "__main__":
    from jet.cli import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
