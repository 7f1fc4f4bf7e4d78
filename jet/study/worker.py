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
from jet.study.execution import Finished, execute
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
    """One request -> Commit (its result, atomically with the ack) or Release (another attempt)."""
    from jet.queues.messages import Commit, Release

    req = RunRequest.from_payload(delivery.payload)
    while await ledger.get_field(r, url, keys, "paused") and not stop.is_set():
        with anyio.move_on_after(1.0):
            await stop.wait()
    if stop.is_set():
        return Release()  # drained before it started: not a failure of the run
    log.info("run %s (arm %d, seed %d, attempt %d)", req.run, req.trial, req.seed, delivery.deliveries)
    outcome = await execute(req, r, url, keys, study_dir, name, delivery.deliveries, stop)
    if isinstance(outcome, Finished):
        log.info("run %s: %s %s", req.run, outcome.result.status, outcome.result.reason)
        return Commit([(keys.study_results, outcome.result.to_fields())])
    log.info("run %s given back: %s", req.run, outcome.why)
    return Release(outcome.why)


async def serve(url: str, study: str, slot: int | str, study_dir: Path, stop: anyio.Event) -> None:
    from jet.queues.connect import connect, retry_forever
    from jet.queues.consumer import consumer_name
    from jet.queues.runtime import Runtime, Settings

    keys = Keys.for_study(study)
    r = await retry_forever(lambda: connect(url), url=url, what="connect", stop=stop)
    try:
        ws = await settings_of(r, url, keys, stop)
        if ws is None:
            return
        name = consumer_name("study", slot)
        # One run at a time per process, nothing read ahead: a request waits in the stream for whichever
        # worker is free. Deliveries count attempts (drains, reclaims); crashes are counted apart
        # (budget.max_retries), so the dead-letter cap only stops a request that kills its workers.
        settings = Settings(lease_ms=int(ws["lease_s"] * 1000), max_deliveries=100, block_ms=2000, batch=1,
                            marker_ttl_s=30 * 86_400)
        async with Runtime(url, keys, keys.study_runs, GROUP_STUDY, name, settings, stop=stop) as rt:
            await rt.serve_each(lambda d: handle_one(r, url, keys, d, study_dir, name, stop), stop, concurrency=1,
                                drain_timeout_s=ws["stop_grace_s"] + 30)
    finally:
        with anyio.CancelScope(shield=True):
            await r.aclose()


class LocalWorkers:
    """`jet study run`'s own study workers: N supervised processes (restarted when they crash) that
    drain if this process dies (they watch it)."""

    def __init__(self, study: str, url: str, folder: Path, n: int):
        from jet.supervisor import Child, Supervisor, python_module

        argv = lambda i: [*python_module("jet.study.worker"), study, "--redis-url", url,  # noqa: E731
                          "--dir", str(folder), "--slot", str(i)]
        self.sup = Supervisor(lambda bank: [Child(f"study-worker-{i}", argv(i), log=folder / "logs" / f"worker-{i}.log")
                                            for i in range(n)])

    def start(self) -> None:
        self.sup.start()

    def poll(self) -> None:
        self.sup.poll()

    def stop(self, timeout: float) -> None:
        self.sup.stop()
        self.sup.wait(timeout)


@click.command("worker")
@click.argument("study")
@click.option("-n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option("--slot", type=int, default=None, help="Run one worker with this slot (consumer name host-study-SLOT).")
@click.option("--redis-url", envvar="JET_REDIS_URL", default=None, help="The study's Redis (default: $JET_REDIS_URL).")
@click.option("--dir", "study_dir", default=None, help="Folder of this study's runs here (default studies/STUDY).")
def cli(study, n, slot, redis_url, study_dir) -> None:
    """Execute STUDY's runs (each an ordinary `jet up`), one at a time per process."""
    from jet.options import resolve_url
    from jet.supervisor import Child, Supervisor, python_module, run_role

    url = resolve_url(redis_url)
    folder = Path(study_dir or Path("studies") / study)
    if slot is None and n > 1:
        base = [*python_module("jet.study.worker"), study, "--redis-url", url, "--dir", str(folder)]
        raise SystemExit(Supervisor(lambda bank: [Child(f"study-worker-{i}", base + ["--slot", str(i)])
                                                  for i in range(n)]).run())
    run_role(lambda stop: serve(url, study, slot or 0, folder, stop), name="jet study worker")


if __name__ == "__main__":
    from jet.options import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
