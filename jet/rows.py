"""Dataset rows from files and the Hub: what `tasks[].dataset` names besides a built-in dataset.

What a dataset string is (`kind`):
- a built-in name (`guess`, `arith`; jet.tasks): no `/`, no file suffix;
- a file: `.jsonl` (one JSON object a line; also an existing file of any other suffix, as before),
  `.parquet` (pyarrow), `.csv` (a header row; every value is a string, as CSV has no types);
- anything else with a `/` goes to `datasets.load_dataset`: a Hub dataset id `owner/name`, or a
  local folder of data files, with optional `?config=<name>&split=<split>&revision=<rev>` (split
  defaults to train). Hub datasets use the datasets cache (HF_HOME, HF_DATASETS_CACHE) and its
  offline mode (HF_HUB_OFFLINE=1); a local path that exists always wins over a Hub id.

Every row, whatever its source, is validated the way a JSONL line is: an object whose values are
JSON values (no NaN, bytes, dates...), else a ConfigError naming the file (or dataset) and row.

What it is not: the built-in datasets (jet.tasks) or the writer of Task messages (jet.workers.feeder.tasks).
"""

from __future__ import annotations

import csv
import math
import os
from typing import Any, Iterator
from urllib.parse import parse_qsl

import orjson

from jet.errors import ConfigError

FILE_KINDS = {".jsonl": "jsonl", ".parquet": "parquet", ".csv": "csv"}
QUERY_KEYS = ("config", "split", "revision")


def split_spec(dataset: str) -> tuple[str, dict[str, str]]:
    """(path or id, {config, split, revision}) of a dataset string; a bad query is a ValueError."""
    where, _, query = dataset.partition("?")
    if not query:
        return where, {}
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False)
    opts = dict(pairs)
    bad = [k for k, _ in pairs if k not in QUERY_KEYS] + [k for k, v in pairs if not v]
    if bad or len(opts) != len(pairs) or "=" not in query:
        raise ValueError(f"{dataset!r}: the part after '?' takes {'/'.join(QUERY_KEYS)}=<value>, joined by '&' "
                         f"(e.g. owner/name?config=main&split=test)")
    return where, opts


def kind(dataset: str) -> str:
    """'builtin', 'jsonl', 'parquet', 'csv' or 'hf' (datasets.load_dataset: a Hub id or a local folder)."""
    where, _ = split_spec(dataset)
    for suffix, k in FILE_KINDS.items():
        if where.lower().endswith(suffix):
            return k
    pathlike = "/" in where or os.sep in where
    if pathlike and "?" not in dataset and os.path.isfile(where):
        return "jsonl"  # an existing file of another suffix is JSON lines, as every dataset file was before
    return "hf" if pathlike or "?" in dataset else "builtin"


def numbered(dataset: str) -> Iterator[tuple[str, dict]]:
    """(where, row) of each row of a file or load_dataset dataset; `where` is `file:line`, `file: row n`
    or `<dataset> row n`. A bad row raises ConfigError naming it."""
    k = kind(dataset)
    if k == "builtin":
        raise ConfigError(f"{dataset!r} is a built-in dataset name, not a file (jet.tasks.dataset reads it)")
    if k in FILE_KINDS.values() and not os.path.isfile(dataset):
        raise ConfigError(f"{dataset}: no such file")
    if k == "jsonl":
        yield from _jsonl(dataset)
        return
    reader = {"parquet": _parquet, "csv": _csv, "hf": _hf}[k]
    for where, row in reader(dataset):
        yield where, check_row(where, row)


def _jsonl(path: str) -> Iterator[tuple[str, dict]]:
    """(file:line, row) of each non-blank line of a JSONL file; a bad line raises ConfigError naming it."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
            yield f"{path}:{n}", row


def read(dataset: str) -> list[dict]:
    """Every row of a file or load_dataset dataset, validated."""
    return [row for _, row in numbered(dataset)]


def check_row(where: str, row: Any) -> dict:
    """`row` if it is what a JSONL line may be: an object with string keys and JSON values."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: each row must be an object, got {type(row).__name__}")
    for key, value in row.items():
        bad = _not_json(value)
        if not isinstance(key, str) or bad:
            raise ConfigError(f"{where}: column {key!r} holds {bad or 'a non-string key'}, not a JSON value "
                              "(string, number, true/false, null, list, object)")
    return row


def _not_json(value: Any) -> str | None:
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"the float {value}"
    if isinstance(value, (list, tuple)):
        return next((bad for v in value if (bad := _not_json(v))), None)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return "an object with non-string keys"
        return next((bad for v in value.values() if (bad := _not_json(v))), None)
    return f"a {type(value).__name__}"


def _parquet(path: str) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading .parquet needs pyarrow: pip install 'jet-rl[datasets]'") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"{path}: not a readable parquet file: {e}") from None
    for n, row in enumerate(table.to_pylist(), 1):
        yield f"{path}: row {n}", row


def _csv(path: str) -> Iterator[tuple[str, dict]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        width = len(reader.fieldnames or [])
        if width and len(set(reader.fieldnames)) != width:
            raise ConfigError(f"{path}:1: the header repeats a column name ({', '.join(reader.fieldnames)})")
        for row in reader:
            if None in row or None in row.values():  # more fields than the header, or fewer
                got = width + len(row.get(None, [])) if None in row else sum(v is not None for v in row.values())
                raise ConfigError(f"{path}:{reader.line_num}: {got} fields, the header has {width}")
            yield f"{path}:{reader.line_num}", row


def _hf(dataset: str) -> Iterator[tuple[str, dict]]:
    where, opts = split_spec(dataset)
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{dataset}: a Hub dataset or dataset folder needs the datasets package: "
                          "pip install 'jet-rl[datasets]'") from None
    split = opts.get("split", "train")
    try:
        data = datasets.load_dataset(where, opts.get("config"), split=split, revision=opts.get("revision"),
                                     token=os.environ.get("HF_TOKEN") or None)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds (not found, offline, bad split): one line
        offline = "; offline (HF_HUB_OFFLINE) and not in the datasets cache?" if _offline() else ""
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{dataset}: cannot load split {split!r}: {type(e).__name__}: {reason}{offline}") from None
    for n, row in enumerate(data, 1):
        yield f"{dataset} row {n}", row


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "on", "yes", "true")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
