"""The `jet` command line.

Subcommands live in the modules that implement them and are imported only when
invoked (`LazyGroup`), so `jet --help` never imports torch or redis.
CLI paths match config paths: `jet worker env`, `jet train`, `jet bench queue`.
"""

from __future__ import annotations

import os

import click

from jet.options import LazyGroup, setup_logging


@click.group(
    cls=LazyGroup,
    lazy={
        "server": ("jet.cli.server:cli", "Run the embedded Valkey server (AOF on) and print its URL."),
        "enqueue": ("jet.cli.enqueue:cli", "Write dataset rows as Task messages to tasks:<task>."),
        "status": ("jet.cli.status:cli", "Show every stream of a run: length, pending, lag, consumers."),
        "dlq": ("jet.cli.status:dlq", "List, requeue or drop dead letters."),
        "up": ("jet.cli.up:cli", "Run everything on this machine (embedded Redis + roles).", "all"),
        "eval": ("jet.cli.eval:cli", "Greedy accuracy of a model on a task's held-out problems (95% interval).",
                 "infer"),
        "init": ("jet.cli.init:cli", "Write a starter project (config, OpenAI-SDK agent, dataset) to a folder."),
        "gateway": ("jet.workers.gateway.app:cli", "OpenAI-compatible API whose calls are recorded in their episodes."),
        "feed": ("jet.workers.feeder.feeder:cli", "Keep the task streams of a config topped up from their datasets."),
        "dash": ("jet.dash.server:cli", "Live web dashboard (swarm, training, episodes, studies) and /metrics.",
                 "dash"),
        "bench": ("jet.cli.main:bench", "Benchmarks that print ratios against an in-run baseline."),
        "model": ("jet.cli.model:cli", "Build tiny local models and tokenizers; convert GGUF; merge adapters.",
                  "infer"),
        "train": ("jet.trainer.cli:train", "Train a model on its trajectories (torch or deepspeed).", "train"),
        "plot": ("jet.trainer.cli:plot", "Write PNG curves (reward, loss, staleness, throughput) of a run.", "train"),
        "worker": ("jet.workers.cli:worker", "Run env or inference workers (-n N processes)."),
        "study": ("jet.study.cli:study", "Automated RL studies: paired seeds, pruning, verdicts, confirmation.",
                  "study"),
    },
)
@click.option("--log-level", default=lambda: os.environ.get("JET_LOG_LEVEL", "INFO"), show_default="INFO")
@click.version_option(package_name="jet-rl")
def main(log_level: str) -> None:
    """Jet: swarm training for LLM agents over Redis Streams."""
    setup_logging(log_level)


@click.group(
    cls=LazyGroup,
    lazy={
        "queue": ("jet.bench.queue:cli", "Raw XADD rate vs the full consumer hop.", "all"),  # its tables: rich
        "merge": ("jet.bench.merge:cli", "Tokens and train time: none vs exact vs tree merging.", "train"),
        "async": ("jet.bench.async_:cli", "Trainer throughput: synchronous barrier vs bounded staleness.", "train"),
        "staleness": ("jet.bench.staleness:cli", "Reward at equal steps on k-versions-old batches, per objective.",
            "train"),
        "rollout": ("jet.bench.rollout:cli", "Generation tokens/s: direct vs full path, continuous vs batch-sync.",
            "infer"),
        "gpu": ("jet.bench.gpu:cli", "Device check: generation and training tokens/s and MFU, Qwen2-0.5B shape.",
            "train"),
        "adapter": ("jet.bench.adapter:cli", "LoRA adapter vs full training: step time, bytes per version and checkpoint.",
                    "train"),
        "trl": ("jet.bench.trl:cli", "Jet vs TRL's GRPOTrainer: same model, task, settings and wall-clock budget.",
            "train"),
        "client": ("jet.bench.client:cli", "Env worker memory: idle and with episodes in flight (client nodes).",
            "infer"),
        "evaluator": ("jet.bench.evaluator:cli", "Training steps/min with the held-out evaluator on vs off.", "train"),
    },
)
def bench() -> None:
    """Benchmarks; each prints a ratio against a baseline measured in the same run."""


if __name__ == "__main__":
    main()
