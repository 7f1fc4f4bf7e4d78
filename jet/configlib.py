"""The glue between YAML, pydantic and Jet's one-line config errors.

What it is: `Section`, the base of every config section (a pydantic v2 model:
frozen, unknown keys forbidden, strict: no `'1'` -> 1, a bool is neither an int
nor a literal 1, an int is taken for a float and stored as one; a section given
as null takes its defaults); `validate`, which reports pydantic's first error as
one `ConfigError` starting with the path (`tasks[0].weight: expected float, got
'x'`); the YAML reader (YAML 1.2 floats, no duplicate keys) and `--set a.b=v`
overrides, whose key path is checked against the schema as it is walked. What
it is not: the schema (`jet.config`) or the checks (pydantic's).

Invariants: every error raised on purpose is a `ConfigError` carrying `.file`,
`.key` (the path) and `.reason`; `validate(cls, dump(x)) == x` for any section.
"""

from __future__ import annotations

import difflib
import re
import types
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Union, get_args, get_origin

import pydantic
import yaml
from pydantic_core import PydanticCustomError

from jet.errors import ConfigError

# Keys that hold secrets never come from a file (it gets committed, copied into
# run folders): each maps to where the value comes from instead.
SECRET_KEYS = {
    "redis_url": "set JET_REDIS_URL in the environment or pass --redis-url",
    "password": "put it in JET_REDIS_URL (redis://:PASSWORD@host:port) in the environment",
}


def invalid(key: str, reason: str, file: str = "") -> ConfigError:
    """The one way to build an error: message `"[<file>: ]<key>: <reason>"`, parts kept as attributes."""
    err = ConfigError(": ".join(p for p in (file, key, reason) if p))
    err.file, err.key, err.reason = file, key, reason
    return err


def problem(key: str, reason: str) -> PydanticCustomError:
    """What a validator raises; `key` is relative to the value validated (`"maxlen.taks"`, `"[0].model"`)."""
    return PydanticCustomError("jet", "{reason}", {"key": key, "reason": reason})


def join(path: str, key: str | int) -> str:
    """`join("tasks", 0) == "tasks[0]"`, `join("tasks[0]", "name") == "tasks[0].name"`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}{key}" if not path or not key or key.startswith("[") else f"{path}.{key}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Section(pydantic.BaseModel):
    """A config section; the docstring under each field is its description."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True,
                                       ser_json_inf_nan="constants")

    @classmethod
    def of(cls, **values: Any) -> Any:
        """A section from keyword values, as a file's would be checked: one ConfigError naming the key
        (a plain `TrainerConfig(lr=...)` raises pydantic's ValidationError)."""
        return validate(cls, values)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _before(cls, data: Any) -> Any:
        if data is None:  # `trainer:` with every line commented out
            return {}
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            tp = _plain(field.annotation) if field else None
            # True == 1 in Python, not in a config: a literal must match in type too.
            if get_origin(tp) is Literal and not any(value == c and type(value) is type(c) for c in get_args(tp)):
                raise problem(name, f"expected {_type_name(tp)}, got {_show(value)}")
            if get_origin(tp) is tuple and isinstance(value, list):  # YAML has lists, not tuples
                out[name] = tuple(value)
        return out


def validate(cls: type[Section], data: Any, path: str = "") -> Any:
    """`cls` built from `data` (as YAML gives it), or one ConfigError naming the path under `path`."""
    _no_secrets(data, path)
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as err:
        raise translate(err, cls, path) from None


def dump(section: Section) -> dict:
    """A section as plain dicts, lists and scalars, ready for YAML."""
    return section.model_dump(mode="json")


def _no_secrets(data: Any, path: str) -> None:
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        if key in SECRET_KEYS and isinstance(data, dict):
            raise invalid(join(path, key), f"secrets do not belong in config files; {SECRET_KEYS[key]}")
        _no_secrets(value, join(path, key if isinstance(data, list) else str(key)))


def translate(err: pydantic.ValidationError, cls: type, path: str = "") -> ConfigError:
    """pydantic's first error (an unknown key before the rest: a typo explains a missing key) as one line."""
    e = min(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    kind, ctx, value, loc = e["type"], e.get("ctx") or {}, e.get("input"), e["loc"]
    where, above, tp, parent = path, path, cls, None
    for i, part in enumerate(loc):
        if part == "[key]":
            return invalid(where, f"keys must be strings, got {_show(value)}")
        if get_origin(tp) in (Union, types.UnionType) and len(_options(tp)) > 1:  # the member pydantic tried
            if i == len(loc) - 1:
                break
            tp = next((a for a in get_args(tp) if getattr(a, "__name__", None) == part), Any)
            continue
        index = get_origin(_plain(tp)) in (list, tuple)  # only lists take [i]; a dict's 1 is .1
        parent, above, tp, where = tp, where, _child(tp, part), join(where, part if index else str(part))
    if kind == "jet":
        return invalid(join(where, ctx["key"]), ctx["reason"])
    if kind == "missing" and get_origin(_plain(parent)) is tuple:
        return invalid(above, f"expected a list of {len(get_args(_plain(parent)))} items, got {len(value)}")
    if tp is float and type(value) is int:
        value = float(value)
    for bound, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if bound in ctx and kind.startswith(("greater", "less")):
            return invalid(where, f"must be {op} {ctx[bound]:g}, got {_show(value)}")
    reason = {
        "missing": "missing required key",
        "invalid_key": f"keys must be strings, got {_show(loc[-1] if loc else value)}",
        "extra_forbidden": "unknown key" + (hint(str(loc[-1]), getattr(_plain(parent), "model_fields", ()))
                                            if loc else ""),
        "string_too_short": "must not be empty",
        "too_long": f"expected a list of {ctx.get('max_length')} items, got {ctx.get('actual_length')}",
        "value_error": str(ctx.get("error")),
    }.get(kind)
    if reason is None:
        reason = f"expected {_type_name(tp)}, got {_show(value)}" if tp is not Any else f"{e['msg']}: {_show(value)}"
    return invalid(where, reason)


def hint(key: str, names: Iterable[str]) -> str:
    """` (did you mean 'lr'?)` for the closest of `names`, or ''."""
    close = difflib.get_close_matches(key, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---- walking the schema (type hints of the sections)


def _options(tp: Any) -> list:
    return [a for a in get_args(tp) if a is not type(None)]


def _plain(tp: Any) -> Any:
    """`tp` without Annotated metadata and without `| None`."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _plain(get_args(tp)[0])
    if origin in (Union, types.UnionType) and len(_options(tp)) == 1:
        return _plain(_options(tp)[0])
    return tp


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)


def _child(tp: Any, key: str | int) -> Any:
    """The type found under `key` in a value of type `tp` (Any when the schema does not say)."""
    tp = _plain(tp)
    origin, args = get_origin(tp), get_args(tp)
    if _is_section(tp):
        field = tp.model_fields.get(key) if isinstance(key, str) else None
        return field.annotation if field else Any
    if origin is dict:
        return args[1]
    if origin is list or (origin is tuple and args[-1:] == (Ellipsis,)):
        return args[0]
    return args[key] if origin is tuple and isinstance(key, int) and key < len(args) else Any


def _type_name(tp: Any) -> str:
    tp = _plain(tp)
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(tp))
    if origin is dict or _is_section(tp):
        return "a mapping"
    if origin in (list, tuple):
        return "a list"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in _options(tp))
    return getattr(tp, "__name__", str(tp))


# ---- YAML files and --set overrides


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-5` is a float, not a string) and no duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
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
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except FileNotFoundError:
        raise invalid("", "no such config file", str(path)) from None
    except OSError as err:
        raise invalid("", f"cannot read config file: {err.strerror or err}", str(path)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise invalid("", f"invalid YAML: {getattr(err, 'problem', None) or err}", where) from None
    if data is not None and not isinstance(data, dict):
        raise invalid("", f"expected a mapping at the top level, got {type(data).__name__}", str(path))
    return data or {}


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """`"tasks.0.weight=2"` (or `tasks[0].weight=2`) -> `(["tasks", 0, "weight"], 2)`."""
    key, sep, raw = text.partition("=")
    parts = re.sub(r"\[(\d+)\]", r".\1", key.strip()).split(".")
    if not sep or not all(parts):
        raise invalid(f"--set {text}", "expected KEY=VALUE, e.g. trainer.lr=1e-5 or tasks.0.weight=2")
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError:
        raise invalid(f"--set {text}", "the value is not valid YAML") from None
    return [int(p) if p.isdigit() else p for p in parts], value


def apply_overrides(cls: type, data: dict, overrides: Iterable[str]) -> dict:
    """`data` (modified in place, and returned) with each `a.b.c=value` override set.

    The key path is checked against the schema of `cls` as it is walked, so a typo
    names the path; the value itself is type-checked later, by `validate`.
    """
    for text in overrides:
        parts, value = parse_override(text)
        node, tp, path = data, cls, ""
        for i, part in enumerate(parts):
            tp, part = _step(_plain(tp), node, part, path)
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
    origin = get_origin(tp)
    if _is_section(tp) or origin is dict:
        part = str(part)
        if not isinstance(node, dict):
            raise invalid(path, f"is not a mapping in the config file (it is {_show(node)})")
        if part in SECRET_KEYS:
            raise invalid(join(path, part), f"secrets do not belong in config files; {SECRET_KEYS[part]}")
        if _is_section(tp) and part not in tp.model_fields:
            raise invalid(join(path, part), "unknown key" + hint(part, tp.model_fields))
        return _child(tp, part), part
    if origin in (list, tuple):
        if not isinstance(part, int):
            raise invalid(join(path, part), f"{path} is a list: use an index, e.g. {path}.0.{part}")
        if not isinstance(node, list):
            raise invalid(path, "is not a list in the config file: set the whole list instead")
        if part >= len(node):
            raise invalid(join(path, part), f"index out of range: {path} has {len(node)} item(s)")
        return _child(tp, part), part
    raise invalid(join(path, part), f"{path} is {_type_name(tp)}, not a section")


def write_yaml(data: dict, path: str | Path, header: str = "") -> Path:
    """Write `data` as YAML atomically (temp file + rename) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False), encoding="utf-8")
    tmp.replace(path)
    return path
