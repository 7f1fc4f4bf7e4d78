"""Lanes of the env worker: where its episodes come from, where they go, who owns retries.

What it is: configuration, not branches. A `Lane` names the consumer group an
env worker reads `tasks:<task>` in, where a new group starts, the stream its
trajectories go to, and whether it owns the task's fate (retries, dead letters):

- `LIVE`: group `env` from the stream's beginning, trajectories to
  `traj:<model>` (trained), failed episodes retried then dead-lettered;
- `SHADOW` (`jet worker env --shadow`): group `env-shadow` from the stream's
  END ("$": it sees every task enqueued after it started and takes none from
  `env`), trajectories to `shadow:<model>` (no trainer reads it: the SETTLE
  step caps it at `queues.maxlen.shadow`, else `traj`, instead of waiting for
  a reader), failures only recorded (the live workers own retries), and on a
  clean exit the consumer leaves its group, and the group goes with the last
  one, so stopped shadow workers leave nothing in `jet status`.

The shadow group is best-effort (`jet.keys.BEST_EFFORT_GROUPS`): safe trimming
of the tasks stream never waits for it, so a SIGKILLed shadow worker cannot
stall the live workers; one a whole stream behind misses the trimmed tasks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from jet.errors import QueueError
from jet.keys import GROUP_ENV, GROUP_ENV_SHADOW, Keys
from jet.queues.connect import translated

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lane:
    group: str  # consumer group on tasks:<task>
    start: str  # where a new group starts reading: "0" every entry, "$" only new ones
    role: str  # consumer names are <host>-<role>-<task>-<slot>
    traj_kind: str  # "traj" (trained) or "shadow" (recorded only): the Keys method of the output streams
    owns_fate: bool  # retries failed episodes and dead-letters tasks (else records failures only)
    leave_on_exit: bool  # a clean exit deletes the consumer (and the group with the last one)
    meta: dict[str, Any] = field(default_factory=dict)  # added to every trajectory's meta

    def traj(self, keys: Keys, model: str) -> str:
        return getattr(keys, self.traj_kind)(model)


LIVE = Lane(GROUP_ENV, "0", "env", "traj", owns_fate=True, leave_on_exit=False)
SHADOW = Lane(GROUP_ENV_SHADOW, "$", "env-shadow", "shadow", owns_fate=False, leave_on_exit=True,
              meta={"shadow": True})


async def leave_group(r, url: str, stream: str, group: str, name: str) -> None:
    """Delete this consumer (its released entries with it), and the group once no consumer is left."""
    try:
        with translated(url):
            await r.xgroup_delconsumer(stream, group, name)
            if not await r.xinfo_consumers(stream, group):
                await r.xgroup_destroy(stream, group)
                log.info("group %s of %s deleted", group, stream)
    except QueueError as e:  # another worker deleted it first, or Redis is gone
        log.info("leaving group %s: %s", group, e)
