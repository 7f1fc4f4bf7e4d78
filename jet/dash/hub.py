"""What the dashboard's handlers share: settings, one Redis client, curves, tokenizers, snapshots.

What it is: `Settings` (where the data is, who may ask) and `Hub`, one per app:
the Redis client (opened on first use), the trainers' curves
(`jet.dash.training.Curves`), the runs found, swarm snapshots cached for
SNAPSHOT_TTL_S (the pages and /metrics share them), and per model a decode
function of its tokenizer, found through the run's resolved config.

What it is not: a cache of anything that must be fresh: a dead-letter action
drops the run's snapshot at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from jet.dash import swarm
from jet.dash.training import Curves
from jet.errors import JetError
from jet.keys import Keys
from jet.runs import RunDir

log = logging.getLogger(__name__)

SNAPSHOT_TTL_S = 1.0  # swarm snapshots are shared by the pages and /metrics for this long


@dataclass
class Settings:
    redis_url: str | None = None
    runs_dir: str = "runs"
    studies_dir: str = "studies"
    run: str | None = None  # the run shown first (else the first found)
    token: str | None = None  # required on every request when set
    loopback: bool = True  # only loopback Host headers are answered
    alive_s: float = 60.0  # a consumer idle longer than this is not counted alive
    model_paths: dict[str, str] = field(default_factory=dict)  # model -> folder, when the run's resolved config has none


class Hub:
    """What the handlers share: one Redis client, the curves, tokenizers, short-lived snapshots."""

    def __init__(self, s: Settings):
        self.s = s
        self.curves = Curves(s.runs_dir)
        self.r = None
        self._snaps: dict[str, tuple[float, dict]] = {}
        self._runs: tuple[float, list[str]] = (0.0, [])
        self._decoders: dict[str, Callable | None] = {}

    async def redis(self):
        if not self.s.redis_url:
            raise NoRedis("no Redis URL: pass --redis-url or set JET_REDIS_URL (or start `jet server`)")
        if self.r is None:
            from jet.queues.connect import connect

            self.r = await connect(self.s.redis_url, name="jet-dash")
        return self.r

    async def close(self) -> None:
        if self.r is not None:
            await self.r.aclose()

    async def runs(self) -> list[str]:
        """Runs with keys on the server or a folder under runs_dir (cached 10 s: it SCANs)."""
        if time.monotonic() - self._runs[0] < 10 and self._runs[1]:
            return self._runs[1]
        found = set()
        if self.s.redis_url:
            from jet.queues import admin

            try:
                found.update(await admin.runs(await self.redis()))
            except JetError as e:
                log.warning("listing runs: %s", e)
        root = Path(self.s.runs_dir)
        if root.is_dir():
            found.update(p.name for p in root.iterdir() if RunDir(root, p.name).exists())
        if self.s.run:
            found.add(self.s.run)
        self._runs = (time.monotonic(), sorted(found))
        return self._runs[1]

    async def default_run(self) -> str | None:
        return self.s.run or next(iter(await self.runs()), None)

    async def snapshot(self, run: str) -> dict:
        cached = self._snaps.get(run)
        if cached and time.monotonic() - cached[0] < SNAPSHOT_TTL_S:
            return cached[1]
        snap = await swarm.snapshot(await self.redis(), Keys(run), self.s.redis_url, alive_s=self.s.alive_s)
        self._snaps[run] = (time.monotonic(), snap)
        return snap

    def forget(self, run: str) -> None:
        """Drop the run's cached snapshot (after an action changed it)."""
        self._snaps.pop(run, None)

    def decoder(self, run: str, model: str) -> Callable | None:
        """The decode function of `model`'s tokenizer (ids -> text), or None when it cannot be found."""
        path = _model_path(Path(self.s.runs_dir) / run, model) or self.s.model_paths.get(model)
        if path not in self._decoders:
            self._decoders[path] = _load_decoder(path) if path else None
        return self._decoders[path]


class NoRedis(JetError):
    pass


def _model_path(run_dir: Path, model: str) -> str | None:
    """The model's folder as the run's resolved config (written by jet up and the trainer) names it."""
    import yaml

    resolved = run_dir / "config.resolved.yaml"
    try:
        data = yaml.safe_load(resolved.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    for m in data.get("models") or []:
        if isinstance(m, dict) and m.get("name") == model and isinstance(m.get("path"), str):
            return m["path"]
    return None


def _load_decoder(path: str) -> Callable | None:
    try:
        from jet.sources import is_local, resolve_model

        if not is_local(path):
            path = resolve_model(path)  # a Hub id: its cached snapshot, as the roles load it
        if (Path(path) / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
            return lambda ids: tok.decode(ids, skip_special_tokens=False)
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path)
        return lambda ids: hf.decode(ids, skip_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - any tokenizer trouble: show token ids instead
        log.warning("no tokenizer at %s (%s): episodes show token ids", path, e)
        return None
