"""Data parallelism across trainer ranks: rank 0 decides, every rank computes its share.

What it is: `Comm` (rank, world size, barrier, sums) and `share(plan, rows,
inputs)`, by which rank 0 broadcasts what a step does (`Plan`) and the step's
packed rows and per-entry tables as raw tensors (no pickle), and `mine(rows)`,
which splits the rows across ranks by token count (largest first, onto the
least loaded rank) and pads every rank to the same number of micro-batches
(`None` = a padding micro-batch, see `jet.trainer.step`). Without a process
group (the torch backend) all of it is a no-op.

Devices: every collective runs on the device its process group's backend
takes: nccl only moves CUDA tensors (it rejects CPU ones), gloo CPU ones. So
`Comm.device` is `cuda:<local rank>` under nccl and the CPU under gloo; each
collective copies its tensor there and hands the result back on the CPU,
where the loop keeps rows and tables (they move to the model's device in
`jet.trainer.packing.row_logprobs`). Collectives run whenever a process group
exists, one rank included, so a one-process DeepSpeed run (the GPU check)
exercises the same code as many.

What it is not: a launcher (`jet train` starts the processes) or a
reader of Redis: only rank 0 talks to the queues.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from jet.trainer.batch import StepInputs
from jet.trainer.packing import FLOAT_TENSORS, INT_TENSORS, Row

_INT_COLUMNS = INT_TENSORS  # every [B, L] tensor of a row, by kind (the packed columns derived from jet.timeline)
_FLOAT_COLUMNS = FLOAT_TENSORS


@dataclass(slots=True)
class Plan:
    """What rank 0 decided this step does."""

    stop: bool = False
    publish: bool = False  # publish weights after the step
    checkpoint: bool = False  # checkpoint after the step
    step: int = 0
    version: int = 0  # weight version after the step
    lr: float = 0.0

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([float(getattr(self, f.name)) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Plan":
        v = t.tolist()
        return cls(bool(v[0]), bool(v[1]), bool(v[2]), int(v[3]), int(v[4]), float(v[5]))


def collective_device(backend: str | None) -> torch.device:
    """Where a process group of `backend` wants its tensors: this rank's GPU for nccl, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class Comm:
    def __init__(self, rank: int = 0, world: int = 1, device: torch.device | str = "cpu", grouped: bool = False):
        self.rank, self.world = rank, world
        self.device = torch.device(device)  # where collectives run (see the module docstring)
        self.grouped = grouped  # a process group exists: collectives run, even with one rank

    @classmethod
    def from_env(cls) -> "Comm":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))

    @classmethod
    def of_process_group(cls) -> "Comm":
        """The Comm of the initialised default process group, on its backend's device."""
        dist = torch.distributed
        return cls(dist.get_rank(), dist.get_world_size(), collective_device(dist.get_backend()), grouped=True)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.grouped:
            ids = [self.device.index] if self.device.type == "cuda" else None
            torch.distributed.barrier(device_ids=ids)

    def close(self) -> None:
        """Every rank, at a clean end: leave the process group together, rather than leave its
        backend's threads to whatever order the interpreter's exit frees things in (torch asks
        for this; a gloo rank has aborted with "terminate called without an active exception")."""
        if self.grouped and torch.distributed.is_initialized():
            self.barrier()
            torch.distributed.destroy_process_group()
            self.grouped = False

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if not self.grouped:
            return t
        t = t.to(self.device, copy=True)
        torch.distributed.all_reduce(t)
        return t.cpu()

    def max(self, x: float) -> float:
        if not self.grouped:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t[0])

    def share_plan(self, plan: Plan | None) -> Plan:
        if not self.grouped:
            assert plan is not None
            return plan
        t = self._bcast(plan.to_tensor() if self.leader else Plan().to_tensor())
        return Plan.from_tensor(t)

    def share(self, rows: list[Row] | None, inputs: StepInputs | None) -> tuple[list[Row], StepInputs]:
        """Rank 0's rows and tables, on every rank."""
        if not self.grouped:
            assert rows is not None and inputs is not None
            return rows, inputs
        if self.leader:
            head = torch.tensor([len(rows), inputs.advantages.numel(), inputs.n_tokens, inputs.n_sequences])
            meta = torch.tensor([[*r.input_ids.shape, int(r.causal), r.n_samples] for r in rows], dtype=torch.int64)
            ints = torch.cat([torch.stack([getattr(r, c).reshape(-1) for c in _INT_COLUMNS]) for r in rows], dim=1)
            floats = torch.cat([torch.stack([getattr(r, c).reshape(-1) for c in _FLOAT_COLUMNS]) for r in rows], dim=1)
            tables = torch.stack([inputs.advantages, inputs.weights])
        head = self._bcast(head if self.leader else torch.zeros(4, dtype=torch.int64))
        n_rows, n_entries, n_tokens, n_seq = head.tolist()
        meta = self._bcast(meta if self.leader else torch.zeros(n_rows, 4, dtype=torch.int64))
        total = int((meta[:, 0] * meta[:, 1]).sum())
        ints = self._bcast(ints if self.leader else torch.zeros(len(_INT_COLUMNS), total, dtype=torch.int64))
        floats = self._bcast(floats if self.leader else torch.zeros(len(_FLOAT_COLUMNS), total))
        tables = self._bcast(tables if self.leader else torch.zeros(2, n_entries))
        if self.leader:
            return rows, inputs
        return _rows(meta, ints, floats), StepInputs([], tables[0], tables[1], n_tokens, n_seq)

    def mine(self, rows: list[Row]) -> list[Row | None]:
        """This rank's micro-batches, padded with None to the longest rank's count."""
        if self.world == 1:
            return list(rows)
        load = [0] * self.world
        parts: list[list[Row]] = [[] for _ in range(self.world)]
        for row in sorted(rows, key=lambda r: r.n_tokens, reverse=True):
            target = load.index(min(load))
            parts[target].append(row)
            load[target] += row.n_tokens
        longest = max(len(p) for p in parts)
        return parts[self.rank] + [None] * (longest - len(parts[self.rank]))

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank, on the CPU (sent on the group's device)."""
        t = t.to(self.device).contiguous()
        torch.distributed.broadcast(t, 0)
        return t.cpu()


def _rows(meta: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> list[Row]:
    out, start = [], 0
    for b, width, causal, n_samples in meta.tolist():
        n = b * width
        cols = {c: ints[i, start:start + n].reshape(b, width).clone() for i, c in enumerate(_INT_COLUMNS)}
        cols.update({c: floats[i, start:start + n].reshape(b, width).clone() for i, c in enumerate(_FLOAT_COLUMNS)})
        out.append(Row.of(cols, causal=bool(causal), n_samples=n_samples))
        start += n
    return out
