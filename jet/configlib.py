"""Generic machinery behind `jet.config`: dataclass sections loaded from YAML.

A config section is a plain `@dataclass(frozen=True, slots=True)`; `load` builds
one from the dict YAML gives, field by field, following the type hints (nested
sections, `list[...]`, `dict[str, ...]`, `tuple[...]`, `X | None`, `Literal`).
It is strict: unknown keys, wrong types and missing required keys raise
`ConfigError` whose message starts with the offending path, e.g.
`tasks[0].weight: expected float, got 'x'`. What this module is not: it knows
nothing of Jet's schema (that is `jet.config`) and imports only pyyaml.

Invariants: every error raised on purpose is a `ConfigError` carrying `.key`
(the path) and `.reason`; `load(cls, dump(x)) == x` for any section `x`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from jet.errors import ConfigError

# Keys that hold secrets never come from a file (it gets committed, copied into
# run folders): each maps to where the value comes from instead.
SECRET_KEYS = {
    "redis_url": "set JET_REDIS_URL in the environment or pass --redis-url",
    "password": "put it in JET_REDIS_URL (redis://:PASSWORD@host:port) in the environment",
}

_MISSING = dataclasses.MISSING


def invalid(key: str, reason: str, file: str = "") -> ConfigError:
    """The one way to build an error: message `"[<file>: ]<key>: <reason>"`, parts kept as attributes."""
    err = ConfigError(": ".join(p for p in (file, key, reason) if p))
    err.file, err.key, err.reason = file, key, reason
    return err


def join(path: str, key: str | int) -> str:
    """`join("tasks", 0) == "tasks[0]"`, `join("tasks[0]", "name") == "tasks[0].name"`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not path or key.startswith("["):
        return f"{path}{key}"
    return f"{path}.{key}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- checks for __post_init__ (they raise with the field name; load prefixes the section path)


def require(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise invalid(key, reason)


def positive(section: Any, *names: str) -> None:
    """Each named field must be > 0."""
    for name in names:
        value = getattr(section, name)
        require(value > 0, name, f"must be > 0, got {_show(value)}")


def non_negative(section: Any, *names: str) -> None:
    """Each named field must be >= 0."""
    for name in names:
        value = getattr(section, name)
        require(value >= 0, name, f"must be >= 0, got {_show(value)}")


# ---- loading


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _type_name(tp: Any) -> str:
    if tp in (int, float, str, bool):
        return tp.__name__
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) or origin is dict:
        return "a mapping"
    if origin in (list, tuple):
        return "a list"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    return getattr(tp, "__name__", str(tp))


def _no_secret(key: Any, path: str) -> None:
    if key in SECRET_KEYS:
        raise invalid(join(path, key), f"secrets do not belong in config files; {SECRET_KEYS[key]}")


def _check_key(cls: type, key: Any, path: str) -> dataclasses.Field:
    """The field of `cls` named `key`, or a ConfigError for secrets and unknown keys."""
    if not isinstance(key, str):
        raise invalid(join(path, str(key)), f"keys must be strings, got {_show(key)}")
    _no_secret(key, path)
    fields = {f.name: f for f in _fields(cls)}
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise invalid(join(path, key), f"unknown key{hint}")
    return fields[key]


def load(cls: type, data: Any, path: str = "") -> Any:
    """Build the dataclass `cls` from `data` (a dict, as YAML gives it), validating everything.

    `path` is where `data` sits in the whole config, used in error messages. A
    section given as None (`trainer:` with every line commented out) takes its
    defaults.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise invalid(path, f"expected a mapping, got {_show(data)}")
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        field = _check_key(cls, key, path)
        kwargs[key] = _convert(hints[field.name], value, join(path, key))
    for field in _fields(cls):
        if field.name not in kwargs and field.default is _MISSING and field.default_factory is _MISSING:
            raise invalid(join(path, field.name), "missing required key")
    try:
        return cls(**kwargs)
    except ConfigError as err:  # raised by __post_init__ with a key relative to this section
        key = getattr(err, "key", None)
        if key is None:
            raise invalid(path, str(err)) from None
        raise invalid(join(path, key), err.reason) from None
    except (ValueError, TypeError) as err:
        raise invalid(path, str(err)) from None


def _convert(tp: Any, value: Any, path: str) -> Any:
    """`value` checked against (and, for sections, lists and tuples, built as) type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return load(tp, value, path)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:
            try:
                return _convert(option, value, path)
            except ConfigError:
                pass
        try:
            return _convert(options[-1], value, path)
        except ConfigError as err:
            if len(options) == 1 or err.key != path:
                raise
            raise invalid(path, f"expected {_type_name(tp)}, got {_show(value)}") from None
    if origin is Literal:
        # `type(...) is` so that True is not taken for 1, nor 1 for 1.0.
        if any(value == c and type(value) is type(c) for c in args):
            return value
        choices = ", ".join(repr(c) for c in args)
        raise invalid(path, f"expected one of {choices}, got {_show(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise invalid(path, f"expected a list, got {_show(value)}")
        return [_convert(args[0], v, join(path, i)) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise invalid(path, f"expected a list, got {_show(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, join(path, i)) for i, v in enumerate(value))
        if len(value) != len(args):
            raise invalid(path, f"expected a list of {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, join(path, i)) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise invalid(path, f"expected a mapping, got {_show(value)}")
        out = {}
        for k, v in value.items():
            _no_secret(k, path)
            out[_convert(args[0], k, join(path, str(k)))] = _convert(args[1], v, join(path, str(k)))
        return out
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (str, bool):
        if type(value) is tp:
            return value
    else:
        raise TypeError(f"{path}: configlib cannot load fields of type {tp!r}")
    raise invalid(path, f"expected {tp.__name__}, got {_show(value)}")


def dump(section: Any) -> Any:
    """A section as plain dicts, lists and scalars (tuples become lists), ready for YAML."""
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return {f.name: dump(getattr(section, f.name)) for f in _fields(type(section))}
    if isinstance(section, (list, tuple)):
        return [dump(v) for v in section]
    if isinstance(section, dict):
        return {k: dump(v) for k, v in section.items()}
    return section


# ---- YAML files and --set overrides


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-5` is a float, not a string) and no duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file; errors name the file (and the line when the YAML is malformed)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise invalid("", "no such config file", str(path)) from None
    except OSError as err:
        raise invalid("", f"cannot read config file: {err.strerror or err}", str(path)) from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise invalid("", f"invalid YAML: {problem}", where) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise invalid("", f"expected a mapping at the top level, got {type(data).__name__}", str(path))
    return data


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """`"tasks.0.weight=2"` (or `tasks[0].weight=2`) -> `(["tasks", 0, "weight"], 2)`."""
    key, sep, raw = text.partition("=")
    key = re.sub(r"\[(\d+)\]", r".\1", key.strip())
    parts = key.split(".")
    if not sep or not all(parts):
        raise invalid(f"--set {text}", "expected KEY=VALUE, e.g. trainer.lr=1e-5 or tasks.0.weight=2")
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError:
        raise invalid(f"--set {text}", "the value is not valid YAML") from None
    return [int(p) if p.isdigit() else p for p in parts], value


def apply_overrides(cls: type, data: dict, overrides: typing.Iterable[str]) -> dict:
    """`data` (modified in place, and returned) with each `a.b.c=value` override set.

    The key path is checked against the schema of `cls` as it is walked, so a typo
    names the path; the value itself is type-checked later, by `load`.
    """
    for text in overrides:
        parts, value = parse_override(text)
        node, tp, path = data, cls, ""
        for i, part in enumerate(parts):
            tp, part = _step(_unwrap_optional(tp), node, part, path)
            path = join(path, part)
            if i == len(parts) - 1:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return data


def _step(tp: Any, node: Any, part: str | int, path: str) -> tuple[Any, str | int]:
    """One key of an override path: the type found under `part` in `tp`, and the key to use in `node`."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) or origin is dict:
        if not isinstance(node, dict):
            raise invalid(path, f"is not a mapping in the config file (it is {_show(node)})")
        if dataclasses.is_dataclass(tp):
            return _hints(tp)[_check_key(tp, str(part), path).name], str(part)
        _no_secret(part, path)
        return typing.get_args(tp)[1], str(part)
    if origin in (list, tuple):
        if not isinstance(part, int):
            raise invalid(join(path, part), f"{path} is a list: use an index, e.g. {path}.0.{part}")
        if not isinstance(node, list):
            raise invalid(path, "is not a list in the config file: set the whole list instead")
        if part >= len(node):
            raise invalid(join(path, part), f"index out of range: {path} has {len(node)} item(s)")
        args = typing.get_args(tp)
        if origin is list or args[-1] is Ellipsis:
            return args[0], part
        if part >= len(args):
            raise invalid(join(path, part), f"index out of range: {path} takes {len(args)} item(s)")
        return args[part], part
    raise invalid(join(path, part), f"{path} is {_type_name(tp)}, not a section")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return options[0]
    return tp


def write_yaml(data: dict, path: str | Path, header: str = "") -> Path:
    """Write `data` as YAML atomically (temp file + rename) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False), encoding="utf-8")
    tmp.replace(path)
    return path
