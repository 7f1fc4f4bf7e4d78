"""`jet status` and `jet dlq`: what is in the streams of a run, and the dead letters.

Rendering only; the queries are jet.queues.admin's. The table is rich's where rich is installed (the
infer, train and study extras bring it) and aligned plain text in the base install (a client node). Every
command here takes `--run`, else $JET_RUN, else the run of `--config` / $JET_CONFIG (`resolve_run`).
"""

from __future__ import annotations

import time

import click
import orjson

from jet.options import (
    redis_url_option,
    resolve_run,
    resolve_url,
    run_config_option,
    run_dir_option,
    run_jet,
    run_option,
)
from jet.keys import Keys


async def _reports(url: str, run: str | None) -> list[dict]:
    from jet.queues import admin
    from jet.queues.connect import connect

    r = await connect(url)
    try:
        names = [run] if run else await admin.runs(r)
        return [await admin.report(r, Keys(n), url) for n in names]
    finally:
        await r.aclose()


COLUMNS = ("run", "stream", "length", "group", "pending", "lag", "consumers (pending, idle)")


def rows(reports: list[dict]) -> list[tuple[tuple[str, ...], str]]:
    """The table's rows, each (cells, style): style '' for a stream, 'b' / 'b yellow' for a summary row."""
    out = []
    for rep in reports:
        for s in rep["streams"]:
            groups = s["groups"] or [None]
            for g in groups:
                cons = ", ".join(f"{c['name']} ({c['pending']}, {c['idle_ms'] / 1000:.1f}s)"
                                 for c in (g["consumers"] if g else []))
                out.append(((rep["run"], s["name"], str(s["length"]), g["name"] if g else "-",
                             str(g["pending"]) if g else "-", str(g["lag"]) if g else "-", cons or "-"), ""))
        stats = ", ".join(f"{k}={v}" for k, v in sorted(rep["stats"].items()))
        out.append(((rep["run"], "dead letters", str(rep["dead"]), "", "", "", stats), "b"))
        if rep["stats"].get("no_llm_calls"):  # episodes that trained nothing: say so, with the likely cause
            why = "they train nothing: the workflow called no model through its session (another endpoint, or none)"
            out.append(((rep["run"], "episodes with no LLM call", str(rep["stats"]["no_llm_calls"]), "", "", "", why),
                        "b yellow"))
    return out


def render(reports: list[dict]):
    """The table as a rich renderable (the full install)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="jet status", show_lines=False)
    for col in COLUMNS:
        table.add_column(col)
    for cells, style in rows(reports):
        table.add_row(cells[0], Text(cells[1], style=style), *cells[2:])
    return table


def render_plain(reports: list[dict]) -> str:
    """The table as aligned text: the base install (a client node) has no rich."""
    lines = [COLUMNS, *(cells for cells, _ in rows(reports))]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(line, widths)), line[-1]]).rstrip() for line in lines)


def _has_rich() -> bool:
    import importlib.util

    return importlib.util.find_spec("rich") is not None


@click.command("status")
@click.option("--run", envvar="JET_RUN", default=None,
              help="Run name. Default: $JET_RUN, the run of --config ($JET_CONFIG), or every run.")
@run_config_option
@redis_url_option
@run_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Refresh every SECONDS.")
def cli(run, config_path, redis_url, run_dir, as_json, watch):
    """Per stream: length, pending, lag, consumers and their idle time, dead letters."""
    run = resolve_run(run, config_path, default=None)
    url = resolve_url(redis_url, run_dir)
    if as_json:
        while True:
            click.echo(orjson.dumps(run_jet(_reports, url, run)).decode())
            if not watch:
                return
            time.sleep(watch)
    if not _has_rich():
        while True:
            text = render_plain(run_jet(_reports, url, run))
            if not watch:
                click.echo(text)
                return
            click.clear()
            click.echo(text)
            time.sleep(watch)
    from rich.console import Console
    from rich.live import Live

    if not watch:
        Console().print(render(run_jet(_reports, url, run)))
        return
    with Live(render(run_jet(_reports, url, run)), auto_refresh=False) as live:
        try:
            while True:
                time.sleep(watch)
                live.update(render(run_jet(_reports, url, run)), refresh=True)
        except KeyboardInterrupt:
            pass


@click.group("dlq")
def dlq():
    """List, requeue or drop dead letters of a run."""


async def _dlq(op: str, url: str, run: str, ids: tuple[str, ...], all_: bool, stream: str | None, limit: int):
    from jet.queues import admin
    from jet.queues.connect import connect

    keys = Keys(run)
    r = await connect(url)
    try:
        if op == "list" or all_:
            rows = await admin.dead_letters(r, keys, stream=stream, limit=limit, url=url)
            if op == "list":
                return rows
            ids = tuple(row["id"] for row in rows)
        if op == "requeue":
            return await admin.requeue(r, keys, list(ids), url)
        return await admin.drop(r, keys, list(ids), url)
    finally:
        await r.aclose()


def _common(f):
    for deco in (run_dir_option, redis_url_option, run_config_option, run_option,
                 click.option("--stream", default=None, help="Only dead letters from this stream (e.g. tasks:guess)."),
                 click.option("--limit", type=int, default=1000, show_default=True)):
        f = deco(f)
    return f


@dlq.command("list")
@_common
@click.option("--json", "as_json", is_flag=True)
def dlq_list(run, config_path, redis_url, run_dir, stream, limit, as_json):
    """Show dead letters: where from, why, how many deliveries."""
    run = resolve_run(run, config_path)
    rows = run_jet(_dlq, "list", resolve_url(redis_url, run_dir), run, (), False, stream, limit)
    if as_json:
        click.echo(orjson.dumps(rows).decode())
        return
    for row in rows:
        click.echo(f"{row['id']}  {row.get('stream', '?')}  {row.get('kind', '?')}  "
                   f"deliveries={row.get('deliveries', '?')}  {row.get('reason', '')}")
    click.echo(f"{len(rows)} dead letter(s) in run {run!r}")


def _change(op: str, done: str):
    """`jet dlq requeue` / `jet dlq drop`: the same arguments, one operation each."""

    @_common
    @click.argument("ids", nargs=-1)
    @click.option("--all", "all_", is_flag=True, help="Every dead letter (of --stream, if given).")
    def command(run, config_path, redis_url, run_dir, stream, limit, ids, all_):
        if bool(ids) == bool(all_):
            raise click.UsageError("give dead-letter ids or --all (not both)")
        run = resolve_run(run, config_path)
        n = run_jet(_dlq, op, resolve_url(redis_url, run_dir), run, ids, all_, stream, limit)
        click.echo(f"{done} {n} dead letter(s) of run {run!r}")

    return command


dlq.command("requeue", help="Put dead letters back on the stream they came from.")(_change("requeue", "requeued"))
dlq.command("drop", help="Delete dead letters for good.")(_change("drop", "dropped"))
