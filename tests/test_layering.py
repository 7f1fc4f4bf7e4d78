"""The layering of Jet, written down and enforced: a walk over every import in the source tree.

Floors, bottom up (a module may import its own floor and the ones below):
- core `jet` (config, wire, keys, errors, timeline, llm, supervisor, options (what every role's
  command shares), ...) and `jet.queues`: `jet.queues` imports neither torch nor click
  (nor transformers, vllm, deepspeed), and neither of them imports a role package;
- the roles: `jet.workers` and `jet.trainer` never import each other (their contract is the wire
  messages);
- the top floor: modules that start roles or compose everything (the `jet.cli` commands, `jet.bench`,
  `jet.study`, `jet.dash`, `jet.eval` (it loads a model as an inference worker does)) may import every
  role.
Inside the floors:
- no circles: no module reaches itself through imports made when it runs (imports under
  `if TYPE_CHECKING:` are annotations, not imports, and do not count);
- no module imports another module's private (underscore) name;
- the three rooms of `jet.workers` (`gateway`, `inference`, `rollout`): the gateway and inference never
  import the rollout side, and the inference engines (`hf`, `hf_engine`, `vllm`) share only
  `jet.workers.inference.backend` and `gate`: none imports another engine.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"jet": ROOT / "jet", "jet.queues": ROOT / "queues", "jet.workers": ROOT / "workers",
            "jet.trainer": ROOT / "trainer"}
TOP_FLOOR = ("jet.cli", "jet.bench", "jet.study", "jet.dash", "jet.eval")
ROLES = ("jet.workers", "jet.trainer")
HEAVY = ("torch", "transformers", "vllm", "deepspeed", "click")
# the inference engines, each one or more modules: an engine's modules import each other, never another's
ENGINES = {"hf": ("jet.workers.inference.hf", "jet.workers.inference.hf_engine"), "vllm": ("jet.workers.inference.vllm",)}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if pkg == "jet" and parts and parts[0] in ("queues", "workers", "trainer"):
                continue  # (never: those folders live beside jet/, but be safe)
            out[".".join([pkg, *parts])] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_nodes(tree: ast.AST, runtime_only: bool = False):
    """Every Import / ImportFrom node; with `runtime_only`, not those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if runtime_only and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _absolute(node: ast.ImportFrom, path: Path, name: str) -> str:
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, name: str, runtime_only: bool = False) -> set[str]:
    """Every module `path` imports, absolute, at any depth (functions included)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in import_nodes(tree, runtime_only):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        else:
            mod = _absolute(node, path, name)
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from jet import workers`
    return found


def private_names(path: Path, name: str, mods: dict[str, Path]) -> list[str]:
    """`from X import _y` of another module X of the tree."""
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in import_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(node, path, name)
            if mod != name and within(mod, "jet"):
                bad += [f"{name} imports the private name {a.name} of {mod}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


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
            elif rooms(name, imp):
                bad.append(rooms(name, imp))
        bad += private_names(path, name, mods)
    return bad


def rooms(name: str, imp: str) -> str | None:
    """Why `name` may not import `imp` inside jet.workers, or None."""
    if within(imp, "jet.workers.rollout") and (within(name, "jet.workers.gateway")
                                               or within(name, "jet.workers.inference")):
        return f"{name} imports the rollout side: {imp}"
    engine = next((e for e, mods in ENGINES.items() if any(within(name, m) for m in mods)), None)
    other = next((e for e, mods in ENGINES.items() if any(within(imp, m) for m in mods)), None)
    if engine and other and other != engine:
        return f"{name} (an inference engine) imports another engine: {imp}"
    return None


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the tree's modules it imports when it runs (a `from pkg import name` counts as pkg.name
    when that is a module of the tree, else as pkg)."""
    out = {}
    for name, path in mods.items():
        edges = set()
        for imp in imports_of(path, name, runtime_only=True):
            if imp in mods and imp != name:
                edges.add(imp)
        out[name] = edges
    # `from jet.timeline import Call` adds jet.timeline and jet.timeline.Call: only real modules stay.
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ importing its own submodules is how a package exports them, not a circle:
    the submodules never import the package back (checked by the circle test on the rest)."""
    return {v: {w for w in ws if not within(w, v)} for v, ws in edges.items()}


def test_the_import_graph_follows_the_floors():
    mods = modules()
    assert len(mods) > 60  # the walk sees the whole tree
    assert violations(mods) == []


def test_no_module_imports_itself_in_a_circle():
    assert cycles(package_edges(graph(modules()))) == []


MAX_LINES = 600  # a module past it has become two rooms: split it along a seam before it grows further


def test_no_module_is_over_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: k for n, k in sizes.items() if k > MAX_LINES} == {}


@pytest.mark.parametrize("source, name, expected", [
    ("import torch\n", "jet.queues.x", "jet.queues.x (jet.queues) imports torch"),
    ("import click\n", "jet.queues.x", "jet.queues.x (jet.queues) imports click"),
    ("def f():\n    from jet.trainer import loop\n", "jet.workers.x", "jet.workers.x (jet.workers) imports jet.trainer"),
    ("from ..workers import env\n", "jet.trainer.x", "jet.trainer.x (jet.trainer) imports jet.workers"),
    ("from jet.cli.up import cli\n", "jet.config", "jet.config (core) imports jet.cli.up"),
    ("from jet.bench import queue\n", "jet.trainer.loop", "jet.trainer.loop (jet.trainer) imports the top floor"),
    ("from jet.cli.up import cpu_count\n", "jet.workers.x", "jet.workers.x (jet.workers) imports the top floor"),
    ("from jet.config import _is_path\n", "jet.cli.up", "jet.cli.up imports the private name _is_path"),
    ("from jet.workers.inference.hf import X\n", "jet.workers.inference.vllm",
     "jet.workers.inference.vllm (an inference engine) imports another engine"),
    ("from jet.workers.rollout.episode import X\n", "jet.workers.gateway.app",
     "jet.workers.gateway.app imports the rollout side"),
    ("import torch\nfrom jet.workers.rollout import worker\n", "jet.cli.up", None),  # the top floor may
    ("from jet.options import load_config\n", "jet.workers.inference.worker", None),  # options are core
    ("from jet.queues import codec\n", "jet.workers.x", None),
    ("from jet.workers.inference.backend import pick_tokens\n", "jet.workers.inference.hf_engine", None),
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


def test_the_circle_check_finds_a_lazy_circle_and_skips_type_checking(tmp_path):
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("from jet.x.b import f\n")
    b.write_text("def g():\n    from jet.x.a import h\n")  # lazy: still a circle
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jet.x.a import h\n")
    mods = {"jet.x.a": a, "jet.x.b": b, "jet.x.c": c}
    assert cycles(package_edges(graph(mods))) == [["jet.x.a", "jet.x.b"]]


def test_every_package_of_the_tree_is_installed():
    """pyproject lists the packages a wheel installs by hand: a new folder missing there imports in a checkout
    (editable) and fails on every installed node (`jet enqueue` on a client node did)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found - listed == set() and listed - found == set()
