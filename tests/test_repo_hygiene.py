"""What the repository tracks: no machine-local links, and no time written outside relay.core.times."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from harness import zygote
from harness.schedule import SLOWEST_FIRST, ordered

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


def test_the_slowest_files_xdist_takes_first_exist_and_go_first() -> None:
    """harness/schedule.py: ./test.sh's workers take the slowest files first. A file of its list that
    was renamed or removed would silently go back to xdist's place for it, so each must exist; the
    others follow by their number of tests (xdist's own sort), and no file's tests are reordered."""
    missing = [path for path in SLOWEST_FIRST if not (ROOT / path).is_file()]
    assert missing == [], f"SLOWEST_FIRST names files that do not exist: {missing}"
    slow, slower = SLOWEST_FIRST[1], SLOWEST_FIRST[0]
    nodeids = [
        "tests/test_a.py::one",
        f"{slow}::first",
        f"{slow}::second",
        "tests/test_b.py::one",
        "tests/test_b.py::two",
        f"{slower}::only",
        "tests/test_c.py::one",
    ]
    assert [nodeids[i] for i in ordered(nodeids)] == [
        f"{slower}::only",
        f"{slow}::first",
        f"{slow}::second",
        "tests/test_b.py::one",
        "tests/test_b.py::two",
        "tests/test_a.py::one",
        "tests/test_c.py::one",
    ]


def test_the_files_that_exec_their_starts_are_named_whole_and_exist() -> None:
    """harness/zygote.py: the files about how Relay or its CLI starts exec their Relays, the others
    fork them from the zygote. The list matched by prefix, and ``test_cli`` also caught
    test_client.py, test_client_review.py and test_cli_oncall.py, whose Relays start as any other
    file's: exec'd, about a second of CPU more per start. A listed file renamed would fork silently."""
    missing = sorted(name for name in zygote.EXEC_FILES if not (ROOT / "tests" / name).is_file())
    assert missing == [], f"zygote.EXEC_FILES names files that do not exist: {missing}"
    # The first three fork; the others are about how Relay, its CLI or a chaos run starts.
    named = ("test_client.py", "test_client_review.py", "test_cli_oncall.py", "test_cli.py", "test_cli_and_db.py")
    forked = [name for name in (*named, "test_chaos_review.py") if zygote.for_file(name)]
    assert forked == list(named[:3]), forked
    assert sorted((ROOT / "tests").glob("test_chaos_*.py")), "no test_chaos_*.py: the family's name changed"
