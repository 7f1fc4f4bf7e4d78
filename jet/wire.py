"""Every message that crosses a stream: frozen dataclasses with an explicit kind.

Each type encodes to an entry field map with `to_fields()` and decodes with
`from_payload(payload)`; the layout (schema version, orjson metadata, raw
int32/float32 arrays) is `jet.queues.codec`'s. Decoding validates and raises
`CodecError` only, which consumers turn into a dead letter with the reason.
Messages are facts: `Task` (a unit of rollout work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jet.errors import CodecError
from jet.queues import codec


def _require(meta: dict, key: str, typ: type | tuple[type, ...], kind: str) -> Any:
    value = meta.get(key)
    if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
        raise CodecError(f"{kind}: field {key!r} must be {getattr(typ, '__name__', typ)}, got {value!r}")
    return value


def _expect_kind(payload: codec.Payload, kind: str) -> None:
    if payload.kind != kind:
        raise CodecError(f"expected a {kind!r} message, got {payload.kind!r}")


@dataclass(frozen=True, slots=True)
class Task:
    """One rollout to run: a dataset row, one member of a GRPO group."""

    KIND = "task"

    task: str  # task name (the `tasks:<task>` stream and the config's task)
    row: dict[str, Any]  # the dataset row handed to the workflow
    group_id: str  # shared by the `group_size` copies of one row
    index: int = 0  # member index within the group
    group_size: int = 1
    msg_id: str = field(default_factory=codec.new_id)

    def to_fields(self) -> dict[bytes, bytes]:
        meta = {"task": self.task, "row": self.row, "group_id": self.group_id,
                "index": self.index, "group_size": self.group_size}
        return codec.encode(self.KIND, meta, msg_id=self.msg_id)

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "Task":
        _expect_kind(p, cls.KIND)
        m = p.meta
        return cls(task=_require(m, "task", str, cls.KIND), row=_require(m, "row", dict, cls.KIND),
                   group_id=_require(m, "group_id", str, cls.KIND), index=_require(m, "index", int, cls.KIND),
                   group_size=_require(m, "group_size", int, cls.KIND), msg_id=p.msg_id)
