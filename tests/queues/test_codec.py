"""The entry codec (docs/design.md, rule 8) and what consumers do with bad entries."""

from array import array

import anyio
import numpy as np
import pytest

from jet.errors import CodecError
from jet.queues import codec
from tests.queues.helpers import close, entry, make_consumer, read_all, serve


def test_roundtrip_raw_little_endian_arrays():
    f = codec.encode("gen", {"model": "m"}, ints={"ids": [1, -2, 2**31 - 1]},
                     floats={"lp": np.array([-0.5, 0.25])}, msg_id="x")
    assert f[b"i4:ids"] == (1).to_bytes(4, "little") + (-2).to_bytes(4, "little", signed=True) + \
        (2**31 - 1).to_bytes(4, "little")
    p = codec.decode(f)
    assert (p.kind, p.msg_id, p.meta) == ("gen", "x", {"model": "m"})
    assert p.arrays["ids"] == array("i", [1, -2, 2**31 - 1]) and list(p.arrays["lp"]) == [-0.5, 0.25]
    assert b"pickle" not in b"".join(f.values())


@pytest.mark.parametrize("fields, reason", [
    ({}, "empty entry"),
    ({b"k": b"x", b"i": b"1", b"m": b"{}"}, "no schema version"),
    ({b"v": b"99", b"k": b"x", b"i": b"1", b"m": b"{}"}, "unknown schema version '99'"),
    ({b"v": b"1", b"k": b"x", b"i": b"1", b"m": b"{not json"}, "malformed entry"),
    ({b"v": b"1", b"k": b"x", b"i": b"1", b"m": b"[1]"}, "not an object"),
    ({b"v": b"1", b"k": b"x", b"m": b"{}"}, "missing field 'i'"),
    ({b"v": b"1", b"k": b"x", b"i": b"1", b"m": b"{}", b"i4:a": b"123"}, "has 3 bytes"),
    ({b"v": b"1", b"k": b"x", b"i": b"1", b"m": b"{}", b"zz": b"1"}, "unknown field"),
])
def test_decode_errors_say_why(fields, reason):
    with pytest.raises(CodecError, match=reason):
        codec.decode(fields)


def test_size_limit_both_ways():
    with pytest.raises(CodecError, match="exceeds the limit"):
        codec.encode("x", {}, ints={"a": range(1000)}, max_bytes=1000)
    f = codec.encode("x", {}, ints={"a": range(1000)})
    with pytest.raises(CodecError, match="oversize entry"):
        codec.decode(f, max_bytes=1000)


@pytest.mark.anyio
async def test_bad_entries_go_dead_with_reason_and_consumer_keeps_going(redis_url, keys):
    src, dst = keys.tasks("a"), keys.traj("b")
    c = await make_consumer(redis_url, keys, src, max_entry_bytes=2000)
    await c.r.xadd(src, {b"garbage": b"\x80\x81"})
    await c.r.xadd(src, {b"v": b"7", b"k": b"x", b"i": b"1", b"m": b"{}"})
    await c.r.xadd(src, codec.encode("x", {}, ints={"big": range(1000)}))
    await c.r.xadd(src, entry(1))
    stop = anyio.Event()

    async def handle(batch):
        return [[(dst, entry(d.payload.meta["n"]))] for d in batch]

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, c, handle, stop)
        with anyio.fail_after(10):
            while await c.r.xlen(dst) < 1:
                await anyio.sleep(0.05)
        stop.set()
    reasons = [p.meta["reason"] for p in await read_all(c.r, keys.dead)]
    assert len(reasons) == 3
    assert "no schema version" in reasons[0]
    assert "unknown schema version '7'" in reasons[1]
    assert "oversize entry" in reasons[2]
    dead0 = (await read_all(c.r, keys.dead))[0]
    assert dead0.raw == {"garbage": b"\x80\x81"}  # the original bytes are kept verbatim
    assert (await c.r.xpending(src, "g"))["pending"] == 0
    await close(c)
