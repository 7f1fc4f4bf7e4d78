"""`jet enqueue`: dataset rows -> Task messages on `tasks:<task>`.

Each row becomes `group_size` Tasks sharing a fresh `group_id` (one GRPO
group). Rows come from a JSONL file (one JSON object a line) or a built-in
dataset (`jet.tasks.dataset`). Writes go through the bounded `Producer`
with dedup markers, so a full stream makes enqueue wait (never drop) and a
retried batch never adds a task twice.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import click
import orjson

from jet.cliopts import DEFAULT_RUN, load_config, redis_url_option, resolve_url, run_dir_option, run_jet, run_option
from jet.errors import ConfigError
from jet.keys import Keys, check_name
from jet.wire import Task


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Rows of a JSONL file; a bad line raises ConfigError naming file and line."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
            yield row


def load_rows(file: str | None, dataset: str | None, n: int | None, seed: int) -> list[dict]:
    if file:
        rows = list(read_jsonl(file))
        return rows[:n] if n else rows
    from jet.tasks import dataset as builtin

    return builtin(dataset, n=n or 100, seed=seed)


def tasks_for(task: str, rows: list[dict], group_size: int) -> list[Task]:
    out = []
    for row in rows:
        gid = uuid.uuid4().hex
        out += [Task(task, row, gid, i, group_size) for i in range(group_size)]
    return out


async def enqueue(url: str, run: str, task: str, tasks: list[Task], maxlen: int, progress=None) -> int:
    from jet.queues.connect import connect
    from jet.queues.producer import Producer

    keys = Keys(run)
    r = await connect(url)
    try:
        prod = Producer(r, url, keys, keys.tasks(task), maxlen=maxlen, dedup=True)
        for i in range(0, len(tasks), 500):
            chunk = tasks[i:i + 500]
            await prod.send([t.to_fields() for t in chunk])
            if progress:
                progress(len(chunk))
    finally:
        await r.aclose()
    return len(tasks)


@click.command("enqueue")
@click.argument("task")
@click.option("--file", "file", type=click.Path(exists=True, dir_okay=False), help="JSONL rows.")
@click.option("--dataset", help="A built-in dataset name (e.g. guess, arith).")
@click.option("-n", "--n", "n", type=int, default=None, help="Rows to take (built-in default 100).")
@click.option("--group-size", type=int, default=None, help="Copies per row sharing a group id (default: config or 4).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of a built-in dataset.")
@click.option("--maxlen", type=int, default=100_000, show_default=True, help="Bound of the tasks stream.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="Take run, dataset and group size from this config's task.")
@run_option
@redis_url_option
@run_dir_option
def cli(task, file, dataset, n, group_size, seed, maxlen, config_path, run, redis_url, run_dir):
    """Write rows as Task messages to tasks:TASK (group_size copies each)."""
    try:
        check_name("task", task)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="TASK") from None
    if config_path:
        cfg = load_config(config_path)
        try:
            tc = cfg.task(task)
        except KeyError:
            raise click.UsageError(f"task {task!r} is not in {config_path}") from None
        run = run or cfg.run
        dataset = dataset or (None if file else tc.dataset)
        group_size = group_size or tc.group_size
        if dataset and ("/" in dataset or dataset.endswith(".jsonl")):
            file, dataset = dataset, None
    if bool(file) == bool(dataset):
        raise click.UsageError("give exactly one of --file or --dataset (or --config)")
    if group_size is not None and group_size < 1:
        raise click.UsageError("--group-size must be >= 1")
    url = resolve_url(redis_url, run_dir)
    try:
        rows = load_rows(file, dataset, n, seed)
    except (ConfigError, KeyError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    tasks = tasks_for(task, rows, group_size or 4)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        tid = bar.add_task(f"tasks:{task}", total=len(tasks))
        count = run_jet(enqueue, url, run or DEFAULT_RUN, task, tasks, maxlen,
                        lambda k: bar.advance(tid, k))
    click.echo(f"enqueued {count} tasks ({len(rows)} rows x {group_size or 4}) to "
               f"{Keys(run or DEFAULT_RUN).tasks(task)}")
