"""`jet worker ...`: the rollout roles, each imported only when invoked.

`jet worker env` runs agent episodes (jet.workers.rollout.worker); `jet worker infer`
serves one model's generation requests (jet.workers.inference.worker); `jet worker eval`
evaluates a model's published versions on held-out rows (jet.workers.evaluator.worker). Each
module also runs alone: `python -m jet.workers.rollout.worker ...`.
"""

from __future__ import annotations

import click

from jet.options import LazyGroup


@click.group(
    cls=LazyGroup,
    lazy={
        "env": ("jet.workers.rollout.worker:cli", "Run agent episodes of the configured tasks (tasks:<task> -> traj:<model>)."),
        "infer": ("jet.workers.inference.worker:cli", "Serve one model's generation requests (gen:<model>), hf or vllm.", "infer"),
        "eval": ("jet.workers.evaluator.worker:cli", "Evaluate a model's published versions on held-out rows (tasks[].eval).",
                 "infer"),
    },
)
def worker() -> None:
    """Rollout workers: env (agent episodes), infer (generation) and eval (held-out evaluation)."""
