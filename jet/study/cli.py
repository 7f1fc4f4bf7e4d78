"""`jet study run|resume|status|report|stop|tidy|worker`: the study commands.

`jet study run FILE` carries a study to its end on this machine: it starts
the embedded Redis in the study folder (unless `--redis-url`), `--workers N`
local study workers (default 2; 0 when they run elsewhere), and the runner,
and leaves report.md, results.csv, decisions.jsonl and the plots in
`<studies_dir>/<name>/`. Ctrl-C, SIGTERM or `jet study stop NAME` pauses it
(runs drain and checkpoint); `jet study resume NAME` (or `run` again)
continues where it was. `jet study tidy NAME` deletes what finished runs no
longer need (a worker does it as each run finishes). The resolved study is
kept as `study.json` in the folder, so `resume NAME` needs no file.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import click
import orjson

from jet.options import LazyGroup
from jet.study.messages import KEEP_FILES


def _load(target: str, overrides: tuple[str, ...], studies_dir: str):
    """A Study from a study file, or from the folder of a study started before (NAME)."""
    from jet.errors import ConfigError
    from jet.study.studyfile import apply_override, load_study, parse_study

    try:
        if target.startswith("builtin:"):
            builtin = Path(__file__).parent / "builtin" / f"{target.split(':', 1)[1]}.yaml"
            if not builtin.is_file():
                names = sorted(p.stem for p in builtin.parent.glob("*.yaml") if "\nhypotheses:" in p.read_text())
                raise click.UsageError(f"no built-in study {target!r}; built-in: {', '.join(names)}")
            return load_study(builtin, overrides)
        if Path(target).is_file():
            return load_study(target, overrides)
        saved = Path(studies_dir) / target / "study.json"
        if not saved.is_file():
            raise click.UsageError(f"{target!r} is neither a study file nor a study in {studies_dir}/")
        data = orjson.loads(saved.read_bytes())
        for o in overrides:
            apply_override(data, o)
        return parse_study(data, str(saved))
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


@contextlib.contextmanager
def study_server(folder: Path, url: str | None):
    """The study's Redis: `url`, a live embedded server of the folder, or a new one on its data (AOF)."""
    if url:
        yield url
        return
    from jet.queues.server import EmbeddedServer, discovered_url

    found = discovered_url(folder)
    if found and _answers(found):  # a server.json of a crashed server (a zombie pid) is not a server
        yield found
        return
    server = EmbeddedServer(folder).start()
    try:
        yield server.url
    finally:
        server.stop()


def _answers(url: str) -> bool:
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=2.0):
            return True
    except OSError:
        return False


redis_url_option = click.option("--redis-url", envvar="JET_REDIS_URL", default=None,
                                help="The study's Redis (default: an embedded one in the study folder).")
studies_dir_option = click.option("--studies-dir", default="studies", show_default=True,
                                  help="Where study folders are (for NAME arguments).")


def _run(study, url: str | None, workers: int) -> None:
    import anyio

    from jet.study.runner import Runner
    from jet.study.worker import LocalWorkers
    from jet.supervisor import run_role

    folder = study.folder()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "study.json").write_bytes(orjson.dumps(study.model_dump(mode="json", by_alias=True),
                                                     option=orjson.OPT_INDENT_2))
    with study_server(folder, url) as url:
        click.echo(f"study {study.name}: Redis at {url}; folder {folder}", err=True)
        local = LocalWorkers(study.name, url, folder, workers) if workers else None
        llm = None
        if study.planner.kind == "llm":
            from jet.study.llm_planner import LLMPlanner

            llm = LLMPlanner(study)
        runner = Runner(study, url, folder, llm)
        ended: list[str] = []
        started = time.monotonic()

        async def main(stop: anyio.Event) -> None:
            if local:
                local.start()
            ended.append(await runner.run(stop, say=lambda t: click.echo(t, err=True),
                                          on_tick=local.poll if local else None))

        try:
            run_role(main, name="jet study")
        finally:
            if local:
                local.stop(timeout=study.worker.stop_grace_s + 30)
    click.echo(f"study {study.name}: {ended[0] if ended else 'interrupted'} "
               f"({(time.monotonic() - started) / 60:.1f} min this session); report: {folder / 'report.md'}")


@click.group(cls=LazyGroup, lazy={"worker": ("jet.study.worker:cli", "Execute a study's runs (-n N processes).")})
def study() -> None:
    """Automated, resumable RL studies with paired seeds and honest verdicts."""


@study.command("run")
@click.argument("file")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a study file value.")
@click.option("--workers", type=click.IntRange(min=0), default=2, show_default=True,
              help="Local study workers (0: they run elsewhere, `jet study worker NAME`).")
@redis_url_option
def run_cmd(file, overrides, workers, redis_url) -> None:
    """Run the study in FILE (or builtin:NAME) to its end, or continue it: plan, launch, prune, judge,
    confirm, report."""
    _run(_load(file, overrides, "studies"), redis_url, workers)


@study.command("resume")
@click.argument("target")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a value (e.g. a budget).")
@click.option("--workers", type=click.IntRange(min=0), default=2, show_default=True, help="Local study workers.")
@redis_url_option
@studies_dir_option
def resume_cmd(target, overrides, workers, redis_url, studies_dir) -> None:
    """Continue a stopped or killed study (NAME, or its FILE): every result is kept, nothing runs twice."""
    _run(_load(target, overrides, studies_dir), redis_url, workers)


def _open_runner(target: str, redis_url: str | None, studies_dir: str):
    s = _load(target, (), studies_dir)
    return s, s.folder()


@study.command("stop")
@click.argument("target")
@redis_url_option
@studies_dir_option
def stop_cmd(target, redis_url, studies_dir) -> None:
    """Pause a study: no run starts, running ones drain (checkpoint); `jet study resume` continues."""
    from jet.options import run_jet
    from jet.keys import Keys
    from jet.queues.connect import connect
    from jet.study import ledger

    s, folder = _open_runner(target, redis_url, studies_dir)

    async def pause(url: str) -> None:
        r = await connect(url)
        try:
            await ledger.set_field(r, url, Keys.for_study(s.name), "paused", repr(time.time()))
        finally:
            await r.aclose()

    with study_server(folder, redis_url) as url:
        run_jet(pause, url)
    click.echo(f"study {s.name} paused: its runner reports and exits, its runs drain; `jet study resume {s.name}`")


@study.command("report")
@click.argument("target")
@redis_url_option
@studies_dir_option
def report_cmd(target, redis_url, studies_dir) -> None:
    """Redraw report.md, results.csv and the plots from the study's durable state."""
    from jet.options import run_jet
    from jet.study import report
    from jet.study.state import StudyState

    s, folder = _open_runner(target, redis_url, studies_dir)

    async def draw(url: str) -> Path:
        state = StudyState(s, url, folder)
        await state.load()
        try:
            return report.write(state, True)
        finally:
            await state.r.aclose()

    with study_server(folder, redis_url) as url:
        click.echo(run_jet(draw, url))


@study.command("tidy")
@click.argument("target")
@click.option("--keep", type=click.Choice(KEEP_FILES), default=None,
              help="What each finished run's folder keeps (default: the study's worker.keep_files).")
@redis_url_option
@studies_dir_option
def tidy_cmd(target, keep, redis_url, studies_dir) -> None:
    """Delete what the study's finished runs no longer need (checkpoints, older weight versions): for
    studies whose runs finished before their workers tidied, or to keep less now. Running runs stay."""
    from jet.options import run_jet
    from jet.study.execution import tidy_finished
    from jet.study.state import StudyState

    s, folder = _open_runner(target, redis_url, studies_dir)

    async def finished(url: str):
        state = StudyState(s, url, folder)
        await state.load()
        await state.r.aclose()
        return state.launched, state.results

    with study_server(folder, redis_url) as url:
        launched, results = run_jet(finished, url)
    freed = tidy_finished(folder, launched, results, keep)
    for run, n in freed.items():
        click.echo(f"{run}: deleted {n / 1e9:.2f} GB")
    running = len([r for r in launched if r not in results])
    kept = f"keeping {keep}" if keep else "each by the worker.keep_files it ran with"
    click.echo(f"study {s.name}: {len(freed)} finished runs tidied ({kept}), {sum(freed.values()) / 1e9:.2f} GB "
               "deleted" + (f"; {running} unfinished runs left as they are" if running else ""))


@study.command("status")
@click.argument("target")
@click.option("--watch", type=float, default=None, metavar="S", help="Redraw every S seconds.")
@redis_url_option
@studies_dir_option
def status_cmd(target, watch, redis_url, studies_dir) -> None:
    """Arms, runs running/finished/failed, best so far, budget left."""
    from rich.console import Console

    from jet.options import run_jet
    from jet.study.state import StudyState
    from jet.study.status import table

    s, folder = _open_runner(target, redis_url, studies_dir)
    console = Console()

    async def show(url: str):
        state = StudyState(s, url, folder)
        await state.load()
        try:
            return await table(state)
        finally:
            await state.r.aclose()

    with study_server(folder, redis_url) as url:
        while True:
            console.print(run_jet(show, url))
            if not watch:
                return
            time.sleep(watch)
            if os.isatty(1):
                console.clear()
