"""A chaos run's record: where it is written, and reading one back to replay it.

A recording is checked whole before any fleet starts (:func:`read_recording`): a file that is
missing, not JSON, not a record, of a newer format or with a field this code does not know, or a
schedule that cannot be played as written on its profile's fleet (an unknown fault kind, a target
out of range, a database fault without its server) is refused with :class:`BadRecording`, which
names the file and the entry. ``python -m chaos`` exits 2 for it.

Records carry ``format`` (:data:`FORMAT`). One without it is from before: its profile without
``relay_instances`` was played on one Relay instance, and is replayed on one
(:meth:`chaos.schedule.Profile.from_json`).

A fresh run writes ``run-PROFILE-SEED[-client].json``; a replay writes
``replay-PROFILE-SEED[-client]-YYYYMMDDTHHMMSSZ.json`` (UTC) beside it, never over a record.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos.schedule import Fault, Profile, unplayable

# 3: ``schedule_shift_secs``, how far faults that ran over pushed the rest of the schedule back
# (chaos.run.ScheduleClock); older code refuses it as a newer format rather than as an unknown field.
FORMAT = 3
# What run() writes, and what a kept recording says of itself (chaos/runs/). A record of an older
# format lacks the fields added since, and replays all the same: only seed, profile and schedule count.
RESULT_FIELDS = frozenset({
    "format", "seed", "client", "profile", "schedule", "faults", "figures", "violations", "unfinished",
    "unplanned_instance_exits", "audit", "ok", "duration_secs", "fleet_start_overrun_secs",
    "schedule_shift_secs", "workdir",
})  # fmt: skip
NOTES = frozenset({"covers", "found", "exercises"})


class BadRecording(ValueError):
    """A recording that cannot be replayed as written; its message names the file and the entry."""


@dataclass(frozen=True)
class Recording:
    seed: int
    profile: Profile
    schedule: list[Fault]
    client: bool


def check_seed(seed: Any) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed {seed!r} is not a whole number of 0 or more")
    return seed


def read_recording(path: Path) -> Recording:
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadRecording(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BadRecording(f"{path}: not JSON, or cut short ({exc})") from None
    if not isinstance(data, dict) or not {"seed", "profile", "schedule"} <= set(data):
        raise BadRecording(f"{path}: not a chaos recording (an object with seed, profile and schedule)")
    try:
        return _recording(data)
    except ValueError as exc:
        raise BadRecording(f"{path}: {exc}") from None


def _recording(data: dict[str, Any]) -> Recording:
    version = data.get("format", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"format {version!r} is not a format number")
    if version > FORMAT:
        raise ValueError(f"format {version} is newer than this code knows ({FORMAT}): replay it with its own code")
    unknown = sorted(set(data) - RESULT_FIELDS - NOTES)
    if unknown:
        raise ValueError(f"unknown field {', '.join(map(repr, unknown))}")
    seed = check_seed(data["seed"])
    client = data.get("client", False)
    if not isinstance(client, bool):
        raise ValueError(f"client {client!r} is not true or false")
    if not isinstance(data["profile"], dict):
        raise ValueError("profile is not an object")
    profile = Profile.from_json(data["profile"])
    if not isinstance(data["schedule"], list):
        raise ValueError("schedule is not a list")
    schedule = []
    for index, entry in enumerate(data["schedule"]):
        try:
            fault = Fault.from_json(entry)
        except ValueError as exc:
            raise ValueError(f"schedule[{index}]: {exc}") from None
        why = unplayable(profile, fault)
        if why is not None:
            raise ValueError(f"schedule[{index}]: {why}")
        schedule.append(fault)
    return Recording(seed, profile, schedule, client)


def write_record(out: Path, result: dict[str, Any], replay: bool) -> Path:
    """Writes ``result`` into ``out`` under a name of its own, never over another file; returns its path."""
    stem = f"{result['profile']['name']}-{result['seed']}{'-client' if result['client'] else ''}"
    if not replay:
        path = out / f"run-{stem}.json"
        path.write_text(json.dumps(result, indent=2))
        return path
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for attempt in range(1, 100):
        path = out / f"replay-{stem}-{stamp}{f'-{attempt}' if attempt > 1 else ''}.json"
        try:
            with path.open("x") as file:  # two replays in the same second: the second gets a suffix
                file.write(json.dumps(result, indent=2))
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{out}: every replay record name of {stem} at {stamp} is taken")
