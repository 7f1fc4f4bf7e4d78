"""`jet dash` as a process: the URL it prints, the token off loopback, `jet up`'s launcher and its port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from jet.dash import launch


def _url_from(proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline, seen = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen += line
        if m := re.search(r"jet dash: (http://\S+)", line):
            return m[1]
        if proc.poll() is not None:
            break
    raise AssertionError(f"no URL printed:\n{seen}")


def _dash(args, redis_url, tmp_path):
    env = {**os.environ, "JET_REDIS_URL": redis_url}
    env.pop("JET_DASH_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "jet.cli", "dash", "--port", "0", "--runs-dir",
                             str(tmp_path / "runs"), *args], env=env, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)


@pytest.mark.slow
def test_jet_dash_prints_its_url_serves_and_stops_on_sigterm(redis_url, keys, tmp_path):
    proc = _dash(["--run", keys.run], redis_url, tmp_path)
    try:
        url = _url_from(proc)
        assert url.startswith("http://127.0.0.1:") and "token" not in url
        runs = httpx.get(url + "api/runs", timeout=10).json()
        assert runs["default"] == keys.run and runs["redis"]
        assert "jet_dead_letters" in httpx.get(url + "metrics", timeout=10).text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


@pytest.mark.slow
def test_off_loopback_jet_dash_makes_a_token_and_requires_it(redis_url, keys, tmp_path):
    proc = _dash(["--run", keys.run, "--host", "0.0.0.0"], redis_url, tmp_path)
    try:
        url = _url_from(proc)
        token = re.search(r"\?token=(\S+)$", url)[1]
        base = url.split("?")[0].replace("0.0.0.0", "127.0.0.1")
        assert len(token) >= 20
        assert httpx.get(base + "api/runs", timeout=10).status_code == 401
        ok = httpx.get(base + "api/runs", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["default"] == keys.run
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


@pytest.mark.slow
def test_jet_ups_launcher_takes_another_port_when_the_default_is_taken(redis_url, keys, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    (tmp_path / "runs").mkdir()
    dash = launch.start(keys.run, str(tmp_path / "runs"), redis_url, tmp_path / "logs" / "dash.log", port=port)
    try:
        assert dash.url.startswith("http://127.0.0.1:") and f":{port}/" not in dash.url
        deadline = time.monotonic() + 60
        while True:  # the socket is bound before the child starts: requests wait for it, none is refused
            try:
                got = httpx.get(dash.url + "api/runs", timeout=30)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or dash.proc.poll() is not None:
                    raise AssertionError((tmp_path / "logs" / "dash.log").read_text())
                time.sleep(0.2)
        assert got.json()["default"] == keys.run
        assert redis_url not in " ".join(dash.proc.args), "the Redis URL stays out of argv"
    finally:
        assert dash.stop() == 0
        taken.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]"])
def test_loopback_names(host):
    from jet.dash.access import is_loopback

    assert is_loopback(host) and not is_loopback("10.0.0.1") and not is_loopback("example.com")


@pytest.mark.slow
def test_the_wheel_ships_the_pages(tmp_path):
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(root)], check=True)
    [wheel] = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for asset in ("index.html", "app.js", "charts.js", "style.css"):
        assert f"jet/dash/static/{asset}" in names
    assert "jet/dash/server.py" in names and "jet/trainer/loggers.py" in names
