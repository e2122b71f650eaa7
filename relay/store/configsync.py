"""relay.yaml into the shared database, whole: its apps, alert rules and keys in one transaction.

Each instance syncs its relay.yaml at start. Synced in three transactions, two instances started
at once with different files could interleave them (one's apps, then the other's apps, rules and
keys, then the first's rules and keys) and leave one file's apps with the other file's rules and
keys. In one transaction the last start wins whole, and no other instance ever reads a mix.

The three stores' advisory locks are taken in the order the syncs run (apps, rules, keys), all
three before anything is written, and held to the commit: the apps' lock, taken first, makes whole
syncs take turns. Every other user of one of them takes it alone, holding nothing else (an instance
of the previous release, which syncs in three transactions, during a rolling upgrade), but may then
wait for a row a sync writes: :meth:`relay.store.keys.KeyStore.create_first_keys` adds org
``default``. Taken as each store's sync began, the keys' lock was asked for while holding the org
the apps' sync had just added, which the first keys, holding that lock, waited for: PostgreSQL
failed one of them (a deadlock), and that instance did not start. An app's deletion locks the app's
row, then its rules by id, as this does (an app relay.yaml lists cannot be deleted); the API's
writes of rules and keys lock only those rows. One transaction, rather than one lock over three: a
start cut short (the process killed, the database lost) leaves the previous sync whole too, and
each store's sync stays as it was, given the caller's connection.
"""

from __future__ import annotations

import logging

from relay.config import RelayConfig
from relay.store.alerts import CONFIG_RULES_LOCK_KEY, AlertStore
from relay.store.apps import APPS_LOCK_KEY, AppStore
from relay.store.db import Database
from relay.store.keys import KEYS_LOCK_KEY, KeyStore

log = logging.getLogger("relay.config")


async def sync_config(db: Database, config: RelayConfig) -> None:
    """Make the orgs, apps, relay.yaml's alert rules and its keys in the database match ``config``.

    A file without ``orgs`` (or none at all: the first start's way) leaves them as they are. Synced,
    it removed every key and rule an earlier file had put there, on every instance, the executors'
    conductor keys among them: a relay.yaml written for other settings, or an instance started
    without its file, closed the fleet's sockets. ``orgs: []`` says "none", and removes them.
    """
    if not config.orgs_given:
        log.info(
            "%s: the keys and alert rules in the database (if an earlier relay.yaml put any in) are left as they are",
            "no relay.yaml was given" if config.file is None else f"{config.file} has no orgs",
        )
        return
    async with db.transaction() as conn:
        for lock in (APPS_LOCK_KEY, CONFIG_RULES_LOCK_KEY, KEYS_LOCK_KEY):  # each store's sync takes its own again
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock,))
        await AppStore(db).sync_config(config, conn)
        await AlertStore(db).sync_config(config, conn)  # after the apps: a rule's app must be there
        await KeyStore(db).sync_config(config, conn)
