"""`jet eval --model PATH_OR_ID --task NAME [--n 100]`: greedy accuracy on a task's held-out problems.

What it is: the model (a folder, a Hub id, or a published weight version of a run,
`runs/<run>/weights/<model>/v<N>`) answers the first `n` evaluation rows of a built-in task that
has an evaluation split greedily, in batches, with an inference worker's backend and sampler, through
its own chat template (`jet.tokenizer`, as an env worker renders it). A single-turn task has
`eval_rows`, `messages` and `score` in its module (`jet.tasks.add`): each reply is scored by the task's
reward. A multi-turn task has `eval_rows` and `environment` (`jet.tasks.tally`): every row's dialogue
is played turn by turn, the live rows of a batch generated together, each reply handed to the row's
environment, whose next message is appended (the same loop as its agent), until it ends; the row's
result is the environment's reward. It prints the mean result with a 95% interval (Wilson for 0/1
results, a normal interval for fractional ones), and with `--json` also each row's result in eval
order, so two evaluations of one task can be compared row by row (a paired test, as `jet bench trl`
does).

A published version holds only `model.safetensors` and `config.json`, or, for a model training an
adapter, `adapter_model.safetensors` and `adapter_config.json` (`jet.adapters`); its base, tokenizer
and generation settings come from the model the run trained (`runs/<run>/config.resolved.yaml`), and
its tensors are loaded as an inference worker loads them (`jet.workers.inference.hf`: an adapter is
merged into the base).

What it is not: an agent run through the swarm (no gateway, no Redis): each turn's prompt is the
dialogue so far re-rendered by the tokenizer's template; agents of arbitrary code are evaluated by
running them (`jet up --episodes`).
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

import click

from jet.adapters import is_adapter
from jet.errors import ConfigError
from jet.runs import RunDir, weight_version_of
from jet.stats import interval
from jet.wire import WEIGHTS_FILE


def task_module(name: str) -> Any:
    """The module of built-in task `name`, which must have an evaluation split."""
    try:
        module = importlib.import_module(f"jet.tasks.{name}")
    except ModuleNotFoundError:
        raise ConfigError(f"--task: no built-in task {name!r}") from None
    needs = ("eval_rows", "environment") if hasattr(module, "environment") else ("eval_rows", "messages", "score")
    missing = [f for f in needs if not hasattr(module, f)]
    if missing:
        raise ConfigError(f"--task: {name!r} has no evaluation split (jet.tasks.{name} lacks {', '.join(missing)})")
    return module


def published_version(path: Path) -> tuple[Path, str, int] | None:
    """(run folder, model name, version) when `path` is `<run>/weights/<model>/v<N>` with its weights
    (full, or an adapter version), else None."""
    found = weight_version_of(path)
    if found is None or not ((path / WEIGHTS_FILE).is_file() or is_adapter(path)):
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
             max_tokens: int | None = None, loaded: tuple[Any, Any, str] | None = None) -> dict:
    """Greedy results of `spec` on the first `n` evaluation rows of `task` (see the module docstring)."""
    from jet.workers.inference.backend import SamplingParams

    module = task_module(task)
    rows = module.eval_rows(n, seed)
    backend, tok, what = loaded or load(spec, device)
    max_tokens = max_tokens or getattr(module, "MAX_TOKENS", 24)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def reply(prompts: list[list[int]]) -> list[str]:
        outs = backend.generate(prompts, [greedy] * len(prompts))
        return [tok.decode(o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids) for o in outs]

    def render(messages: list[dict]) -> list[int]:
        return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)

    results: list[float] = []
    t0 = time.monotonic()
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        if hasattr(module, "environment"):
            results += play(chunk, module.environment, reply, render)
            continue
        for r, text in zip(chunk, reply([render(module.messages(r)) for r in chunk])):
            results.append(int(module.score(r, text) >= 1.0))
    k = sum(results)
    lo, hi = interval(results) if results else (0.0, 1.0)
    return {"model": what, "task": task, "n": len(results), "seed": seed, "correct": k,
            "accuracy": k / len(results) if results else 0.0, "ci95": [lo, hi], "results": results,
            "version": backend.version, "max_tokens": max_tokens, "seconds": time.monotonic() - t0}


def play(rows: list[dict], environment, reply, render) -> list[float]:
    """Each row's dialogue with its environment, the live rows' turns generated together; their rewards."""
    envs = [environment(r) for r in rows]
    messages = [e.opening() for e in envs]
    live = list(range(len(rows)))
    while live:
        texts = reply([render(messages[j]) for j in live])
        still = []
        for j, text in zip(live, texts):
            messages[j].append({"role": "assistant", "content": text})
            follow = envs[j].answer(text)
            if follow is not None:
                messages[j].append({"role": "user", "content": follow})
                still.append(j)
        live = still
    return [e.reward for e in envs]


@click.command("eval")
@click.option("--model", "spec", required=True,
              help="A model folder, a Hub id (owner/name[@revision]), or runs/<run>/weights/<model>/v<N>.")
@click.option("--task", default="add", show_default=True, help="A built-in task with an evaluation split.")
@click.option("--n", type=click.IntRange(1), default=100, show_default=True, help="Evaluation rows.")
@click.option("--seed", type=int, default=0, show_default=True, help="Which evaluation rows (their order).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@click.option("--batch", type=click.IntRange(1), default=16, show_default=True, help="Prompts generated at once.")
@click.option("--max-tokens", type=click.IntRange(1), default=None,
              help="Completion tokens per turn (default: the task's MAX_TOKENS, else 24).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (with each row's 0/1).")
def cli(spec, task, n, seed, device, batch, max_tokens, as_json) -> None:
    """Greedy accuracy (mean reward) of a model on a task's held-out problems, with a 95% interval."""
    import orjson

    try:
        report = evaluate(spec, task, n, seed=seed, device=device, batch=batch, max_tokens=max_tokens)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    lo, hi = report["ci95"]
    click.echo(f"{report['model']} on {task}: {report['correct']:g}/{report['n']} = {report['accuracy']:.3f} "
               f"(95% CI {lo:.3f}-{hi:.3f}), greedy, {report['seconds']:.0f} s")
