"""`jet bench queue` runs end to end (real server, real worker processes) and
reports what it promises. No timing assertions: speed is the benchmark's output."""

import orjson
import pytest
from click.testing import CliRunner

from jet.bench.queue import cli

FIELDS = {"payload", "entry_bytes", "mode", "consumers", "n", "seconds", "msgs_s", "mb_s", "client_cpu_us",
          "server_cpu_us", "samples", "ratio", "goal", "met"}


@pytest.mark.slow
def test_quick_json_on_its_own_embedded_server():
    result = CliRunner().invoke(cli, ["--quick", "--json"], env={"JET_REDIS_URL": ""})
    assert result.exit_code == 0, result.output
    report = orjson.loads(result.stdout)
    assert report["server"]["embedded"] is True
    rows = report["rows"]
    assert [(x["payload"], x["mode"], x["consumers"]) for x in rows] == [
        (p, m, k) for p in ("100B", "40KB") for m, k in (("raw", 0), ("lua", 1), ("hop", 1), ("hop", 2), ("each", 1))]
    for x in rows:
        assert set(x) == FIELDS
        assert x["msgs_s"] > 0 and x["mb_s"] > 0 and x["seconds"] > 0
        assert x["client_cpu_us"] > 0 and x["server_cpu_us"] > 0
        assert x["n"] == (2000 if x["payload"] == "100B" else 200)
    sizes = {x["payload"]: x["entry_bytes"] for x in rows}
    assert 90 <= sizes["100B"] <= 110 and 39_000 <= sizes["40KB"] <= 41_000
    for x in rows:
        if x["mode"] == "raw":
            assert x["ratio"] is None and x["goal"] is None
        else:
            assert x["ratio"] == pytest.approx(x["msgs_s"] / next(
                r["msgs_s"] for r in rows if r["payload"] == x["payload"] and r["mode"] == "raw"), rel=1e-2)
        if x["mode"] == "hop":
            assert x["goal"] == {"100B": 0.7, "40KB": 0.5}[x["payload"]]
            assert x["met"] == (x["ratio"] >= x["goal"])
    assert set(report["goals"]) == {"100B", "40KB"}


@pytest.mark.slow
def test_table_against_a_given_server(redis_url):
    args = ["--redis-url", redis_url, "--n-small", "300", "--n-large", "20", "--consumers", "2", "--repeat", "1"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "jet bench queue" in out and "embedded" not in out.splitlines()[0]
    for word in ("raw", "lua", "hop", "each", "100B", "40KB", "msgs/s", "MB/s", "x raw", ">= 0.7", ">= 0.5"):
        assert word in out


def test_commit_packing_matches_redis_py():
    """The consumer packs its (large) COMMIT calls itself for speed; the bytes on the
    wire must be exactly what redis-py would have sent."""
    from redis.asyncio.connection import Connection

    from jet.queues.consumer import resp

    conn = Connection()
    big = bytes(range(256)) * 200  # over the inline limit: passed on uncopied
    args = [b"EVALSHA", "a" * 40, 3, "jet:{r}:tasks:x", b"", 21600, 2.5, "ü", big, b"v", memoryview(b"mv"), big]
    ours = resp(args, conn.encoder.encode)
    assert b"".join(ours) == b"".join(conn.pack_command(*args))
    assert any(part is big for part in ours)
    with pytest.raises(Exception, match="Invalid input of type: 'bool'"):
        resp([b"SET", True], conn.encoder.encode)
