"""Jet's roles started by hand, each in a folder of its own, as on separate machines: the chaos runs' launcher.

What it is: `Swarm(root, config, url)` starts the roles with the `jet` commands
a deployment runs (`jet feed`, `jet worker env`, `jet worker infer`, `jet
train`), each with its own working folder under `root` (`root/<role>/`, where
its log goes too) and the Redis URL in `JET_REDIS_URL`; the run folder
(`runs_dir`) is the one shared folder, as the trainer and inference nodes share
it in a deployment. `Server(root, port)` is `jet server` in its folder, which a
test stops (SIGTERM: the AOF is flushed) and starts again on the same port.
`write_config` writes the demo's config for a model folder; `ledger_report`
checks the trainer's ledger against `traj:<model>` the way
`scripts/compose_check.py` does and counts the outcomes. `chaos_run` puts it
together: a run of the demo with the trainer SIGKILLed at given steps and,
with `faults`, Redis behind a `tests.faultproxy.FaultProxy` and the network
faults of `NETWORK` (`network_fault`) at theirs; `scripts/restart-bench.py`
runs it from the command line.

What it is not: a supervisor. A role that exits stays down until the test
starts it again, so what a role does on its own (reconnect, or exit) shows.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import yaml

from jet.config import load_file
from jet.keys import Keys
from jet.queues.connect import connect
from jet.runs import RunDir, read_metrics
from jet.trainer.checkpoint import Checkpoints
from tests.faultproxy import FaultProxy

JET = str(Path(sys.executable).parent / "jet")
COMMANDS = {"feed": ["feed", "--every", "0.5"], "env": ["worker", "env"], "infer": ["worker", "infer"],
            "train": ["train"]}
MODEL = "tiny"
LEASE_S = 3.0  # queues.lease_ms of write_config


def write_config(path: Path, run: str, model_dir: Path, runs_dir: Path, *, steps: int, **trainer) -> Path:
    """The demo's config (jet/configs/default.yaml: the guess task, 4 groups of 4 a step, max_staleness 2,
    checkpoint every 10) for `model_dir`, with short leases (LEASE_S) so a blackhole of seconds outlasts them."""
    data = {
        "run": run, "runs_dir": str(runs_dir),
        "queues": {"lease_ms": int(LEASE_S * 1000), "block_ms": 500, "max_deliveries": 8},
        "models": [{"name": MODEL, "path": str(model_dir), "max_inflight": 16, "threads": 1}],
        "tasks": [{"name": "guess", "workflow": "jet.tasks.guess:workflow", "dataset": "guess", "group_size": 4,
                   "episode_timeout_s": 30, "max_retries": 2, "concurrency": 8, "model": MODEL}],
        "trainer": {"lr": 2e-3, "batch_groups": 4, "micro_batch_tokens": 2048, "max_staleness": 2,
                    "publish_every": 1, "checkpoint_every": 10, "steps": steps, "min_group_size": 2,
                    "group_timeout_s": 120, "lease_s": 60, "threads": 1, "keep_weights": 3, **trainer},
    }
    path.write_text(yaml.safe_dump(data))
    load_file(path)  # validate
    return path


class Server:
    """`jet server` in `root/redis/`, on a fixed port so a restart keeps the URL."""

    def __init__(self, root: Path, port: int):
        self.dir, self.port = root / "redis", port
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Server:
        with open(self.dir / "server.log", "ab") as log:  # the child keeps its own copy of the file
            self.proc = subprocess.Popen([JET, "server", "--run-dir", ".", "--port", str(self.port)], cwd=self.dir,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(self.answers, 30, what="jet server to answer")
        return self

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """SIGTERM: Valkey flushes and fsyncs its AOF, then exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)

    def restart(self) -> None:
        self.stop()
        self.start()
        self.restarts += 1


class Swarm:
    """Role processes of one run, each in `root/<role>/` with its log there."""

    def __init__(self, root: Path, config: Path, url: str):
        self.root, self.config, self.url = root, config, url
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, role: str, *args: str) -> subprocess.Popen:
        folder = self.root / role
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "JET_REDIS_URL": self.url, "OMP_NUM_THREADS": "1", "JET_LOG_LEVEL": "INFO"}
        with open(folder / f"{role}.log", "ab") as log:
            proc = subprocess.Popen([JET, *COMMANDS[role], "--config", str(self.config), *args], cwd=folder,
                                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[role] = proc
        return proc

    def kill(self, role: str, sig: int = signal.SIGKILL) -> int:
        proc = self.procs[role]
        proc.send_signal(sig)
        return proc.wait(60)

    def alive(self, role: str) -> bool:
        return self.procs[role].poll() is None

    def check_alive(self) -> None:
        """Fail naming the role (and its log's tail) that exited on its own."""
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{role} exited with {proc.returncode}:\n{self.log(role)}")

    def log(self, role: str, chars: int | None = 3000) -> str:
        path = self.root / role / f"{role}.log"
        text = path.read_text(errors="replace") if path.is_file() else ""
        return text[-chars:] if chars else text

    def stop_all(self, timeout: float = 60) -> None:
        """SIGTERM every role (they drain), SIGKILL what is still there after `timeout`."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_until(predicate, timeout: float, *, what: str, swarm: Swarm | None = None, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if swarm is not None:
            swarm.check_alive()
        if time.monotonic() > deadline:
            logs = "".join(f"\n--- {r}\n{swarm.log(r)}" for r in swarm.procs) if swarm else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{logs}")
        time.sleep(every)


def trainer_step(cfg) -> int:
    """The trainer's newest step in its metrics file (0 before the first)."""
    return max((r["step"] for r in read_metrics(RunDir.of(cfg).metrics(MODEL))), default=0)


async def _stream(url: str, key: str, dead: str) -> tuple[int, set[str], int]:
    """(entries ever added to `key`, the ids still in it, entries of the dead stream `dead`)."""
    r = await connect(url)
    try:
        info = await r.xinfo_stream(key)
        added = int(info.get(b"entries-added", info.get("entries-added", 0)))
        return added, {i.decode() for i, _ in await r.xrange(key)}, await r.xlen(dead)
    finally:
        await r.aclose()


def ledger_report(cfg, url: str) -> dict:
    """The ledger of the surviving lineage against `traj:<model>`: each entry decided once, each trajectory
    trained once, every entry ever added decided or still in the stream; with the outcome counts."""
    decided = Checkpoints(RunDir.of(cfg).trainer(MODEL)).consumed()
    keys = Keys(cfg.run)
    added, left, dead = anyio.run(_stream, url, keys.traj(MODEL), keys.dead)
    entries = Counter(c["entry"] for c in decided)
    trained = Counter(c["msg"] for c in decided if c["outcome"] == "trained")
    outcomes = Counter(c["outcome"] for c in decided)
    return {
        "added": added, "decided": len(decided), "left_in_stream": len(left - set(entries)),
        "decided_twice": sorted(e for e, n in entries.items() if n > 1),
        "trained_twice": sorted(m for m, n in trained.items() if n > 1),
        "lost": added - len(set(entries) | left),
        "outcomes": dict(outcomes), "dead": dead,
        "stale_fraction": outcomes["stale"] / max(1, len(decided)),
    }


# The network faults of a chaos run, at the trainer's steps: three cuts of every connection, a latency
# spike of 1.5 s for 3 s, a blackhole of twice the lease, a restart of Redis under the running roles.
NETWORK = [(2, "cut"), (3, "latency"), (6, "cut"), (7, "blackhole"), (9, "restart"), (10, "cut")]


def network_fault(what: str, server: Server, proxy) -> None:
    """Do one of NETWORK's faults (`chaos_run`'s `faults`)."""
    if what == "cut":  # the roles may still be reconnecting from the fault before
        wait_until(lambda: proxy.open_connections > 0, 60, what="a connection to cut")
        assert proxy.cut() > 0, "a cut with no connection open cut nothing"
    elif what == "latency":
        proxy.latency(1.5)
        time.sleep(3)
        proxy.latency(0)
    elif what == "blackhole":
        proxy.hold(2 * LEASE_S)
    elif what == "restart":
        server.restart()
    else:
        raise ValueError(f"unknown fault {what!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chaos_run(root: Path, model_dir: Path, *, steps: int, events: list[tuple[int, str]], faults=None,
              env_procs: int = 2, timeout: float = 600, **trainer) -> dict:
    """Train `steps` steps of the demo with every role started by hand in `root/<role>/`, doing each of
    `events` ((trainer step, what)) once the trainer has reached that step: `kill` SIGKILLs the trainer
    and starts it again; any other name is `faults(name, server, proxy)`'s (network faults: Redis is then
    behind a `tests.faultproxy.FaultProxy`). Returns the ledger's report (`ledger_report`) with the wall
    time, the faults done, the trainer's exit codes and the steps it trained twice."""
    t0 = time.monotonic()
    server = Server(root, free_port()).start()
    done: list[tuple[int, str, float]] = []
    kills: list[tuple[int, int]] = []  # (the trainer's step at a SIGKILL, the pid of its restart)
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)
        proxy = stack.enter_context(FaultProxy.to(server.url)) if faults else None
        url = proxy.url_for(server.url) if proxy else server.url
        config = write_config(root / "config.yaml", f"chaos{os.getpid()}", model_dir, root / "runs", steps=steps,
                              **trainer)
        cfg = load_file(config)
        swarm = Swarm(root, config, url)
        stack.callback(swarm.stop_all)
        for role, args in (("infer", ()), ("env", ("-n", str(env_procs))), ("feed", ()), ("train", ())):
            swarm.start(role, *args)
        for step, what in sorted(events, key=lambda e: e[0]):
            wait_until(lambda step=step: trainer_step(cfg) >= step, timeout - (time.monotonic() - t0),
                       what=f"trainer step {step} (for {what})", swarm=swarm)
            at = trainer_step(cfg)
            if what == "kill":
                assert swarm.kill("train") == -signal.SIGKILL
                kills.append((at, swarm.start("train").pid))
            else:
                faults(what, server, proxy)
            done.append((at, what, round(time.monotonic() - t0, 1)))
        trainer = swarm.procs["train"]
        wait_until(lambda: trainer.poll() is not None, timeout - (time.monotonic() - t0), what="the trainer's end",
                   swarm=None)
        train_exit = trainer.returncode
        exited = {r: p.returncode for r, p in swarm.procs.items() if r != "train" and p.poll() is not None}
        swarm.stop_all()
        report = ledger_report(cfg, server.url)
        text = swarm.log("train", None)
        resumed = [re.search(rf"\[{pid}\]: resumed \S+ from .*\(step (\d+), version \d+\)", text) for _, pid in kills]
        rows = read_metrics(RunDir.of(cfg).metrics(MODEL))
        report.update(wall_s=round(time.monotonic() - t0, 1), events=done, train_exit=train_exit, exited=exited,
                      steps=trainer_step(cfg), proxy=dict(proxy.stats) if proxy else {},
                      steps_redone=sum(k - int(r.group(1) if r else 0) for (k, _), r in zip(kills, resumed)),
                      staleness_max=max((r["policy/staleness_max"] for r in rows), default=0),
                      # entries whose lease ran out in the blackhole and were taken over (the work ran twice)
                      leases_lost=sum(swarm.log(r, None).count("lease lost on") for r in swarm.procs),
                      logs={r: swarm.log(r, 1500) for r in swarm.procs} if train_exit else {})
        return report
