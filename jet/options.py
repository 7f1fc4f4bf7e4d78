"""Options and helpers every command shares, the roles' own (`jet worker env`, `jet train`, ...) and the
CLI's (`jet/cli`): where Redis is, which run, the config, logging, lazy groups. Core, not CLI: a role's
entry point imports it without importing the CLI above it.

The Redis URL comes from `--redis-url`, else $JET_REDIS_URL, else the embedded
server started from the run directory (`.jet/server.json`, see
jet.queues.server). The run name from `--run`, else $JET_RUN, else the `run` of
`--config` (else $JET_CONFIG), else "default": every command that takes `--run`
takes `--config` too (`resolve_run`), so an operator who exported JET_CONFIG as
the deployment guide says sees the config's run, not an empty "default".
Nothing here imports redis or torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Awaitable, Callable, Iterable

import click

from jet.errors import JetError

DEFAULT_RUN = "default"

redis_url_option = click.option(
    "--redis-url", envvar="JET_REDIS_URL", default=None,
    help="Redis URL (redis://, rediss://, user:password@). Default: $JET_REDIS_URL, else the local `jet server`. "
         "While it is unreachable a long-running role waits with backoff (up to 30 s between tries) and goes on "
         "once it answers; a one-shot command exits 1 (docs/configuration.md, 'When Redis is unreachable').")
run_option = click.option("--run", envvar="JET_RUN", default=None,
                          help="Run name (the key namespace). Default: $JET_RUN, the run of --config "
                               "($JET_CONFIG), or 'default'.")
run_config_option = click.option(
    "--config", "config_path", envvar="JET_CONFIG", default=None, type=click.Path(exists=True, dir_okay=False),
    help="A config whose `run` is the default run (default: $JET_CONFIG).")
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


def resolve_run(run: str | None, config_path: str | None, default: str | None = DEFAULT_RUN) -> str | None:
    """The run a `--run` command acts on: `run` (--run or $JET_RUN), else the config's `run`, else `default`."""
    if run:
        return run
    return load_config(config_path).run if config_path else default


def load_config(path: str, overrides: tuple[str, ...] | list[str] = ()):
    """The JetConfig at `path` with `overrides`; a bad one is a one-line CLI error naming the key."""
    from jet.config import load_file
    from jet.errors import ConfigError

    try:
        return load_file(path, overrides)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


def require_models(cfg, path: str, names: Iterable[str] | None = None):
    """The config with each model named (every model when None) at its local folder (a Hub id resolved,
    `jet.config.check_models`), else a one-line CLI error naming `models[i].path`: a role that loads a
    model calls this first and loads what it returns, so a wrong path is not a traceback from transformers."""
    from jet.config import check_models
    from jet.errors import ConfigError

    try:
        return check_models(cfg, names)
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


class LazyGroup(click.Group):
    """A click group whose subcommands are `module:attribute` strings, imported on use."""

    def __init__(self, *args, lazy: dict[str, tuple[str, ...]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})  # name -> (import path, one-line help[, the extra it needs])

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            path, _, *extra = self.lazy[name]
            if extra:
                from jet.extras import MissingExtra, require

                try:
                    require(extra[0], f"{ctx.command_path} {name}")
                except MissingExtra as e:
                    raise click.ClickException(str(e)) from None
            module, attr = path.split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter):
        # Help text from the table, so listing commands imports nothing.
        rows = [(n, self.lazy[n][1]) for n in sorted(self.lazy)]
        rows += [(n, c.get_short_help_str()) for n, c in sorted(self.commands.items())]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(sorted(rows))


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
