"""The chaos harness's database faults: in the schedule of a profile that asks for them only."""

from __future__ import annotations

import itertools
from dataclasses import replace

from chaos.schedule import (
    DATABASE_FAULTS,
    FAULT_KINDS,
    INSTANCE_FAULTS,
    PROFILES,
    SYSDB_LEAD_SECS,
    SYSTEM_DATABASE_FAULTS,
    Profile,
    faults_end,
    make_schedule,
)


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
    every = set(DATABASE_FAULTS + SYSTEM_DATABASE_FAULTS)
    assert not PROFILES["quick"].db_faults
    assert not {f.kind for seed in range(20) for f in make_schedule(seed, PROFILES["quick"])} & every
    # The same profile without the flag: the schedule of the other kinds alone.
    plain = replace(PROFILES["db"], db_faults=False)
    assert not {f.kind for f in make_schedule(1, plain)} & every


def test_the_ci_profile_plays_a_database_kill_a_cut_and_a_system_database_restart_whatever_the_seed() -> None:
    profile = PROFILES["ci"]
    assert set(profile.db_kinds) == {"db_kill", "db_cut", "sysdb_restart"}
    for seed in range(100):
        faults = make_schedule(seed, profile)
        kinds = {f.kind for f in faults}
        assert kinds >= {"db_kill", "db_cut", "sysdb_restart"} | set(INSTANCE_FAULTS), seed
        assert not kinds & {"db_restart", "db_pause"}  # not asked for
        for fault, after in itertools.pairwise(faults):
            if fault.kind == "sysdb_restart":
                assert 0 <= fault.target < profile.executors and SYSDB_LEAD_SECS < fault.duration <= 4.0
                # The kill, the grace period and the outage, before the next fault.
                assert after.at >= fault.at + profile.grace_secs - SYSDB_LEAD_SECS + fault.duration


def test_the_db_profile_plays_every_database_and_instance_fault_whatever_the_seed() -> None:
    profile = PROFILES["db"]
    for seed in range(100):
        faults = make_schedule(seed, profile)
        assert {f.kind for f in faults} >= set(DATABASE_FAULTS + SYSTEM_DATABASE_FAULTS + INSTANCE_FAULTS), seed
        # The workload runs until the last fault is over when the schedule went past fault_secs.
        last = faults[-1]
        if last.at >= profile.fault_secs:
            assert faults_end(profile, faults) == last.at + last.duration
        else:
            assert faults_end(profile, faults) == profile.fault_secs
    assert max(faults_end(profile, make_schedule(seed, profile)) for seed in range(100)) > profile.fault_secs
    assert faults_end(PROFILES["quick"], make_schedule(1, PROFILES["quick"])) == PROFILES["quick"].fault_secs


def test_the_soak_plays_every_fault_kind() -> None:
    assert PROFILES["soak"].db_faults
    kinds = {f.kind for f in make_schedule(1, PROFILES["soak"])}
    assert kinds == set(FAULT_KINDS + DATABASE_FAULTS + SYSTEM_DATABASE_FAULTS)


def test_a_record_from_before_db_kinds_plays_relays_database_faults_only() -> None:
    data = PROFILES["db"].to_json()
    del data["db_kinds"]
    assert Profile.from_json(data).db_kinds == DATABASE_FAULTS
    assert Profile.from_json(PROFILES["ci"].to_json()) == PROFILES["ci"]
