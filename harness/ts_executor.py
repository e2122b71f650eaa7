"""Real DBOS executors on the TypeScript SDK: harness/ts_app, a Node.js application on
``@dbos-inc/dbos-sdk`` 5.2 whose conductor client is the SDK's own; and harness/ts_app53, one on
5.3 (whose conductor client is no longer open source) connected by Relay's open client, client-ts/.

Their packages are installed on first use with ``npm ci`` from their package-lock.json (into
harness/ts_app*/node_modules, kept; a lock file makes two test workers install them once).
ts_app53 installs client-ts through ``file:../../client-ts`` as a copy (its .npmrc), installed
again whenever client-ts/ differs from that copy.
Node.js 20 or later and npm are needed: test.sh stops and says so when they are missing (Debian
12's own nodejs is 18, too old for the SDK).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harness.executors import ROOT, ExecutorProcess

TS_APP = ROOT / "harness" / "ts_app"
SDK_VERSION = "5.2.11"
TS_APP53 = ROOT / "harness" / "ts_app53"
SDK53_VERSION = "5.3.0"
CLIENT_TS = ROOT / "client-ts"


def _sdk_installed(app: Path, version: str) -> bool:
    manifest = app / "node_modules" / "@dbos-inc" / "dbos-sdk" / "package.json"
    return manifest.exists() and json.loads(manifest.read_text())["version"] == version


def _client_files(root: Path) -> dict[str, bytes]:
    files = [root / "package.json", root / "index.js", root / "index.d.ts", *sorted((root / "lib").glob("*.js"))]
    return {str(f.relative_to(root)): f.read_bytes() for f in files if f.exists()}


def _client_installed(app: Path) -> bool:
    """Whether the copy of client-ts in ``app``'s node_modules is client-ts/ as it is now."""
    copy = app / "node_modules" / "@relay-oss" / "client"
    return copy.is_dir() and not copy.is_symlink() and _client_files(copy) == _client_files(CLIENT_TS)


def _install(app: Path, installed: Callable[[], bool], what: str) -> None:
    with open(app.parent / f"{app.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not installed():
            npm = shutil.which("npm")
            if npm is None:
                raise RuntimeError("npm is not installed: the TypeScript executor's tests need Node.js 20 and npm")
            subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=app, check=True,
                           timeout=600)  # fmt: skip
            assert installed(), f"npm ci did not install {what}"


def ts_app() -> Path:
    """harness/ts_app/app.js, with its packages installed first if they are not yet."""
    _install(TS_APP, lambda: _sdk_installed(TS_APP, SDK_VERSION), f"@dbos-inc/dbos-sdk {SDK_VERSION}")
    return TS_APP / "app.js"


def ts_app53() -> Path:
    """harness/ts_app53/app.js, with its packages (client-ts's current copy among them) installed first."""
    _install(
        TS_APP53,
        lambda: _sdk_installed(TS_APP53, SDK53_VERSION) and _client_installed(TS_APP53),
        f"@dbos-inc/dbos-sdk {SDK53_VERSION} and client-ts",
    )
    return TS_APP53 / "app.js"


def node_url(url: str) -> str:
    """``url`` as Node.js's URL parser takes it: a socket directory given as ``?host=`` (libpq's
    form, the embedded server's) with no host before the path is refused there, so ``localhost``
    stands in (libpq and node-postgres let the query's host win)."""
    parts = urlsplit(url)
    if parts.hostname:
        return url
    return parts._replace(netloc=f"{parts.netloc}localhost").geturl()


def start_ts_executor(
    workdir: Path, sysdb_url: str, conductor_url: str, *, sdk53: bool = False, **kwargs: Any
) -> ExecutorProcess:
    """A TypeScript executor (harness/ts_app; with ``sdk53``, harness/ts_app53 and Relay's open
    client) with ExecutorProcess's settings."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed: the TypeScript executor's tests need Node.js 20")
    env = dict(kwargs.pop("env", None) or {})
    for url in ("RELAY_TEST_EVIDENCE", "RELAY_TEST_ALERTS"):
        if url in env:
            env[url] = node_url(env[url])
    command = [node, str(ts_app53() if sdk53 else ts_app())]
    return ExecutorProcess(workdir, node_url(sysdb_url), conductor_url, env=env, command=command, **kwargs)
