"""`tasks[].dataset` beyond JSONL: parquet and csv files, dataset folders and Hub datasets (jet/rows.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jet.config import load_file
from jet.errors import ConfigError
from jet.rows import kind, read

pa = pytest.importorskip("pyarrow", reason="needs the datasets extra: pip install 'jet-rl[datasets]'")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [{"question": "1 + 2", "answer": 3, "tags": ["easy"], "meta": {"src": "a"}},
        {"question": "7 * 6", "answer": 42, "tags": [], "meta": {"src": "b"}}]


def config(tmp_path: Path, dataset: str) -> Path:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    f = tmp_path / "jet.yaml"
    f.write_text(yaml.safe_dump({"models": [{"name": "m", "path": "./m"}],
                                 "tasks": [{"name": "t", "workflow": "a:b", "dataset": dataset}]}))
    return f


def test_kinds():
    assert [kind(d) for d in ("guess", "a.jsonl", "d/a.parquet", "a.CSV", "org/name", "org/name?split=test",
                              "./folder")] == ["builtin", "jsonl", "parquet", "csv", "hf", "hf", "hf"]
    with pytest.raises(ValueError, match="config/split/revision"):
        kind("org/name?splt=test")


def test_a_file_of_another_suffix_is_still_json_lines(tmp_path):
    (tmp_path / "rows.txt").write_text('{"q": 1}\n\n{"q": 2}\n')
    cfg = load_file(config(tmp_path, "./rows.txt"))
    assert read(cfg.tasks[0].dataset) == [{"q": 1}, {"q": 2}]
    (tmp_path / "rows.txt").write_text('{"q": 1}\n[2]\n')
    with pytest.raises(ConfigError, match=r"rows.txt:2: each line must be a JSON object"):
        read(cfg.tasks[0].dataset)


def test_a_parquet_file_gives_its_typed_rows(tmp_path):
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "data" / "rows.parquet")
    cfg = load_file(config(tmp_path, "data/rows.parquet"), check_paths=False)
    assert cfg.tasks[0].dataset == str(tmp_path / "data" / "rows.parquet")
    assert read(cfg.tasks[0].dataset) == ROWS


def test_a_csv_file_gives_string_rows(tmp_path):
    (tmp_path / "rows.csv").write_text('question,answer\n1 + 2,3\n"say ""hi"", twice",hi hi\n')
    assert read(str(load_file(config(tmp_path, "rows.csv")).tasks[0].dataset)) == [
        {"question": "1 + 2", "answer": "3"}, {"question": 'say "hi", twice', "answer": "hi hi"}]


def test_a_bad_parquet_row_is_named(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"q": ["a", "b", "c"], "x": [1.0, 2.0, math.nan]}), path)
    with pytest.raises(ConfigError) as e:
        read(str(path))
    assert str(e.value) == (f"{path}: row 3: column 'x' holds the float nan, not a JSON value "
                            "(string, number, true/false, null, list, object)")
    pq.write_table(pa.table({"q": [b"\x00"]}), path)
    with pytest.raises(ConfigError, match=r"rows.parquet: row 1: column 'q' holds a bytes"):
        read(str(path))
    path.write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="not a readable parquet file"):
        read(str(path))


@pytest.mark.parametrize("line, why", [("4,5,6", "3 fields, the header has 2"), ("4", "1 fields, the header has 2")])
def test_a_bad_csv_row_is_named(tmp_path, line, why):
    path = tmp_path / "rows.csv"
    path.write_text(f"q,a\n1,2\n{line}\n7,8\n")
    with pytest.raises(ConfigError) as e:
        read(str(path))
    assert str(e.value) == f"{path}:3: {why}"


def test_check_paths_and_bad_queries_name_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_file(config(tmp_path, "absent.parquet"), check_paths=True)
    assert e.value.key == "tasks[0].dataset" and "no such file" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_file(config(tmp_path, "org/name?config=main&spilt=test"))
    assert e.value.key == "tasks[0].dataset"
    cfg = load_file(config(tmp_path, "org/name?config=main&split=test"), check_paths=True)  # a Hub id: not checked
    assert cfg.tasks[0].dataset == "org/name?config=main&split=test"


def test_enqueue_writes_parquet_rows_and_names_a_bad_one(tmp_path, redis_url, keys):
    import anyio
    from click.testing import CliRunner

    from jet.cli.main import main
    from jet.queues import codec
    from jet.queues.connect import connect
    from jet.wire import Task

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    args = ["enqueue", "t", "--dataset", str(path), "--group-size", "2", "--run", keys.run, "--redis-url", redis_url]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output

    async def entries():
        r = await connect(redis_url)
        try:
            return await r.xrange(keys.tasks("t"))
        finally:
            await r.aclose()

    tasks = [Task.from_payload(codec.decode(f)) for _, f in anyio.run(entries)]
    assert [t.row for t in tasks] == [ROWS[0], ROWS[0], ROWS[1], ROWS[1]]
    pq.write_table(pa.table({"q": ["a", "b"], "x": [1.0, math.inf]}), path)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1].startswith(
        f"Error: {path}: row 2: column 'x' holds the float inf")


def prepared_cache(cache: Path, repo: str, config: str, splits: dict[str, list[dict]], tmp: Path) -> None:
    """What an online `load_dataset(repo, config)` of a parquet dataset leaves in HF_DATASETS_CACHE:
    <owner>___<name>/<config>/0.0.0/<hash>/ with one arrow file a split and dataset_info.json, written
    here by datasets' own parquet builder (what offline mode then reads)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {}
    for split, rows in splits.items():
        files[split] = str(tmp / f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), files[split])
    builder = Parquet(cache_dir=str(cache), dataset_name=repo.split("/")[1], config_name=config, data_files=files,
                      hash="0" * 16)
    builder.repo_id = repo  # the cache folder of a Hub dataset is named after its repo
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()
    folder = cache / repo.replace("/", "___")
    (next(folder.glob(f"{config}-*"))).rename(folder / config)  # local data files add a hash to the config id


SCRIPT = """
import json, sys
from jet.errors import ConfigError
from jet.rows import read
out = {}
for spec in sys.argv[1:]:
    try:
        out[spec] = read(spec)
    except ConfigError as e:
        out[spec] = str(e)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_hub_datasets_and_folders_offline(tmp_path):
    pytest.importorskip("datasets", reason="needs the datasets extra: pip install 'jet-rl[datasets]'")
    cache, train, test = tmp_path / "dcache", [{"q": "1+1", "a": 2}, {"q": "2+2", "a": 4}], [{"q": "3+3", "a": 6}]
    prepared_cache(cache, "org/arith", "main", {"train": train, "test": test}, tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.csv").write_text("q,a\n5+5,10\n")
    (folder / "test.csv").write_text("q,a\n6+6,12\n")
    specs = ["org/arith?config=main&split=test", "org/arith?config=main", "org/absent?split=train",
             f"{folder}?split=test", str(folder)]
    env = {"HF_DATASETS_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", SCRIPT, *specs], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got[specs[0]] == test and got[specs[1]] == train
    assert got[specs[2]].startswith("org/absent?split=train: cannot load split 'train': ")
    assert got[specs[2]].endswith("offline (HF_HUB_OFFLINE) and not in the datasets cache?")
    assert "\n" not in got[specs[2]]
    assert got[specs[3]] == [{"q": "6+6", "a": 12}] and got[specs[4]] == [{"q": "5+5", "a": 10}]


def test_the_feeder_cycles_a_parquet_dataset_read_once(tmp_path, redis_url, keys, monkeypatch):
    import anyio

    from jet import rows
    from jet.workers.feeder.feeder import Feeder
    from jet.queues import codec
    from jet.queues.connect import connect
    from jet.wire import Task

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    f = config(tmp_path, "rows.parquet")
    data = yaml.safe_load(f.read_text())
    data.update(run=keys.run)
    data["tasks"][0]["group_size"] = 2
    f.write_text(yaml.safe_dump(data))
    reads = []
    monkeypatch.setattr(rows, "read", lambda d, real=rows.read: reads.append(d) or real(d))
    async def entries(drop: bool = False):
        r = await connect(redis_url)
        try:
            return await (r.delete(keys.tasks("t")) if drop else r.xrange(keys.tasks("t")))
        finally:
            await r.aclose()

    feed = Feeder(load_file(f), redis_url, backlog_per_weight=6)
    try:
        feed.tick()
        first = [Task.from_payload(codec.decode(e)).row for _, e in anyio.run(entries)]
        anyio.run(entries, True)  # consumed: the next tick tops up again
        feed.tick()
        second = [Task.from_payload(codec.decode(e)).row for _, e in anyio.run(entries)]
    finally:
        feed.close()
    assert first == [ROWS[0]] * 2 + [ROWS[1]] * 2 + [ROWS[0]] * 2  # cycled in file order
    assert second[:2] == [ROWS[1]] * 2  # where the first tick stopped
    assert reads == [str(tmp_path / "rows.parquet")]  # read once, not every tick
