"""Shadow mode of the env worker (`jet worker env --shadow`): its consumer group and its output streams.

What it is: the Redis steps that differ from a live env worker, used by
`jet.workers.env.TaskRunner` when it runs in shadow mode:

- `GROUP_START`: the shadow group `env-shadow` on `tasks:<task>` is created
  at the stream's END ("$"), so a shadow worker sees every task enqueued after
  it started and takes none from the live group `env`;
- `trim_outputs`: its trajectories go to `shadow:<model>`, which no trainer
  reads (so no group acks them): each publish trims it to the newest
  `queues.maxlen.traj` entries;
- `leave_group`: on a clean exit the consumer is deleted, and the group with
  the last one, so stopped shadow workers leave nothing in `jet status`.

The shadow group is best-effort (`jet.keys.BEST_EFFORT_GROUPS`): safe trimming
of the tasks stream never waits for it, so a SIGKILLed shadow worker, whose
group stays behind, cannot stall the live workers; a shadow worker a whole
stream behind misses the trimmed tasks. Shadow workers never retry,
dead-letter or re-enqueue a task (the env worker checks `shadow`), and tag
their trajectories `meta["shadow"] = True`.

What it is not: the episode loop, which is the env worker's.
"""

from __future__ import annotations

import logging

from jet.errors import QueueError
from jet.queues.connect import translated
from jet.queues.consumer import Consumer

log = logging.getLogger(__name__)

GROUP_START = "$"  # `Consumer.ensure_group(start)` of the shadow group: new tasks only


async def trim_outputs(c: Consumer, url: str, streams: set[str], maxlen: int) -> None:
    """Shadow streams have no reader group: keep the newest `maxlen` entries (approximately)."""
    with translated(url):
        for key in streams:
            await c.r.xtrim(key, maxlen=maxlen, approximate=True)


async def leave_group(c: Consumer, url: str) -> None:
    """Delete this consumer (its released entries with it), and the group once no consumer is left."""
    try:
        with translated(url):
            await c.r.xgroup_delconsumer(c.stream, c.group, c.name)
            if not await c.r.xinfo_consumers(c.stream, c.group):
                await c.r.xgroup_destroy(c.stream, c.group)
                log.info("shadow group %s of %s deleted", c.group, c.stream)
    except QueueError as e:  # another shadow worker deleted it first, or Redis is gone
        log.info("leaving shadow group %s: %s", c.group, e)
