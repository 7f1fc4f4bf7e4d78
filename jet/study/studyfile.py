"""Reading a study file: YAML (1.2 floats), `--set` overrides, and errors that name the path.

`load_study(path, overrides)` reads the file, applies each `KEY=VALUE`
override (`budget.max_runs=8`; a space path is one key:
`space.trainer.lr.low=1e-4`), resolves `base` against the file's folder and
validates with the schema of `jet.study.spec`; every error is one
`ConfigError` line such as `s.yaml: budget.max_runs: expected int, got 'x'`.
What it is not: the schema itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from jet.errors import ConfigError
from jet.study.spec import Study

__all__ = ["load_study", "parse_study", "apply_override"]

class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats: `1e-5` is a float, not a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
               |\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


_TYPES = {"int_type": "int", "float_type": "float", "string_type": "str", "bool_type": "bool", "list_type": "a list",
          "dict_type": "a mapping", "model_type": "a mapping", "int_from_float": "int"}


def _message(err: dict) -> str:
    """One pydantic error as `path: reason`, in the words of Jet's config errors."""
    loc = [p for p in err["loc"] if not (isinstance(p, str) and (p.startswith("function-") or p in
                                                                 ("literal['best']", "dict[str,any]")))]
    path = ""
    for p in loc:
        path += f"[{p}]" if isinstance(p, int) else (f".{p}" if path else str(p))
    kind, value = err["type"], err.get("input")
    if kind in _TYPES:
        reason = f"expected {_TYPES[kind]}, got {_show(value)}"
    elif kind == "extra_forbidden":
        reason = "unknown key"
    elif kind == "missing":
        reason = "missing required key"
    elif kind == "literal_error":
        reason = f"expected {err['ctx']['expected']}, got {_show(value)}"
    elif kind.startswith(("greater_than", "less_than")):
        reason = err["msg"].replace("Input should be", "must be") + f", got {_show(value)}"
    else:
        reason = err["msg"].removeprefix("Value error, ")
    return f"{path}: {reason}" if path else reason


def parse_study(data: Any, file: str = "") -> Study:
    """A Study from a mapping (as YAML gives it); ConfigError naming the path (and the file) otherwise."""
    if not isinstance(data, dict):
        raise ConfigError(f"{file + ': ' if file else ''}expected a mapping at the top level, got {_show(data)}")
    try:
        return Study.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        first = _message(errors[0])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"{file + ': ' if file else ''}{first}{more}") from None


def apply_override(data: dict, text: str) -> None:
    """`budget.max_runs=8` into `data` (in place). A space path is one key: `space.trainer.lr.low=1e-4`."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text}: expected KEY=VALUE, e.g. budget.max_runs=8")
    try:
        value = _yaml(raw)
    except yaml.YAMLError:
        raise ConfigError(f"--set {text}: the value is not valid YAML") from None
    parts = key.strip().split(".")
    if parts[0] == "space" and len(parts) > 2:  # space keys are config paths with dots of their own
        known = sorted(data.get("space") or {}, key=len, reverse=True)
        rest = ".".join(parts[1:])
        path = next((k for k in known if rest == k or rest.startswith(k + ".")), None)
        if path is not None:
            parts = ["space", path] + ([p for p in rest[len(path) + 1:].split(".")] if rest != path else [])
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        step: Any = int(part) if part.isdigit() and isinstance(node, list) else part
        if isinstance(node, dict):
            node = node.setdefault(step, {})
        elif isinstance(node, list) and isinstance(step, int) and step < len(node):
            node = node[step]
        else:
            raise ConfigError(f"--set {text}: {'.'.join(parts[:i + 1])} is not a mapping or list index")
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"--set {text}: cannot set {key} here")


def load_study(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Study:
    """Read, override and validate a study file; its `base` becomes an absolute path."""
    path = Path(path)
    try:
        data = _yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such study file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    data = data if data is not None else {}
    if isinstance(data, dict):
        for text in overrides:
            apply_override(data, text)
        if isinstance(data.get("base"), str):
            data["base"] = str((path.parent / data["base"]).resolve())
    return parse_study(data, str(path))
