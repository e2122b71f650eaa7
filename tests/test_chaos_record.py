"""A chaos run's record: the kept recordings are playable as written, a record reads back as it was
written, and replays never write over a record (no fleet: chaos/record.py alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.record import FORMAT, BadRecording, read_recording, write_record
from chaos.schedule import PROFILES, make_schedule

ROOT = Path(__file__).resolve().parents[1]
KEPT = sorted((ROOT / "chaos" / "runs").rglob("*.json"))


@pytest.mark.parametrize("path", KEPT, ids=lambda p: p.name)
def test_every_kept_recording_is_playable_as_written(path: Path) -> None:
    recording = read_recording(path)
    assert recording.schedule and recording.profile.relay_instances >= 1


def _result(seed: int = 4) -> dict[str, object]:
    profile = PROFILES["ci"]
    schedule = make_schedule(seed, profile)
    return {"format": FORMAT, "seed": seed, "client": False, "profile": profile.to_json(),
            "schedule": [f.to_json() for f in schedule], "violations": [], "ok": True}  # fmt: skip


def test_a_record_reads_back_as_it_was_written(tmp_path: Path) -> None:
    path = write_record(tmp_path, _result(), replay=False)
    assert path.name == "run-ci-4.json"
    recording = read_recording(path)
    assert recording.profile == PROFILES["ci"] and recording.schedule == make_schedule(4, PROFILES["ci"])


def test_replays_in_the_same_second_keep_every_record(tmp_path: Path) -> None:
    first = write_record(tmp_path, _result(), replay=False)
    replays = [write_record(tmp_path, _result(), replay=True) for _ in range(3)]
    assert len({first, *replays}) == 4 and all(p.name.startswith("replay-ci-4-") for p in replays)


def test_a_record_of_a_newer_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**_result(), "format": FORMAT + 1}))
    with pytest.raises(BadRecording, match=f"format {FORMAT + 1} is newer"):
        read_recording(path)


def test_a_record_with_the_schedule_s_shift_reads_back_and_one_from_before_it_still_replays(tmp_path: Path) -> None:
    """run() records how far faults that ran over pushed the schedule back (``schedule_shift_secs``,
    chaos.run.ScheduleClock); a record of format 2 has no such field and replays all the same."""
    new = write_record(tmp_path, {**_result(), "fleet_start_overrun_secs": 19.4, "schedule_shift_secs": 70.0}, False)
    assert read_recording(new).schedule == make_schedule(4, PROFILES["ci"])
    old = tmp_path / "format-2.json"
    old.write_text(json.dumps({**_result(), "format": 2, "fleet_start_overrun_secs": 19.4}))
    assert read_recording(old).schedule == make_schedule(4, PROFILES["ci"])
