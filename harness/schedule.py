"""The order in which ./test.sh's pytest-xdist workers take the suite's files.

``--dist loadfile`` hands each worker a whole file at a time, in the order the workers collected
them; left to itself (``--loadscope-reorder``) xdist sorts the files by how many tests they hold.
That count says little about time here: a file of many unit tests ends in seconds, and some files
of a few tests that start Relay instances and executors and wait out grace periods and leases take
minutes. tests/test_openapi_fuzz.py, one test of some two minutes, was the very last file handed
out (by count, then by name), and test_rolling_upgrade.py (two tests, over a minute) came near the
end: one worker went on for minutes after the other two had run out of files. ./test.sh turns
xdist's sort off (``--no-loadscope-reorder``) and the workers collect the files in
:func:`ordered`'s order: the slowest first, then the rest as xdist would have sorted them, so that
what is left at the end is short files that even out the workers' ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

#: The files that took longest, slowest first, as measured file by file (``-p no:xdist
#: --durations=0``, three to five files at once on 2 cores shared with other runs, 2026-12-06): each
#: above half a minute there (test_openapi_fuzz.py from 71 s to 155 s, as loaded as the machine was). A
#: file left out (a new one, or one that became slow) only runs later, in xdist's order; measure
#: again when the workers' ends drift apart.
SLOWEST_FIRST = (
    "tests/test_alerts.py",
    "tests/test_instances.py",
    "tests/test_recovery.py",
    "tests/test_database_restore.py",  # 2026-12-07: six tests, 70 to 120 s (two Relays, pg_basebackup)
    "tests/test_keys.py",
    "tests/test_database_outage.py",
    "tests/test_bad_input.py",
    "tests/test_db_faults.py",
    "tests/test_dbos_mcp.py",
    "tests/test_openapi_fuzz.py",
    "tests/test_hostile_input.py",
    "tests/test_typescript_sdk.py",
    "tests/test_client.py",
    "tests/test_reconciler.py",
    "tests/test_repair.py",
    "tests/test_first_run.py",
    "tests/test_console.py",
    "tests/test_app_retention.py",
    "tests/test_upgrade.py",
    "tests/test_console_incident.py",
    "tests/test_fuzz_frames.py",
    "tests/test_api.py",
    "tests/test_ops_review.py",
    "tests/test_executors.py",
    "tests/test_deploy_review.py",
    "tests/test_typescript_client.py",
    "tests/test_metrics.py",
    "tests/test_grace_batches.py",
    "tests/test_console_oncall.py",
    "tests/test_rolling_upgrade.py",
    "tests/test_lease.py",
    "tests/test_workflow_api.py",
    "tests/test_long_wait.py",
    "tests/test_deploy.py",
    "tests/test_chaos_review.py",
    "tests/test_cli_and_db.py",
    "tests/test_events.py",
    "tests/test_getting_started.py",
    "tests/test_bench_small.py",
    "tests/test_alert_resolutions.py",
    "tests/test_shared_frames.py",
    "tests/test_audit_refusals.py",
    "tests/test_http_guard.py",
    "tests/test_cli.py",
    "tests/test_shutdown.py",
    "tests/test_growth_review.py",
)


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def ordered(nodeids: Sequence[str]) -> list[int]:
    """The positions of ``nodeids`` in the order the workers are to take them: the files of
    :data:`SLOWEST_FIRST` in its order, then the others by their number of tests, most first
    (xdist's own sort); within a file its tests keep their order (module fixtures rely on it)."""
    counts = Counter(file_of(n) for n in nodeids)
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}

    def key(i: int) -> tuple[int, int]:
        path = file_of(nodeids[i])
        return (rank.get(path, len(rank)), -counts[path] if path not in rank else 0)

    return sorted(range(len(nodeids)), key=key)  # stable: collection order within a file and a tie
