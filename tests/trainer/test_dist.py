"""`jet.trainer.dist.Comm` on a real process group: two gloo ranks share rank 0's rows, sampling columns included.

Two processes join a gloo group; rank 0 packs rows from samples drawn at
mixed temperatures / top_p and shares them with the plan; rank 1 writes
what it received to a file, which must equal rank 0's rows column by column.
The device a collective runs on follows the group's backend (nccl: this
rank's GPU, which nccl requires; gloo: the CPU): checked without a GPU by
`collective_device`, and on a GPU by `scripts/gpu-check.sh`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jet.queues.server import free_port
from jet.trainer.dist import Comm, collective_device

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("input_ids", "position_ids", "parent_index", "subtree_end", "versions", "seq", "loss_mask",
           "behaviour_logprobs", "temperatures", "top_ps", "rewards")

RANK_SCRIPT = r"""
import json, os, sys
import torch
from jet.timeline import Call, merge_calls
from jet.trainer.batch import build_step
from jet.trainer.dist import Comm, Plan
from jet.trainer.packing import pack
from jet.wire import Trajectory

torch.distributed.init_process_group("gloo")
comm = Comm.of_process_group()
rows = inputs = plan = None
if comm.leader:
    calls = [Call([1, 2, 3], [4, 5, 6], [-0.5, -0.25, -1.0], 2, "m", temperature=0.6, top_p=0.9),
             Call([1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.75, -2.0], 3, "m", temperature=1.4)]
    group = [Trajectory("t", "g", i, f"e{i}", "m", float(i), tuple(merge_calls(calls, "tree", episode_id=f"e{i}",
                        reward=float(i))), group_size=2) for i in range(2)]
    inputs = build_step([group], advantage="grpo", loss_agg="token_mean", prefix_trees=False)
    rows = pack(inputs.samples, 10)
    plan = Plan(publish=True, step=7, version=3, lr=0.5)
plan = comm.share_plan(plan)
rows, inputs = comm.share(rows, inputs)
total = comm.sum(torch.tensor([float(comm.rank + 1)], dtype=torch.float64))
biggest = comm.max(float(comm.rank))
comm.barrier()
out = {"plan": [plan.publish, plan.step, plan.version, plan.lr], "sum": total.tolist(), "max": biggest,
       "device": str(comm.device), "advantages": inputs.advantages.tolist(), "weights": inputs.weights.tolist(),
       "rows": [{c: getattr(r, c)[0].tolist() for c in sys.argv[2].split(",")} | {"causal": r.causal}
                for r in rows]}
with open(sys.argv[1] + f".{comm.rank}", "w") as f:
    json.dump(out, f)
torch.distributed.destroy_process_group()
"""


def test_collectives_go_to_the_device_of_the_groups_backend(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert collective_device("nccl") == torch.device("cuda", 3)
    assert collective_device("gloo") == torch.device("cpu")
    alone = Comm()
    assert alone.sum(torch.ones(2)).tolist() == [1.0, 1.0] and alone.max(2.5) == 2.5  # no group: no collective


@pytest.mark.slow
def test_two_gloo_ranks_receive_rank_zeros_rows_exactly(tmp_path):
    port = free_port()
    out = tmp_path / "received"
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(out), ",".join(COLUMNS)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        log = p.communicate(timeout=120)[0]
        assert p.returncode == 0, log[-3000:]
    sent, got = (json.loads(Path(f"{out}.{r}").read_text()) for r in range(2))
    assert got["rows"] == sent["rows"] and len(sent["rows"]) >= 2
    assert got["advantages"] == sent["advantages"] and got["weights"] == sent["weights"]
    assert got["plan"] == sent["plan"] == [True, 7, 3, 0.5]
    assert got["sum"] == sent["sum"] == [3.0] and got["max"] == sent["max"] == 1.0
    assert sent["device"] == got["device"] == "cpu"
    temps = {t for r in got["rows"] for t in r["temperatures"]}
    assert {round(t, 4) for t in temps} == {0.6, 1.0, 1.4} and any(p < 1 for r in got["rows"] for p in r["top_ps"])
