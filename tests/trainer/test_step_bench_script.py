"""The trainer-step bench's commands as docs/benchmarks.md gives them, run on the suite's tiny model.

What it proves: every `python scripts/trainer-step-bench.py MODEL_DIR ...` command the guide tells a
reader to run (one per `--part` of the script) runs and prints the JSON line the guide's figures come
from, both sides timed and a ratio of them, so the guide cannot drift from the script. The repeats and
samples are cut to the least that exercises the code; the figures themselves come from the real model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/trainer-step-bench.py"
COMMAND = re.compile(r"`python " + re.escape(SCRIPT) + r" MODEL_DIR([^`]*)`")
PARTS = ("step", "optimizer", "publish")  # the script's --part choices


def documented() -> list[list[str]]:
    """The arguments after MODEL_DIR of every command docs/benchmarks.md gives for the script."""
    return [args.split() for args in COMMAND.findall((ROOT / "docs/benchmarks.md").read_text())]


def part(args: list[str]) -> str:
    return args[args.index("--part") + 1] if "--part" in args else "step"


def shrunk(args: list[str]) -> list[str]:
    """`args` with --repeats 1 and --samples 4 (a flag given twice: argparse keeps the last)."""
    return [*args, "--repeats", "1", *(["--samples", "4"] if part(args) == "step" else [])]


def test_the_guide_gives_a_command_for_every_part_of_the_script():
    assert sorted(part(a) for a in documented()) == sorted(PARTS)
    choices = re.search(r'"--part", choices=\[([^]]*)\]', (ROOT / SCRIPT).read_text())
    assert choices and re.findall(r'"(\w+)"', choices.group(1)) == list(PARTS)  # no part the guide leaves out


@pytest.mark.slow  # a subprocess each, loading torch and transformers
@pytest.mark.parametrize("args", documented(), ids=lambda a: part(a))
def test_each_documented_command_runs_and_times_both_sides(tiny_model: Path, args: list[str]):
    done = subprocess.run([sys.executable, SCRIPT, str(tiny_model), *shrunk(args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if part(args) == "step":
        sides = {name: v["seconds"] for name, v in report["layouts"].items()}
        ratio = report["speedup"]
    else:
        sides, ratio = report["seconds"], report["median_ratio"]
        if part(args) == "optimizer":
            assert report["fused"] is True  # the trainer's AdamW is the fused kernel on a CPU
    assert len(sides) == 2 and all(len(s) == 1 and s[0] >= 0 for s in sides.values()), sides
    assert ratio > 0
