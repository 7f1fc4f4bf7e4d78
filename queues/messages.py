"""What a consumer hands a handler and what the handler hands back: values, not callbacks.

What it is: `Delivery` (one entry read from a group, decoded) and the four
outcomes a handler returns for it: `Commit` (ack + marker + outputs),
`Release` (give it back now), `Dead` (dead-letter with a reason) and `Drop`
(ack, the work is moot). `jet.queues.consumer.Consumer.settle` applies them
atomically; `jet.queues.runtime.Runtime` turns handler results into them.
What it is not: I/O. Nothing here talks to Redis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from jet.queues import codec


@dataclass(slots=True)
class Delivery:
    """One entry handed to a handler."""

    stream: str
    entry_id: str
    fields: dict[bytes, bytes]
    payload: codec.Payload
    deliveries: int = 1
    received: float = field(default_factory=time.monotonic)

    @classmethod
    def known(cls, stream: str, entry_id: str, msg_id: str) -> "Delivery":
        """An entry known by its ids alone (a checkpoint's ledger): enough to settle it."""
        return cls(stream, entry_id, {}, codec.Payload("", msg_id, {}))


Output = tuple[str, Mapping[bytes, bytes]]  # (stream key, entry fields)


# -- outcomes: what a handler decided for one delivery ---------------------------
# Values by convention, not frozen: a frozen dataclass costs ~0.25 us more per instance, and a
# batch hop builds one per message (`jet bench queue`). Nothing mutates an outcome once made.


@dataclass(slots=True)
class Commit:
    """Ack + idempotency marker + these outputs, atomically (outputs to `dead` count as dead letters);
    `counter`, when set, is bumped in stats in the same step."""

    outputs: Sequence[Output] = ()
    counter: str = ""


@dataclass(slots=True)
class Release:
    """Give the entry back now for another delivery; `error` becomes the reason if it dies later."""

    error: str | None = None


@dataclass(slots=True)
class Dead:
    """Dead-letter the entry now with `reason`, atomically with its ack."""

    reason: str


# The reason of a dead letter the trainer wrote as one of its own outcomes (poison: counted in its counts,
# so the feeder's admission does not count it again as lost work).
TRAINER_REASON = "trainer: "


@dataclass(slots=True)
class Drop:
    """Ack without marker or outputs: the work is moot (its client is gone). Bumps stats `counter`."""

    counter: str = ""


Outcome = Commit | Release | Dead | Drop
