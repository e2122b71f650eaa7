"""The few DBOS members the client needs that are not public API, in one place.

Each is present, with the same meaning, in dbos 3.3 and 3.4 (the handler tests
run against both):

- ``DBOS._recover_pending_workflows(executor_ids)``: the entry point the 3.2
  SDK's own client called for ``recovery``. It re-enqueues the PENDING
  workflows of those executors at this process's application version, so a
  second call is a no-op;
- ``dbos._dbos._dbos_global_instance``: the live DBOS object, to tell whether
  it was launched or destroyed and whether a conductor key was given to it;
- its ``_alert_handler``: where ``@DBOS.alert_handler`` stores the function
  (only dbos-enterprise reads it in 3.3 and later);
- ``dbos._utils.GlobalParams.app_name``: the application's name, which has no
  public accessor.

Nothing here touches ``dbos._enterprise`` or what it guards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import dbos._dbos as _dbos_module
from dbos import DBOS
from dbos._utils import GlobalParams

AlertHandler = Callable[[str, str, dict[str, str]], None]


def live_instance() -> DBOS | None:
    """The DBOS object of this process, or None before ``DBOS(...)`` and after ``DBOS.destroy()``."""
    instance = getattr(_dbos_module, "_dbos_global_instance", None)
    return instance if isinstance(instance, DBOS) else None


def is_launched(instance: DBOS) -> bool:
    return bool(getattr(instance, "_launched", False))


def conductor_key(instance: DBOS) -> str | None:
    key = getattr(instance, "conductor_key", None)
    return key if isinstance(key, str) else None


def alert_handler(instance: DBOS) -> AlertHandler | None:
    handler = getattr(instance, "_alert_handler", None)
    return cast(AlertHandler, handler) if callable(handler) else None


def app_name() -> str:
    return GlobalParams.app_name or ""


def recover_pending_workflows(executor_ids: list[str]) -> int:
    """Re-enqueue the PENDING workflows of ``executor_ids`` (this version's); how many."""
    return len(DBOS._recover_pending_workflows(executor_ids))
