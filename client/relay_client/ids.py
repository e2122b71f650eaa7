"""Executor ids issued by :func:`new_executor_id`, and which launch each belongs to.

Relay recovers a dead executor's workflows by its id, so an id must name one
process's launch and nothing else: ``local`` (every DBOS process without an
id) or an id typed into a config file would make a peer take the work of live
processes. Only ids drawn here, in this process, are accepted by ``connect()``,
and each belongs to the first DBOS launch that connects with it.
"""

from __future__ import annotations

import os
import threading
import uuid
import weakref

from dbos import DBOS

from relay_client.errors import ConnectRefused

_lock = threading.Lock()
_issued: set[str] = set()
_owners: dict[str, weakref.ref[DBOS]] = {}


def new_executor_id() -> str:
    """A fresh executor id for ``DBOSConfig["executor_id"]``: a random UUID, one per launch."""
    executor_id = str(uuid.uuid4())
    with _lock:
        _issued.add(executor_id)
    return executor_id


def claim(executor_id: object, instance: DBOS) -> str:
    """``executor_id`` as this launch's own, or :class:`ConnectRefused` saying why it cannot be."""
    if not isinstance(executor_id, str) or not executor_id:
        raise ConnectRefused(f"DBOS's executor id is {executor_id!r}: {_HOW}")
    if executor_id == "local":
        raise ConnectRefused(
            "DBOS's executor id is 'local', which every DBOS process without an id shares: "
            f"recovering it would take other processes' workflows. {_HOW}"
        )
    with _lock:
        if executor_id not in _issued:
            raise ConnectRefused(
                f"executor id {executor_id!r} was not issued by relay_client.new_executor_id(). {_HOW}"
            )
        owner = _owners.get(executor_id)
        if owner is not None and owner() is not instance:
            raise ConnectRefused(
                f"executor id {executor_id!r} belongs to an earlier DBOS launch; "
                "draw a new one with relay_client.new_executor_id() for each launch"
            )
        _owners[executor_id] = weakref.ref(instance)
    return executor_id


def _forget_in_child() -> None:
    """A forked process is not the one that drew the ids: it draws its own (gunicorn --preload, a
    multiprocessing pool that forks). Otherwise every worker would connect under its parent's id,
    and Relay would take them for one executor."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    _issued.clear()
    _owners.clear()


os.register_at_fork(after_in_child=_forget_in_child)

_HOW = 'Configure DBOS with DBOS(config={..., "executor_id": relay_client.new_executor_id()}).'
