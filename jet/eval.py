"""Greedy accuracy of a model on a task's held-out problems: what `jet eval` (jet/cli/eval.py) runs.

What it is: the model (a folder, a Hub id, or a published weight version of a run,
`runs/<run>/weights/<model>/v<N>`) answers the first `n` evaluation rows of a built-in task that
has an evaluation split greedily, in batches, with an inference worker's backend and sampler, through
its own chat template (`jet.tokenizer`, as an env worker renders it). The task's module is loaded and
checked by `jet.tasks.held_out_task` (the protocol: `jet.tasks.protocol`). A single-turn task
(`jet.tasks.add`): each reply to `messages(row)` is scored by the task's reward, `score(row, reply)`. A
multi-turn task (`jet.tasks.tally`): every row's dialogue with its `environment(row)` is played turn by
turn, the live rows of a batch generated together, each reply handed to the row's environment, whose
next message is appended (the same loop as its agent), until it ends; the row's result is the
environment's reward. The report holds the mean result with a 95% interval (Wilson for 0/1 results, a
normal interval for fractional ones) and each row's result in eval order, so two evaluations of one
task can be compared row by row (a paired test, as `jet bench trl` does). The command that prints it,
`jet eval`, lives in jet/cli/eval.py; this module has no click.

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

import time
from pathlib import Path
from typing import Any

from jet.adapters import is_adapter
from jet.errors import ConfigError
from jet.runs import RunDir, weight_version_of
from jet.stats import interval
from jet.tasks import held_out_task
from jet.wire import WEIGHTS_FILE


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

    held = held_out_task(task)
    rows = held.eval_rows(n, seed)
    backend, tok, what = loaded or load(spec, device)
    max_tokens = max_tokens or held.max_tokens
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
        if held.kind == "multi":
            results += play(chunk, held.environment, reply, render)
            continue
        for r, text in zip(chunk, reply([render(held.messages(r)) for r in chunk])):
            results.append(int(held.score(r, text) >= 1.0))
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

