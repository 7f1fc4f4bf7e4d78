"""Options and helpers shared by `jet` subcommands: where Redis is, which run.

The Redis URL comes from `--redis-url`, else $JET_REDIS_URL, else the embedded
server started from the run directory (`.jet/server.json`, see
jet.queues.server). The run name from `--run`, else $JET_RUN, else `--config`'s
`run`, else "default". Nothing here imports redis or torch.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import click

from jet.errors import JetError

DEFAULT_RUN = "default"

redis_url_option = click.option(
    "--redis-url", envvar="JET_REDIS_URL", default=None,
    help="Redis URL (redis://, rediss://, user:password@). Default: $JET_REDIS_URL, else the local `jet server`.")
run_option = click.option("--run", envvar="JET_RUN", default=None,
                          help="Run name (the key namespace). Default: $JET_RUN, the config's run, or 'default'.")
run_dir_option = click.option("--run-dir", default=".jet", show_default=True,
                              help="Where the embedded server keeps its data and server.json.")


def resolve_url(url: str | None, run_dir: str = ".jet") -> str:
    if url:
        return url
    from jet.queues.server import discovered_url

    found = discovered_url(run_dir)
    if not found:
        raise click.UsageError(
            "no Redis: pass --redis-url, set JET_REDIS_URL, or start one with `jet server` (or use `jet up`)")
    return found


def run_jet(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run an async command body; JetErrors become a clean one-line CLI error."""
    import anyio

    try:
        return anyio.run(fn, *args)
    except JetError as e:
        raise click.ClickException(str(e)) from None
