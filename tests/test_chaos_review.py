"""Review of the chaos harness from the side of a CI that runs it (``python -m chaos run|replay|mutants``)
and replays its recordings when something fails.

Each test fails on the code it was written against, for the reason its docstring gives, and passes
once that is fixed. They use real processes, real signals and real PostgreSQL servers; the CLI's
fast failures are reached by pointing ``RELAY_TEST_DATABASE_URL`` (test.sh's documented switch) at a
port where nothing listens, so that a run that wrongly starts stops at once and leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import chaos.mutants
from chaos.__main__ import _report
from chaos.mutants import copy_tree
from chaos.run import Fleet, ScheduleClock, play_faults
from chaos.schedule import Fault, Profile
from harness.pgserver import PostgresServer
from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "chaos" / "runs" / "epoch-reuse-quick-seed1.json"
# The exit code of a run whose checks found violations (README: "exit 0 only if every check holds").
VIOLATIONS = 1


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(ROOT / "protocol"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _unreachable_database() -> str:
    """A PostgreSQL URL where nothing listens: a run that starts anyway fails at its first database."""
    return f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"


def _chaos(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args], cwd=ROOT, env=_env(**(env or {})),
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def _tiny_profile(**over: Any) -> dict[str, Any]:
    """The smallest fleet a recording can ask for: one Relay, one executor and its decoy."""
    profile = {
        "name": "tiny", "executors": 1, "fault_secs": 60.0, "warmup_secs": 1.0, "heal_timeout_secs": 5.0,
        "workload_interval_secs": 0.5, "grace_secs": 0.5, "ping_interval_secs": 0.2, "ping_wait_secs": 0.5,
        "fault_gap_secs": [1.0, 1.0], "relay_instances": 1, "lease_secs": 3.0, "db_faults": False,
        "db_kinds": [], "liars": 0, "decoys": 1, "reconcile_secs": None,
    }  # fmt: skip
    return {**profile, **over}


# -- 1. a run killed by CI's timeout ------------------------------------------------------------------


def _ours(base: Path, tag: str) -> list[int]:
    """Pids of live processes this test's run started: their working directory is under ``base``
    (PostgreSQL's postmaster and backends live in their data folder, Relay in the run's folder) or
    their environment carries ``tag`` (the executors)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            status = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if status == "Z":
                continue
            cwd = os.readlink(entry / "cwd")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if cwd.startswith(str(base)) or tag.encode() in environ:
            found.append(int(entry.name))
    return found


def _kind(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "relay serve" in cmdline:
        return "relay instance"
    if "chaos.app" in cmdline:
        return "executor"
    if "postgres" in cmdline:
        return "postgres"
    return cmdline[:60]


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A folder for one run and its temporary files (TMPDIR), readable by the postgres user that a root
    run's embedded PostgreSQL runs as; anything the run leaves running is ended at the test's end."""
    base = Path(tempfile.mkdtemp(prefix="chaos-review-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    for pid in _ours(base, str(base)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("to", ["group", "process"])
def test_sigterm_from_ci_s_timeout_leaves_no_process_running_and_no_data_behind(run_dir: Path, to: str) -> None:
    """CI's timeout sends SIGTERM to the run's process group (coreutils ``timeout``, a runner's
    cancel) or to the run's process alone (a supervisor that knows one pid). The harness installs
    no handler, so nothing of ``Fleet.stop`` runs and no atexit hook either. To the group: Relay and
    the executors share it and die, but each PostgreSQL server is started by ``pg_ctl``, which puts
    the postmaster in a session of its own (``setsid``): it keeps running, with its data folder
    (``relay-test-pg-*`` under TMPDIR), after the run is gone. To the process: the Relay instances
    and the executors are left running as well."""
    tag = str(run_dir)
    recording = run_dir / "tiny.json"
    recording.write_text(json.dumps({"seed": 1, "profile": _tiny_profile(), "schedule": []}))
    out = run_dir / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos", "replay", str(recording), "--out", str(out)],
        cwd=ROOT, env=_env(TMPDIR=str(run_dir), CHAOS_REVIEW_TAG=tag),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        # Until the fleet is up: PostgreSQL, a Relay instance, an executor ready and the decoy launched.
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and proc.poll() is None and not list(out.glob("chaos-*/executor-1-0.log")):
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert list(out.glob("chaos-*/executor-1-0.log")), "the fleet did not start within 40 s"
        (os.killpg if to == "group" else os.kill)(proc.pid, signal.SIGTERM)
        proc.wait(30)
        time.sleep(3.0)  # what the signal ends has ended by now
        left = Counter(_kind(pid) for pid in _ours(run_dir, tag))
        data = sorted(p.name for p in run_dir.glob("relay-*"))
        assert not left and not data, (
            f"after SIGTERM to the run's {to}: still running {dict(left)}; left in TMPDIR {data}"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- 2. exit codes: "Relay broke a promise" (1) versus "the harness could not run" ---------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case", ["missing", "truncated", "not-a-recording", "newer-format", "postgres-down", "mutants-postgres-down"]
)
def test_a_harness_failure_does_not_exit_with_the_violations_code(tmp_path: Path, case: str) -> None:
    """``python -m chaos`` exits 1 when a run's checks find violations, and 1 too (an uncaught
    traceback) when it could not run at all: a missing or truncated recording, a file that is not a
    recording, one from another format, PostgreSQL unreachable. ``mutants`` likewise exits 1 both
    when a mutant was missed and when its replay could not run (verdict "error"). CI cannot tell
    "Relay broke a promise" from "the harness broke", and retries or pages on the wrong one."""
    env: dict[str, str] = {}
    recording = tmp_path / "run.json"
    if case == "missing":
        recording = tmp_path / "no-such-run.json"
    elif case == "truncated":
        text = RECORDED.read_text()
        recording.write_text(text[: len(text) // 2])
    elif case == "not-a-recording":
        recording.write_text(json.dumps([{"mutant": "grace", "verdict": "caught"}]))  # a mutants.json
    elif case == "newer-format":
        recorded = json.loads(RECORDED.read_text())
        recorded["profile"]["network_faults"] = True  # a field this version does not know
        recording.write_text(json.dumps(recorded))
    else:
        recording = RECORDED
        env["RELAY_TEST_DATABASE_URL"] = _unreachable_database()
    if case == "mutants-postgres-down":
        result = _chaos("mutants", "grace", "--out", str(tmp_path / "out"), env=env)
    else:
        result = _chaos("replay", str(recording), "--out", str(tmp_path / "out"), env=env)
    assert result.returncode not in (0, VIOLATIONS), (
        f"{case}: exit {result.returncode}, the same as a run that found violations:\n{result.stderr[-800:]}"
    )


# -- 3. a recording is checked before it is played ---------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ({"at": 8, "kind": "kill_9", "target": 0, "duration": 0.0}, "kill_9"),  # a typo, or a newer kind
        ({"at": 8, "kind": "kill9", "target": 7, "duration": 0.0}, "target"),  # 3 executors: slots 0-2
        ({"at": 8, "kind": "db_kill", "target": -1, "duration": 3.0}, "db_kill"),  # profile without db_faults
    ],
    ids=["unknown-kind", "target-out-of-range", "database-fault-without-its-server"],
)
def test_a_recording_that_cannot_be_played_as_written_is_refused_before_the_fleet_starts(
    tmp_path: Path, fault: dict[str, Any], named: str
) -> None:
    """``replay`` builds ``Fault(**f)`` from whatever the file holds and starts the fleet. A kind it
    does not know falls through every branch of ``inject`` and is recorded as executed though
    nothing happened (the run can pass having played none of it); a target out of range crashes
    with an IndexError, a database fault in a profile without its server with an AssertionError,
    both after minutes of fleet. Here the fleet's database is unreachable, so today's code fails
    at its first connection with a psycopg traceback that names none of this."""
    recorded = json.loads(RECORDED.read_text())
    recorded["schedule"] = [fault]
    recording = tmp_path / "run.json"
    recording.write_text(json.dumps(recorded))
    unreachable = {"RELAY_TEST_DATABASE_URL": _unreachable_database()}
    result = _chaos("replay", str(recording), "--out", str(tmp_path / "out"), env=unreachable)
    said = result.stdout + result.stderr
    assert result.returncode not in (0, VIOLATIONS) and named in said and "psycopg" not in said, (
        f"exit {result.returncode}; output:\n{said[-800:]}"
    )


# -- 4. a replay must not overwrite the recording it replays -------------------------------------------


@pytest.mark.timeout(90)
def test_replaying_a_failed_run_into_its_own_out_folder_keeps_the_original_record(run_dir: Path) -> None:
    """A CI's failed run leaves ``.chaos/run-ci-SEED.json``; the obvious next step is
    ``python -m chaos replay .chaos/run-ci-SEED.json`` (``--out`` defaults to ``.chaos``). The replay
    writes its own record to ``DIR/run-PROFILE-SEED.json``, the very same path: the failed run's
    violations, its faults as executed and its ``workdir`` (where its logs are) are gone."""
    out = run_dir / "out"
    out.mkdir()
    original = {"seed": 1, "profile": _tiny_profile(fault_secs=0.5, warmup_secs=0.0), "schedule": [],
                "violations": ["workflow ledger:x:1 never finished (status PENDING)"], "ok": False,
                "workdir": "/ci/.chaos/chaos-original"}  # fmt: skip
    recording = out / "run-tiny-1.json"
    recording.write_text(json.dumps(original))
    before = recording.read_text()
    result = subprocess.run(
        [sys.executable, "-m", "chaos", "replay", str(recording), "--out", str(out)],
        cwd=ROOT, env=_env(TMPDIR=str(run_dir)), capture_output=True, text=True, timeout=80, check=False,
    )  # fmt: skip
    assert recording.read_text() == before, (
        f"the replay (exit {result.returncode}) wrote over the record it replayed: "
        f"{sorted(p.name for p in out.glob('*.json'))}\n{result.stdout[-600:]}"
    )
    # And it did write a record of its own (a replay that crashed would keep the original trivially).
    assert len(list(out.glob("*.json"))) == 2, f"exit {result.returncode}:\n{result.stderr[-800:]}"


# -- 5. a failed run says where to look ----------------------------------------------------------------


def test_a_failed_run_s_report_says_where_its_logs_and_record_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On failure the report prints the violations (50 at most) and nothing else to go on: neither
    the run's folder with Relay's and the executors' logs (``result["workdir"]``) nor the JSON record
    with the rest of the violations. A CI log is all a CI engineer has at first."""
    workdir = tmp_path / "chaos-abc123"
    workdir.mkdir()
    (workdir / "relay-1.log").write_text("2026-12-05 10:00:00 INFO relay started\n")
    violations = [f"workflow ledger:e{i}:1 never finished (status PENDING)" for i in range(60)]
    result = {"figures": {}, "unplanned_instance_exits": [], "workdir": str(workdir), "violations": violations,
              "seed": 7, "profile": {"name": "ci"}, "client": False, "duration_secs": 170.0}  # fmt: skip
    assert _report(result) == VIOLATIONS
    printed = capsys.readouterr().out
    assert str(workdir) in printed, f"the report names no folder to read:\n{printed[-400:]}"


# -- 6. mutants copy the checkout's other virtualenvs ----------------------------------------------------


def test_a_mutant_s_copy_of_the_tree_leaves_out_every_virtualenv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``copy_tree`` leaves out ``.venv`` but not ``.venv-client``, ``.venv-client-3.3`` or
    ``.venv-mcp``, which ``./test.sh`` builds in the checkout before it runs the mutants (and
    ``lib64 -> lib`` is followed, so each is copied twice over): on this machine 564 MB per replay,
    two for ``./test.sh``'s ``mutants grace --baseline``, eleven for ``mutants --baseline``, each
    left in /tmp when the run is killed. The checkout here is a small git repository with the
    project's .gitignore, so that a fix by ignore patterns or by tracked files both pass."""
    checkout = tmp_path / "checkout"
    (checkout / "relay").mkdir(parents=True)
    (checkout / "relay" / "__init__.py").write_text("")
    (checkout / "chaos" / "runs" / "mutants").mkdir(parents=True)
    (checkout / "chaos" / "runs" / "mutants" / "grace-quick.json").write_text("{}")
    shutil.copy(ROOT / ".gitignore", checkout / ".gitignore")
    for venv in (".venv-client", ".venv-client-3.3", ".venv-mcp"):
        site = checkout / venv / "lib" / "python3.11" / "site-packages"
        site.mkdir(parents=True)
        (site / "dbos.py").write_text("# 200 MB of packages, in a real one\n")
        (checkout / venv / "lib64").symlink_to("lib")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    monkeypatch.setattr(chaos.mutants, "ROOT", checkout)
    tree = copy_tree(tmp_path / "mutant", None)
    assert (tree / "relay" / "__init__.py").exists()
    copied = sorted(p.name for p in tree.iterdir() if p.name.startswith(".venv"))
    assert not copied, f"copied into every mutant's tree: {copied}"


# -- 7. databases left on the PostgreSQL of RELAY_TEST_DATABASE_URL --------------------------------------


@pytest.mark.timeout(60)
def test_a_run_on_relay_test_database_url_drops_the_databases_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test.sh: "Set RELAY_TEST_DATABASE_URL to use your own PostgreSQL instead of an embedded one."
    The chaos fleet takes ``Postgres()`` with ``drop_databases=False``, so every run, replay and
    mutant replay leaves its four databases there (the system databases, the evidence with a row
    per step, Relay's), unlike the benchmarks that pass ``drop_databases=True``."""
    server = PostgresServer("chaos-review")
    try:
        monkeypatch.setenv("RELAY_TEST_DATABASE_URL", server.url())
        fleet = Fleet(Profile.from_json(_tiny_profile()), 1, tmp_path)
        fleet.stop()  # what run() does in its ``finally``
        with psycopg.connect(server.url()) as conn:
            rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'chaos%' ORDER BY 1").fetchall()
        assert not rows, f"left on the user's server: {[r[0] for r in rows]}"
    finally:
        server.close()


# -- 8. an old recording is replayed on another fleet ----------------------------------------------------


def test_a_recording_from_before_several_instances_is_not_replayed_on_three_of_them() -> None:
    """``chaos/runs/epoch-reuse-quick-seed1.json`` (replayed by ./test.sh) was recorded on a fleet of
    one Relay instance (commit 7a2e029); its profile has no ``relay_instances``. ``Profile.from_json``
    fills in today's default, 3, so the replay puts three instances behind a balancer, with instance
    adoption and its own timing, under a schedule recorded without them, and calls it the same run.
    A record has no format version either. Faithful (one instance) or refused, not silently other."""
    recorded = json.loads(RECORDED.read_text())
    assert "relay_instances" not in recorded["profile"]
    try:
        profile = Profile.from_json(recorded["profile"])
    except (ValueError, TypeError, KeyError):
        return  # refused: as good as replayed faithfully
    assert profile.relay_instances == 1, f"replayed with {profile.relay_instances} Relay instances, recorded with 1"


# -- 9. a fault that runs over: the faults after it come at once ------------------------------------------


def test_a_fault_that_runs_over_pushes_the_rest_of_the_schedule_back(capsys: pytest.CaptureFixture[str]) -> None:
    """Seed 682129's ci run under a load of 26: ``relay_sigstop`` (5.62 s) and ``relay_kill`` (4.03 s)
    ended about 21.5 s after they started, their instance slow to start again. The runner slept until
    ``origin + fault.at`` for each fault, so every later one came at once after the one before:
    ``kill9 0`` 0.4 ms after ``partition 0`` of the same executor healed, where the schedule had put
    a gap and the grace period's settle time, and the run failed on workflows the schedule never
    meant to strand. An overrun may eat the gap, not the settle time: here the first fault's stand-in
    takes 0.6 s more than its duration, the gap after it is 0.4 s and every settle time 0.2 s, so
    the rest is pushed back by the 0.2 s the gap did not absorb, and no more (pushing back by the
    whole overrun made every ci run of the gate some 20 s longer, a kill's relaunch counting as one)."""
    settle = 0.2
    schedule = [Fault(0.0, "relay_kill", 0, 0.2), Fault(0.8, "partition", 0, 0.1), Fault(1.5, "kill9", 0, 0.0)]
    spans: list[tuple[float, float]] = []

    def carry_out(fault: Fault) -> dict[str, Any]:
        began = time.time()
        time.sleep(fault.duration + (0.6 if fault.kind == "relay_kill" else 0.0))
        spans.append((began, time.time()))
        return {"kind": fault.kind}

    workload_ends: list[float] = []
    clock = ScheduleClock(time.time())
    done = play_faults(schedule, clock, 1.8, lambda _: settle, carry_out, workload_ends.append)
    healed = time.time()
    assert [d["kind"] for d in done] == ["relay_kill", "partition", "kill9"]
    for before, after, (_, ended), (began, _) in zip(schedule, schedule[1:], spans, spans[1:], strict=False):
        assert began - ended >= settle - 1e-6, (  # a microsecond: the rounding of Unix times as floats
            f"{after.kind} came {began - ended:.3f} s after {before.kind} ended; the schedule put a settle "
            f"time of {settle} s there"
        )
    # Pushed back by what the gap did not absorb: the first fault's overrun less its 0.4 s gap.
    overrun = spans[0][1] - (clock.origin + 0.2)
    assert overrun >= 0.6 and abs(clock.shift - (overrun - 0.4)) < 0.02, (overrun, clock.shift)
    # The second fault ended in time: the third keeps its written time (1.5 s, plus the shift).
    assert abs(spans[2][0] - (clock.origin + clock.shift + 1.5)) < 0.1, (spans, clock.shift)
    # The workload's end and the heal phase move with the schedule, and the record says by how much.
    assert workload_ends and workload_ends[-1] >= clock.origin + clock.shift + 1.8 - 1e-6
    assert healed >= clock.origin + clock.shift + 1.8
    printed = capsys.readouterr().out
    assert re.search(r"\] relay_kill 0 ran \d+\.\d s over: later faults pushed back \d+\.\d s", printed), printed
