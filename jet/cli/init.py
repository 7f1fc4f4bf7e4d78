"""`jet init DIR`: a starter project that `jet up --config DIR/config.yaml` trains as it is.

What it writes (copied from `jet/templates/starter/`, shipped in the package):
`config.yaml` (every key commented), `agent.py` (the workflow: plain OpenAI-SDK
code pointed at the episode's gateway) and `rows.jsonl` (its dataset). The
run name is the folder's name, made key-safe. Its model path,
`.jet/models/tiny` relative to the config, is built by `jet up` when missing.

What it is not: a scaffold generator with options; edit the files. Invariant:
it never overwrites a file unless told (`--force`), and a config it writes
loads (`jet.config.load_file`) before the command returns.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import click

FILES = ("config.yaml", "agent.py", "rows.jsonl")


def run_name(folder: Path) -> str:
    """The folder's name as a run name (`[A-Za-z0-9_.-]+`, see `jet.keys.check_name`)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", folder.resolve().name).strip("-.")
    return name or "starter"


def write_project(folder: str | Path, *, force: bool = False) -> list[Path]:
    """Write the starter files into `folder` (created if needed); returns their paths."""
    folder = Path(folder)
    targets = [folder / name for name in FILES]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise click.ClickException(f"{', '.join(existing)} already exist(s); pass --force to overwrite")
    folder.mkdir(parents=True, exist_ok=True)
    source = importlib.resources.files("jet").joinpath("templates", "starter")
    for name, target in zip(FILES, targets):
        text = source.joinpath(name).read_text(encoding="utf-8")
        target.write_text(text.replace("__RUN__", run_name(folder)) if name == "config.yaml" else text,
                          encoding="utf-8")
    from jet.config import load_file

    load_file(targets[0], check_paths=False)  # what we wrote is valid
    return targets


@click.command("init")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Overwrite the starter files if they exist.")
def cli(folder: str, force: bool) -> None:
    """Write a starter project to FOLDER: config.yaml, agent.py (OpenAI SDK) and rows.jsonl."""
    for path in write_project(folder, force=force):
        click.echo(f"wrote {path}")
    click.echo(f"train it: jet up --config {Path(folder) / 'config.yaml'}")
