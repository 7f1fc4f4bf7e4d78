"""The studies page's data: what a `jet study` left in its directory, read as it is.

What it is: `studies(root)` lists the folders under the studies directory;
`study(root, name)` reads the files a study writes there, each only if it
exists: `results.csv` (one row per run; shown as a table), `decisions.jsonl`
(every ask, prune and stage change, with time), `report.md` (the verdicts, as
text) and the PNG plots. When the results have an arm column and numeric
columns, `arms` summarises each numeric column per arm: mean and a 95%
confidence interval over the arm's runs (Student t); with a step column too,
`curves` gives mean and band per arm and step.

What it is not: the study's statistics (paired tests, Holm correction and the
verdicts are the study runner's, in its report); this is a viewer. To follow a
change in the study's file layout, change the names in FILES and ARM_COLUMNS.

Invariants: only plain files inside a study folder (or one sub-folder deep,
like `plots/`) are ever read or served; no name from a request reaches outside.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import orjson

from jet import stats

FILES = {"results": "results.csv", "decisions": "decisions.jsonl", "report": "report.md"}
ARM_COLUMNS = ("arm", "arm_id", "trial", "params")  # the first present names a run's arm
SEED_COLUMNS = ("seed",)
STEP_COLUMNS = ("step", "steps")
MAX_ROWS = 5000

def studies(root: Path) -> list[dict]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        present = [key for key, f in FILES.items() if (d / f).is_file()]
        mtime = max((f.stat().st_mtime for f in d.iterdir() if f.is_file()), default=d.stat().st_mtime)
        out.append({"name": d.name, "files": present, "updated": mtime})
    return out


_SAFE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def file_in(root: Path, name: str, filename: str) -> Path | None:
    """The plain file `filename` inside study `name` (one sub-folder deep at most, e.g.
    `plots/reward.png`), or None: also for any name that could step outside the study."""
    parts = filename.split("/")
    if not _SAFE.match(name) or len(parts) > 2 or not all(_SAFE.match(p) for p in parts):
        return None
    folder = (Path(root) / name).resolve()
    path = (folder / filename).resolve()
    return path if path.is_file() and folder in path.parents else None


def _number(x: str) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def interval(values: list[float]) -> dict:
    """{n, mean, lo, hi}: the mean and its 95% Student-t interval (`jet.stats.mean_interval`; lo = hi = mean
    for one value)."""
    m = stats.mean_interval(values)
    lo, hi = m["ci95"] or (m["mean"], m["mean"])
    return {"n": m["n"], "mean": m["mean"], "lo": lo, "hi": hi}


def _summaries(columns: list[str], rows: list[dict]) -> tuple[str | None, dict, dict]:
    arm = next((c for c in ARM_COLUMNS if c in columns), None)
    step = next((c for c in STEP_COLUMNS if c in columns), None)
    skip = {arm, step, *SEED_COLUMNS}
    numeric = [c for c in columns if c not in skip and rows and all(_number(r.get(c)) is not None
                                                                     for r in rows if r.get(c) not in ("", None))
               and any(_number(r.get(c)) is not None for r in rows)]
    if arm is None:
        return None, {}, {}
    arms: dict[str, dict] = {}
    curves: dict[str, dict] = {}
    for c in numeric:
        by_arm: dict[str, list[float]] = {}
        by_step: dict[str, dict[float, list[float]]] = {}
        for r in rows:
            v = _number(r.get(c))
            if v is None:
                continue
            by_arm.setdefault(r[arm], []).append(v)
            s = _number(r.get(step)) if step else None
            if s is not None:
                by_step.setdefault(r[arm], {}).setdefault(s, []).append(v)
        arms[c] = {a: interval(vs) for a, vs in by_arm.items()}
        if by_step:
            curves[c] = {a: [{"step": s, **interval(vs)} for s, vs in sorted(pts.items())]
                         for a, pts in by_step.items()}
    return arm, arms, curves


def study(root: Path, name: str) -> dict | None:
    """What study `name` has written so far; None if there is no such study."""
    folder = Path(root) / name
    if not _SAFE.match(name) or not folder.is_dir():
        return None
    files = [p for p in folder.iterdir() if p.is_file()]
    files += [p for sub in folder.iterdir() if sub.is_dir() and _SAFE.match(sub.name) for p in sub.iterdir()
              if p.is_file()]
    out: dict = {"name": name, "files": sorted(p.relative_to(folder).as_posix() for p in files)}
    path = file_in(root, name, FILES["results"])
    if path:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.DictReader(f)
            rows = [row for _, row in zip(range(MAX_ROWS), reader)]
            columns = list(reader.fieldnames or [])
        arm, arms, curves = _summaries(columns, rows)
        out["results"] = {"columns": columns, "rows": rows, "arm_column": arm, "arms": arms, "curves": curves}
    path = file_in(root, name, FILES["decisions"])
    if path:
        decisions = []
        for line in path.read_bytes().splitlines()[-1000:]:
            try:
                decisions.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
        out["decisions"] = decisions
    path = file_in(root, name, FILES["report"])
    if path:
        out["report"] = path.read_text(encoding="utf-8", errors="replace")[:200_000]
    out["plots"] = [f for f in out["files"] if f.lower().endswith(".png")]
    return out
