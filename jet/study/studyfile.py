"""Reading a study file: YAML, `--set` overrides, and errors that name the path.

`load_study(path, overrides)` reads the file (jet.configlib's reader: YAML 1.2
floats, no duplicate keys), applies each `KEY=VALUE` override
(`budget.max_runs=8`; a space path is one key: `space.trainer.lr.low=1e-4`),
resolves `base` against the file's folder and validates with the schema of
`jet.study.spec`, through the same glue as run configs: every error is one
`ConfigError` line such as `s.yaml: budget.max_runs: expected int, got 'x'`.
What it is not: the schema itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jet import configlib
from jet.errors import ConfigError
from jet.study.spec import Study

__all__ = ["load_study", "parse_study", "apply_override"]


def parse_study(data: Any, file: str = "") -> Study:
    """A Study from a mapping (as YAML gives it); ConfigError naming the path (and the file) otherwise."""
    if not isinstance(data, dict):
        raise configlib.invalid("", f"expected a mapping at the top level, got {type(data).__name__}", file)
    try:
        return configlib.validate(Study, data)
    except ConfigError as err:
        raise configlib.invalid(getattr(err, "key", ""), getattr(err, "reason", str(err)), file) from None


def apply_override(data: dict, text: str) -> None:
    """`budget.max_runs=8` into `data` (in place). A space path is one key: `space.trainer.lr.low=1e-4`."""
    parts, value = configlib.parse_override(text)
    parts = [str(p) for p in parts]
    if parts[0] == "space" and len(parts) > 2:  # space keys are config paths with dots of their own
        rest = ".".join(parts[1:])
        known = sorted(data.get("space") or {}, key=len, reverse=True)
        path = next((k for k in known if rest == k or rest.startswith(k + ".")), None)
        if path is not None:
            parts = ["space", path] + (rest[len(path) + 1:].split(".") if rest != path else [])
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise configlib.invalid(f"--set {text}", f"{'.'.join(parts[:i]) or 'the study'} is not a mapping here")


def load_study(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Study:
    """Read, override and validate a study file; its `base` becomes an absolute path."""
    path = Path(path)
    data = configlib.read_yaml(path)
    for text in overrides:
        apply_override(data, text)
    if isinstance(data.get("base"), str):
        data["base"] = str((path.parent / data["base"]).resolve())
    return parse_study(data, str(path))
