"""relay.yaml into the shared database, whole: its apps, alert rules and keys in one transaction.

Each instance syncs its relay.yaml at start. Synced in three transactions, two instances started
at once with different files could interleave them (one's apps, then the other's apps, rules and
keys, then the first's rules and keys) and leave one file's apps with the other file's rules and
keys. In one transaction the last start wins whole, and no other instance ever reads a mix.

The three stores' advisory locks are taken in the order the syncs run (apps, rules, keys) and held
to the commit: the apps' lock, taken first, makes whole syncs take turns. No deadlock comes of
holding them together. Every other user of one of them takes it alone, holding nothing else
(:meth:`relay.store.keys.KeyStore.create_first_keys`; an instance of the previous release, which
syncs in three transactions, during a rolling upgrade); an app's deletion locks the app's row, then
its rules by id, as this does (an app relay.yaml lists cannot be deleted); the API's writes of
rules and keys lock only those rows. One transaction, rather than one lock over three: a start cut
short (the process killed, the database lost) leaves the previous sync whole too, and each store's
sync stays as it was, given the caller's connection.
"""

from __future__ import annotations

from relay.config import RelayConfig
from relay.store.alerts import AlertStore
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.keys import KeyStore


async def sync_config(db: Database, config: RelayConfig) -> None:
    """Make the orgs, apps, relay.yaml's alert rules and its keys in the database match ``config``."""
    async with db.transaction() as conn:
        await AppStore(db).sync_config(config, conn)
        await AlertStore(db).sync_config(config, conn)  # after the apps: a rule's app must be there
        await KeyStore(db).sync_config(config, conn)
