"""`jet worker ...`: the rollout roles, each imported only when invoked.

`jet worker env` runs agent episodes (jet.workers.rollout.worker); `jet worker infer`
serves one model's generation requests (jet.workers.inference.worker). Each module also
runs alone: `python -m jet.workers.rollout.worker ...`.
"""

from __future__ import annotations

import click

from jet.cli.options import LazyGroup


@click.group(
    cls=LazyGroup,
    lazy={
        "env": ("jet.workers.rollout.worker:cli", "Run agent episodes of the configured tasks (tasks:<task> -> traj:<model>)."),
        "infer": ("jet.workers.inference.worker:cli", "Serve one model's generation requests (gen:<model>), hf or vllm.", "infer"),
    },
)
def worker() -> None:
    """Rollout workers: env (agent episodes) and infer (generation)."""
