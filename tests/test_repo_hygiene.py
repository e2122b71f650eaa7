"""What the repository tracks: no machine-local links, and no time written outside relay.core.times."""

from __future__ import annotations

import re
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


def test_times_are_written_by_relay_core_times_only() -> None:
    """``datetime.isoformat()`` leaves the fraction out of a whole second (``...:27+00:00`` sorts after
    ``...:27.080000+00:00``) and writes ``+00:00`` where Relay's answers say ``Z``: workflows/reconcile.py
    sent its executor filters so. Every time that reaches an executor or an answer of Relay is written
    by relay/core/times.py (``us_iso``, ``ms_iso``, ``sdk_time``, ``sdk_ms_time``, and the CLI's for people);
    parsing (``fromisoformat``, ``strptime``) is free. ``strftime`` too built a time by hand (the SDK's
    times of workflows/services.sdk_iso), so it is caught as well."""
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("relay", "workflows")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path != ROOT / "relay" / "core" / "times.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(?<!from)isoformat\(|strftime\(", line)
    ]
    assert found == [], f"isoformat() or strftime() outside relay/core/times.py: {found}"
