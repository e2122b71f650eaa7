"""An open executor client for Relay, for applications on DBOS 3.3 and later::

    DBOS(config={..., "executor_id": relay_client.new_executor_id()})
    DBOS.launch()
    relay_client.connect("ws://relay:8080/", key="...")   # app: DBOS's name, "ledger"

It speaks the executor's side of the DBOS Conductor executor protocol as the
open-source SDK's client (dbos 3.2) did, built on DBOS's public API. It never
imports, loads or answers for ``dbos-enterprise``.
"""

from __future__ import annotations

import os
import ssl
from typing import Any
from urllib.parse import urlsplit

from dbos import DBOS

from relay_client import _internals, ids, lifecycle
from relay_client.connection import MAX_FRAME_BYTES, Connection, check_frame_bytes, check_key, check_url
from relay_client.errors import ConnectRefused, RelayClientError
from relay_client.handlers import Handlers, Identity
from relay_client.ids import new_executor_id
from relay_client.retention import Retention
from relay_protocol import ExecutorInfoReply, ProtocolError

__version__ = "0.1.0"

__all__ = ["ConnectRefused", "Connection", "RelayClientError", "connect", "new_executor_id"]


def connect(
    url: str,
    *,
    key: str,
    app: str | None = None,
    metadata: dict[str, Any] | None = None,
    ca_file: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    max_concurrent_requests: int = 4,
    send_queue_size: int = 64,
    max_waiting_requests: int = 64,
    max_frame_bytes: int = MAX_FRAME_BYTES,
) -> Connection:
    """Connect this launched DBOS process to Relay at ``url`` (``ws://`` or ``wss://``) as an executor of ``app``.

    ``app`` is the Relay app the executor joins: DBOS's application name (the
    config's ``name``), which is also the default. Returns at once; a background
    thread connects, answers Relay and reconnects after a loss until
    ``DBOS.destroy()``, the interpreter's exit or :meth:`Connection.stop`.
    ``metadata`` is reported as the executor's metadata. For ``wss://``,
    ``ca_file`` names the CA bundle to trust, or ``ssl_context`` is used as
    given (default: the system's CAs). A frame from Relay over ``max_frame_bytes`` (100 MiB by
    default) is not read: the socket is closed (1009) and the client connects again.

    Raises ValueError for a URL that is not ``ws://`` or ``wss://`` (the console's ``http://`` URL, say)
    or ``metadata`` that JSON cannot carry, before anything else. Raises :class:`ConnectRefused` when
    DBOS is not launched, when ``app`` is not DBOS's application name (a peer of another application
    would answer recoveries from the wrong system database), when its executor id is ``local`` or was
    not drawn from :func:`new_executor_id` (recovery by id would take other processes' work), when a
    conductor key is configured, or when a connection of this process is already running.
    """
    check_url(url)  # before anything is checked, claimed or started
    check_key(key)
    check_frame_bytes(max_frame_bytes)
    _check_metadata(metadata)
    instance = _refuse_unsafe()
    app = _app_of_dbos(app)
    executor_id = ids.claim(DBOS.executor_id, instance)
    if lifecycle.active():
        raise ConnectRefused("relay_client is already connected in this process; stop() that connection first")
    identity = Identity(executor_id=executor_id, application_version=DBOS.application_version, metadata=metadata)
    connection = Connection(
        url, key=key, app=app, ssl_context=_tls(url, ca_file, ssl_context),
        handlers=Handlers(identity),
        max_concurrent_requests=max_concurrent_requests, send_queue_size=send_queue_size,
        max_waiting_requests=max_waiting_requests, max_frame_bytes=max_frame_bytes,
        alive=lambda: _internals.live_instance() is instance,
    )  # fmt: skip
    connection.handlers.retention = Retention(stopping=lambda: connection.draining or not connection.running)
    connection.handlers.shutting_down = lambda: connection.draining or _internals.live_instance() is not instance
    lifecycle.track(connection)
    connection.start()
    return connection


def _refuse_unsafe() -> DBOS:
    """The launched DBOS instance, or :class:`ConnectRefused` if connecting it would be unsafe."""
    instance = _internals.live_instance()
    if instance is None or not _internals.is_launched(instance):
        raise ConnectRefused(
            "DBOS is not launched: call DBOS(config=...) and DBOS.launch() before relay_client.connect()"
        )
    if _internals.conductor_key(instance) is not None:
        raise ConnectRefused(
            "a conductor key is configured: DBOS then replaces the executor id and connects through "
            "dbos-enterprise; relay_client needs neither, so remove conductor_key from the DBOS config"
        )
    if os.environ.get("DBOS__CLOUD") == "true":
        raise ConnectRefused("DBOS__CLOUD=true: DBOS Cloud manages its executors' ids itself")
    return instance


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    """ValueError, naming the key, for metadata the handshake's ``executor_info`` cannot carry (a
    value JSON has no type for, a number that is not finite, more than the protocol's size): every
    handshake would fail the same way, and Relay would never take the executor. Checked by the very
    encoder the handshake uses."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, not {type(metadata).__name__}")
    reply = ExecutorInfoReply(request_id="-", executor_id="-", application_version="-", executor_metadata=metadata)
    try:
        reply.to_json()
    except ProtocolError as exc:  # "executor_info reply: executor_metadata.launched: datetime is not a JSON value"
        raise ValueError(f"metadata cannot be sent to Relay: {str(exc).split(': ', 1)[-1]}") from None


def _app_of_dbos(app: str | None) -> str:
    """The Relay app to join: DBOS's application name. Relay takes an app's executors for peers that
    can recover one another's workflows; an executor of another DBOS application (another system
    database) would answer a recovery by finding nothing to recover, and Relay would take it as done."""
    name = _internals.app_name()
    if not name:
        raise ConnectRefused("DBOS has no application name: give DBOS's config a name, the Relay app to join")
    if app is not None and app != name:
        raise ConnectRefused(
            f"app {app!r} is not this DBOS application's name {name!r}: an executor joins the Relay app of "
            f"its own DBOS application, whose peers share its system database; connect with app={name!r} "
            "or leave app out"
        )
    return name


def _tls(url: str, ca_file: str | None, ssl_context: ssl.SSLContext | None) -> ssl.SSLContext | None:
    if ca_file is not None and ssl_context is not None:
        raise ValueError("give ca_file or ssl_context, not both")
    if urlsplit(url).scheme != "wss":  # urlsplit lowers the scheme: WSS:// is wss://
        if ca_file is not None or ssl_context is not None:
            raise ValueError(f"ca_file and ssl_context are for wss:// URLs, not {url.split(':', 1)[0]}://")
        return None
    if ca_file is not None:
        return ssl.create_default_context(cafile=ca_file)
    return ssl_context
