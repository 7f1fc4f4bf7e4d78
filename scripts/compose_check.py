"""What scripts/compose-test.sh reads inside the compose stack: the image's python, the runs volume, its Redis.

    docker compose exec -T trainer python -P - step [SINCE] < scripts/compose_check.py
        the trainer's newest step in metrics.jsonl (0 before the first), from the packaged config's run;
        with SINCE (epoch seconds), the newest step trained since then
    docker compose run --rm --no-deps -T trainer python -P - ledger < scripts/compose_check.py
        with the trainer stopped: the ledger (jet/trainer/checkpoint.py, checked as tests/trainer/
        test_trainer_redis.py's check_exactly_once does) decides no stream entry twice and trains no
        trajectory twice, and every entry ever added to traj:<model> is in the ledger or still in
        the stream (acked entries are trimmed only once decided): no trajectory was lost.
        Prints the counts; exits 1 naming what failed.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import anyio

from jet.config import default_config_path, load_file
from jet.keys import Keys
from jet.queues.connect import connect
from jet.runs import RunDir, read_metrics
from jet.trainer.checkpoint import Checkpoints


def trainer_dirs(cfg) -> dict[str, Path]:
    return {m.name: RunDir.of(cfg).trainer(m.name) for m in cfg.models if m.trainable}


def step(cfg, since: float = 0.0) -> int:
    """The newest step trained at or after `since` (epoch seconds): 0 if none."""
    newest = 0
    for model in trainer_dirs(cfg):
        steps = [m["step"] for m in read_metrics(RunDir.of(cfg).metrics(model)) if m.get("time", 0) >= since]
        newest = max([newest, *steps])
    return newest


async def stream(url: str, key: str) -> tuple[int, set[str]]:
    """(entries ever added, ids still in the stream) of `key`."""
    r = await connect(url)
    try:
        info = await r.xinfo_stream(key)
        added = info.get("entries-added", info.get(b"entries-added"))
        ids = {i.decode() if isinstance(i, bytes) else i for i, _ in await r.xrange(key)}
        return int(added), ids
    finally:
        await r.aclose()


def ledger(cfg) -> list[str]:
    failures = []
    keys = Keys(cfg.run)
    for model, folder in trainer_dirs(cfg).items():
        decided = Checkpoints(folder).consumed()
        twice = [e for e, n in Counter(c["entry"] for c in decided).items() if n > 1]
        trained = Counter(c["msg"] for c in decided if c["outcome"] == "trained")
        added, left = anyio.run(stream, os.environ["JET_REDIS_URL"], keys.traj(model))
        lost = added - len({c["entry"] for c in decided} | left)
        print(f"{model}: {added} trajectories added, {len(decided)} decided in the ledger "
              f"({sum(trained.values())} trained), {len(left)} still in the stream")
        if not decided:
            failures.append(f"{model}: the ledger is empty")
        if twice:
            failures.append(f"{model}: entries decided twice: {twice[:5]}")
        if [m for m, n in trained.items() if n > 1]:
            failures.append(f"{model}: trajectories trained twice: {[m for m, n in trained.items() if n > 1][:5]}")
        if lost > 0:
            failures.append(f"{model}: {lost} trajectories neither in the ledger nor in the stream (lost)")
    return failures


def main(argv: list[str]) -> int:
    cfg = load_file(os.environ.get("JET_CONFIG") or default_config_path())
    if argv[:1] == ["step"] and len(argv) <= 2:
        print(step(cfg, float(argv[1]) if len(argv) == 2 else 0.0))
        return 0
    if argv == ["ledger"]:
        failures = ledger(cfg)
        for f in failures:
            print(f"FAIL {f}")
        return 1 if failures else 0
    print(f"usage: python -P - step [SINCE] | ledger (got {argv})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
