"""The glue between YAML, pydantic and Jet's one-line config errors.

What it is: `Section`, the base of every config section (a pydantic v2 model:
frozen, unknown keys forbidden, strict types: no `'1'` -> 1, a bool is not an
int, an int is accepted for a float and stored as one; an empty section takes
its defaults); `validate`, which turns pydantic's ValidationError into one
`ConfigError` whose message starts with the offending path
(`tasks[0].weight: expected float, got 'x'`); the YAML reader (YAML 1.2
floats, no duplicate keys) and `--set a.b.c=value` overrides, whose key path is
checked against the schema as it is walked. What it is not: the schema (that is
`jet.config`); the checks themselves are pydantic's.

Invariants: every error raised on purpose is a `ConfigError` carrying `.file`,
`.key` (the path) and `.reason`; `validate(cls, dump(x)) == x` for any section.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Union

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
    """What a validator raises: `key` is relative to the value validated (`"maxlen.taks"`, `"[0].model"`)."""
    return PydanticCustomError("jet", "{reason}", {"key": key, "reason": reason})


def join(path: str, key: str | int) -> str:
    """`join("tasks", 0) == "tasks[0]"`, `join("tasks[0]", "name") == "tasks[0].name"`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not path or not key or key.startswith("["):
        return f"{path}{key}"
    return f"{path}.{key}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Meta(type(pydantic.BaseModel)):
    # `TrainerConfig(lr=-1.0)` raises the same ConfigError as a file would. Only direct calls come
    # through here: pydantic builds nested sections without calling the class.
    def __call__(cls, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except pydantic.ValidationError as err:
            raise translate(err, cls) from None


class Section(pydantic.BaseModel, metaclass=_Meta):
    """A config section; each field's docstring (the line below it) is its description."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True,
                                       ser_json_inf_nan="constants")

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
            tp = _unwrap_optional(field.annotation) if field else None
            # True == 1 in Python, but not in a config: a literal matches in type too.
            if typing.get_origin(tp) is Literal and not any(value == c and type(value) is type(c)
                                                            for c in typing.get_args(tp)):
                raise problem(name, f"expected one of {_choices(tp)}, got {_show(value)}")
            if typing.get_origin(tp) is tuple and isinstance(value, list):  # YAML has lists, not tuples
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
    if isinstance(data, dict):
        for key, value in data.items():
            if key in SECRET_KEYS:
                raise invalid(join(path, key), f"secrets do not belong in config files; {SECRET_KEYS[key]}")
            _no_secrets(value, join(path, str(key)))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _no_secrets(value, join(path, i))


# ---- pydantic's errors as one line naming the path


def translate(err: pydantic.ValidationError, cls: type, path: str = "") -> ConfigError:
    """The first of `err`'s errors (an unknown key before the others: a typo explains a missing key)."""
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    e = errors[0]
    where, tp, parent, above = path, cls, None, path
    loc = list(e["loc"])
    for i, part in enumerate(loc):
        if part == "[key]":
            return invalid(where, f"keys must be strings, got {_show(e['input'])}")
        if _is_union(tp):  # pydantic names the union member it tried: skip it
            if i == len(loc) - 1:
                break
            tp = next((a for a in typing.get_args(tp) if _name(a) == part), Any)
            continue
        key = part if typing.get_origin(_unwrap_optional(tp)) in (list, tuple) else str(part)  # only lists index
        parent, above, tp, where = tp, where, _child(tp, part), join(where, key)
    kind, ctx, value = e["type"], e.get("ctx") or {}, e.get("input")
    if kind == "jet":
        return invalid(join(where, ctx["key"]), ctx["reason"])
    if kind == "missing" and typing.get_origin(_unwrap_optional(parent)) is tuple:
        want = len(typing.get_args(_unwrap_optional(parent)))
        return invalid(above, f"expected a list of {want} items, got {len(value)}")
    if kind == "missing":
        return invalid(where, "missing required key")
    if kind == "invalid_key":
        return invalid(where, f"keys must be strings, got {_show(loc[-1])}")
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), list(getattr(parent, "model_fields", ())), n=1)
        return invalid(where, "unknown key" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    bounds = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
              "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}
    if kind in bounds:
        name, op = bounds[kind]
        return invalid(where, f"must be {op} {ctx[name]:g}, got {_show(value)}")
    if kind == "string_too_short":
        return invalid(where, "must not be empty")
    if kind in ("too_short", "too_long"):
        return invalid(where, f"expected a list of {ctx.get('max_length', ctx.get('min_length'))} items, "
                              f"got {ctx['actual_length']}")
    if kind == "value_error":
        return invalid(where, str(ctx["error"]))
    if kind == "literal_error" and typing.get_origin(tp) is Literal:
        return invalid(where, f"expected one of {_choices(tp)}, got {_show(value)}")
    if kind.endswith("_type") or kind == "model_attributes_type":
        return invalid(where, f"expected {_type_name(tp)}, got {_show(value)}")
    return invalid(where, f"{e['msg']}, got {_show(value)}")


def _child(tp: Any, key: str | int) -> Any:
    """The type found under `key` in a value of type `tp` (Any when the schema does not say)."""
    tp = _unwrap_optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        field = tp.model_fields.get(key) if isinstance(key, str) else None
        return field.annotation if field else Any
    if origin is dict:
        return args[1]
    if origin is list or (origin is tuple and args[-1:] == (Ellipsis,)):
        return args[0]
    if origin is tuple and isinstance(key, int) and key < len(args):
        return args[key]
    return Any


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and len(_options(tp)) > 1


def _options(tp: Any) -> list:
    return [a for a in typing.get_args(tp) if a is not type(None)]


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Annotated:
        return _unwrap_optional(typing.get_args(tp)[0])
    if typing.get_origin(tp) in (Union, types.UnionType) and len(_options(tp)) == 1:
        return _unwrap_optional(_options(tp)[0])
    return tp


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is None else str(tp)


def _choices(tp: Any) -> str:
    return ", ".join(repr(c) for c in typing.get_args(tp))


def _type_name(tp: Any) -> str:
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if tp in (int, float, str, bool):
        return tp.__name__
    if origin is dict or (isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)):
        return "a mapping"
    if origin in (list, tuple):
        return "a list"
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in _options(tp))
    return _name(tp)


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
        raise invalid("", f"invalid YAML: {getattr(err, 'problem', None) or err}", where) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise invalid("", f"expected a mapping at the top level, got {type(data).__name__}", str(path))
    return data


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
    is_model = isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)
    if is_model or origin is dict:
        if not isinstance(node, dict):
            raise invalid(path, f"is not a mapping in the config file (it is {_show(node)})")
        part = str(part)
        if part in SECRET_KEYS:
            raise invalid(join(path, part), f"secrets do not belong in config files; {SECRET_KEYS[part]}")
        if is_model and part not in tp.model_fields:
            close = difflib.get_close_matches(part, list(tp.model_fields), n=1)
            raise invalid(join(path, part), "unknown key" + (f" (did you mean {close[0]!r}?)" if close else ""))
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
