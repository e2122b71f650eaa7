"""The exceptions of relay_client.

The tree::

    Exception
    └── RelayClientError      anything this package raises on purpose
        └── ConnectRefused    connect() will not start: the executor id, the DBOS
                              instance or its configuration would make recovery unsafe
"""

from __future__ import annotations

#: The client logs under DBOS's logger, so its lines appear where the application's DBOS lines do.
LOGGER_NAME = "dbos.relay_client"


class RelayClientError(Exception):
    """Anything relay_client raises on purpose."""


class ConnectRefused(RelayClientError):
    """``connect()`` will not start; the message says why and what to change."""
