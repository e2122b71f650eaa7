"""Times as DBOS's listing filters read them: ISO 8601 in, epoch milliseconds compared."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def iso_ms(ms: int) -> str:
    """Epoch millisecond ``ms`` as an ISO 8601 time that DBOS reads back as exactly ``ms``.

    DBOS computes ``int(datetime.fromisoformat(s).timestamp() * 1000)``, whose float
    error can land just below a whole millisecond; half a millisecond more keeps it on ``ms``.
    """
    return (_EPOCH + timedelta(milliseconds=ms, microseconds=500)).isoformat()


def epoch_ms(iso: str) -> int:
    """An ISO 8601 time as epoch milliseconds, as DBOS reads a filter time."""
    return int(datetime.fromisoformat(iso).timestamp() * 1000)
