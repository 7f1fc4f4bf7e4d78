"""The entry codec: how every Jet message is laid out in a stream entry.

An entry is a flat field map (no pickle, ever):

    v        schema version, ASCII digits (SCHEMA_VERSION)
    k        message kind (`task`, `gen`, `traj`, ...)
    i        the message's own id: the idempotency key that survives redelivery
             and producer retries (a stream entry id does not)
    m        metadata as orjson
    i4:NAME  an int32 array, raw little-endian bytes (token ids)
    f4:NAME  a float32 array, raw little-endian bytes (logprobs)
    o:NAME   an opaque byte field carried verbatim (a dead letter's original entry)

`decode` validates all of it and raises `CodecError` with a reason; consumers
turn that into a dead letter. This module does no I/O and imports no redis.
"""

from __future__ import annotations

import sys
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import orjson

from jet.errors import CodecError

SCHEMA_VERSION = 1
DEFAULT_MAX_BYTES = 16 * 1024 * 1024  # one entry; a 10k-token request is ~40 KB

_TYPECODES = {b"i4:": "i", b"f4:": "f"}
_BIG_ENDIAN = sys.byteorder == "big"
assert array("i").itemsize == 4 and array("f").itemsize == 4, "int32/float32 arrays required"


def new_id() -> str:
    """A fresh message id (hex uuid4)."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Payload:
    """A decoded entry."""

    kind: str
    msg_id: str
    meta: dict[str, Any]
    arrays: dict[str, array] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)


def _to_array(name: str, values: Any, code: str) -> bytes:
    if isinstance(values, array) and values.typecode == code:
        arr = values
    elif hasattr(values, "numpy") and callable(values.numpy):  # a torch tensor
        return _to_array(name, values.detach().cpu().numpy(), code)
    elif hasattr(values, "dtype") and hasattr(values, "tobytes"):  # numpy
        want = "<i4" if code == "i" else "<f4"
        return values.astype(want, copy=False).tobytes()
    else:
        try:
            arr = array(code, values)
        except (TypeError, OverflowError) as e:
            raise CodecError(f"array {name!r}: {e}") from e
    if _BIG_ENDIAN:
        arr = array(code, arr)
        arr.byteswap()
    return arr.tobytes()


def encode(
    kind: str,
    meta: Mapping[str, Any],
    *,
    ints: Mapping[str, Iterable[int]] | None = None,
    floats: Mapping[str, Iterable[float]] | None = None,
    raw: Mapping[str, bytes] | None = None,
    msg_id: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[bytes, bytes]:
    """Build an entry's field map. Raises CodecError when it would exceed `max_bytes`."""
    try:
        m = orjson.dumps(meta)
    except TypeError as e:
        raise CodecError(f"{kind}: metadata is not JSON-serialisable: {e}") from e
    fields: dict[bytes, bytes] = {
        b"v": str(SCHEMA_VERSION).encode(),
        b"k": kind.encode(),
        b"i": (msg_id or new_id()).encode(),
        b"m": m,
    }
    for name, values in (ints or {}).items():
        fields[b"i4:" + name.encode()] = _to_array(name, values, "i")
    for name, values in (floats or {}).items():
        fields[b"f4:" + name.encode()] = _to_array(name, values, "f")
    for name, value in (raw or {}).items():
        fields[b"o:" + name.encode()] = bytes(value)
    size = entry_size(fields)
    if size > max_bytes:
        raise CodecError(f"{kind}: entry of {size} bytes exceeds the limit of {max_bytes}")
    return fields


def entry_size(fields: Mapping[bytes, bytes]) -> int:
    return sum(len(k) + len(v) for k, v in fields.items())


def decode(fields: Mapping[bytes, bytes], *, max_bytes: int = DEFAULT_MAX_BYTES) -> Payload:
    """Validate and decode an entry; raise CodecError naming what is wrong."""
    if not fields:
        raise CodecError("empty entry (its payload was trimmed or deleted)")
    size = entry_size(fields)
    if size > max_bytes:
        raise CodecError(f"oversize entry: {size} bytes exceeds the limit of {max_bytes}")
    version = fields.get(b"v")
    if version is None:
        raise CodecError("malformed entry: no schema version field 'v'")
    if version != str(SCHEMA_VERSION).encode():
        shown = version[:20].decode("utf-8", "replace")
        raise CodecError(f"unknown schema version {shown!r} (this worker reads {SCHEMA_VERSION})")
    try:
        kind = fields[b"k"].decode()
        msg_id = fields[b"i"].decode()
        meta = orjson.loads(fields[b"m"])
    except KeyError as e:
        raise CodecError(f"malformed entry: missing field {e.args[0].decode()!r}") from None
    except (UnicodeDecodeError, orjson.JSONDecodeError) as e:
        raise CodecError(f"malformed entry: {e}") from None
    if not isinstance(meta, dict):
        raise CodecError(f"malformed entry: metadata is {type(meta).__name__}, not an object")
    arrays: dict[str, array] = {}
    raw: dict[str, bytes] = {}
    for key, value in fields.items():
        if key in (b"v", b"k", b"i", b"m"):
            continue
        prefix = key[:3]
        if prefix in _TYPECODES:
            if len(value) % 4:
                raise CodecError(f"malformed entry: array {key.decode()!r} has {len(value)} bytes")
            arr = array(_TYPECODES[prefix])
            arr.frombytes(value)
            if _BIG_ENDIAN:
                arr.byteswap()
            arrays[key[3:].decode()] = arr
        elif key.startswith(b"o:"):
            raw[key[2:].decode("utf-8", "replace")] = value
        else:
            raise CodecError(f"malformed entry: unknown field {key[:40]!r}")
    return Payload(kind, msg_id, meta, arrays, raw)
