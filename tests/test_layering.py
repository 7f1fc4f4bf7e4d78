"""The layering of Jet, written down and enforced: a walk over every import in the source tree.

Floors, bottom up (a module may import its own floor and the ones below):
- core `jet` (config, wire, keys, errors, timeline, llm, supervisor, ...) and `jet.queues`:
  `jet.queues` imports neither torch nor click (nor transformers, vllm, deepspeed), and
  neither of them imports a role package;
- the roles: `jet.workers` and `jet.trainer` never import each other (their contract is the
  wire messages);
- the top floor: modules that start roles or compose everything (`jet.cli`, `jet.up`,
  `jet.progress` (its display), `jet.bench`, `jet.study`, `jet.dash`, `jet.eval` (it loads a model as an
  inference worker does)) may import every role.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"jet": ROOT / "jet", "jet.queues": ROOT / "queues", "jet.workers": ROOT / "workers",
            "jet.trainer": ROOT / "trainer"}
TOP_FLOOR = ("jet.cli", "jet.up", "jet.progress", "jet.bench", "jet.study", "jet.dash", "jet.eval")
ROLES = ("jet.workers", "jet.trainer")
HEAVY = ("torch", "transformers", "vllm", "deepspeed", "click")


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "jet" and parts and parts[0] in ("queues", "workers", "trainer"):
                continue  # (never: those folders live beside jet/, but be safe)
            out[name] = path
    return out


def imports_of(path: Path, name: str) -> set[str]:
    """Every module `path` imports, absolute, at any depth (functions included)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from jet import workers`
    return found


def within(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def floor(mod: str) -> str:
    if any(within(mod, t) for t in TOP_FLOOR):
        return "top"
    for role in ROLES:
        if within(mod, role):
            return role
    return "queues" if within(mod, "jet.queues") else "core"


def violations(mods: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in sorted(mods.items()):
        here = floor(name)
        for imp in sorted(imports_of(path, name)):
            if not within(imp, "jet") and not any(within(imp, h) for h in HEAVY):
                continue
            there = floor(imp) if within(imp, "jet") else "heavy"
            if here == "queues" and (there in ("top", *ROLES) or there == "heavy"):
                bad.append(f"{name} (jet.queues) imports {imp}")
            elif here == "core" and there in ("top", *ROLES):
                bad.append(f"{name} (core) imports {imp}")
            elif here in ROLES and there in ROLES and there != here:
                bad.append(f"{name} ({here}) imports {imp}")
            elif here in ROLES and there == "top":
                bad.append(f"{name} ({here}) imports the top floor: {imp}")
    return bad


def test_the_import_graph_follows_the_floors():
    mods = modules()
    assert len(mods) > 60  # the walk sees the whole tree
    assert violations(mods) == []


@pytest.mark.parametrize("source, name, expected", [
    ("import torch\n", "jet.queues.x", "jet.queues.x (jet.queues) imports torch"),
    ("import click\n", "jet.queues.x", "jet.queues.x (jet.queues) imports click"),
    ("def f():\n    from jet.trainer import loop\n", "jet.workers.x", "jet.workers.x (jet.workers) imports jet.trainer"),
    ("from ..workers import env\n", "jet.trainer.x", "jet.trainer.x (jet.trainer) imports jet.workers"),
    ("from jet.up import cli\n", "jet.config", "jet.config (core) imports jet.up"),
    ("from jet.bench import queue\n", "jet.trainer.loop", "jet.trainer.loop (jet.trainer) imports the top floor"),
    ("import torch\nfrom jet.workers import env\n", "jet.up", None),  # the top floor may
    ("from jet.queues import codec\n", "jet.workers.x", None),
])
def test_the_walk_catches_a_violation(tmp_path, source, name, expected):
    """The checker itself can fail: planted imports are reported (inside functions and relative ones too)."""
    path = tmp_path / "planted.py"
    path.write_text(source)
    found = violations({name: path})
    if expected is None:
        assert found == []
    else:
        assert any(v.startswith(expected) for v in found), found
