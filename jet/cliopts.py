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


def config_options(reads: str):
    """`--config` (default configs/default.yaml, or $JET_CONFIG) and repeatable `--set KEY=VALUE`;
    `reads` names the sections the command uses, for the help text."""
    def decorate(f):
        f = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value.")(f)
        return click.option("--config", "config_path", default="configs/default.yaml", show_default=True,
                            envvar="JET_CONFIG", type=click.Path(dir_okay=False),
                            help=f"Experiment config ({reads}).")(f)
    return decorate


def load_config(path: str, overrides: tuple[str, ...] | list[str] = ()):
    """The JetConfig at `path` with `overrides`; a bad one is a one-line CLI error naming the key."""
    from jet.config import load_file
    from jet.errors import ConfigError

    try:
        return load_file(path, overrides)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


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
