"""Real DBOS executors in subprocesses, and what they leave behind.

An executor is :mod:`harness.executor_app`: a real DBOS application using the
SDK's own conductor client, not an imitation.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, LiteralString

import psycopg

from harness import zygote
from harness.keys import CONDUCTOR_KEYS
from harness.procs import Child
from harness.relay import RelayProcess, one_more_healthy
from harness.waiting import assert_eventually

ROOT = Path(__file__).resolve().parents[1]


def await_ready(proc: Child, timeout: float = 60) -> str | None:
    """The executor id from the ``READY <id>`` line an executor prints once launched."""
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.match(rb"READY (\S+)", line)
            if match:
                found.append(match.group(1).decode())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return found[0] if found else None


class ExecutorProcess:
    """A real DBOS application in a subprocess: harness/executor_app.py, or another ``module``
    that takes the same settings (harness/workflow_app.py)."""

    def __init__(
        self, workdir: Path, sysdb_url: str, conductor_url: str, org: str = "acme", app: str = "ledger",
        version: str = "v1", sleepers: int = 0, key: str | None = None, env: dict[str, str] | None = None,
        python: str | Path = sys.executable, module: str = "harness.executor_app",
        command: list[str] | None = None,
    ) -> None:  # fmt: skip
        """``python``/``module``: another program, e.g. harness.client_app in the client's venv;
        ``command``: one that is not Python (harness.ts_executor's TypeScript app)."""
        self.org = org
        self.app = app
        self.log_path = workdir / f"executor-{uuid.uuid4().hex[:6]}.log"
        env = {
            **os.environ,
            "RELAY_TEST_APP": app,
            "RELAY_TEST_SYSDB": sysdb_url,
            "RELAY_TEST_CONDUCTOR_URL": conductor_url,
            "RELAY_TEST_CONDUCTOR_KEY": key or CONDUCTOR_KEYS[org],
            "RELAY_TEST_APP_VERSION": version,
            "RELAY_TEST_SLEEPERS": str(sleepers),
            **(env or {}),
        }
        self._log = open(self.log_path, "wb")
        self.proc: Child
        # The harness's own Python programs, in this interpreter, start from the zygote; a program
        # of another interpreter (the client's venv) or language is exec'd.
        in_this_python = command is None and Path(python) == Path(sys.executable) and module.startswith("harness.")
        if zygote.wanted(env) and in_this_python:
            self.proc = zygote.zygote(zygote.EXECUTOR).start(
                module, [], env, ROOT, stdout=subprocess.PIPE, stderr=self._log
            )
        else:
            self.proc = subprocess.Popen(
                command or [str(python), "-m", module],
                stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=ROOT,
            )  # fmt: skip
        self.executor_id = self._wait_ready()

    def _wait_ready(self) -> str:
        executor_id = await_ready(self.proc)
        if executor_id is None:
            self.stop()
            raise RuntimeError(f"executor did not start:\n{self.log_path.read_text(errors='replace')}")
        return executor_id

    def kill(self) -> None:
        """kill -9: the process gets no chance to close its socket politely."""
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class HeldJobs:
    """An executor launching with its jobs held back until its gate opens (:func:`jobs_held`)."""

    def __init__(self, gate: Path, launching: Future[ExecutorProcess]) -> None:
        self.gate = gate
        self.launching = launching
        self.executor_id = ""  # learned from the registry (await_healthy): its READY comes past the jobs

    def await_healthy(
        self, relay: RelayProcess, beside: Collection[str], timeout: float, what: str, app: str = "ledger"
    ) -> dict[str, str]:
        """The app's HEALTHY executors and each one's instance, once they are ``beside`` and this one,
        whose id this learns."""
        everyone = assert_eventually(lambda: one_more_healthy(relay, beside, app), timeout, what=what)
        (self.executor_id,) = everyone.keys() - set(beside)
        return everyone

    def release(self) -> ExecutorProcess:
        """Opens the gate (again, harmlessly, past jobs_held): the executor, once its jobs are started
        (PENDING) and its READY, past them, is read; it is the one the registry showed."""
        self.gate.touch()
        executor = self.launching.result()
        assert executor.executor_id == self.executor_id, (
            f"READY gave {executor.executor_id}, the registry {self.executor_id}"
        )
        return executor


@contextmanager
def jobs_held(
    start: Callable[..., ExecutorProcess], conductor_url: str, workdir: Path, env: dict[str, str], **kwargs: Any
) -> Iterator[HeldJobs]:
    """An executor launched by ``start`` (a test's fixture) in a thread, its jobs held back until the
    gate opens (RELAY_TEST_JOBS_GATE: harness/executor_app.py, client_app.py, the TypeScript apps).
    Started as it launched, they could end on it before it died when a loaded machine was slow; held,
    they start when the test is ready for them. The gate opens on the way out, failed or not."""
    gate = workdir / f"jobs-gate-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(1) as pool:
        held = HeldJobs(
            gate, pool.submit(start, conductor_url, env={**env, "RELAY_TEST_JOBS_GATE": str(gate)}, **kwargs)
        )
        try:
            yield held
            held.release()  # for its check: the launch ended as READY, with the id the registry showed
        finally:
            gate.touch()


class Evidence:
    """Reads what the test executors wrote (see executor_app.py)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _rows(self, sql: LiteralString) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url) as conn:
            try:
                return list(conn.execute(sql).fetchall())
            except psycopg.errors.UndefinedTable:
                return []

    def outcomes(self) -> dict[str, str]:
        """workflow id -> executor id that recorded its outcome."""
        return {w: e for w, e in self._rows("SELECT workflow_id, executor_id FROM outcomes")}

    def outcome_count(self) -> int:
        """Outcome rows, duplicates included (there must be none: one per workflow)."""
        return len(self._rows("SELECT workflow_id FROM outcomes"))

    def outcome_versions(self) -> dict[str, str]:
        return {w: v for w, v in self._rows("SELECT workflow_id, version FROM outcomes")}

    def step_runs(self) -> list[tuple[str, str, str]]:
        """(workflow id, step, executor id) for every execution of a step."""
        return [(w, s, e) for w, s, e in self._rows("SELECT workflow_id, step, executor_id FROM step_evidence")]
