"""The first start with no configured org: a default org and its first two keys.

With no org in relay.yaml (or no relay.yaml at all) and no key in the
database, nobody could connect an executor or call the API. So the first
start makes the org ``default``, an admin API key and a conductor key
(``websocket.connect``), keeps only their hashes as keys of the tokens API
(source ``generated``), and hands the secrets back once to be printed. Later
starts find the keys and make none; they are listed, created and deleted
through the tokens API like any other (``relay tokens``). An instance starting
at the same moment on the same database waits on the store's lock and finds
the keys the other one made (contract section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.auth import ADMIN, CONDUCTOR, hash_key, new_secret
from relay.config import RelayConfig
from relay.store.keys import KeyStore, NewKey

DEFAULT_ORG = "default"
ADMIN_KEY_NAME = "admin"
CONDUCTOR_KEY_NAME = "conductor"


@dataclass(frozen=True)
class FirstKeys:
    """What the first start found or made. The secrets are set only on the start that made them."""

    org: str
    made: bool
    admin_key: str | None = None
    conductor_key: str | None = None
    kept: tuple[str, ...] = ()  # org/name of the generated keys found, on a later start


async def ensure_first_keys(keys: KeyStore, config: RelayConfig) -> FirstKeys | None:
    """None when relay.yaml configures orgs: then its keys are the way in, and nothing is made."""
    if config.orgs:
        return None
    admin, conductor = new_secret(), new_secret()
    wanted = [
        NewKey(ADMIN_KEY_NAME, hash_key(admin), sorted(ADMIN)),
        NewKey(CONDUCTOR_KEY_NAME, hash_key(conductor), sorted(CONDUCTOR)),
    ]
    if await keys.create_first_keys(DEFAULT_ORG, wanted):
        return FirstKeys(DEFAULT_ORG, True, admin, conductor)
    kept = tuple(f"{record.org}/{record.name}" for record in await keys.generated())
    return FirstKeys(DEFAULT_ORG, False, kept=kept)
