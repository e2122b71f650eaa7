"""What the repository tracks: no machine-local links."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_symlink_is_tracked() -> None:
    """7ab7ae8 committed .venv-client, .venv-client-3.3, .venv-mcp and harness/ts_app/node_modules as
    symlinks to /work/main/... (the .gitignore patterns end in "/", which matches directories only).
    Checked out in /work/main they replaced the real (ignored, so expendable to git) directories with
    links to themselves, and every clone gets links into another checkout."""
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    links = [line.split("\t", 1)[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    assert links == [], f"symlinks tracked: {links}"
