"""`jet enqueue`: dataset rows -> Task messages on `tasks:<task>`.

Each row becomes `group_size` Tasks sharing a fresh `group_id` (one GRPO
group). Rows come from a JSONL file (one JSON object a line) or a built-in
dataset (`jet.tasks.dataset`). Writes go through the bounded `Producer`
with dedup markers, so a full stream makes enqueue wait (never drop) and a
retried batch never adds a task twice.

Invariant: a file is validated whole before anything is written: every
non-blank line must be a JSON object whose task entry fits the entry limit
(`queues.max_entry_bytes`); the first that does not is an error naming the
file, the line and why, and the stream is left untouched. What was written is
said exactly: tasks, rows, group size and stream (and, when Redis fails
midway, how many went in before it did).
"""

from __future__ import annotations

import contextlib
import sys

import click

from jet.options import DEFAULT_RUN, load_config, redis_url_option, resolve_url, run_dir_option, run_option
from jet.errors import ConfigError, JetError
from jet.keys import Keys, check_name
from jet.workers.feeder.tasks import encode_rows, write

def _rows(file: str | None, dataset: str | None, n: int | None, seed: int) -> tuple[list[tuple[str, dict]], int, str]:
    """Every row (with where it comes from: a file is checked whole), how many to take, and where from."""
    if file:
        from jet.rows import numbered

        rows = list(numbered(file))
        if not rows:
            raise ConfigError(f"{file}: no rows")
        taken = min(n, len(rows)) if n else len(rows)
        return rows, taken, f"from {file}" + (f" (first {taken} of {len(rows)} rows)" if taken < len(rows) else "")
    from jet.tasks import dataset as builtin

    rows = builtin(dataset, n=n or 100, seed=seed)
    return [(f"dataset {dataset!r} row {i}", r) for i, r in enumerate(rows)], len(rows), f"from dataset {dataset!r}"


@click.command("enqueue")
@click.argument("task")
@click.option("--file", "file", type=click.Path(exists=True, dir_okay=False), help="A .jsonl, .parquet or .csv file.")
@click.option("--dataset", help="A built-in dataset name (e.g. guess, arith), a dataset folder or a Hub dataset "
                                "(owner/name[?config=C&split=S&revision=R]).")
@click.option("-n", "--n", "n", type=int, default=None, help="Rows to take (built-in default 100).")
@click.option("--group-size", type=int, default=None, help="Copies per row sharing a group id (default: config or 4).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of a built-in dataset.")
@click.option("--maxlen", type=int, default=100_000, show_default=True, help="Bound of the tasks stream.")
@click.option("--config", "config_path", envvar="JET_CONFIG", type=click.Path(exists=True, dir_okay=False),
              help="Take run, dataset and group size from this config's task (default: $JET_CONFIG, whose run "
                   "alone is taken when TASK is not one of its tasks).")
@run_option
@redis_url_option
@run_dir_option
@click.pass_context
def cli(ctx, task, file, dataset, n, group_size, seed, maxlen, config_path, run, redis_url, run_dir):
    """Write rows as Task messages to tasks:TASK (group_size copies each)."""
    try:
        check_name("task", task)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="TASK") from None
    cfg = None
    if config_path:
        cfg = load_config(config_path)
        run = run or cfg.run
        if task in [t.name for t in cfg.tasks]:
            tc = cfg.task(task)
            dataset = dataset or (None if file else tc.dataset)
            group_size = group_size or tc.group_size
        elif ctx.get_parameter_source("config_path") != click.core.ParameterSource.ENVIRONMENT:
            raise click.UsageError(f"task {task!r} is not in {config_path}")
    if dataset and not file:
        from jet.rows import kind

        try:
            if kind(dataset) != "builtin":
                file, dataset = dataset, None
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--dataset") from None
    if bool(file) == bool(dataset):
        raise click.UsageError("give exactly one of --file or --dataset (or --config)")
    if group_size is not None and group_size < 1:
        raise click.UsageError("--group-size must be >= 1")
    url = resolve_url(redis_url, run_dir)
    group_size = group_size or 4
    from jet.queues.codec import DEFAULT_MAX_BYTES

    max_bytes = cfg.queues.max_entry_bytes if cfg else DEFAULT_MAX_BYTES
    try:
        rows, taken, source = _rows(file, dataset, n, seed)
        entries = encode_rows(task, rows, group_size, max_bytes, keep=taken)
    except (ConfigError, KeyError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    import anyio

    stream, sent = Keys(run or DEFAULT_RUN).tasks(task), [0]
    # click's bar, not rich's: the base install (a client node, which runs this) has no rich; on a terminal only
    shown = (click.progressbar(length=len(entries), label=f"tasks:{task}", file=sys.stderr)
             if sys.stderr.isatty() else None)
    with shown or contextlib.nullcontext():

        def progress(k: int) -> None:
            sent[0] += k
            if shown is not None:
                shown.update(k)

        try:
            anyio.run(write, url, run or DEFAULT_RUN, task, entries, maxlen, progress)
        except JetError as e:
            raise click.ClickException(f"{e}; {sent[0]} of {len(entries)} tasks had been written to {stream} "
                                       "(the rest were not)") from None
    click.echo(f"enqueued {len(entries)} tasks ({taken} rows x {group_size}) to {stream} {source}")
