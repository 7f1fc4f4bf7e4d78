"""`jet train` (the trainer of one model) and `jet plot` (PNG curves of a run's metrics).

`jet train --model NAME --config C [--backend torch|deepspeed] [--nproc N]`
consumes `traj:<model>` and trains until `trainer.steps` (see
`jet.trainer.loop`). SIGTERM/SIGINT drain: the step in hand finishes, a
checkpoint is written, the entries it covers are acked, held ones released,
exit 0; a second signal exits at once. With `--backend deepspeed` and no
RANK in the environment it starts `--nproc` ranks of itself with torchrun's own
launcher (`torch.distributed.run`, as a library call: it sets RANK, WORLD_SIZE,
MASTER_ADDR/PORT, forwards signals and stops every rank when one dies); under
torchrun or the deepspeed launcher on several nodes it is one rank. Errors end
it with one line: exit code EXIT_FATAL (`jet.supervisor`) for a fatal one, so
`jet up` stops instead of restarting it; a SIGTERM while still connecting exits 0.
"""

from __future__ import annotations

import os
import signal
import threading

import click

from jet.options import config_options, load_config, redis_url_option, require_models, resolve_url
from jet.errors import JetError, Stopped, is_fatal
from jet.supervisor import EXIT_FATAL


def _stop_on_signals() -> threading.Event:
    """An event set by the first SIGTERM/SIGINT; a second one exits at once."""
    stop = threading.Event()

    def handler(sig, _frame):
        if stop.is_set():
            raise SystemExit(128 + sig)
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, handler)
    return stop


def _trained_model(cfg, model: str | None) -> str:
    trainable = [m.name for m in cfg.models if m.trainable]
    if model is None:
        if len(trainable) != 1:
            raise click.UsageError(f"--model is required: trainable models are {trainable}")
        return trainable[0]
    if model not in trainable:
        raise click.UsageError(f"--model: {model!r} is not a trainable model; trainable: {trainable}")
    return model


@click.command("train")
@config_options("models, trainer, run")
@click.option("--model", default=None, help="Model to train (default: the only trainable one).")
@click.option("--backend", type=click.Choice(["torch", "deepspeed"]), default=None,
              help="Overrides trainer.backend.")
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="DeepSpeed ranks; overrides trainer.nproc.")
@click.option("--device", default=None, help="Torch device; overrides trainer.device.")
@redis_url_option
def train(config_path, overrides, model, backend, nproc, device, redis_url) -> None:
    """Train a model on its trajectories (traj:<model>), publishing weights to weights:<model>."""
    from jet.config import REDIS_URL_ENV, pins

    cfg = load_config(config_path, overrides)
    model = _trained_model(cfg, model)
    cfg, raw = require_models(cfg, config_path, [model]), cfg
    backend = backend or cfg.trainer_of(model).backend
    nproc = nproc or cfg.trainer_of(model).nproc
    rank = os.environ.get("RANK")
    url = resolve_url(redis_url) if rank in (None, "0") else None
    if backend == "deepspeed" and rank is None:
        args = ["--config", config_path, "--model", model, "--backend", backend]  # ranks read WORLD_SIZE
        sets = (*overrides, *pins(raw, cfg))  # every rank loads the commit a Hub id resolved to here
        args += [x for o in sets for x in ("--set", o)] + (["--device", device] if device else [])
        os.environ[REDIS_URL_ENV] = url  # the ranks inherit it; a password never shows in `ps`
        raise SystemExit(_torchrun(nproc, args))
    stop = _stop_on_signals()
    from jet.trainer.loop import run

    try:
        run(cfg, model, url, stop.is_set, backend=backend, device=device)
    except Stopped as e:
        click.echo(f"jet train: {e}", err=True)
    except JetError as e:
        click.echo(f"jet train: error: {e}", err=True)
        raise SystemExit(EXIT_FATAL if is_fatal(e) else 1) from None


def _torchrun(nproc: int, args: list[str]) -> int:
    """Run `nproc` ranks of this command on this machine with torchrun's launcher; 0 if all exited 0.

    A SIGTERM/SIGINT reaches every rank (they drain: rank 0 decides, the others follow its plan)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # The ranks start as `python -m jet.trainer.cli`: safe-path mode keeps this folder off their
    # sys.path (as jet.supervisor.python_module's -P does for every other role).
    os.environ["PYTHONSAFEPATH"] = "1"
    parsed = get_args_parser().parse_args(["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc),
                                           "--max-restarts", "0", "--shutdown-timeout", "120", "--module", "jet.trainer.cli", *args])
    try:
        run(parsed)
    except SignalException as e:  # told to stop: the ranks were signalled and have drained
        click.echo(f"jet train: stopped ranks after {e.sigval.name}", err=True)
    except ChildFailedError as e:
        failures = {r: f.exitcode for r, f in e.failures.items()}
        click.echo(f"jet train: trainer rank(s) failed (rank: exit code) {failures}", err=True)
        return EXIT_FATAL if EXIT_FATAL in failures.values() else 1
    return 0


@click.command("plot")
@click.argument("run", type=click.Path(exists=True))
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Folder for the PNGs (default: plots/ next to each metrics file).")
def plot(run, out_dir) -> None:
    """Write reward, loss, staleness and throughput curves (PNG) of a run folder or metrics file."""
    from pathlib import Path

    from jet.runs import metrics_files
    from jet.trainer.metrics import plot as plot_file

    files = metrics_files(Path(run))
    if not files:
        raise click.ClickException(f"no metrics.jsonl under {run}")
    for f in files:
        target = Path(out_dir) / f.parent.name if out_dir and len(files) > 1 else out_dir
        for png in plot_file(f, target):
            click.echo(str(png))


if __name__ == "__main__":
    from jet.options import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    train()
