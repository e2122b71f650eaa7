"""``python -m chaos mutants``: its mutants still apply, to a copy only, and their recordings load.

The replays themselves are chaos runs (``./test.sh`` runs the grace mutant's)."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.mutants import MUTANTS, ROOT, RUNS, Edit, Mutant, copy_tree, replay
from chaos.schedule import Fault, Profile


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_still_finds_its_text_once(mutant: Mutant) -> None:
    for edit in mutant.edits:
        assert (ROOT / edit.path).read_text().count(edit.old) == 1, (mutant.name, edit.path)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_recording_loads_and_has_faults(mutant: Mutant) -> None:
    recorded = json.loads((RUNS / mutant.recorded).read_text())
    profile = Profile.from_json(recorded["profile"])
    schedule = [Fault(**f) for f in recorded["schedule"]]
    assert schedule and all(f.at < profile.fault_secs for f in schedule)


def test_a_mutant_edits_the_copy_and_never_the_checkout(tmp_path: Path) -> None:
    grace = next(m for m in MUTANTS if m.name == "grace")
    before = (ROOT / "workflows" / "grace.py").read_text()
    tree = copy_tree(tmp_path, grace)
    assert "timeout_seconds=0.01)" in (tree / "workflows" / "grace.py").read_text()
    assert (ROOT / "workflows" / "grace.py").read_text() == before
    assert not (tree / ".venv").exists() and (tree / "chaos" / "runs" / "mutants" / grace.recorded).exists()


def test_a_mutant_whose_text_is_gone_is_an_error_not_a_pass(tmp_path: Path) -> None:
    gone = Mutant("gone", "edits text no longer there", "grace-quick.json",
                  (Edit("workflows/grace.py", "no such line", "x"),))  # fmt: skip
    result = replay(gone, gone.recorded, tmp_path)
    assert result["verdict"] == "error" and "no longer holds" in result["why"]


def test_a_second_run_on_the_same_out_folder_is_refused_before_it_deletes_anything(tmp_path: Path) -> None:
    """Each replay empties its own subfolder of ``--out`` first: a second run given the first's
    folder would delete the first's replays under it. It is refused with exit code 2, naming the
    first run, and the folder is left as it was."""
    out = tmp_path / "mutants"
    kept = out / "grace" / "replay-1.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    with open(out / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a first run holds while it runs
        lock.write("4242")
        lock.flush()
        done = subprocess.run(
            [sys.executable, "-m", "chaos", "mutants", "grace", "--out", str(out)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
    assert done.returncode == 2, done
    assert "another `chaos mutants` run (pid 4242)" in done.stderr and "another --out" in done.stderr
    assert kept.read_text() == "{}" and sorted(p.name for p in out.iterdir()) == [".lock", "grace"]
