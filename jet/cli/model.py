"""`jet model ...`: build tiny local models (`init`), convert a GGUF file (`convert`), merge a trained
adapter version into its base (`merge`).

The commands only; what they call lives in core modules without click: `jet.models` (tiny models and
their tokenizers), `jet.convert` (GGUF to a Hugging Face folder) and `jet.adapters` (adapter versions).
"""

from __future__ import annotations

from pathlib import Path

import click

from jet.convert import DTYPES
from jet.errors import ConfigError
from jet.models import ARCHS, TEMPLATES


@click.group()
def cli() -> None:
    """Build tiny local models and tokenizers; convert GGUF files; merge adapter versions."""


@cli.command("init")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--arch", type=click.Choice(ARCHS), default="llama", show_default=True)
@click.option("--template", type=click.Choice(sorted(TEMPLATES)), default="chatml", show_default=True)
@click.option("--hidden", type=click.IntRange(min=8), default=64, show_default=True, help="Hidden size.")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--vocab-size", type=click.IntRange(min=300), default=1024, show_default=True)
@click.option("--max-position", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--exist-ok", is_flag=True, help="Do nothing when DIR already holds a model (for deployments).")
def init(out_dir, arch, template, hidden, layers, heads, kv_heads, vocab_size, max_position, seed, exist_ok) -> None:
    """Write a random tiny causal LM and its tokenizer as a Hugging Face directory."""
    from jet.models import init_model

    if exist_ok and (Path(out_dir) / "config.json").is_file():
        click.echo(f"{out_dir} exists; left as it is")
        return
    path = init_model(
        out_dir, arch=arch, template=template, vocab_size=vocab_size, hidden_size=hidden,
        layers=layers, heads=heads, kv_heads=kv_heads, max_position=max_position, seed=seed,
    )
    click.echo(str(path))


@cli.command("convert")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write.")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
              help="dtype of the saved weights.")
def convert(file, out_dir, dtype) -> None:
    """Write a GGUF model file as a Hugging Face folder (safetensors, tokenizer, chat template)."""
    from jet.convert import convert as to_folder

    try:
        click.echo(str(to_folder(file, out_dir, dtype)))
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


@cli.command("merge")
@click.option("--base", "base_path", required=True, type=click.Path(exists=True, file_okay=False),
              help="The base model folder (models[].path).")
@click.option("--adapter", "adapter_folder", required=True, type=click.Path(exists=True, file_okay=False),
              help="An adapter version folder (runs/<run>/weights/<model>/v<N>).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write.")
def merge(base_path: str, adapter_folder: str, out_dir: str) -> None:
    """Merge a trained adapter version into its base: a plain Hugging Face folder."""
    from jet.adapters import AdapterError, merge_folder

    if Path(out_dir).exists() and any(Path(out_dir).iterdir()):
        raise click.ClickException(f"{out_dir} exists and is not empty")
    try:
        out = merge_folder(base_path, adapter_folder, out_dir)
    except AdapterError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out}: {base_path} with the adapter of {adapter_folder} merged in")
