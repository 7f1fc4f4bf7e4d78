"""Fixtures of the trainer tests: a tiny model directory (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jet.models import init_model

from .helpers import MODEL


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("model") / MODEL, vocab_size=512, hidden_size=32, layers=2,
                      heads=4, kv_heads=2, max_position=256, seed=0)
