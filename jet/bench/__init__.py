"""Benchmarks (`jet bench ...`): each prints ratios against a baseline measured in the same run."""

from __future__ import annotations

from typing import Any, Callable


def emit(report: dict, as_json: bool, table: Callable[[dict], Any], min_width: int = 120) -> None:
    """Print `report` as indented JSON, or `table(report)` (a rich renderable) at least `min_width` wide."""
    import click

    if as_json:
        import orjson

        click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    from rich.console import Console

    console = Console()
    console.width = max(console.width, min_width)
    console.print(table(report))
