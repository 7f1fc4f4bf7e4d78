"""The reaper: reclaims entries other consumers left idle past the lease.

It runs inside every consumer process (the consumer runtime,
jet.queues.runtime, runs a pass every lease/2, at most every 5 s, and trims the
stream after it), so reclaiming scales with consumers and needs no extra role.
Each pass follows XAUTOCLAIM's cursor until 0-0 (or until it has claimed what
the consumer has room for, `room()`: a busy consumer claims nothing, so an idle
one takes a dead consumer's work; the next pass resumes from the cursor), counts the deleted
ids XAUTOCLAIM reports as lost work, and queues claimed entries for its
Consumer's `fetch`, which dead-letters those past `max_deliveries`. An entry
already queued or in flight here is never queued twice (its delivery count is
updated instead); the runtime's lease keeper renews queued entries like
in-flight ones until `fetch` hands them out.
"""

from __future__ import annotations

import logging

from jet.queues.connect import translated
from jet.queues.consumer import Consumer, as_str

log = logging.getLogger(__name__)


class Reaper:
    """`room()`, when given, says how many more entries this consumer can take now (a busy one
    claims nothing, so another, idle, consumer reclaims a dead one's work)."""

    def __init__(self, consumer: Consumer, room=None):
        self.c = consumer
        self.room = room
        self.cursor = "0-0"
        self.lost = 0
        self.claimed_total = 0

    async def reap(self) -> int:
        """One pass; returns how many entries were claimed for this consumer."""
        c = self.c
        want = (self.room() if self.room else c.cfg.batch * 2) - len(c.claimed)
        if want <= 0:
            return 0
        got = 0
        with translated(c.url):
            while got < want:
                cursor, claimed, deleted = await c.r.execute_command(
                    "XAUTOCLAIM", c.stream, c.group, c.name, c.cfg.lease_ms, self.cursor, "COUNT", c.cfg.batch)
                self.cursor = as_str(cursor)
                if deleted:
                    self.lost += len(deleted)
                    await c.count_lost(len(deleted), "idle entries whose payload was deleted (XAUTOCLAIM)")
                if claimed:
                    counts = await self._counts([as_str(i) for i, _ in claimed])
                    if not c.cfg.count_rereads:
                        counts = await self._uncount(counts)
                    queued = {e[0]: k for k, e in enumerate(c.claimed)}
                    for entry_id, fields in claimed:
                        entry_id = as_str(entry_id)
                        fields = dict(zip(fields[::2], fields[1::2])) if isinstance(fields, list) else fields
                        item = (entry_id, fields or {}, counts.get(entry_id, 1))
                        if entry_id in queued:
                            c.claimed[queued[entry_id]] = item
                        elif entry_id not in c.inflight:
                            c.claimed.append(item)
                    got += len(claimed)
                if self.cursor == "0-0":
                    break
        if got:
            self.claimed_total += got
            log.info("%s: reclaimed %d idle entries", c.keys.short(c.stream), got)
        return got

    async def _uncount(self, counts: dict[str, int]) -> dict[str, int]:
        """Take back the delivery XAUTOCLAIM just counted (XCLAIM RETRYCOUNT, JUSTID): for a consumer whose
        re-reads do not count (`Settings.count_rereads` off: the trainer, whose name is stable across
        restarts), what a restarted process reclaims from its dead predecessor is no more a delivery than
        what it re-reads, so a crash loop never dead-letters the trajectories it held."""
        c = self.c
        back = {i: max(1, n - 1) for i, n in counts.items()}
        async with c.r.pipeline(transaction=False) as p:
            for i, n in back.items():
                p.xclaim(c.stream, c.group, c.name, 0, [i], retrycount=n, justid=True)
            await p.execute()
        return back

    async def _counts(self, ids: list[str]) -> dict[str, int]:
        """Delivery counts of just-claimed ids (XAUTOCLAIM bumped them already)."""
        c = self.c
        async with c.r.pipeline(transaction=False) as p:
            for i in ids:
                p.xpending_range(c.stream, c.group, i, i, 1)
            rows = await p.execute()
        return {as_str(r[0]["message_id"]): r[0]["times_delivered"] for r in rows if r}
