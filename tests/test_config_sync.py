"""relay.yaml's sync at start: its apps, alert rules and keys land whole, one file's, however
instances with different files start together (relay.store.configsync)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harness.keys import sha
from harness.ports import free_port
from harness.postgres import Postgres
from relay.auth import Permission
from relay.config import RelayConfig, load_config, parse_config
from relay.store.alerts import CONFIG_RULES_LOCK_KEY, AlertStore
from relay.store.apps import APPS_LOCK_KEY, AppStore
from relay.store.configsync import sync_config
from relay.store.db import Database
from relay.store.keys import KeyStore, NewKey
from tests.test_alert_resolutions import sessions_waiting
from tests.test_alerts import alert_config


def relay_file(name: str, org: str = "acme") -> RelayConfig:
    """A relay.yaml whose apps, rule and key all say which file they are from (``name``), of ``org``."""
    rule = {"kind": "ExecutorDead", "webhook": f"http://127.0.0.1:9/{name}", "minIntervalSecs": len(name)}
    config = alert_config(free_port(), [rule])
    acme = config["orgs"][0]
    acme["apps"].append({"name": f"app-{name}"})
    acme["conductorKeys"] = [{"name": f"key-{name}", "sha256": sha(f"secret-{name}")}]
    acme["apiKeys"] = []
    acme["name"] = org
    config["orgs"] = [acme]
    return RelayConfig.model_validate(config)


async def files_in_force(db: Database) -> tuple[str, str, str]:
    """Whose file (by name) the apps, the rules and the keys the database holds from relay.yaml are."""
    async with db.connection() as conn:
        cur = await conn.execute("SELECT name FROM apps WHERE from_config AND name LIKE 'app-%' ORDER BY name")
        apps = ",".join(str(r["name"]).removeprefix("app-") for r in await cur.fetchall())
        cur = await conn.execute("SELECT webhook_url FROM alert_rules WHERE source = 'config' ORDER BY 1")
        rules = ",".join(str(r["webhook_url"]).rsplit("/", 1)[1] for r in await cur.fetchall())
        cur = await conn.execute("SELECT name FROM tokens WHERE source = 'config' ORDER BY name")
        keys = ",".join(str(r["name"]).removeprefix("key-") for r in await cur.fetchall())
    return apps, rules, keys


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


async def interleaved(url: str, first: RelayConfig, second: RelayConfig) -> tuple[str, str, str]:
    """Two starts, the first slow between its writes: the pool of its instance (one connection) is
    taken by another task as soon as the first write gives its connection back, while the second
    start runs. Synced in three transactions, the first file's rules and keys came after the second
    file's apps, rules and keys; in one, the first start wins whole, then the second does."""
    slow, fast = Database(url, min_size=1, max_size=1), Database(url)
    await slow.open()
    await fast.open()
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():  # both starts queue for the apps' lock, the slow one first
                await holder.execute("SELECT pg_advisory_xact_lock(%s)", (APPS_LOCK_KEY,))
                slow_sync = asyncio.create_task(sync_config(slow, first))
                await until(lambda: _waiting(holder, 1), "the first start never waited for the apps' lock")
                let_go = asyncio.Event()

                async def take_slow_pool() -> None:
                    async with slow.connection():
                        await let_go.wait()

                taker = asyncio.create_task(take_slow_pool())
                await until(lambda: _pool_waits(slow), "the taker never queued for the slow pool")
                fast_sync = asyncio.create_task(sync_config(fast, second))
                await until(lambda: _waiting(holder, 2), "the second start never waited for the apps' lock")
            await asyncio.wait_for(fast_sync, 10)
            let_go.set()
            await asyncio.wait_for(asyncio.gather(slow_sync, taker), 10)
        return await files_in_force(fast)
    finally:
        await slow.close()
        await fast.close()


async def _waiting(holder: psycopg.AsyncConnection[Any], sessions: int) -> bool:
    return await sessions_waiting(holder) >= sessions


async def _pool_waits(db: Database) -> bool:
    return int(db.pool.get_stats().get("requests_waiting", 0)) >= 1


async def together(url: str, files: list[RelayConfig], rounds: int) -> list[tuple[str, str, str]]:
    """``rounds`` of every file's start at once, each on an instance (a pool) of its own; what each
    round left in force."""
    dbs = [Database(url) for _ in files]
    for db in dbs:
        await db.open()
    try:
        await dbs[0].migrate()
        outcomes = []
        for n in range(rounds):
            order = files[n % len(files) :] + files[: n % len(files)]  # each file first in turn
            await asyncio.gather(*(sync_config(db, config) for db, config in zip(dbs, order, strict=True)))
            outcomes.append(await files_in_force(dbs[0]))
        return outcomes
    finally:
        for db in dbs:
            await db.close()


async def previous_release_sync(db: Database, config: RelayConfig) -> None:
    """An instance of the previous release starting: three transactions, each under its own lock."""
    await AppStore(db).sync_config(config)
    await AlertStore(db).sync_config(config)
    await KeyStore(db).sync_config(config)


async def with_previous_release(url: str, files: list[RelayConfig], rounds: int) -> list[BaseException]:
    """``rounds`` of this release's starts together with one of the previous release (a rolling
    upgrade): the errors they met (a deadlock, a collision)."""
    dbs = [Database(url) for _ in range(len(files) + 1)]
    for db in dbs:
        await db.open()
    try:
        errors: list[BaseException] = []
        for _ in range(rounds):
            syncs = [sync_config(db, config) for db, config in zip(dbs, files, strict=False)]
            results = await asyncio.gather(*syncs, previous_release_sync(dbs[-1], files[0]), return_exceptions=True)
            errors += [r for r in results if isinstance(r, BaseException)]
        return errors
    finally:
        for db in dbs:
            await db.close()


def test_two_starts_with_different_files_leave_one_files_apps_rules_and_keys_whole(postgres: Postgres) -> None:
    """The starts synced relay.yaml's apps, rules and keys in three transactions: two instances
    started together with different files could end with one file's apps and the other file's rules
    and keys (forced here: the first start slow between its writes). One transaction now: the last
    start wins whole, forced or in 40 rounds of free races, and this release's starts neither
    deadlock nor collide with one of the previous release's (three transactions) under way."""
    url = postgres.create_database("config_sync")
    files = [relay_file("a"), relay_file("b")]
    started = time.monotonic()
    outcomes = asyncio.run(together(url, files, rounds=40))
    assert all(len(set(o)) == 1 for o in outcomes), [o for o in outcomes if len(set(o)) > 1]
    assert asyncio.run(interleaved(url, files[0], files[1])) == ("b", "b", "b")
    assert asyncio.run(with_previous_release(url, files, rounds=10)) == []
    assert time.monotonic() - started < 10


async def first_keys_beside_a_sync(url: str, config: RelayConfig) -> list[BaseException]:
    """An instance without orgs in relay.yaml making the first keys (under the keys' lock, adding
    org ``default``) while another's start syncs a file with org ``default``, paused between its
    apps and its rules (a lock held here); the errors they met."""
    syncing, first = Database(url), Database(url)
    for db in (syncing, first):
        await db.open()
    try:
        await syncing.migrate()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as holder:
            async with holder.transaction():
                await holder.execute("SELECT pg_advisory_xact_lock(%s)", (CONFIG_RULES_LOCK_KEY,))
                sync = asyncio.create_task(sync_config(syncing, config))
                await until(lambda: _waiting(holder, 1), "the start never waited for the rules' lock")
                made = asyncio.create_task(KeyStore(first).create_first_keys("default", [FIRST_KEY]))
                await until(lambda: _done_or_waiting(made, holder), "the first keys neither made nor waiting")
            results = await asyncio.wait_for(asyncio.gather(sync, made, return_exceptions=True), 10)
        return [r for r in results if isinstance(r, BaseException)]
    finally:
        for db in (syncing, first):
            await db.close()


FIRST_KEY = NewKey("admin", sha("first-secret"), [Permission.ORGANIZATION_READ])


async def _done_or_waiting(task: asyncio.Task[Any], holder: psycopg.AsyncConnection[Any]) -> bool:
    return task.done() or await _waiting(holder, 2)


def test_a_start_syncing_beside_the_first_keys_being_made_does_not_deadlock(postgres: Postgres) -> None:
    """One start synced relay.yaml in one transaction taking the apps', rules' and keys' locks one
    by one: holding the org ``default`` it had just added, it waited for the keys' lock held by
    another instance's first keys (no orgs in its file), which waited to add that org: PostgreSQL
    failed one of them (a deadlock), and that instance did not start. The start takes the three
    locks before it writes anything: the first keys are made, then the file is synced."""
    config = relay_file("a", org="default")
    assert asyncio.run(first_keys_beside_a_sync(postgres.create_database("first_keys_sync"), config)) == []


async def in_force_after(url: str, *configs: RelayConfig) -> list[tuple[str, str, str]]:
    """What :func:`files_in_force` says after each of ``configs`` is synced in turn, as starts would."""
    db = Database(url)
    await db.open()
    try:
        await db.migrate()
        seen = []
        for config in configs:
            await sync_config(db, config)
            seen.append(await files_in_force(db))
        return seen
    finally:
        await db.close()


def test_a_file_without_orgs_leaves_the_keys_and_rules_an_earlier_file_put_in_and_orgs_empty_removes_them(
    postgres: Postgres,
) -> None:
    """A relay.yaml with no ``orgs`` (written for other settings, or none at all) removed every key
    and alert rule an earlier file (``relay init``'s) had put in the shared database, on every
    instance: the executors' conductor keys too. Left out, the section leaves them as they are (also
    through an override of the database's URL, as RELAY_DATABASE_URL gives); ``orgs: []`` removes them."""
    url = postgres.create_database("config_no_orgs")
    without = parse_config(f"server: {{port: {free_port()}}}\n").with_overrides(database_url=url)
    assert not without.orgs_given and parse_config("orgs: []\n").orgs_given
    after = asyncio.run(in_force_after(url, relay_file("a"), without, RelayConfig(), parse_config("orgs: []\n")))
    # orgs: [] takes the org out of the file: its apps are no longer the file's either (they kept it,
    # and the API refused to delete them).
    assert after == [("a", "a", "a"), ("a", "a", "a"), ("a", "a", "a"), ("", "", "")]
    # So are those of an org a later file no longer lists, beside another it does.
    other = asyncio.run(in_force_after(postgres.create_database("config_org_gone"), relay_file("a"),
                                       relay_file("b", org="globex")))  # fmt: skip
    assert other == [("a", "a", "a"), ("b", "b", "b")]


def test_the_start_says_there_is_no_relay_yaml_when_none_was_given_and_names_a_file_without_orgs(
    postgres: Postgres, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Started with no relay.yaml at all (``./run.sh``), the log said "relay.yaml has no orgs": of a
    file there is not. It says none was given; a file without orgs is named."""
    written = tmp_path / "relay.yaml"
    written.write_text(f"server: {{port: {free_port()}}}\n")
    url = postgres.create_database("config_no_file")
    caplog.set_level(logging.INFO, logger="relay.config")

    async def synced(config: RelayConfig) -> None:
        await sync_config(Database(url), config)  # a file without orgs: nothing to write, the pool unopened

    for config in (load_config(None), load_config(written).with_overrides(database_url=url)):
        asyncio.run(synced(config))
    said = [r.getMessage() for r in caplog.records if r.name == "relay.config"]
    assert said[0].startswith("no relay.yaml was given: the keys and alert rules in the database"), said
    assert said[1].startswith(f"{written} has no orgs: the keys and alert rules in the database"), said
