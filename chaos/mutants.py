"""``python -m chaos mutants``: deliberate bugs in Relay that the checker must catch.

Each mutant is a few exact text edits. It is applied to a copy of the tree in a
temporary folder, never to the checkout, and a recorded run that exercises it
(``chaos/runs/mutants/*.json``) is replayed from that copy (``PYTHONPATH`` puts
the copy's packages before the installed ones, for the Relay instances and the
executors too). A mutant is caught when the replay's checker finds violations;
missed when the replay passes; an error when the replay left no verdict. An
edit whose text is no longer in the tree is an error too, so a mutant cannot
silently stop applying. ``--baseline`` replays each recording on the unmutated
tree as well, which must pass. ``python -m chaos mutants`` exits 1 when a mutant
was missed or a baseline failed, else 3 when a replay left no verdict. Two runs
cannot share an ``--out`` folder (each replay empties its own subfolder first):
the second is refused with exit code 2 before it starts anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "chaos" / "runs" / "mutants"


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    recorded: str  # a file of chaos/runs/mutants
    edits: tuple[Edit, ...]


GRACE_WAIT = "woken = await DBOS.recv_async(RECONNECTED_TOPIC, timeout_seconds=remaining(timeout_secs, lost_at))"

MUTANTS = (
    Mutant("grace", "the grace period's wait cut to 0.01 s", "grace-quick.json",
           (Edit("workflows/grace.py", "timeout_seconds=remaining(timeout_secs, lost_at))", "timeout_seconds=0.01)"),)),
    Mutant("verify", "verification ignored: a peer's success: true taken on trust", "liar.json",
           (Edit("workflows/recovery.py", "        if reply.exist:\n", "        if False:\n"),)),
    Mutant("app-filter", "the app filter dropped from peer choice and from routing", "app-filter.json",
           (Edit("relay/store/executors.py",
                 "WHERE e.org = %s AND e.app = %s AND e.state = 'HEALTHY' ORDER BY e.executor_id",
                 "WHERE e.org = %s AND %s::text IS NOT NULL AND e.state = 'HEALTHY' ORDER BY e.executor_id"),)),
    Mutant("reconnect", "a reconnect does not end the grace period", "reconnect.json", (
        Edit("workflows/grace.py", GRACE_WAIT,
             "await DBOS.sleep_async(remaining(timeout_secs, lost_at))\n    woken = None"),
        Edit("relay/core/lifecycle.py", "    (S.DISCONNECTED, E.GRACE_EXPIRED): S.DEAD,\n",
             "    (S.DISCONNECTED, E.GRACE_EXPIRED): S.DEAD,\n    (S.HEALTHY, E.GRACE_EXPIRED): S.DEAD,\n"),
        Edit("relay/store/recoveries.py", "await self.executors.apply(key, event, epoch=epoch, conn=conn)",
             "await self.executors.apply(key, event, epoch=None, conn=conn)"),
    )),
    Mutant("lease-gives-up", "an instance stops renewing its lease at its first failed renewal",
           "db-outages.json",
           (Edit("relay/store/lease.py",
                 '                failed += 1\n',
                 '                return\n'),)),
    Mutant("no-frame", "the recovery frame never sent (its success assumed)", "liar.json",
           (Edit("workflows/recovery.py",
                 "    reply = await _ask(ref, peer, RecoveryRequest(executor_ids=[ref.key.executor_id]), "
                 "RecoveryReply, timeout)\n",
                 "    return {\"ok\": True}\n"),)),
    Mutant("unresolved", "a death's end resolves none of its alerts", "grace-quick.json",
           (Edit("relay/core/alerts.py", "    over = death_over(fact)\n", "    over = None\n"),)),
    Mutant("nothing-pending", "a blocked recovery finds nothing pending without asking a peer", "deploy.json",
           (Edit("workflows/recovery.py",
                 "    asked = order_peers(ref.key.executor_id, peers)[:NOTHING_PENDING_ASKED]\n",
                 "    return peers[0].executor_id\n"),)),
)  # fmt: skip

# Every virtualenv (.venv, .venv-client*, .venv-mcp: hundreds of MB each), the runs' folders and caches.
IGNORED = shutil.ignore_patterns(
    ".git", ".venv*", ".chaos*", ".relay", "node_modules", "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache",
    ".pytest_cache", ".hypothesis",
)  # fmt: skip


def copy_tree(into: Path, mutant: Mutant | None) -> Path:
    tree = into / "tree"
    shutil.copytree(ROOT, tree, ignore=IGNORED, symlinks=True)  # a link is copied as a link, not followed
    for edit in mutant.edits if mutant else ():
        path = tree / edit.path
        text = path.read_text()
        if text.count(edit.old) != 1:
            raise ValueError(f"mutant {mutant.name if mutant else ''}: {edit.path} no longer holds {edit.old!r} once")
        path.write_text(text.replace(edit.old, edit.new))
    return tree


def replay(mutant: Mutant | None, recorded: str, out: Path) -> dict[str, Any]:
    """Replays ``recorded`` from a copy of the tree with ``mutant`` applied; returns the verdict."""
    label = mutant.name if mutant else "baseline"
    started = time.monotonic()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"chaos-mutant-{label}-") as tmp:
        try:
            tree = copy_tree(Path(tmp), mutant)
        except ValueError as exc:
            return {"mutant": label, "verdict": "error", "why": str(exc), "secs": 0.0}
        run_out = out / label
        shutil.rmtree(run_out, ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        recording = tree / RUNS.relative_to(ROOT) / recorded
        cmd = [sys.executable, "-m", "chaos", "replay", str(recording), "--out", str(run_out)]
        log = out / f"{label}.log"
        with log.open("wb") as sink:
            code = _replay_process(cmd, tree, env, sink)
    results = list(run_out.glob("replay-*.json"))
    secs = round(time.monotonic() - started, 1)
    if not results:
        return {"mutant": label, "verdict": "error", "why": f"no verdict (exit {code}); see {log}", "secs": secs}
    violations = json.loads(results[0].read_text())["violations"]
    caught = bool(violations) if mutant else not violations
    verdict = ("caught" if caught else "missed") if mutant else ("passed" if caught else "failed")
    return {"mutant": label, "recorded": recorded, "verdict": verdict, "violations": violations[:3], "secs": secs}


def _replay_process(cmd: list[str], tree: Path, env: dict[str, str], sink: IO[bytes]) -> int:
    """Runs one replay to its end; interrupted (a signal to this process), passes SIGTERM on and
    waits for the replay to stop its fleet, rather than killing it with its PostgreSQL servers left."""
    with subprocess.Popen(cmd, cwd=tree, env=env, stdout=sink, stderr=subprocess.STDOUT) as proc:
        try:
            return proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def run_mutants(names: list[str] | None, baseline: bool, out: Path) -> int:
    chosen = [m for m in MUTANTS if not names or m.name in names]
    unknown = set(names or ()) - {m.name for m in MUTANTS}
    if unknown:
        print(f"chaos: no such mutant: {', '.join(sorted(unknown))} (there are {', '.join(m.name for m in MUTANTS)})",
              file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    with _sole_user(out) as holder:
        if holder is not None:
            print(f"chaos: another `chaos mutants` run (pid {holder or 'unknown'}) uses {out}; it would delete "
                  "that run's replays: give this one another --out", file=sys.stderr)  # fmt: skip
            return 2
        return _run_mutants(chosen, baseline, out)


@contextlib.contextmanager
def _sole_user(out: Path) -> Iterator[str | None]:
    """Holds ``out/.lock`` for the run (released when the process ends, however it ends): yields
    None when this run has it, else the pid that another run wrote in it (or "")."""
    with open(out / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            yield lock.read().strip()
            return
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        yield None


def _run_mutants(chosen: list[Mutant], baseline: bool, out: Path) -> int:
    report = []
    for recorded in dict.fromkeys(m.recorded for m in chosen) if baseline else ():
        report.append(replay(None, recorded, out / recorded.removesuffix(".json")))
        print(_line(report[-1]), flush=True)
    for mutant in chosen:
        print(f"mutant {mutant.name}: {mutant.bug}; replaying {mutant.recorded}", flush=True)
        report.append(replay(mutant, mutant.recorded, out))
        print(_line(report[-1]), flush=True)
    (out / "mutants.json").write_text(json.dumps(report, indent=2))
    caught = sum(r["verdict"] == "caught" for r in report)
    print(f"mutants: {caught} of {len(chosen)} caught")
    # A miss is a finding whatever else happened; a replay with no verdict is the harness's failure.
    if any(r["verdict"] in ("missed", "failed") for r in report):
        return 1
    errors = [r["mutant"] for r in report if r["verdict"] == "error"]
    if errors:
        print(f"chaos: the harness could not run the replays of {', '.join(errors)} (see above)", file=sys.stderr)
        return 3
    return 0


def _line(r: dict[str, Any]) -> str:
    why = r.get("why") or "; ".join(r.get("violations", []))
    what = r["mutant"] if r["mutant"] != "baseline" else f"baseline {r.get('recorded', '')}"
    return f"  {what}: {r['verdict'].upper()} in {r['secs']} s {('- ' + why[:300]) if why else ''}"
