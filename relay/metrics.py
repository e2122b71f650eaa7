"""``/metrics``: this instance's figures in the Prometheus text format, written by prometheus_client.

One registry per process. Most figures are read from the live objects when
scraped (a custom collector); the registry-wide ones (executors by state,
blocked recoveries) come from one query each, made by :meth:`Metrics.render`
just before the registry is collected. A scrape sees every family through its
key (:class:`ScrapeView`): a series labelled with an org or app only if it is
of the key's org and apps; the instance-wide ones (no such label) always.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from relay.appmetrics import EVERYTHING, AppFiguresCollector, ScrapeView
from relay.core.alerts import Kind
from relay.core.failover import RECOVERIES_AT_ONCE
from relay.errors import DatabaseError
from relay.net.hub import Hub
from relay.net.router import Router
from relay.store.executors import ExecutorStore
from relay.store.lease import Lease

# Alerts delivered, and given up after their last attempt, by this instance (workflows/alerts.py).
ALERTS_SENT = Counter("relay_alerts_sent", "Alerts this instance delivered, by kind.", ["kind"], registry=None)
ALERTS_FAILED = Counter(
    "relay_alerts_failed", "Alerts this instance gave up delivering, by kind.", ["kind"], registry=None
)
for _kind in Kind:  # every kind from 0, so a scraper sees the series before the first alert
    ALERTS_SENT.labels(_kind.value)
    ALERTS_FAILED.labels(_kind.value)


async def _answers() -> bool:
    return True


@dataclass
class _Snapshot:
    by_state: dict[tuple[str, str, str], int] = field(default_factory=dict)
    blocked: dict[tuple[str, str, str], int] = field(default_factory=dict)


class Metrics(Collector):
    def __init__(
        self,
        hub: Hub,
        lease: Lease,
        router: Router,
        executors: ExecutorStore,
        adopted: Callable[[], int],
        reconciled: Mapping[tuple[str, str, str], int] | None = None,
        frames: Mapping[str, int] | None = None,
        grace_starts: Callable[[], tuple[int, int]] = lambda: (0, 0),
        recovery_turns: Callable[[], tuple[int, int]] = lambda: (0, 0),
        database_answers: Callable[[], Awaitable[bool]] = _answers,
        back_from_dead: Callable[[], tuple[int, int]] = lambda: (0, 0),
        recovery_wakeups: Callable[[], int] = lambda: 0,
        retention_rounds: Mapping[tuple[str, str, str], int] | None = None,
    ) -> None:
        self.retention_rounds = retention_rounds if retention_rounds is not None else {}
        self.back_from_dead = back_from_dead
        self.recovery_wakeups = recovery_wakeups
        self.database_answers = database_answers
        self._database_up = True
        self.grace_starts = grace_starts
        self.recovery_turns = recovery_turns
        self.reconciled = reconciled if reconciled is not None else {}
        self.frames = frames if frames is not None else {}
        self.hub = hub
        self.lease = lease
        self.router = router
        self.executors = executors
        self.adopted = adopted
        self._snapshot = _Snapshot()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._app_figures: list[AppFiguresCollector] = []
        # One scrape at a time: the collectors hold what the scrape read and the view (the key's org)
        # it is seen through until it is written, so concurrent scrapes must not interleave.
        self._scraping = asyncio.Lock()
        self.registry.register(ALERTS_SENT)
        self.registry.register(ALERTS_FAILED)

    async def render(self, view: ScrapeView = EVERYTHING, accept: str = "") -> tuple[bytes, str]:
        """The exposition and its content type: OpenMetrics when ``accept`` asks for it (as DBOS
        Conductor's documented scrapes do), else Prometheus text."""
        encoder, content_type = choose_encoder(accept)
        async with self._scraping:
            # Asked first on the probe's own connection, within 1.5 s: while the database is away the
            # pool would have the scrape wait 10 s for a connection, past Prometheus's scrape_timeout,
            # and answer 503; the scraper would see a gap, not why. The instance's own figures are
            # served then, with relay_database_up 0, and those read from the database left out.
            up = await self.database_answers()
            if up:
                try:
                    self._snapshot = _Snapshot(
                        await self.executors.count_by_state(), await self.executors.count_blocked()
                    )
                    for figures in self._app_figures:
                        await figures.refresh(view)
                except DatabaseError:
                    up = False
            if not up:
                self._snapshot = _Snapshot()
                for figures in self._app_figures:
                    figures.clear(view)
            self._database_up = up
            return encoder(_Seen(self.registry, view)), content_type

    def collect(self) -> Iterator[Metric]:
        yield _gauge("relay_connections", "Executor sockets open on this instance.", len(self.hub.connections))
        yield _gauge(
            "relay_pending_handshakes", "Sockets accepted but not yet past executor_info.", self.hub.pending_handshakes
        )
        yield _gauge("relay_lease_held", "Whether this instance holds its lease (1) or not (0).", int(self.lease.held))
        yield _gauge(
            "relay_database_up",
            "Whether Relay's database answered this scrape (1) or not (0: the figures read from it, "
            "relay_executors, relay_executors_blocked and the apps' dbos_conductor_v1_*, are left out).",
            int(self._database_up),
        )
        yield _counter(
            "relay_requests_relayed",
            "Requests this instance sent to its executors for another instance.",
            self.router.relayed,
        )
        yield _counter(
            "relay_instances_adopted", "Instances whose expired lease this instance adopted.", self.adopted()
        )
        yield _labelled(
            CounterMetricFamily("relay_hub_events", "Hub events on this instance, by kind.", labels=["kind"]),
            [((kind,), n) for kind, n in self.hub.counters.items()],
        )
        yield _labelled(
            CounterMetricFamily(
                "relay_executor_events",
                "Lifecycle events the executor store applied on this instance, or lost to a race, by event.",
                labels=["event", "outcome"],
            ),
            self.executors.events.items(),
        )
        writes = self.executors.db.writes
        yield _counter(
            "relay_write_transactions",
            "Transactions of combined fenced writes this instance committed (relay.store.combiner).",
            writes.batches,
        )
        yield _counter("relay_writes_combined", "Fenced writes those transactions carried.", writes.writes)
        transactions, started = self.grace_starts()
        yield _counter(
            "relay_grace_start_transactions",
            "Transactions that started grace periods together on this instance (workflows.gracestart).",
            transactions,
        )
        yield _counter("relay_grace_periods_started", "Grace periods this instance started.", started)
        batches, deaths = self.back_from_dead()
        yield _counter(
            "relay_back_from_dead_batches",
            "Batches of executors back from the dead (reconnected while DEAD or RECOVERING) handled together.",
            batches,
        )
        yield _counter("relay_back_from_dead_executors", "Executors back from the dead those batches handled.", deaths)
        yield _counter(
            "relay_recovery_wakeups",
            "Wake-ups sent to blocked recoveries (a peer connected, settings changed, an operator's nudge).",
            self.recovery_wakeups(),
        )
        held, waiting = self.recovery_turns()
        yield _gauge(
            "relay_recovery_turns_held",
            f"Recoveries at work on this instance: at most {RECOVERIES_AT_ONCE} at once, they take turns.",
            held,
        )
        yield _gauge(
            "relay_recovery_turns_waiting",
            "Recoveries on this instance waiting for a turn, given the earliest death first.",
            waiting,
        )
        yield _counter(
            "relay_recovery_frames", "Recovery frames this instance sent to peers.", self.frames.get("sent", 0)
        )
        yield _counter(
            "relay_recovery_frame_executors",
            "Dead executors those recovery frames named (more than the frames: frames shared by a group).",
            self.frames.get("executors", 0),
        )
        yield _labelled(
            GaugeMetricFamily(
                "relay_executors", "Executors in the registry, by org, app and state.", labels=["org", "app", "state"]
            ),
            self._snapshot.by_state.items(),
        )
        yield _labelled(
            GaugeMetricFamily(
                "relay_executors_blocked",
                "DEAD executors whose recovery waits, by reason.",
                labels=["org", "app", "reason"],
            ),
            self._snapshot.blocked.items(),
        )
        for what, documentation in RECONCILED.items():
            yield _labelled(
                CounterMetricFamily(f"relay_reconcile_{what}", documentation, labels=["org", "app"]),
                [((org, app), n) for (org, app, kind), n in self.reconciled.items() if kind == what],
            )
        yield _labelled(
            CounterMetricFamily(
                "relay_app_retention_rounds",
                "The apps' retention rounds run on this instance, by result: dispatched or skipped.",
                labels=["org", "app", "result"],
            ),
            self.retention_rounds.items(),
        )


# The stranded-workflow reconciler's figures on this instance (workflows/reconcile.py counts them).
RECONCILED = {
    "runs": "Reconciler runs that looked over an app's PENDING workflows on this instance.",
    "executors_found": "Executor ids whose PENDING workflows the reconciler found stranded.",
    "workflows_found": "PENDING workflows the reconciler found stranded.",
    "recoveries_started": "Recoveries the reconciler started for stranded executor ids.",
    "executors_alive": "Executor ids with no record and old PENDING workflows that the reconciler left alone: "
    "a workflow of theirs was created or completed within the grace period.",
}


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _labelled(
    family: GaugeMetricFamily | CounterMetricFamily, samples: Iterable[tuple[tuple[str, ...], float]]
) -> Metric:
    for labels, value in sorted(samples):
        family.add_metric(list(labels), value)
    return family


# -- The recovery pipeline and the apps' figures (README "Metrics") -------------------------------


def add_collectors(metrics: Metrics, collectors: Iterable[Collector]) -> None:
    """Register collectors of figures kept elsewhere (the recovery pipeline's histograms and counters)."""
    for collector in collectors:
        metrics.registry.register(collector)


def add_app_figures(metrics: Metrics, figures: AppFiguresCollector) -> None:
    """Serve the apps' stored figures; they are read from the database before each scrape."""
    metrics.registry.register(figures)
    metrics._app_figures.append(figures)


class _Seen:
    """The registry as one scrape may see it (:class:`ScrapeView`): its families filtered by name, and
    every family's series labelled with an org or app filtered to the key's org and apps (a family
    left with no series is still described: its HELP and TYPE).

    No ``*_created`` series. prometheus_client adds one to each series of its Counter and Histogram
    objects (the alerts' counters, the recovery pipeline's), and the Prometheus text format writes
    them as gauges of their own, one per series: a second series per series, holding when the
    process made it. Relay's other counters have none, nor have Conductor's figures (all gauges),
    and OpenMetrics makes them optional. Left out here, for this registry alone:
    ``prometheus_client.disable_created_metrics()`` and PROMETHEUS_DISABLE_CREATED_SERIES would
    change every registry of the process."""

    def __init__(self, registry: CollectorRegistry, view: ScrapeView) -> None:
        self.registry = registry
        self.view = view

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if not self.view.shows_family(family.name):
                continue
            created = f"{family.name}_created"
            shown = [s for s in family.samples if s.name != created and self.view.shows_labels(s.labels)]
            if len(shown) == len(family.samples):
                yield family
                continue
            seen = Metric(family.name, family.documentation, family.type, family.unit)
            seen.samples = shown
            yield seen
