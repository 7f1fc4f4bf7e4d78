"""Benchmarks (`jet bench ...`): each prints ratios against a baseline measured in the same run."""

from __future__ import annotations

import sys
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


def write_json(path: Path, data: Any) -> None:
    """Whole or not at all (temp file + rename): a crash while writing leaves no half file for a later
    `--resume` to trust."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


_report_out = None  # the real stdout, once `json_stdout` has moved sys.stdout to stderr


def json_stdout(as_json: bool) -> None:
    """With --json, keep stdout for the report alone: whatever else prints to sys.stdout from now on (a
    library's banner: DeepSpeed's accelerator detection, imported by transformers when accelerate is
    installed, logs to stdout) goes to stderr; `emit` writes the report to the real stdout."""
    global _report_out
    if not as_json or _report_out is not None:
        return
    _report_out, sys.stdout = sys.stdout, sys.stderr
    ctx = click.get_current_context(silent=True)
    if ctx is not None:  # the command's end puts stdout back (in-process callers: tests, CliRunner)
        ctx.call_on_close(_restore_stdout)


def _restore_stdout() -> None:
    global _report_out
    if _report_out is not None:
        sys.stdout, _report_out = _report_out, None


def progress(quiet: bool) -> Callable[[str], None]:
    """A `say(line)` that prints to stderr with the seconds since now, or nothing when `quiet` (--json,
    which also keeps stdout for the report: `json_stdout`)."""
    json_stdout(quiet)
    t0 = time.monotonic()
    return (lambda s: None) if quiet else (lambda s: click.echo(f"[{time.monotonic() - t0:5.1f}s] {s}", err=True))


def emit(report: dict, as_json: bool, table: Callable[[dict], Any], min_width: int = 120) -> None:
    """Print `report` as indented JSON, or `table(report)` (a rich renderable) at least `min_width` wide."""
    if as_json:
        import orjson

        click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode(), file=_report_out or sys.stdout)
        return
    from rich.console import Console

    console = Console()
    console.width = max(console.width, min_width)
    console.print(table(report))
