"""Where a `.ci/run` spent its time: each phase against its budget, then the slowest tests.

    python3 scripts/ci_times.py [FOLDER]           (default .ci-out: what .ci/run wrote)
    python3 scripts/ci_times.py FOLDER --markdown  (the same tables for docs/testing.md)

.ci/run writes one line per phase to FOLDER/phases.tsv (name, start and end in epoch seconds, budget in
seconds, exit code) and each pytest phase's JUnit XML to FOLDER/<phase>.xml. This prints:
- the phases in the order they started, with start offset, seconds, share of the run's wall time, budget
  and a verdict (phases may overlap: a background phase's offset shows it);
- per pytest phase, its slowest tests (setup, call and teardown together, as JUnit counts them) and their
  share of that phase, and the test files that cost most.
Standard library only: CI runs it with the machine's python3, before or without any venv.
"""

from __future__ import annotations

import argparse
import csv
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def read_phases(folder: Path) -> list[dict]:
    path = folder / "phases.tsv"
    if not path.exists():
        return []
    out = []
    for name, start, end, budget, rc in csv.reader(path.open(), delimiter="\t"):
        out.append({"name": name, "start": int(start), "end": int(end), "budget": int(budget), "rc": int(rc)})
    return sorted(out, key=lambda p: p["start"])


def read_tests(xml: Path) -> list[tuple[str, float]]:
    """(node id, seconds) of every test case in a JUnit XML file."""
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        if not case.get("classname"):  # a collection-time entry (a skipped module), not a test
            continue
        module = case.get("classname").replace(".", "/")
        cases.append((f"{module}.py::{case.get('name')}", float(case.get("time") or 0.0)))
    return cases


def fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s:.0f} s ({s / 60:.1f} min)"


def table(rows: list[list[str]], header: list[str], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def report(folder: Path, top: int = 15, markdown: bool = False) -> str:
    phases = read_phases(folder)
    out = []
    if phases:
        t0, t1 = min(p["start"] for p in phases), max(p["end"] for p in phases)
        wall = max(1, t1 - t0)
        rows = []
        for p in phases:
            took = p["end"] - p["start"]
            verdict = "OVER BUDGET" if took > p["budget"] else ("failed" if p["rc"] else "ok")
            rows.append([p["name"], f"+{p['start'] - t0} s", fmt_s(took), f"{100 * took / wall:.0f}%",
                         f"{p['budget']} s", verdict])
        out.append(table(rows, ["phase", "starts", "took", "of the run", "budget", "verdict"], markdown))
        out.append(f"\nthe whole run: {fmt_s(wall)} of wall time")
    for xml in sorted(folder.glob("*.xml")):
        cases = read_tests(xml)
        if not cases:
            continue
        total = sum(s for _, s in cases)
        out.append(f"\n{xml.stem}: {len(cases)} tests, {fmt_s(total)} summed over tests "
                   f"(more than the phase's wall time when tests run in parallel)")
        slow = sorted(cases, key=lambda c: -c[1])[:top]
        out.append(table([[f"{s:.1f} s", f"{100 * s / total:.1f}%", name] for name, s in slow],
                         ["seconds", "share", f"the {len(slow)} slowest tests"], markdown))
        files = Counter()
        for name, s in cases:
            files[name.split("::")[0]] += s
        out.append("")
        out.append(table([[f"{s:.1f} s", f"{100 * s / total:.1f}%", name] for name, s in files.most_common(10)],
                         ["seconds", "share", "the 10 costliest files"], markdown))
    return "\n".join(out) if out else f"nothing recorded in {folder}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default=".ci-out", type=Path)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    print(report(args.folder, args.top, args.markdown))


if __name__ == "__main__":
    main()
