"""Times as Relay writes them: ISO 8601 in UTC, one fixed width per kind, so that the strings of a
field sort as its times do (clients, the console, the CLI, dbos-mcp, scripts compare the strings).

- Relay's own times (PostgreSQL's ``timestamptz``, the moments Relay notes): six fraction digits,
  ``2026-01-31T12:00:00.000000Z``. Some are read back as cursors and filters (the audit log's
  ``--since``), so they keep the microseconds the database has.
- Times an executor sends as epoch milliseconds: three fraction digits, ``2026-01-31T12:00:00.000Z``,
  as JavaScript's ``toISOString`` writes them.

``datetime.isoformat()`` alone leaves the fraction out when it is zero: a whole second
(``...:27Z``) would sort after ``...:27.080000Z``. The SDK's own form (``+00:00``, for Python 3.10's
``fromisoformat``) is :func:`sdk_time`, and :func:`sdk_ms_time` for epoch milliseconds. The CLI's
times for people (local, to the second) are :func:`local_seconds` and :func:`utc_minutes`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import overload

_EPOCH = datetime(1970, 1, 1)


def utc(value: datetime) -> datetime:
    """``value`` in UTC. A time that UTC takes past the years 1 to 9999 (0001-01-01T00:30+01:00)
    is the first or the last time there is: as a bound of a filter or a window, it leaves out
    nothing that could exist."""
    try:
        return value.astimezone(UTC)
    except (OverflowError, OSError):
        return (datetime.min if value.year == 1 else datetime.max).replace(tzinfo=UTC)


@overload
def us_iso(value: datetime) -> str: ...
@overload
def us_iso(value: None) -> None: ...
@overload
def us_iso(value: datetime | None) -> str | None: ...
def us_iso(value: datetime | None) -> str | None:
    """One of Relay's times (one without a zone is UTC) as ISO 8601 UTC with six fraction digits and
    ``Z``; None for None."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return utc(value).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def ms_iso(value: str | int | None) -> str | None:
    """Epoch milliseconds (a number, or a number in a string) as ISO 8601 UTC; None if absent, not a
    number, or outside the years 1 to 9999. Exact: no trip through a float, which far from 1970 is
    off by microseconds. Always three fraction digits, as JavaScript's ``toISOString`` writes them:
    a whole second is ``.000``, so the strings sort as the times do."""
    if value is None:
        return None
    try:
        return (_EPOCH + timedelta(milliseconds=int(value))).isoformat(timespec="milliseconds") + "Z"
    except (TypeError, ValueError, OverflowError):
        return None


def sdk_time(value: datetime) -> str:
    """A time as the SDK parses it (Python 3.10's ``fromisoformat``: four-digit year, six fraction
    digits, ``+00:00`` rather than ``Z``)."""
    return utc(value).isoformat(timespec="microseconds")


def sdk_ms_time(epoch_ms: int) -> str:
    """Epoch milliseconds as the SDK parses a time: three fraction digits and ``+00:00``
    (``2026-01-31T12:00:00.000+00:00``), the string Relay's app figures and retention checks have
    always sent (once written with ``strftime``, character for character the same)."""
    return (_EPOCH + timedelta(milliseconds=epoch_ms)).isoformat(timespec="milliseconds") + "+00:00"


def local_seconds(value: datetime) -> str:
    """A time for people: in the machine's local zone, to the second (``2026-01-31 13:00:00``)."""
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def utc_minutes(value: datetime) -> str:
    """A time for people, in UTC to the minute (``2026-01-31 12:00 UTC``)."""
    return utc(value).strftime("%Y-%m-%d %H:%M UTC")


def utc_seconds(epoch: float) -> str:
    """A time for people, in UTC to the second (``2026-01-31 12:00:05 UTC``), of seconds since 1970."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
