"""`jet status` and `jet dlq`: what is in the streams of a run, and the dead letters.

Rendering only; the queries are jet.queues.admin's.
"""

from __future__ import annotations

import time

import click
import orjson

from jet.cli.options import redis_url_option, resolve_url, run_dir_option, run_jet, run_option
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


def render(reports: list[dict]):
    from rich.table import Table

    table = Table(title="jet status", show_lines=False)
    for col in ("run", "stream", "length", "group", "pending", "lag", "consumers (pending, idle)"):
        table.add_column(col)
    for rep in reports:
        for s in rep["streams"]:
            groups = s["groups"] or [None]
            for g in groups:
                cons = ", ".join(f"{c['name']} ({c['pending']}, {c['idle_ms'] / 1000:.1f}s)"
                                 for c in (g["consumers"] if g else []))
                table.add_row(rep["run"], s["name"], str(s["length"]), g["name"] if g else "-",
                              str(g["pending"]) if g else "-", str(g["lag"]) if g else "-", cons or "-")
        stats = ", ".join(f"{k}={v}" for k, v in sorted(rep["stats"].items()))
        table.add_row(rep["run"], "[b]dead letters[/b]", str(rep["dead"]), "", "", "", stats)
        if rep["stats"].get("no_llm_calls"):  # episodes that trained nothing: say so, with the likely cause
            table.add_row(rep["run"], "[b yellow]episodes with no LLM call[/b yellow]", str(rep["stats"]["no_llm_calls"]),
                          "", "", "", "they train nothing: the workflow called no model through its session "
                          "(another endpoint, or none)")
    return table


@click.command("status")
@run_option
@redis_url_option
@run_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Refresh every SECONDS.")
def cli(run, redis_url, run_dir, as_json, watch):
    """Per stream: length, pending, lag, consumers and their idle time, dead letters."""
    url = resolve_url(redis_url, run_dir)
    if as_json:
        while True:
            click.echo(orjson.dumps(run_jet(_reports, url, run)).decode())
            if not watch:
                return
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
    for deco in (run_dir_option, redis_url_option, run_option,
                 click.option("--stream", default=None, help="Only dead letters from this stream (e.g. tasks:guess)."),
                 click.option("--limit", type=int, default=1000, show_default=True)):
        f = deco(f)
    return f


@dlq.command("list")
@_common
@click.option("--json", "as_json", is_flag=True)
def dlq_list(run, redis_url, run_dir, stream, limit, as_json):
    """Show dead letters: where from, why, how many deliveries."""
    rows = run_jet(_dlq, "list", resolve_url(redis_url, run_dir), run or "default", (), False, stream, limit)
    if as_json:
        click.echo(orjson.dumps(rows).decode())
        return
    for row in rows:
        click.echo(f"{row['id']}  {row.get('stream', '?')}  {row.get('kind', '?')}  "
                   f"deliveries={row.get('deliveries', '?')}  {row.get('reason', '')}")
    click.echo(f"{len(rows)} dead letter(s)")


def _change(op: str, done: str):
    """`jet dlq requeue` / `jet dlq drop`: the same arguments, one operation each."""

    @_common
    @click.argument("ids", nargs=-1)
    @click.option("--all", "all_", is_flag=True, help="Every dead letter (of --stream, if given).")
    def command(run, redis_url, run_dir, stream, limit, ids, all_):
        if bool(ids) == bool(all_):
            raise click.UsageError("give dead-letter ids or --all (not both)")
        n = run_jet(_dlq, op, resolve_url(redis_url, run_dir), run or "default", ids, all_, stream, limit)
        click.echo(f"{done} {n} dead letter(s)")

    return command


dlq.command("requeue", help="Put dead letters back on the stream they came from.")(_change("requeue", "requeued"))
dlq.command("drop", help="Delete dead letters for good.")(_change("drop", "dropped"))
