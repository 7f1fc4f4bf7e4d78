"""`jet up` and `jet status` on a real local Redis Cluster (three primaries), through a
`redis+cluster://` URL, with a run whose hash slot lives on a primary other than the URL's node."""

import os
import re
import subprocess
import sys

import orjson
import pytest

from jet.keys import Keys
from tests.cli.test_fail_loudly import run_on_other_node, write_config

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_short_up_and_status_on_a_cluster(cluster, tiny_model, tmp_path):
    run = run_on_other_node(cluster, prefix="upcl")
    config = write_config(tmp_path, run, tiny_model)
    env = {k: v for k, v in os.environ.items() if k != "JET_REDIS_URL"}
    res = subprocess.run([sys.executable, "-m", "jet.cli", "up", "--config", str(config), "--redis-url", cluster.url,
                          "--episodes", "8", "--no-live", "--run-dir", str(tmp_path / ".jet")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(re.findall(r"trajectories (\d+)", res.stderr)[-1]) >= 8
    assert "'env': 0" in res.stderr and "'infer-tiny': 0" in res.stderr  # every role drained cleanly
    status = subprocess.run([sys.executable, "-m", "jet.cli", "status", "--redis-url", cluster.url, "--json"],
                            env=env, capture_output=True, text=True, timeout=60, check=True)
    reports = {r["run"]: r for r in orjson.loads(status.stdout)}  # no --run: every primary is scanned
    streams = {s["name"]: s for s in reports[run]["streams"]}
    assert streams["traj:tiny"]["length"] >= 8
    assert {g["name"] for g in streams["tasks:guess"]["groups"]} == {"env"}
    owner = cluster.node_of_key(Keys(run).traj("tiny"))
    assert owner != 0
    with cluster.client(owner) as r:  # the run's streams are on its own primary
        assert r.xlen(Keys(run).traj("tiny")) == streams["traj:tiny"]["length"]
