"""Fixtures of the dashboard tests: a tokenizer folder, a run's data in a real Redis, a client of the app."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jet.dash.server import Settings, create_app
from jet.models import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tiny"
    train_tokenizer(vocab_size=512).save_pretrained(path)
    return path


@pytest.fixture
def runs_dir(tmp_path, keys, tokenizer_dir) -> Path:
    """runs/<run>/config.resolved.yaml naming the model `tiny` (where the dashboard finds its tokenizer)."""
    run = tmp_path / "runs" / keys.run
    run.mkdir(parents=True)
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"run": keys.run, "models": [
        {"name": "tiny", "path": str(tokenizer_dir)}]}))
    return tmp_path / "runs"


@pytest.fixture
def client(redis_url, keys, runs_dir, tmp_path):
    from starlette.testclient import TestClient

    app = create_app(Settings(redis_url=redis_url, runs_dir=str(runs_dir), studies_dir=str(tmp_path / "studies"),
                              run=keys.run))
    with TestClient(app, base_url="http://127.0.0.1:8265") as c:
        yield c
