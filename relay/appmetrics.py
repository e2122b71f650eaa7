"""The apps' figures on ``/metrics``: DBOS Conductor's ``dbos_conductor_v1_*`` gauges.

The workflow figures are computed once per window by one instance
(:mod:`workflows.appfigures`) and stored; every instance reads the latest
ones just before a scrape, so a scraper may read any instance and gets the
same values. ``executor_count`` is read from the registry at the scrape.
Figures older than three windows (the job has not run since: no executor
answered, or no instance is up to run it) are not served.

What a scrape shows is narrowed by a :class:`ScrapeView`: the key's org (and
apps) for these families and for every series of Relay's own labelled with an
org or app, as Conductor's endpoint shows a key's org, and Conductor's query
filters (``applications``, ``workflow_names``, ``metrics``); ``scope`` picks
Relay's own families (``instance``), the apps' (``apps``) or both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from relay.core.appfigures import FAMILIES, PREFIX, Series, executor_counts
from relay.store.appfigures import AppFiguresStore, StoredFigures

SCOPES = ("all", "instance", "apps")


@dataclass(frozen=True)
class ScrapeView:
    """What one scrape may and wants to see (``None``: no restriction)."""

    orgs: frozenset[str] | None = None  # the key's org; None with publicMetrics
    apps: frozenset[str] | None = None  # a key limited to apps
    applications: frozenset[str] | None = None  # ?applications=
    workflow_names: frozenset[str] | None = None  # ?workflow_names=
    metrics: frozenset[str] | None = None  # ?metrics= (family names)
    scope: str = "all"

    def shows_family(self, name: str) -> bool:
        if self.metrics is not None and name not in self.metrics and f"{name}_total" not in self.metrics:
            return False
        apps = name.startswith(PREFIX)
        return self.scope == "all" or (self.scope == "apps") == apps

    def shows_app(self, org: str, app: str) -> bool:
        return (
            (self.orgs is None or org in self.orgs)
            and (self.apps is None or app in self.apps)
            and (self.applications is None or app in self.applications)
        )

    def shows_labels(self, labels: Mapping[str, str]) -> bool:
        """Whether a series with these labels may be seen: one naming an org or an app (``app``, or
        Conductor's ``application``) only if it is of the key's org and apps (and of the
        ``applications`` asked for); one naming an app but not its org only without a key's limits."""
        org = labels.get("org")
        app = labels.get("app", labels.get("application"))
        if org is None and app is None:
            return True  # an instance-wide figure
        if org is None or app is None:
            return self.orgs is None and self.apps is None and self.applications is None
        return self.shows_app(org, app)

    def shows_series(self, series: Series) -> bool:
        name = series.labels.get("workflow_name")
        return self.workflow_names is None or name is None or name in self.workflow_names


EVERYTHING = ScrapeView()


class AppFiguresCollector(Collector):
    def __init__(self, store: AppFiguresStore, window_secs: float) -> None:
        self.store = store
        self.window_secs = window_secs
        self._figures: list[StoredFigures] = []
        self._executors: list[tuple[str, str, Series]] = []
        self.view = EVERYTHING

    async def refresh(self, view: ScrapeView) -> None:
        """Read the stored figures and the registry's executors, for a scrape seen through ``view``."""
        self.view = view
        wanted = [PREFIX + f for f in FAMILIES]
        if not any(view.shows_family(name) for name in wanted):
            self._figures, self._executors = [], []
            return
        # A window's figures are written a little after it ends: three windows is stale.
        self._figures = await self.store.latest(fresh_secs=3 * self.window_secs + 5)
        self._executors = executor_counts(await self.store.executor_versions())

    def clear(self, view: ScrapeView) -> None:
        """Nothing to show to a scrape seen through ``view``: the database did not answer it."""
        self.view = view
        self._figures, self._executors = [], []

    def collect(self) -> Iterator[Metric]:
        view = self.view
        families: dict[str, GaugeMetricFamily] = {}
        for family, (labels, _, documentation) in FAMILIES.items():
            if view.shows_family(PREFIX + family):
                families[family] = GaugeMetricFamily(
                    PREFIX + family, documentation, labels=["org", "application", *labels]
                )
        for stored in self._figures:
            if not view.shows_app(stored.org, stored.app):
                continue
            stamp = stored.window_start.timestamp()
            for s in stored.series:
                self._add(families, stored.org, stored.app, s, stamp if s.windowed else None)
        for org, app, s in self._executors:
            if view.shows_app(org, app):
                self._add(families, org, app, s, None)
        yield from families.values()

    def _add(self, families: dict[str, GaugeMetricFamily], org: str, app: str, s: Series, stamp: float | None) -> None:
        family = families.get(s.family)
        if family is None or not self.view.shows_series(s):
            return
        names = FAMILIES[s.family][0]
        family.add_metric([org, app, *(s.labels.get(n, "") for n in names)], s.value, timestamp=stamp)
