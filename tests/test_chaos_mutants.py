"""``python -m chaos mutants``: its mutants still apply, to a copy only, and their recordings load.

The replays themselves are chaos runs (``./test.sh`` runs the grace mutant's)."""

from __future__ import annotations

import json
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
