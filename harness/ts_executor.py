"""Real DBOS executors on the TypeScript SDK: harness/ts_app, a Node.js application on
``@dbos-inc/dbos-sdk`` 5.2 whose conductor client is the SDK's own.

Its packages are installed on first use with ``npm ci`` from its package-lock.json (into
harness/ts_app/node_modules, kept; a lock file makes two test workers install them once).
Node.js 20 or later and npm are needed: test.sh stops and says so when they are missing (Debian
12's own nodejs is 18, too old for the SDK).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harness.executors import ROOT, ExecutorProcess

TS_APP = ROOT / "harness" / "ts_app"
SDK_VERSION = "5.2.11"


def _installed() -> bool:
    manifest = TS_APP / "node_modules" / "@dbos-inc" / "dbos-sdk" / "package.json"
    return manifest.exists() and json.loads(manifest.read_text())["version"] == SDK_VERSION


def ts_app() -> Path:
    """harness/ts_app/app.js, with its packages installed first if they are not yet."""
    with open(ROOT / "harness" / "ts_app.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed():
            npm = shutil.which("npm")
            if npm is None:
                raise RuntimeError("npm is not installed: the TypeScript executor's tests need Node.js 20 and npm")
            subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=TS_APP, check=True,
                           timeout=600)  # fmt: skip
            assert _installed(), f"npm ci did not install @dbos-inc/dbos-sdk {SDK_VERSION}"
    return TS_APP / "app.js"


def node_url(url: str) -> str:
    """``url`` as Node.js's URL parser takes it: a socket directory given as ``?host=`` (libpq's
    form, the embedded server's) with no host before the path is refused there, so ``localhost``
    stands in (libpq and node-postgres let the query's host win)."""
    parts = urlsplit(url)
    if parts.hostname:
        return url
    return parts._replace(netloc=f"{parts.netloc}localhost").geturl()


def start_ts_executor(workdir: Path, sysdb_url: str, conductor_url: str, **kwargs: Any) -> ExecutorProcess:
    """A TypeScript executor (harness/ts_app) with ExecutorProcess's settings."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed: the TypeScript executor's tests need Node.js 20")
    env = dict(kwargs.pop("env", None) or {})
    for url in ("RELAY_TEST_EVIDENCE", "RELAY_TEST_ALERTS"):
        if url in env:
            env[url] = node_url(env[url])
    command = [node, str(ts_app())]
    return ExecutorProcess(workdir, node_url(sysdb_url), conductor_url, env=env, command=command, **kwargs)
