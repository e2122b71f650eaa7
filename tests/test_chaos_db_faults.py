"""The chaos harness's database faults: in the schedule of a profile that asks for them only."""

from __future__ import annotations

import itertools
from dataclasses import replace

from chaos.schedule import DATABASE_FAULTS, PROFILES, make_schedule


def test_the_db_profile_plays_both_database_faults_one_at_a_time() -> None:
    profile = PROFILES["db"]
    faults = make_schedule(1, profile)
    assert faults == make_schedule(1, profile)
    assert {f.kind for f in faults} >= set(DATABASE_FAULTS)
    for fault in faults:
        if fault.kind in DATABASE_FAULTS:
            assert fault.target == -1 and 2.0 <= fault.duration <= 5.0
        if fault.kind == "db_pause":
            assert fault.duration > profile.lease_secs  # every instance misses its renewals
    for earlier, later in itertools.pairwise(faults):
        assert later.at >= earlier.at + earlier.duration


def test_profiles_without_database_faults_never_play_them() -> None:
    for name in ("ci", "quick", "soak"):
        assert not PROFILES[name].db_faults
        assert not {f.kind for seed in range(20) for f in make_schedule(seed, PROFILES[name])} & set(DATABASE_FAULTS)
    # The same profile without the flag: the schedule of the other kinds alone.
    plain = replace(PROFILES["db"], db_faults=False)
    assert not {f.kind for f in make_schedule(1, plain)} & set(DATABASE_FAULTS)
