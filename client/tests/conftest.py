from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dbos import DBOS

sys.path.insert(0, str(Path(__file__).parent))
# The repository's root, last: its harness.certificates (standard library only) is shared with
# the repository's own tests; nothing of Relay's is installed in this venv, and nothing else there
# has a name the client's tests import.
sys.path.append(str(Path(__file__).resolve().parents[2]))

import app

import relay_client


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """DBOS launched on SQLite with an id from new_executor_id(); the executor id."""
    executor_id = relay_client.new_executor_id()
    app.launch(tmp_path_factory.mktemp("dbos"), executor_id, alert_handler=True)
    yield executor_id
    DBOS.destroy()
