"""What a trainer restart costs: the demo trained by roles started by hand, the trainer SIGKILLed.

    python scripts/restart-bench.py [--steps 24] [--kill-at 6,15] [--network] [--set trainer.KEY=VALUE ...]
                                    [--dir DIR] [--json]

Runs `tests.swarm.chaos_run`: `jet server`, `jet feed`, `jet worker env -n 2`, `jet worker infer` and
`jet train`, each in a folder of its own, train the demo's config for --steps steps; the trainer is
SIGKILLed and started again once it reaches each step of --kill-at. With --network, Redis sits behind
a fault proxy (`tests/faultproxy.py`) and `tests.swarm.NETWORK`'s faults come at their steps too:
three cuts of every connection, a latency spike, a blackhole past the lease, a Redis restart. Prints
the trainer ledger's check and outcome counts, and the fraction of trajectories dropped as stale
(--json: the whole report as one JSON line). `--set trainer.resume=checkpoint` measures the design
before resume points (docs/design.md, "Restarts"). Needs a checkout: it imports the test suite's launcher.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jet.models import init_model
from tests.swarm import NETWORK, chaos_run, network_fault


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--kill-at", default="6,15", help="trainer steps at which it is SIGKILLed, comma-separated")
    p.add_argument("--network", action="store_true", help="also the network faults, Redis behind a fault proxy")
    p.add_argument("--set", dest="sets", action="append", default=[], help="trainer.KEY=VALUE (a YAML value)")
    p.add_argument("--dir", default=None, help="where the run goes (default: a new temporary folder)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = p.parse_args()
    import yaml

    trainer = {}
    for s in args.sets:
        key, _, value = s.partition("=")
        if not key.startswith("trainer.") or not value:
            p.error(f"--set {s}: expected trainer.KEY=VALUE")
        trainer[key.removeprefix("trainer.")] = yaml.safe_load(value)
    kills = [int(k) for k in args.kill_at.split(",") if k]
    events = [(k, "kill") for k in kills] + (NETWORK if args.network else [])
    root = Path(args.dir or tempfile.mkdtemp(prefix="restart-bench-"))
    model = init_model(root / "model", vocab_size=512, hidden_size=32, layers=2, heads=4, kv_heads=2,
                       max_position=256, seed=0)
    report = chaos_run(root, model, steps=args.steps, events=events, faults=network_fault if args.network else None,
                       **trainer)
    if args.json:
        print(json.dumps(report))
        return
    print(json.dumps({k: v for k, v in report.items() if k != "logs"}, indent=1))
    o = report["outcomes"]
    print(f"stale: {o.get('stale', 0)} of {report['decided']} trajectories decided "
          f"({100 * report['stale_fraction']:.1f}%); trainer SIGKILLed {len(kills)}x, {report['steps_redone']} "
          f"steps trained twice; lost {report['lost']}, decided twice {len(report['decided_twice'])}; "
          f"wall {report['wall_s']} s")
    if report["train_exit"]:
        print(json.dumps(report["logs"], indent=1))
        sys.exit(1)


if __name__ == "__main__":
    main()
