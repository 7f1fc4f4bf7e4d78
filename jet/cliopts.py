"""Options and helpers shared by `jet` subcommands: where Redis is, which run.

The Redis URL comes from `--redis-url`, else $JET_REDIS_URL, else the embedded
server started from the run directory (`.jet/server.json`, see
jet.queues.server). The run name from `--run`, else $JET_RUN, else `--config`'s
`run`, else "default". Nothing here imports redis or torch.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable

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


def default_config() -> str:
    """The config `--config` reads when not given: the one shipped in the package (any folder works)."""
    from jet.config import default_config_path

    return str(default_config_path())


def config_options(reads: str):
    """`--config` (default: $JET_CONFIG, else the packaged default config) and repeatable `--set KEY=VALUE`;
    `reads` names the sections the command uses, for the help text."""
    def decorate(f):
        f = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value.")(f)
        return click.option("--config", "config_path", default=default_config, envvar="JET_CONFIG",
                            show_default="packaged jet/configs/default.yaml", type=click.Path(dir_okay=False),
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


def require_models(cfg, path: str, names: Iterable[str] | None = None) -> None:
    """Each model named (every model when None) has a model directory at its path, else a one-line CLI
    error naming `models[i].path`: a role that loads a model calls this first, so a wrong path is not a
    traceback from transformers."""
    from jet.config import check_models
    from jet.errors import ConfigError

    try:
        check_models(cfg, names)
    except ConfigError as e:
        raise click.ClickException(f"{path}: {e}") from None


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
