"""Which optional extra of the `jet-rl` package each role needs, and the one line that says so.

What it is: the base install (`pip install jet-rl`) is a client node: the CLI, the env worker, the
gateway, the LLM client, `jet enqueue`, `jet feed`, `jet server`, `jet status`, `jet dlq` and the
queues, with no torch, transformers, numpy, scipy, optuna, matplotlib, prometheus-client or rich.
The roles that need more name their extra here (pyproject.toml's `[project.optional-dependencies]`
lists the same names), and a role started without it ends with `require`'s one line instead of a
traceback from deep inside.

Invariant: `tests/test_client_node.py` checks that every module named here is in the extra's
requirements, so this table and pyproject cannot drift apart silently.
"""

from __future__ import annotations

import importlib.util

from jet.errors import ConfigError

# extra -> the import names it provides that a role needs
EXTRAS: dict[str, tuple[str, ...]] = {
    "infer": ("torch", "transformers", "safetensors"),
    "train": ("torch", "transformers", "safetensors", "matplotlib", "peft"),
    "study": ("optuna", "scipy", "numpy", "matplotlib", "rich"),
    "dash": ("prometheus_client",),
    "all": ("torch", "transformers", "safetensors", "matplotlib", "optuna", "scipy", "numpy", "prometheus_client",
            "rich"),
    "vllm": ("vllm",),
    "deepspeed": ("deepspeed",),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` this environment cannot import."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Raise `MissingExtra` (one line: what needs it, what is missing, the pip command) unless `extra` is installed."""
    gone = missing(extra)
    if gone:
        raise MissingExtra(f"{what} needs the '{extra}' extra ({', '.join(gone)} not installed): "
                           f"pip install 'jet-rl[{extra}]'")


class MissingExtra(ConfigError):
    """A role started in an install without the extra it needs: fatal, restarting cannot help."""
