"""The writer of Task messages: dataset rows -> `group_size` Tasks a row on `tasks:<task>`.

Each row becomes `group_size` Tasks sharing a fresh `group_id` (one GRPO group). Writes go through the
bounded `Producer` with dedup markers, so a full stream makes a write wait (never drop) and a retried batch
never adds a task twice. Used by the feeder (`jet.workers.feeder.feeder`), `jet enqueue`
(`jet.cli.enqueue`) and the benches.
"""

from __future__ import annotations

import uuid
from typing import Callable

from jet.errors import CodecError, ConfigError
from jet.keys import Keys
from jet.wire import Task

SEND_CHUNK = 100  # tasks per Producer.send: one atomic PRODUCE call unless the stream is full


def tasks_for(task: str, rows: list[dict], group_size: int) -> list[Task]:
    out = []
    for row in rows:
        gid = uuid.uuid4().hex
        out += [Task(task, row, gid, i, group_size) for i in range(group_size)]
    return out


def encode_rows(task: str, rows: list[tuple[str, dict]], group_size: int, max_bytes: int,
                keep: int | None = None) -> list[dict]:
    """The entries of the `group_size` tasks of each of the first `keep` rows (all by default); later rows
    are checked (one task each) but not kept. `rows` are (where, row), `where` naming the row
    (`file:line`); a row whose entry cannot be encoded or exceeds `max_bytes` is a ConfigError naming it."""
    from jet.queues.codec import entry_size

    entries = []
    for i, (where, row) in enumerate(rows):
        kept = keep is None or i < keep
        for t in tasks_for(task, [row], group_size if kept else 1):
            try:
                fields = t.to_fields()
            except CodecError as e:
                raise ConfigError(f"{where}: cannot be written as a task: {e}") from None
            size = entry_size(fields)
            if size > max_bytes:
                raise ConfigError(f"{where}: its task entry is {size} bytes, over the entry limit "
                                  f"queues.max_entry_bytes ({max_bytes}); nothing was written")
            if kept:
                entries.append(fields)
    return entries


async def write(url: str, run: str, task: str, entries: list[dict], maxlen: int,
                progress: Callable[[int], None] | None = None) -> int:
    """Send encoded task entries to tasks:<task>; `progress(k)` after each k sent."""
    from jet.queues.connect import connect
    from jet.queues.producer import Producer

    keys = Keys(run)
    r = await connect(url)
    try:
        prod = Producer(r, url, keys, keys.tasks(task), maxlen=maxlen, dedup=True)
        for i in range(0, len(entries), SEND_CHUNK):
            chunk = entries[i:i + SEND_CHUNK]
            await prod.send(chunk)
            if progress:
                progress(len(chunk))
    finally:
        await r.aclose()
    return len(entries)


async def enqueue(url: str, run: str, task: str, tasks: list[Task], maxlen: int, progress=None) -> int:
    """Send Tasks to tasks:<task> (what `jet feed` and `jet up` top up with); returns how many."""
    return await write(url, run, task, [t.to_fields() for t in tasks], maxlen, progress)
