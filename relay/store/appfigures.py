"""The apps' workflow figures: written once per window by whichever instance computed them,
read by every instance for ``/metrics`` and for ``GET .../apps/{app}/metrics``.

``app_figures`` keeps each app's latest window (its series as JSON);
``app_metric_counts`` keeps the per-window counts of Conductor's ``Metric``
(pruned by Relay's retention after ``retention.appMetricsDays``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from relay.core.appfigures import Series, Window
from relay.store.db import Database

# The metric type and name of Relay's own count in GET .../metrics: recovery requests sent to
# the app's executors (Conductor's recovery_count, which it reports itself).
RECOVERY_COUNT = ("recovery_count", "recovery")


@dataclass(frozen=True)
class StoredFigures:
    org: str
    app: str
    window_start: datetime
    series: list[Series]


class AppFiguresStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def apps_with_healthy_executors(self) -> list[tuple[str, str]]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT DISTINCT org, app FROM executors WHERE state = 'HEALTHY' ORDER BY org, app"
            )
            return [(str(r["org"]), str(r["app"])) for r in await cur.fetchall()]

    async def save(
        self, org: str, app: str, window: Window, series: list[Series], counts: list[tuple[str, str, int]]
    ) -> None:
        """An app's figures for ``window``; an older window never replaces a newer one."""
        start = window.start_ms / 1000
        async with self.db.fenced() as conn:
            await conn.execute(
                """INSERT INTO app_figures (org, app, window_start, window_secs, series)
                   VALUES (%s, %s, to_timestamp(%s), %s, %s)
                   ON CONFLICT (org, app) DO UPDATE SET window_start = EXCLUDED.window_start,
                       window_secs = EXCLUDED.window_secs, series = EXCLUDED.series, computed_at = now()
                   WHERE app_figures.window_start <= EXCLUDED.window_start""",
                (org, app, start, window.secs, Jsonb([asdict(s) for s in series])),
            )
            if counts:
                await conn.execute(
                    """INSERT INTO app_metric_counts (org, app, time_bucket, granularity, metric_type, metric_name,
                                                      value)
                       SELECT %s, %s, to_timestamp(%s), %s, t, n, v
                       FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS c(t, n, v)
                       ON CONFLICT (org, app, time_bucket, metric_type, metric_name)
                       DO UPDATE SET value = EXCLUDED.value""",
                    (org, app, start, granularity(window.secs),
                     [c[0] for c in counts], [c[1] for c in counts], [c[2] for c in counts]),
                )  # fmt: skip

    async def latest(self, fresh_secs: float) -> list[StoredFigures]:
        """Every app's latest figures, if computed within the last ``fresh_secs``."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT org, app, window_start, series FROM app_figures
                   WHERE computed_at > now() - make_interval(secs => %s) ORDER BY org, app""",
                (fresh_secs,),
            )
            rows = await cur.fetchall()
        return [StoredFigures(r["org"], r["app"], r["window_start"], [Series(**s) for s in r["series"]]) for r in rows]

    async def executor_versions(self) -> list[tuple[str, str, str, str, int]]:
        """``(org, app, state, application version, executors)`` of the registry."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT org, app, state, application_version, count(*) AS n FROM executors
                   GROUP BY org, app, state, application_version"""
            )
            return [
                (r["org"], r["app"], r["state"], r["application_version"], int(r["n"])) for r in await cur.fetchall()
            ]

    async def metric_counts(
        self, org: str, app: str, start: datetime, end: datetime, granularity_secs: int, limit: int, offset: int
    ) -> list[dict[str, Any]]:
        """Conductor's ``Metric`` rows of ``[start, end)``: the stored workflow and step counts, and
        the recovery requests sent to the app's executors per bucket of ``granularity_secs``."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT time_bucket, granularity, metric_type, metric_name, value FROM app_metric_counts
                   WHERE org = %(org)s AND app = %(app)s AND time_bucket >= %(start)s AND time_bucket < %(end)s
                   UNION ALL
                   SELECT to_timestamp(floor(extract(epoch FROM coalesce(a.dispatched_at, a.at)) / %(g)s) * %(g)s),
                          %(g)s, %(type)s, %(name)s, count(*)
                   FROM recovery_attempts a JOIN recoveries r ON r.id = a.recovery_id
                   WHERE r.org = %(org)s AND r.app = %(app)s
                     AND coalesce(a.dispatched_at, a.at) >= %(start)s AND coalesce(a.dispatched_at, a.at) < %(end)s
                   GROUP BY 1
                   ORDER BY 1, 3, 4 LIMIT %(limit)s OFFSET %(offset)s""",
                {"org": org, "app": app, "start": start, "end": end, "g": granularity_secs,
                 "type": RECOVERY_COUNT[0], "name": RECOVERY_COUNT[1], "limit": limit, "offset": offset},
            )  # fmt: skip
            return list(await cur.fetchall())


def granularity(window_secs: float) -> int:
    """The ``granularity`` of Conductor's ``Metric``: the window in whole seconds."""
    return max(1, round(window_secs))
