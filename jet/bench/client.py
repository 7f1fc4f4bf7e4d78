"""`jet bench client`: resident memory of one env worker process, idle and with episodes in flight.

What it is: for each interpreter given (this one by default; `--baseline-python` adds another, for
example a venv of an older checkout, measured in the same run), and for each task measured (`guess`:
agent code on `jet.llm`; `arith`: plain OpenAI-SDK agent code through the worker's embedded gateway):

1. a fresh embedded server and a tiny model folder (its tokenizer is all an env worker loads);
2. one env worker, `<python> -P -m jet.workers.rollout.worker --task T` with `tasks[].concurrency = inflight`,
   and no inference worker, so every episode's first LLM call waits for a reply that never comes:
   exactly `inflight` episodes stay in flight, whatever the machine's speed;
3. `idle`: its memory once its consumer has joined the task group (tokenizer loaded, nothing to do);
4. `in flight`: `2 x inflight` tasks are enqueued; once `inflight` generation requests are on
   `gen:<model>`, the largest of a few samples a little apart;
5. SIGTERM, and the next.

Memory is read from /proc: RSS (VmRSS: what `ps` and the goal count) and USS (private pages, from
smaps_rollup: what each further process adds, since library pages are shared). `fit_4gb` is how
many such processes fit in 4 GiB by RSS (conservative) and by USS. Printed ratios: the baseline's
RSS over this interpreter's. Linux only (/proc); nothing is asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import click

from jet.bench import emit, progress

MODEL = "tiny"
GIB4 = 4 * 1024  # MiB


def memory(pid: int) -> dict:
    """RSS and USS of `pid` in MiB, from /proc."""
    out = {"rss_mb": 0.0, "uss_mb": 0.0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mb"] = int(line.split()[1]) / 1024
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            private = sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:")))
        out["uss_mb"] = private / 1024
    except OSError:
        out["uss_mb"] = float("nan")
    return out


def _config(folder: Path, task: str, inflight: int) -> Path:
    import yaml

    dataset = {"guess": "guess", "arith": "arith"}[task]
    cfg = {"run": "bench-client", "runs_dir": str(folder / "runs"),
           "models": [{"name": MODEL, "path": str(folder / "model")}],
           "tasks": [{"name": task, "workflow": f"jet.tasks.{task}:workflow", "dataset": dataset, "model": MODEL,
                      "group_size": 2, "concurrency": inflight, "episode_timeout_s": 600}]}
    path = folder / f"{task}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def _wait(what: str, check, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise click.ClickException(f"the env worker exited ({proc.returncode}) while waiting for {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise click.ClickException(f"timed out after {timeout:.0f}s waiting for {what}")
        await anyio.sleep(0.2)


async def measure(python: str, task: str, inflight: int, folder: Path, url: str, log: Path, say) -> dict:
    """Idle and in-flight memory of one env worker under `python` (see the module docstring)."""
    from jet.workers.feeder.tasks import enqueue, tasks_for
    from jet.keys import Keys
    from jet.queues.connect import connect
    from jet.tasks import dataset

    keys = Keys("bench-client")
    config = _config(folder, task, inflight)
    env = {**os.environ, "JET_REDIS_URL": url, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([python, "-P", "-m", "jet.workers.rollout.worker", "--config", str(config), "--task", task,
                                 "--drain-timeout", "1"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder)
    r = await connect(url)
    try:
        async def joined() -> bool:
            try:
                return any(c["consumers"] for c in await r.xinfo_groups(keys.tasks(task)))
            except Exception:  # the stream does not exist yet
                return False

        await _wait("the env worker to join its group", joined, 120, proc, log)
        say("  joined its group")
        await anyio.sleep(1.0)
        idle = memory(proc.pid)
        await enqueue(url, "bench-client", task, tasks_for(task, dataset(task, inflight), 2), 10_000)

        async def waiting() -> bool:
            return await r.xlen(keys.gen(MODEL)) >= inflight

        await _wait(f"{inflight} generation requests", waiting, 300, proc, log)
        say(f"  {inflight} generation requests waiting")
        samples = []
        for _ in range(5):
            await anyio.sleep(0.4)
            samples.append(memory(proc.pid))
        busy = max(samples, key=lambda m: m["rss_mb"])
        busy["gen_requests"] = await r.xlen(keys.gen(MODEL))
    finally:
        await r.aclose()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    fit = {"by_rss": int(GIB4 // busy["rss_mb"]), "by_uss": int(GIB4 // busy["uss_mb"]) if busy["uss_mb"] else None}
    return {"idle": idle, "in_flight": busy, "fit_4gb": fit}


def imports_torch(python: str) -> bool:
    """Whether an env worker under `python` has torch importable at all (a client install has not)."""
    return subprocess.run([python, "-P", "-c", "import torch"], capture_output=True).returncode == 0


def run(pythons: dict[str, str], tasks: list[str], inflight: int, say) -> dict:
    from jet.models import init_model
    from jet.queues.server import EmbeddedServer

    report = {"inflight": inflight, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="jet-bench-client-") as tmp:
        folder = Path(tmp)
        init_model(folder / "model", vocab_size=512, hidden_size=32, layers=2, heads=4, kv_heads=2, seed=0)
        for label, python in pythons.items():
            for task in tasks:
                say(f"{label}: {task}, {inflight} episodes in flight")
                with EmbeddedServer(folder / f"redis-{label}-{task}") as server:
                    result = anyio.run(measure, python, task, inflight, folder, server.url,
                                       folder / f"{label}-{task}.log", say)
                result["torch_importable"] = imports_torch(python)
                report["runs"].setdefault(label, {})[task] = result
                say(f"  idle {result['idle']['rss_mb']:.0f} MB, in flight {result['in_flight']['rss_mb']:.0f} MB RSS")
    if "baseline" in report["runs"]:
        report["ratios"] = {task: {
            "idle_rss_baseline_over_this": report["runs"]["baseline"][task]["idle"]["rss_mb"]
            / report["runs"]["this"][task]["idle"]["rss_mb"],
            "in_flight_rss_baseline_over_this": report["runs"]["baseline"][task]["in_flight"]["rss_mb"]
            / report["runs"]["this"][task]["in_flight"]["rss_mb"]} for task in tasks}
    return report


def table(report: dict):
    from rich.table import Table

    t = Table(title=f"env worker memory (MiB), {report['inflight']} episodes in flight")
    for col in ("python", "task", "idle RSS", "idle USS", "in-flight RSS", "in-flight USS", "fit in 4 GiB (RSS/USS)",
                "torch importable"):
        t.add_column(col)
    for label, tasks in report["runs"].items():
        for task, m in tasks.items():
            t.add_row(label, task, f"{m['idle']['rss_mb']:.0f}", f"{m['idle']['uss_mb']:.0f}",
                      f"{m['in_flight']['rss_mb']:.0f}", f"{m['in_flight']['uss_mb']:.0f}",
                      f"{m['fit_4gb']['by_rss']} / {m['fit_4gb']['by_uss']}", str(m["torch_importable"]))
    for task, r in report.get("ratios", {}).items():
        t.add_row("ratio", task, f"{r['idle_rss_baseline_over_this']:.2f}x", "",
                  f"{r['in_flight_rss_baseline_over_this']:.2f}x", "", "baseline / this", "")
    return t


@click.command("client")
@click.option("--inflight", type=click.IntRange(1), default=32, show_default=True, help="Episodes in flight.")
@click.option("--task", "tasks", type=click.Choice(["guess", "arith"]), multiple=True,
              help="Tasks to measure (repeatable; default both).")
@click.option("--python", "python", default=sys.executable, show_default=True,
              help="Interpreter whose env worker is measured (a client install, say).")
@click.option("--baseline-python", default=None, help="Another interpreter measured in the same run (e.g. an "
              "older checkout's venv); the ratios are its RSS over --python's.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def cli(inflight, tasks, python, baseline_python, as_json):
    """Resident memory of one env worker, idle and with episodes in flight."""
    if not Path("/proc/self/status").exists():
        raise click.ClickException("jet bench client reads /proc: Linux only")
    pythons = {"this": python, **({"baseline": baseline_python} if baseline_python else {})}
    report = run(pythons, list(tasks) or ["guess", "arith"], inflight, progress(as_json))
    emit(report, as_json, table)
