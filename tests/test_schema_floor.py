"""The schema's compatibility floor (relay/store/migrations.py), for real: a release that finds a
database migrated by a newer one runs on it unless the database's floor is above what it knows.

A newer release is this code's own migration runner given one more migration than this release
has (``relay.store.db.MIGRATIONS``, patched in this process only); this release is ``relay serve``
in a subprocess, as an operator runs it.
"""

from __future__ import annotations

import asyncio
import tarfile
from pathlib import Path

import psycopg
import pytest
import yaml

from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import RelayProcess, relay_yaml
from relay import __version__
from relay.errors import StartupError
from relay.store import db as db_module
from relay.store.migrations import MIGRATIONS, Migration
from tests.test_cli_and_db import _migrate_once, refused_serve
from tests.test_upgrade import RELEASE, schema_versions

NEWEST = MIGRATIONS[-1].version
# The floor migration 15 records: every release that reads the floor may run on today's schema.
TODAYS_FLOOR = 14


def migrate(url: str) -> list[int]:
    return asyncio.run(_migrate_once(url))


def migrate_as_newer_release(url: str, monkeypatch: pytest.MonkeyPatch, *newer: Migration) -> list[int]:
    """Migrate ``url`` as a release would that has this release's migrations and ``newer``."""
    with monkeypatch.context() as patch:
        patch.setattr(db_module, "MIGRATIONS", [*MIGRATIONS, *newer])
        return migrate(url)


def floor_of(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [int(r[0]) for r in conn.execute("SELECT version FROM relay_schema_floor")]


def snapshot(url: str) -> dict[str, str]:
    """Every table of every schema (Relay's, DBOS's if any) with a digest of its rows, and every
    sequence with its position: what a start that writes anything would change."""
    with psycopg.connect(url) as conn:
        tables = conn.execute(
            """SELECT schemaname, tablename FROM pg_tables
               WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2"""
        ).fetchall()
        seen: dict[str, str] = {}
        for schema, table in tables:
            name = f'"{schema}"."{table}"'
            digest = "md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), ''))"
            row = conn.execute(f"SELECT count(*), {digest} FROM {name} t").fetchone()
            assert row is not None
            seen[name] = f"{row[0]} rows, {row[1]}"
        for schema, sequence, last in conn.execute(
            "SELECT schemaname, sequencename, last_value FROM pg_sequences ORDER BY 1, 2"
        ).fetchall():
            seen[f'"{schema}"."{sequence}" (sequence)'] = str(last)
    return seen


def test_a_fresh_database_records_todays_floor(postgres: Postgres) -> None:
    url = postgres.create_database("floor_fresh")
    assert migrate(url) == [m.version for m in MIGRATIONS]
    assert floor_of(url) == [TODAYS_FLOOR]
    assert TODAYS_FLOOR < NEWEST  # this release runs on its own schema
    assert migrate(url) == [] and floor_of(url) == [TODAYS_FLOOR]


def test_a_breaking_migration_raises_the_floor_and_no_other_does(
    postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = postgres.create_database("floor_raised")
    migrate(url)
    plain = Migration(NEWEST + 1, "CREATE TABLE relay_newer_plain (id integer)")
    assert migrate_as_newer_release(url, monkeypatch, plain) == [NEWEST + 1]
    assert floor_of(url) == [TODAYS_FLOOR]
    breaking = Migration(NEWEST + 2, "ALTER TABLE relay_newer_plain RENAME TO relay_newer", breaks_older=True)
    later = Migration(NEWEST + 3, "CREATE TABLE relay_newer_still (id integer)")
    assert migrate_as_newer_release(url, monkeypatch, plain, breaking, later) == [NEWEST + 2, NEWEST + 3]
    assert floor_of(url) == [NEWEST + 2]
    # This release, below the floor, is refused in the same way by the runner itself.
    with pytest.raises(StartupError, match=f"compatibility floor.*knows versions up to {NEWEST}"):
        migrate(url)
    assert floor_of(url) == [NEWEST + 2]


def test_a_database_a_newer_release_migrated_above_this_ones_floor_runs_it_with_a_warning(
    postgres: Postgres, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rolling upgrade: the newer release migrated the database with a migration that older code
    can live with; an instance of this release (re)started meanwhile runs, and says so once."""
    url = postgres.create_database("floor_below")
    migrate_as_newer_release(url, monkeypatch, Migration(NEWEST + 1, "CREATE TABLE relay_newer (id integer)"))
    relay = RelayProcess(tmp_path, url, relay_yaml(free_port()), "relay-old").start()
    try:
        with relay.api() as api:
            assert api.get("/apps").status_code == 200
    finally:
        relay.stop()
    warning = (
        f"WARNING relay.db: the database's schema is at version {NEWEST + 1}, migrated by a newer release of "
        f"Relay; this Relay ({__version__}) knows versions up to {NEWEST} and runs on it, as the database's "
        f"compatibility floor ({TODAYS_FLOOR}) allows"
    )
    assert relay.log().count(warning) == 1, relay.log()
    assert schema_versions(url) == [*(m.version for m in MIGRATIONS), NEWEST + 1]
    assert floor_of(url) == [TODAYS_FLOOR]


def test_a_database_whose_floor_is_above_this_release_is_refused_and_left_as_it_was(
    postgres: Postgres, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rollback past a breaking migration (or a much older release): one line, exit 1 as other
    failed starts, and nothing written: no migration, no org or key from relay.yaml, no lease, no
    DBOS schema or workflow."""
    url = postgres.create_database("floor_above")
    breaking = Migration(NEWEST + 1, "ALTER TABLE relay_instances RENAME TO relay_leases", breaks_older=True)
    migrate_as_newer_release(url, monkeypatch, breaking)
    assert floor_of(url) == [NEWEST + 1]
    before = snapshot(url)
    assert not any(name.startswith('"dbos"') for name in before)

    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump(relay_yaml(free_port())))
    args = ["--config", str(config), "--database-url", url]
    code, stderr = refused_serve(
        args, {"RELAY_INSTANCE_ID": "relay-old", "RELAY_HOME": str(tmp_path / "home")}, tmp_path
    )
    assert code == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1] == (
        f"relay: the database's schema is at version {NEWEST + 1}, migrated by a newer release of Relay, and "
        f"needs a release that knows schema version {NEWEST + 1} or later (its compatibility floor); this Relay "
        f"({__version__}) knows versions up to {NEWEST} and does not start on it: upgrade Relay (to the release "
        "that migrated the database, or a later one)"
    )
    assert snapshot(url) == before


def test_an_upgrade_from_the_last_release_records_the_floor(postgres: Postgres, tmp_path: Path, relay_db: str) -> None:
    """0.2.0 (schema 1 and 2) made the database; this release migrates it forward, without the
    warning for a newer schema, and records today's floor."""
    old_home = tmp_path / "relay-0.2.0"
    old_home.mkdir()
    with tarfile.open(RELEASE) as release:
        release.extractall(old_home, filter="data")
    old = RelayProcess(old_home, relay_db, relay_yaml(free_port()), "relay-1").start()
    old.stop()
    assert schema_versions(relay_db) == [1, 2]
    new = RelayProcess(tmp_path, relay_db, relay_yaml(free_port()), "relay-1").start()
    new.stop()
    assert schema_versions(relay_db) == [m.version for m in MIGRATIONS]
    assert floor_of(relay_db) == [TODAYS_FLOOR]
    assert "newer release" not in new.log() and f"database migrated to version {NEWEST}" in new.log()
