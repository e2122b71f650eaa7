"""harness/zygote.py: children forked from a preloaded interpreter end, report and behave as
``python -m`` children do, and none outlives the test process that asked for it."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import psycopg
import pytest

from harness import zygote
from harness.executors import ExecutorProcess
from harness.relay import RelayProcess
from harness.waiting import assert_eventually
from harness.web import TLS
from harness.zygote import ROOT, Zygote, ZygoteProcess

PROBE = """
import atexit, os, random, sys, threading, time

what = sys.argv[1]
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "raise":
    raise ValueError("boom")
if what == "show":
    print("READY", os.environ.get("PROBE_SETTING"), os.getcwd(), __name__, " ".join(sys.argv[1:]), random.random())
    sys.stdout.flush()
if what == "sleep":
    print("READY", flush=True)
    time.sleep(600)
if what == "ending":
    # A non-daemon thread is joined and atexit handlers run, as at any interpreter exit.
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
"""

# A preloaded module that starts a thread once the zygote is serving (on SIGUSR1), and one that
# starts a thread while it is imported.
LATE_THREAD = """
import signal, threading, time, pathlib, os

def start(*_):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    pathlib.Path(os.environ["THREAD_STARTED"]).touch()

signal.signal(signal.SIGUSR1, start)
"""
EARLY_THREAD = "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("modules")
    (where / "probe.py").write_text(PROBE)
    (where / "late_thread.py").write_text(textwrap.dedent(LATE_THREAD))
    (where / "early_thread.py").write_text(EARLY_THREAD)
    return where


@pytest.fixture(scope="module")
def light() -> Iterator[Zygote]:
    """A zygote that preloads nothing heavy: these tests are about the forks, not the imports."""
    server = Zygote(("json",))
    yield server
    server.close()


Start = Callable[..., ZygoteProcess]


@pytest.fixture
def start(light: Zygote, modules: Path) -> Iterator[Start]:
    started: list[ZygoteProcess] = []
    logs: list[object] = []

    def run(*args: str, pipe: bool = False, env: dict[str, str] | None = None) -> ZygoteProcess:
        log = open(modules / f"probe-{len(logs)}.log", "wb")
        logs.append(log)
        proc = light.start(
            "probe", list(args), {**os.environ, **(env or {})}, modules,
            stdout=subprocess.PIPE if pipe else log, stderr=log,
        )  # fmt: skip
        started.append(proc)
        return proc

    yield run
    for proc in started:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    for log in logs:
        log.close()  # type: ignore[attr-defined]


def log_of(modules: Path, index: int) -> str:
    return (modules / f"probe-{index}.log").read_text()


def test_exit_codes_signals_and_an_unhandled_exception_are_reported_as_popen_does(start: Start, modules: Path) -> None:
    assert start("exit", "7").wait(10) == 7
    crashed = start("raise")
    assert crashed.wait(10) == 1
    assert "Traceback" in log_of(modules, 1) and "ValueError: boom" in log_of(modules, 1)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        sleeper = start("sleep", pipe=True)
        assert sleeper.stdout is not None and sleeper.stdout.readline() == b"READY\n"
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(0.2)
        assert sleeper.poll() is None
        sleeper.send_signal(sig)
        assert sleeper.wait(10) == -sig and sleeper.returncode == -sig
        sleeper.kill()  # as Popen's: nothing, once it has been waited for


def test_an_exit_joins_threads_and_runs_atexit(start: Start, modules: Path) -> None:
    ending = start("ending", pipe=True)
    assert ending.wait(10) == 0
    assert ending.stdout is not None and ending.stdout.read().splitlines() == [b"thread done", b"atexit ran"]


def test_environment_directory_argv_and_random_are_each_childs_own(start: Start, modules: Path) -> None:
    shown = []
    for setting in ("one", "two"):
        child = start("show", setting, pipe=True, env={"PROBE_SETTING": setting})
        assert child.stdout is not None
        shown.append(child.stdout.readline().decode().split())
        assert child.wait(10) == 0
    (_, env1, cwd1, name1, what1, arg1, random1), (_, env2, _, _, _, arg2, random2) = shown
    assert (env1, env2, arg1, arg2) == ("one", "two", "one", "two")
    assert (cwd1, name1, what1) == (str(modules), "__main__", "show")
    assert random1 != random2, "each child reseeds random"


def test_a_killed_owner_leaves_no_child_running(modules: Path) -> None:
    owner_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from harness.zygote import Zygote
        server = Zygote(("json",))
        child = server.start("probe", ["sleep"], dict(os.environ), {str(modules)!r}, stdout=subprocess.PIPE)
        child.stdout.readline()
        print(server.proc.pid, child.pid, flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert owner.stdout is not None
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(running(pid) for pid in pids)
    finally:
        owner.kill()
        owner.wait()
        assert owner.stdout is not None
        owner.stdout.close()
    assert_eventually(lambda: not any(running(pid) for pid in pids), 10, what="the zygote and its child gone")


def test_a_zygote_started_from_a_thread_that_ends_outlives_the_thread(modules: Path) -> None:
    """PR_SET_PDEATHSIG fires when the thread that started a process ends, not its process: a zygote
    first used from a thread (tests/test_recovery.py starts an executor from a ThreadPoolExecutor)
    got SIGTERM as that thread ended, killed the children it had, and every later start of the
    pytest worker failed. Started so, it serves on; its test process's end still ends it (above)."""
    made: list[Zygote] = []
    thread = threading.Thread(target=lambda: made.append(Zygote(("json",))))
    thread.start()
    thread.join()
    # Gone from the kernel too, not only from Python's threads: the signal came as it went.
    task = Path(f"/proc/self/task/{thread.native_id}")
    assert_eventually(lambda: not task.exists(), 10, what="the starting thread gone")
    (server,) = made
    try:
        child = server.start("probe", ["sleep"], dict(os.environ), modules, stdout=subprocess.PIPE)
        assert child.stdout is not None and child.stdout.readline() == b"READY\n"
        assert server.proc.poll() is None and child.poll() is None
        child.kill()
        assert child.wait(10) == -signal.SIGKILL
        child.stdout.close()
    finally:
        server.close()


def test_a_zygote_that_died_is_started_again_and_a_start_on_it_leaves_nothing_open(modules: Path) -> None:
    """A zygote that died (its thread's end above, the OOM killer) stayed this process's zygote: every
    later start of the pytest worker failed on its closed socket, and each left its pipe and reply
    socket to the collector. The next start gets a new zygote; the failed one closes what it opened."""
    dead = zygote.zygote(("json",))
    try:
        dead.proc.kill()
        dead.proc.wait(10)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always", ResourceWarning)
            with pytest.raises(OSError):
                dead.start("probe", ["exit", "0"], dict(os.environ), modules, stdout=subprocess.PIPE)
            gc.collect()
        assert [str(w.message) for w in warned if issubclass(w.category, ResourceWarning)] == []
        again = zygote.zygote(("json",))
        assert again is not dead and again.proc.poll() is None
        assert again.start("probe", ["exit", "4"], dict(os.environ), modules).wait(10) == 4
    finally:
        with zygote._zygotes_lock:
            zygote._zygotes.pop(("json",)).close()


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_zygote_with_a_thread_refuses_to_fork(modules: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(modules), "THREAD_STARTED": str(tmp_path / "started")}
    with pytest.raises(RuntimeError, match="the imports started threads"):
        Zygote(("early_thread",), env=env)
    server = Zygote(("late_thread",), env=env)
    try:
        os.kill(server.proc.pid, signal.SIGUSR1)
        assert_eventually(lambda: (tmp_path / "started").exists(), 10, what="the zygote's thread")
        with pytest.raises(RuntimeError, match="refused: the zygote has threads"):
            server.start("probe", ["exit", "0"], dict(os.environ), modules)
    finally:
        server.close()


def test_a_relay_and_an_executor_from_the_zygote_work_and_the_relay_exits_3_when_its_lease_is_taken(
    start_relay: Callable[..., RelayProcess], start_executor: Callable[..., ExecutorProcess]
) -> None:
    assert zygote.wanted(dict(os.environ)) or os.environ.get("RELAY_TEST_ZYGOTE") == "0"
    relay = start_relay(instanceLeaseSecs=0.6)
    executor = start_executor(relay.conductor_url)
    if os.environ.get("RELAY_TEST_ZYGOTE") != "0":
        assert isinstance(relay.proc, ZygoteProcess) and isinstance(executor.proc, ZygoteProcess)
    assert httpx.get(f"{relay.http}/readyz", timeout=5, verify=TLS).status_code == 200
    assert_eventually(lambda: relay.state_of("acme", "ledger", executor.executor_id) == "HEALTHY", 10)
    with psycopg.connect(relay.database_url, autocommit=True) as conn:
        conn.execute("UPDATE relay_instances SET lease_epoch = lease_epoch + 1 WHERE instance_id = 'relay-1'")
    assert relay.proc is not None and relay.proc.wait(10) == 3
    assert "lease taken over by another instance; exiting (code 3)" in relay.log()


def test_a_program_whose_environment_changes_the_interpreter_s_start_is_exec_d(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_relay: Callable[..., RelayProcess]
) -> None:
    """tests/test_single_writer.py gives Relay a PYTHONPATH with a sitecustomize that logs its writes:
    a fork of the zygote, an interpreter already started, ran none of it, and that test found no log
    (the first full run with the zygote). A PYTHON* variable that differs from the zygote's is an
    exec'd start, and the zygote itself starts with the environment the harness was imported with."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['RELAY_TEST_SITE_RAN']).write_text(str(os.getpid()))\n"
    )
    ran = tmp_path / "site-ran"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("RELAY_TEST_SITE_RAN", str(ran))
    assert not zygote.wanted(dict(os.environ))
    relay = start_relay()
    assert not isinstance(relay.proc, ZygoteProcess)
    assert relay.proc is not None and ran.read_text() == str(relay.proc.pid)
    monkeypatch.delenv("RELAY_TEST_SITE_RAN")
    monkeypatch.setenv("PYTHONPATH", zygote.BASE_ENV.get("PYTHONPATH", ""))
    if not zygote.BASE_ENV.get("PYTHONPATH"):
        monkeypatch.delenv("PYTHONPATH")
    assert zygote.wanted(dict(os.environ)) or os.environ.get("RELAY_TEST_ZYGOTE") == "0"
