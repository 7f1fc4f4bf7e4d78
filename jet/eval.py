"""`jet eval --model PATH_OR_ID --task NAME [--n 100]`: greedy accuracy on a task's held-out problems.

What it is: the model (a folder, a Hub id, or a published weight version of a run,
`runs/<run>/weights/<model>/v<N>`) answers the first `n` evaluation rows of a built-in task that
has an evaluation split (`eval_rows`, `messages` and `score` in its module, as `jet.tasks.add`
has) greedily, in batches, with an inference worker's backend and sampler, through its own chat
template (`jet.tokenizer`, as an env worker renders it); each reply is scored by the task's
reward. It prints the accuracy with a 95% Wilson interval, and with `--json` also each row's 0/1
result in eval order, so two evaluations of one task can be compared row by row (a paired test,
as `jet bench trl` does).

A published version holds only `model.safetensors` and `config.json`; its tokenizer and
generation settings come from the model the run trained (`runs/<run>/config.resolved.yaml`), and
its tensors are loaded as an inference worker loads them (`jet.workers.inference.hf`).

What it is not: an agent run. The prompt is the task's own first message list rendered by the
tokenizer's template; multi-turn agents are evaluated by running them (`jet up --episodes`).
"""

from __future__ import annotations

import importlib
import math
import time
from pathlib import Path
from typing import Any

import click

from jet.errors import ConfigError
from jet.runs import RunDir, weight_version_of
from jet.wire import WEIGHTS_FILE


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def task_module(name: str) -> Any:
    """The module of built-in task `name`, which must have an evaluation split."""
    try:
        module = importlib.import_module(f"jet.tasks.{name}")
    except ModuleNotFoundError:
        raise ConfigError(f"--task: no built-in task {name!r}") from None
    missing = [f for f in ("eval_rows", "messages", "score") if not hasattr(module, f)]
    if missing:
        raise ConfigError(f"--task: {name!r} has no evaluation split (jet.tasks.{name} lacks {', '.join(missing)})")
    return module


def published_version(path: Path) -> tuple[Path, str, int] | None:
    """(run folder, model name, version) when `path` is `<run>/weights/<model>/v<N>` with its weights,
    else None."""
    found = weight_version_of(path)
    if found is None or not (path / WEIGHTS_FILE).is_file():
        return None
    run, model, version = found
    return run.root, model, version


def load(spec: str, device: str, dtype: str = "float32") -> tuple[Any, Any, str]:
    """(backend, tokenizer, what was loaded) for a folder, a Hub id or a published version: the backend
    is an inference worker's (`jet.workers.inference.hf.HFBackend`), weights loaded as it loads them."""
    from jet.sources import resolve_model
    from jet.tokenizer import load_tokenizer
    from jet.workers.inference.hf import HFBackend

    version = published_version(Path(spec)) if Path(spec).is_dir() else None
    if version is not None:
        run_dir, name, v = version
        import yaml

        resolved = RunDir.at(run_dir).resolved_config
        if not resolved.is_file():
            raise ConfigError(f"--model: {spec} is a published version but {resolved} is missing")
        models = {m["name"]: m for m in yaml.safe_load(resolved.read_text()).get("models", [])}
        if name not in models:
            raise ConfigError(f"--model: {resolved} has no model {name!r}")
        base = resolve_model(models[name]["path"], f"models[{name}].path")
        what = f"{name} v{v} of {run_dir}"
    else:
        base, what = resolve_model(spec, "--model"), spec
    backend = HFBackend(base, device=device, dtype=dtype)
    if version is not None:
        backend.load_weights(Path(spec), version=version[2])
    return backend, load_tokenizer(base), what


def evaluate(spec: str, task: str, n: int = 100, *, seed: int = 0, device: str = "cpu", batch: int = 16,
             max_tokens: int = 24, loaded: tuple[Any, Any, str] | None = None) -> dict:
    """Greedy accuracy of `spec` on the first `n` evaluation rows of `task` (see the module docstring)."""
    from jet.workers.inference.backend import SamplingParams

    module = task_module(task)
    rows = module.eval_rows(n, seed)
    backend, tok, what = loaded or load(spec, device)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results: list[int] = []
    t0 = time.monotonic()
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        prompts = [tok.apply_chat_template(module.messages(r), tokenize=True, add_generation_prompt=True)
                   for r in chunk]
        for r, out in zip(chunk, backend.generate(prompts, [greedy] * len(prompts))):
            ids = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
            results.append(int(module.score(r, tok.decode(ids)) >= 1.0))
    k = sum(results)
    lo, hi = wilson(k, len(results))
    return {"model": what, "task": task, "n": len(results), "seed": seed, "correct": k,
            "accuracy": k / len(results) if results else 0.0, "ci95": [lo, hi], "results": results,
            "version": backend.version, "max_tokens": max_tokens, "seconds": time.monotonic() - t0}


@click.command("eval")
@click.option("--model", "spec", required=True,
              help="A model folder, a Hub id (owner/name[@revision]), or runs/<run>/weights/<model>/v<N>.")
@click.option("--task", default="add", show_default=True, help="A built-in task with an evaluation split.")
@click.option("--n", type=click.IntRange(1), default=100, show_default=True, help="Evaluation rows.")
@click.option("--seed", type=int, default=0, show_default=True, help="Which evaluation rows (their order).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@click.option("--batch", type=click.IntRange(1), default=16, show_default=True, help="Prompts generated at once.")
@click.option("--max-tokens", type=click.IntRange(1), default=24, show_default=True, help="Completion tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (with each row's 0/1).")
def cli(spec, task, n, seed, device, batch, max_tokens, as_json) -> None:
    """Greedy accuracy of a model on a task's held-out problems, with a 95% interval."""
    import orjson

    try:
        report = evaluate(spec, task, n, seed=seed, device=device, batch=batch, max_tokens=max_tokens)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    lo, hi = report["ci95"]
    click.echo(f"{report['model']} on {task}: {report['correct']}/{report['n']} = {report['accuracy']:.3f} "
               f"(95% CI {lo:.3f}-{hi:.3f}), greedy, {report['seconds']:.0f} s")
