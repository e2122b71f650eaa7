"""A fork server for the test suite: Relay instances and executors started without their imports.

The suite starts some 300 Relay instances and 200 executors; each spent about a second of CPU
importing dbos, fastapi, SQLAlchemy and the rest before doing anything, on two cores that are
already busy. A zygote is a fresh interpreter (exec'd, never a fork of the pytest worker, which
has threads) that imports those modules once and then forks a child per start. The child takes the
stdin/stdout/stderr, environment, working directory and arguments it was sent, leaves the server
loop and runs its module as ``python -m <module> <args>`` would, at this script's top level, so that
its end is an ordinary interpreter exit: SystemExit's code, a traceback and 1 for an unhandled
exception, non-daemon threads joined, atexit handlers run.

The test side (:func:`start`) gets a :class:`ZygoteProcess`, which answers as ``subprocess.Popen``
does (pid, poll, wait, returncode, send_signal, terminate, kill, stdout, args). The zygote reaps
its children and sends each one's exit status back. If the test process dies, even by SIGKILL,
the zygote sees its socket close (and, started from the main thread, gets SIGTERM through
PR_SET_PDEATHSIG), kills its children and exits; a child whose zygote dies is killed too (its own
PR_SET_PDEATHSIG).

What differs from an exec start (README, "The test suite"): the children of one zygote share its
hash seed (PYTHONHASHSEED is fixed when an interpreter starts and every string already imported
holds a hash made with it, so a child cannot be given its own); /proc/<pid>/cmdline and
``sys.orig_argv`` show the zygote's command line; a module imported by the zygote was imported
with the zygote's environment (dbos reads three variables at import: they are read again here).
``RELAY_TEST_ZYGOTE=0`` turns it off for the whole suite.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]

# What ``relay serve`` imports, and what harness.executor_app does. Two zygotes, not one: Relay's
# own modules register its DBOS workflows when imported, and an executor must not carry them.
RELAY = ("relay.entry", "relay.cli", "relay.runtime")
EXECUTOR = ("dbos", "sqlalchemy", "psycopg")

PR_SET_PDEATHSIG = 1
# How a zygote learns that its test process is gone: its socket's close, and with WATCH_PARENT also
# SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG).
WATCH_PARENT, WATCH_SOCKET = "parent", "socket"
MAX_REQUEST = 1 << 20
STARTED_WITHIN = 120.0  # seconds for a zygote's imports, or a fork's answer, on a loaded machine

# The test files about how Relay, its CLI, a deployment or a chaos run starts, whose starts are
# exec'd (the suite's conftest asks :func:`for_file`): these by their exact names, and every
# test_chaos_*.py. By name, not prefix: "test_cli" also caught test_client.py, test_cli_oncall.py...,
# whose Relays start as any other file's.
EXEC_FILES = frozenset(
    {
        "test_first_run.py",
        "test_getting_started.py",
        "test_cli.py",
        "test_cli_and_db.py",
        "test_deploy.py",
        "test_deploy_review.py",
    }
)
EXEC_FAMILY = "test_chaos_"

_wanted = False
_zygotes: dict[tuple[str, ...], Zygote] = {}
_zygotes_lock = threading.Lock()


def use(wanted: bool) -> None:
    """Whether the harness starts its Relay instances and executors here (the suite's conftest
    says, per test file); ``RELAY_TEST_ZYGOTE=0`` says no for the whole run."""
    global _wanted
    _wanted = wanted


def for_file(name: str) -> bool:
    """Whether the test file ``name`` (``test_x.py``) starts its Relay instances and executors here."""
    return name not in EXEC_FILES and not name.startswith(EXEC_FAMILY)


def wanted(env: dict[str, str]) -> bool:
    """Whether a program with the environment ``env`` starts from the zygote: not when turned off,
    nor when ``env`` sets the interpreter's own start differently from the zygote's (a
    ``PYTHONPATH`` with a sitecustomize, as tests/test_single_writer.py gives Relay to log its
    writes; ``PYTHONWARNINGS``, ``PYTHONDEVMODE``...), which a fork of an interpreter already
    started would not apply."""
    if not _wanted or os.environ.get("RELAY_TEST_ZYGOTE", "1") == "0":
        return False
    return _interpreter(env) == _interpreter(BASE_ENV)


def _interpreter(env: dict[str, str]) -> dict[str, str]:
    """What of ``env`` the interpreter reads as it starts (its ``PYTHON*`` variables)."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


# The environment the zygotes start with: this process's as the harness was imported, before any
# test set its own (a zygote started from a test's environment would give every later child what
# that test set, a sitecustomize among it).
BASE_ENV = dict(os.environ)


def _pdeathsig(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    """poll, not select: a test with thousands of sockets open gets descriptors past select's 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout is None else timeout * 1000))


# The test side.


class ZygoteProcess:
    """A child of a zygote, as ``subprocess.Popen`` shows a child: the zygote reaps it and sends its
    exit status, which ``poll`` and ``wait`` read."""

    def __init__(self, args: list[str], reply: socket.socket, stdout: IO[bytes] | None) -> None:
        self.args = args
        self.stdin: IO[bytes] | None = None
        self.stdout = stdout
        self.stderr: IO[bytes] | None = None
        self.returncode: int | None = None
        self._reply = reply
        self._lock = threading.Lock()
        first = self._receive(STARTED_WITHIN)
        if first is None or not first.startswith(b"pid "):
            reply.close()
            why = first.decode(errors="replace") if first else "the zygote did not answer"
            raise RuntimeError(f"could not start {args}: {why}")
        self.pid = int(first[4:])

    def __repr__(self) -> str:
        return f"<ZygoteProcess: returncode: {self.returncode} args: {self.args!r}>"

    def _receive(self, timeout: float | None) -> bytes | None:
        return self._reply.recv(4096) if _readable(self._reply, timeout) else None

    def _read_status(self, timeout: float | None) -> None:
        message = self._receive(timeout)
        if message is None:
            return
        if not message.startswith(b"exit "):
            # Only a zygote that died answers with nothing; it kills its children as it goes.
            raise RuntimeError(f"the zygote of {self.pid} ended without its status: {message!r}")
        self.returncode = int(message[5:])
        self._reply.close()

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None:
                    self._read_status(0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                self._read_status(timeout)
        if self.returncode is None:
            assert timeout is not None
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # As Popen: not to a child already waited for, whose pid may be another process's by now.
        self.poll()
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One zygote server, started once per test process for one set of preloaded modules."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str] | None = None) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.control = mine
        # PR_SET_PDEATHSIG fires when the thread that started the zygote ends, not the process: one
        # started from a thread that ends (a test's ThreadPoolExecutor starting an executor) got
        # SIGTERM as it ended, and killed every child it had, the later tests' too. Only the main
        # thread lasts as long as the process; from another, the socket's close is the only watch.
        watch = WATCH_PARENT if threading.current_thread() is threading.main_thread() else WATCH_SOCKET
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.zygote", str(theirs.fileno()), watch, *preload],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
        )  # fmt: skip
        theirs.close()
        answer = mine.recv(4096) if _readable(mine, STARTED_WITHIN) else b""
        if answer != b"ready":
            self.close()
            raise RuntimeError(f"the zygote for {preload} did not start: {answer.decode(errors='replace')}")

    def start(
        self, module: str, args: list[str], env: dict[str, str], cwd: str | Path,
        stdin: int | IO[Any] | None = None, stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> ZygoteProcess:  # fmt: skip
        """As ``subprocess.Popen([sys.executable, "-m", module, *args], ...)``; ``stdout`` may be
        ``subprocess.PIPE``, ``stderr`` ``subprocess.STDOUT``."""
        request = json.dumps({"module": module, "args": args, "env": env, "cwd": str(cwd)}).encode()
        close: list[int] = []
        pipe: IO[bytes] | None = None

        def fd_of(given: int | IO[Any] | None, inherited: int) -> int:
            if given is None:
                return inherited
            return given if isinstance(given, int) else given.fileno()

        in_fd = fd_of(stdin, 0 if _open(0) else _devnull())
        if stdout == subprocess.PIPE:
            read_end, out_fd = os.pipe()
            pipe = open(read_end, "rb")
            close.append(out_fd)
        else:
            out_fd = fd_of(stdout, 1)
        err_fd = out_fd if stderr == subprocess.STDOUT else fd_of(stderr, 2)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self.control, [request], [in_fd, out_fd, err_fd, theirs.fileno()])
        except BaseException:
            # Not sent (a zygote gone): this side's ends go too, not left open to the collector.
            mine.close()
            if pipe is not None:
                pipe.close()
            raise
        finally:
            theirs.close()
            for fd in close:
                os.close(fd)
        try:
            return ZygoteProcess([sys.executable, "-m", module, *args], mine, pipe)
        except BaseException:
            if pipe is not None:
                pipe.close()
            raise

    def close(self) -> None:
        """The zygote sees its socket close, kills any child left and exits."""
        self.control.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _devnull() -> int:
    global _null
    if _null is None:
        _null = os.open(os.devnull, os.O_RDONLY)
    return _null


_null: int | None = None


def zygote(preload: tuple[str, ...]) -> Zygote:
    """This process's zygote for ``preload``, started on first use, and again if it has died."""
    with _zygotes_lock:
        running = _zygotes.get(preload)
        if running is not None and running.proc.poll() is not None:
            # It died (killed, out of memory), and its children with it: the test that saw that fails,
            # and the later ones get a zygote that answers, not its closed socket.
            running.close()
            running = None
        if running is None:
            if not _zygotes:
                atexit.register(_close_all)
            running = _zygotes[preload] = Zygote(preload, BASE_ENV)
        return running


def _close_all() -> None:
    for each in _zygotes.values():
        each.close()


# The server side.


class _Server:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.pid = os.getpid()
        self.children: dict[int, socket.socket] = {}
        # A fresh interpreter's dispositions, which each child gets back.
        self.initial = {sig: signal.getsignal(sig) for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        self.poller = select.poll()
        self.poller.register(self.control, select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        # The handlers do nothing themselves: the loop reads the signal numbers from the wakeup fd.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        # A Ctrl-C at the terminal reaches the children, as it would exec'd ones; the zygote, in the
        # same process group, must not die of it and take them along.
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def serve(self) -> dict[str, Any]:
        """Serves until the test process goes; returns only in a child, with its request."""
        while True:
            ready = [fd for fd, _ in self.poller.poll()]
            if self.wake_r in ready:
                try:
                    woken = os.read(self.wake_r, 4096)
                except BlockingIOError:
                    woken = b""
                self.reap()
                if signal.SIGTERM in woken:
                    self.shutdown()
            if self.control.fileno() in ready:
                message, fds, _, _ = socket.recv_fds(self.control, MAX_REQUEST, 4)
                if not message:
                    self.shutdown()
                request: dict[str, Any] = json.loads(message)
                if self.fork(request, fds):
                    return request

    def fork(self, request: dict[str, Any], fds: list[int]) -> bool:
        """True in the child."""
        reply = socket.socket(fileno=fds[3])
        if threading.active_count() != 1:
            # A fork copies only the forking thread: a lock another thread held stays held forever.
            names = ", ".join(t.name for t in threading.enumerate())
            self._send(reply, f"refused: the zygote has threads ({names}); a fork would copy none of them")
            reply.close()
            for fd in fds[:3]:
                os.close(fd)
            return False
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.become(request, fds)
            return True
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = reply
        self._send(reply, f"pid {pid}")
        return False

    def become(self, request: dict[str, Any], fds: list[int]) -> None:
        """In the child: its streams, directory, environment and arguments; the zygote's own gone."""
        _pdeathsig(signal.SIGKILL)
        if os.getppid() != self.pid:  # the zygote died before the line above
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig, handler in self.initial.items():
            signal.signal(sig, handler)
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.control.close()
        for each in self.children.values():
            each.close()
        os.close(fds[3])
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in set(fds[:3]):
            if fd > 2:
                os.close(fd)
        # As a fresh interpreter sets them: stdout line-buffered only at a terminal.
        if isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(line_buffering=os.isatty(1))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-m", *request["args"]]
        sys.path[0] = os.getcwd()  # as ``python -m`` puts the working directory first
        importlib.invalidate_caches()
        utils = sys.modules.get("dbos._utils")
        if utils is not None:
            # What dbos reads from the environment when imported, read again from the child's.
            params = utils.GlobalParams
            params.app_version = os.environ.get("DBOS__APPVERSION", "")
            params.executor_id = os.environ.get("DBOS__VMID") or "local"
            params.dbos_cloud = os.environ.get("DBOS__CLOUD") == "true"

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            reply = self.children.pop(pid, None)
            if reply is not None:
                self._send(reply, f"exit {os.waitstatus_to_exitcode(status)}")
                reply.close()

    def shutdown(self) -> None:
        """The test process is gone: no child of its may outlive it."""
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.children):
            os.waitpid(pid, 0)
        os._exit(0)

    @staticmethod
    def _send(reply: socket.socket, message: str) -> None:
        try:
            reply.send(message.encode())
        except OSError:  # the test side let go of this child
            pass


def _main() -> dict[str, Any]:
    control = socket.socket(fileno=int(sys.argv[1]))
    if sys.argv[2] == WATCH_PARENT:
        parent = os.getppid()
        _pdeathsig(signal.SIGTERM)
        if os.getppid() != parent:  # the test process died before the line above
            os._exit(1)
    try:
        for module in sys.argv[3:]:
            importlib.import_module(module)
    except BaseException as exc:
        control.send(f"{type(exc).__name__}: {exc}".encode())
        raise
    if threading.active_count() != 1:
        control.send(f"the imports started threads: {threading.enumerate()}".encode())
        raise SystemExit(1)
    # The preloaded objects are never freed: kept out of the collector, a child's collections do
    # not touch (and copy) the pages they live on.
    gc.freeze()
    server = _Server(control)
    control.send(b"ready")
    return server.serve()


if __name__ == "__main__":
    # Only a child comes back from the server loop; it runs its module here, at the top level, so
    # that its exit is the interpreter's own.
    _request = _main()
    runpy.run_module(_request["module"], run_name="__main__", alter_sys=True)
