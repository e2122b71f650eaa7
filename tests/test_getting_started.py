"""What a new user meets following the README's getting-started tour: a database that is not
there, a RELAY_HOME that cannot be made, the console before signing in, ``./run.sh`` again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from playwright.sync_api import expect

from harness.browser import chromium
from harness.ports import free_port
from harness.procs import listens
from harness.relay import RelayProcess
from harness.waiting import assert_eventually
from harness.web import TLS
from relay.cli.errors import EXIT_ERROR
from relay.runtime import EXIT_FENCED

ROOT = Path(__file__).resolve().parents[1]


def run_relay(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_serve_with_an_unreachable_database_says_so_in_one_line_and_exits_1_not_3() -> None:
    """``relay serve`` catches DatabaseError to print ``relay: cannot connect to PostgreSQL: ...`` and
    return 1, but the database is opened in uvicorn's lifespan: uvicorn logs a traceback of some 80
    lines ("pool initialization incomplete after 15.0 sec", the reason only in the pool's warnings)
    and exits 3, the code the README gives an instance whose lease was adopted (EXIT_FENCED)."""
    result = run_relay("serve", "--port", str(free_port()), "--database-url", "postgresql://nobody@127.0.0.1:1/none")
    assert result.returncode != EXIT_FENCED, "exit 3 is an adopted lease's, not a database that is not there"
    assert result.returncode == EXIT_ERROR, result.returncode
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "relay: cannot connect to PostgreSQL" in result.stderr, result.stderr[-3000:]


def test_a_relay_home_that_cannot_be_made_is_an_embedded_postgres_error_not_an_internal_one(tmp_path: Path) -> None:
    """EmbeddedPostgres.start makes RELAY_HOME before the ``try`` that turns OS errors into "cannot
    start the embedded PostgreSQL in ...": RELAY_HOME naming a file (or a folder Relay may not
    write) is reported as ``relay: internal error: FileExistsError`` with a traceback."""
    home = tmp_path / "not-a-folder"
    home.write_text("")
    result = run_relay("serve", "--port", str(free_port()), env={"RELAY_HOME": str(home)})
    assert result.returncode == EXIT_ERROR, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "cannot start the embedded PostgreSQL" in result.stderr, result.stderr


def test_the_sign_in_page_shows_no_sign_out_button(start_relay: Callable[..., RelayProcess]) -> None:
    """The header's session block (who, the live dot, Sign out) is ``hidden`` until a key signs in,
    but console.css gives ``.session`` ``display: flex``, which overrides the attribute: a visitor
    who has not signed in (and one who just signed out) sees a "Sign out" button."""
    relay = start_relay()
    with chromium() as browser:
        page = browser.new_page()
        page.goto(f"{relay.http}/")
        expect(page.get_by_role("heading", name="Sign in to Relay")).to_be_visible()
        assert page.locator("#session").get_attribute("hidden") is not None  # the page means it hidden
        expect(page.locator("#signout")).to_be_hidden()


def _run_sh(repo: Path, home: Path, port: int, database_url: str, env: dict[str, str], name: str) -> int:
    """``./run.sh --port P --database-url URL`` in ``repo`` until /readyz answers (or it exits): its exit
    code, or 0 once it served and stopped on SIGTERM."""
    run_env = {**os.environ, "RELAY_HOME": str(home), **env}
    for unset in ("RELAY_CONFIG", "RELAY_DATABASE_URL", "RELAY_INSTANCE_ID", "VIRTUAL_ENV"):
        run_env.pop(unset, None)
    with open(repo / f"{name}.out", "wb") as out:
        proc = subprocess.Popen(["./run.sh", "--port", str(port), "--database-url", database_url],
                                cwd=repo, stdout=out, stderr=subprocess.STDOUT, env=run_env)  # fmt: skip

    def ready() -> bool:
        if proc.poll() is not None:
            return True
        if not listens(proc.pid, port):  # run.sh's own relay answering, not another run's server on the port
            return False
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1, verify=TLS).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert_eventually(ready, 300, interval=0.5, what=f"{name}: ./run.sh serving or exited")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            code = 0
        else:
            code = proc.returncode
    return code


def test_run_sh_counts_as_serving_only_once_its_own_relay_listens(tmp_path: Path) -> None:
    """Another process on run.sh's port (another run's server, handed the same port) answered the
    /readyz that ``_run_sh`` waited for: a run.sh still installing counted as serving and was
    stopped, and its test failed for no fault of run.sh's. It counts once run.sh's own process (or
    its child) listens there, as the harness's RelayProcess does."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "run.sh").write_text("#!/bin/sh\nsleep 1\nexit 3\n")  # installs a moment, then fails: never listens
    (repo / "run.sh").chmod(0o755)
    answers = tmp_path / "answers"
    answers.mkdir()
    (answers / "readyz").write_text("ready")  # GET /readyz answered 200, as another run's Relay answers it
    handler = partial(SimpleHTTPRequestHandler, directory=str(answers))
    with ThreadingHTTPServer(("127.0.0.1", free_port()), handler) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        try:
            code = _run_sh(repo, tmp_path / "home", other.server_port, "postgresql://127.0.0.1:1/none", {}, "held")
        finally:
            other.shutdown()
    assert code == 3, "run.sh was taken for serving on a port another process answers on"


def _copy_of_the_repository(repo: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)


def _old_python3_on_path(tmp_path: Path) -> dict[str, str]:
    """A PATH whose ``python3`` answers as Python 3.10 does (Ubuntu 22.04's python3), where python3.11
    is installed beside it: an interpreter on which Relay's packages refuse to install."""
    bin_dir = tmp_path / "old-python-bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    refusal = "echo 'ERROR: Package requires a different Python: 3.10.12 not in >=3.11' >&2; exit 1"
    shim.write_text(f'#!/bin/sh\ncase "$*" in *version_info*) echo 3.10; exit 0;; esac\n{refusal}\n')
    shim.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_run_sh_on_a_python3_older_than_3_11_says_so_and_names_PYTHON(tmp_path: Path) -> None:
    """The README asks for Python 3.11+, but run.sh ran whatever ``python3`` is: on an older one it
    made a .venv of it and stopped in pip with "Package 'relay-protocol' requires a different
    Python", and there was no way to name the python3.11 installed beside it."""
    repo = tmp_path / "relay"
    _copy_of_the_repository(repo)
    env = {**os.environ, **_old_python3_on_path(tmp_path)}
    env.pop("PYTHON", None)
    result = subprocess.run(["./run.sh"], cwd=repo, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1, result.stderr
    assert "Relay needs Python 3.11 or later; 'python3' is 3.10" in result.stderr, result.stderr
    assert "PYTHON=python3.11 ./run.sh" in result.stderr, result.stderr
    assert not (repo / ".venv").exists(), "no virtualenv is made of a Python Relay cannot run on"


def test_run_sh_again_starts_relay_without_reaching_pypi(tmp_path: Path, relay_db: str) -> None:
    """Step 6 of the tour restarts Relay with ``./run.sh`` again. run.sh runs ``pip install -e`` at
    every start, and an editable install builds in an isolated environment that fetches setuptools
    from the index each time: with Relay installed in .venv already, a restart without PyPI (a
    network outage, an air-gapped host after the first install) fails in pip and Relay does not
    start. tests/test_first_run.py's own words: "run.sh itself also installs, once".

    The first start is also given its interpreter by ``PYTHON``, with a ``python3`` too old on PATH
    (run.sh used to take python3 whatever it was)."""
    repo = tmp_path / "relay"
    _copy_of_the_repository(repo)
    home = tmp_path / "home"
    first_env = {**_old_python3_on_path(tmp_path), "PYTHON": sys.executable}
    first = _run_sh(repo, home, free_port(), relay_db, first_env, "first")
    assert first == 0, (repo / "first.out").read_text(errors="replace")[-3000:]
    assert (repo / ".venv" / "bin" / "relay").exists()
    # The index unreachable: pip is told to use none (what an outage amounts to for pip).
    again = _run_sh(repo, home, free_port(), relay_db, {"PIP_NO_INDEX": "1"}, "again")
    assert again == 0, (repo / "again.out").read_text(errors="replace")[-3000:]
