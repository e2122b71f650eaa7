from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dbos import DBOS

sys.path.insert(0, str(Path(__file__).parent))

import app

import relay_client


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """DBOS launched on SQLite with an id from new_executor_id(); the executor id."""
    executor_id = relay_client.new_executor_id()
    app.launch(tmp_path_factory.mktemp("dbos"), executor_id, alert_handler=True)
    yield executor_id
    DBOS.destroy()
