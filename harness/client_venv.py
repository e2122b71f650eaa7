"""The separate virtualenv where executors using relay_client run: dbos 3.4, not Relay's 3.2.

Relay itself stays on dbos 3.2 (its venv, ``.venv``); applications on dbos 3.3
and later use the open client in ``client/``. This builds ``.venv-client`` (dbos
3.4) at the repository's root once, and ``.venv-client-3.3`` for the client's
own tests on dbos 3.3, and rebuilds one when what it was built from changes
(client/pyproject.toml, protocol/pyproject.toml or the list of packages
below): their hash is kept inside it.

``python -m harness.client_venv [SERIES]`` builds one (if needed) and prints its python.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The dbos release series the client declares (client/pyproject.toml) and is tested on.
DBOS_SERIES = ("3.4", "3.3")
# What the test apps need besides the client: the evidence database's driver, and
# the tools test.sh and the client's own tests run in this venv.
PACKAGES = ["sqlalchemy", "psycopg[binary]", "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "mypy>=1.11"]
_STAMP = ".relay-client-hash"


def venv_path(dbos: str = DBOS_SERIES[0]) -> Path:
    """``.venv-client`` for the newest series, ``.venv-client-3.3`` for another."""
    return ROOT / (".venv-client" if dbos == DBOS_SERIES[0] else f".venv-client-{dbos}")


def _packages(dbos: str) -> list[str]:
    return [f"dbos=={dbos}.*", *PACKAGES]


def _digest(dbos: str) -> str:
    h = hashlib.sha256()
    for path in (ROOT / "client" / "pyproject.toml", ROOT / "protocol" / "pyproject.toml"):
        h.update(path.read_bytes())
    h.update(repr(_packages(dbos)).encode())
    return h.hexdigest()


def client_python(dbos: str = DBOS_SERIES[0], venv: Path | None = None) -> Path:
    """The python of the client venv with dbos ``dbos``.*, built or rebuilt first if missing or out of date."""
    venv = venv or venv_path(dbos)
    python = venv / "bin" / "python"
    digest = _digest(dbos)
    lock_path = venv.with_name(venv.name + ".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once build it once
        stamp = venv / _STAMP
        if python.exists() and stamp.exists() and stamp.read_text() == digest:
            return python
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "-e", str(ROOT / "protocol"), "-e", str(ROOT / "client"), *_packages(dbos)],
            check=True, cwd=ROOT,
        )  # fmt: skip
        stamp.write_text(digest)
    return python


if __name__ == "__main__":
    print(client_python(sys.argv[1] if len(sys.argv) > 1 else DBOS_SERIES[0]))
