"""Benchmarks (`jet bench ...`): each prints ratios against a baseline measured in the same run."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import click

redis_url_option = click.option(
    "--redis-url", envvar="JET_REDIS_URL", default=None,
    help="Server to use. Default: $JET_REDIS_URL, else a fresh embedded one (AOF on) in a temp dir.")


@contextmanager
def server_url(redis_url: str | None, folder: Path) -> Iterator[str]:
    """`redis_url`, or the URL of an embedded server started in `folder` and stopped on exit."""
    if redis_url:
        yield redis_url
        return
    from jet.queues.server import EmbeddedServer

    with EmbeddedServer(folder) as server:
        yield server.url


def progress(quiet: bool) -> Callable[[str], None]:
    """A `say(line)` that prints to stderr with the seconds since now, or nothing when `quiet` (--json)."""
    t0 = time.monotonic()
    return (lambda s: None) if quiet else (lambda s: click.echo(f"[{time.monotonic() - t0:5.1f}s] {s}", err=True))


def emit(report: dict, as_json: bool, table: Callable[[dict], Any], min_width: int = 120) -> None:
    """Print `report` as indented JSON, or `table(report)` (a rich renderable) at least `min_width` wide."""
    if as_json:
        import orjson

        click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    from rich.console import Console

    console = Console()
    console.width = max(console.width, min_width)
    console.print(table(report))
