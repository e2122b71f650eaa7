"""The recovery pipeline's figures: how long each stage took, failovers, blocked recoveries.

Each figure is observed by the store method that first records the stage's
effect (a guarded write that changed a row, an audit entry inserted under a
new dedupe key), once its transaction has committed. A workflow step that
DBOS runs again after a crash finds its change already made and observes
nothing, so no stage is counted twice; a crash between the commit and the
observation loses that one observation. Durations are differences of the
database's own timestamps (the ones the audit log and the executor record
show), so they are the same whichever instance observes them.

The objects are prometheus_client's, registered by :mod:`relay.metrics`
in the instance's registry: each instance reports the stages it performed.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.registry import Collector

# From sub-second test timers to an hour-long wait for an operator.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, float("inf"))


class RecoveryPipeline:
    def __init__(self) -> None:
        def histogram(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, registry=None, buckets=BUCKETS)

        self.disconnect_to_dead = histogram(
            "relay_recovery_disconnect_to_dead_seconds",
            "From an executor's recorded disconnection to its DEAD declaration (the grace period as it ran).",
        )
        self.dead_to_dispatched = histogram(
            "relay_recovery_dead_to_dispatched_seconds",
            "From DEAD to the first recovery request dispatched to a peer for that death.",
        )
        self.dispatched_to_reply = histogram(
            "relay_recovery_dispatched_to_reply_seconds",
            "From a recovery attempt's dispatch to the peer's reply (attempts that got one).",
        )
        self.reply_to_verified = histogram(
            "relay_recovery_reply_to_verified_seconds",
            "From the peer's reply to the verification that nothing of the dead executor is left PENDING.",
        )
        self.dead_to_deleted = histogram(
            "relay_recovery_dead_to_deleted_seconds",
            "From DEAD to the executor's record deleted after a verified recovery.",
        )
        self.failovers = Counter(
            "relay_recovery_failovers",
            "Recovery attempts dispatched to another peer after a failed one, by org and app.",
            ["org", "app"],
            registry=None,
        )
        self.blocked = Counter(
            "relay_recoveries_blocked",
            "Recoveries that began to wait for a peer or an operator, by org, app and reason.",
            ["org", "app", "reason"],
            registry=None,
        )

    def collectors(self) -> list[Collector]:
        return [
            self.disconnect_to_dead,
            self.dead_to_dispatched,
            self.dispatched_to_reply,
            self.reply_to_verified,
            self.dead_to_deleted,
            self.failovers,
            self.blocked,
        ]


def observe(histogram: Histogram, seconds: object) -> None:
    """Observe a duration read from the database (None when a timestamp is missing: a row of an
    earlier release); never a negative one."""
    if seconds is not None:
        histogram.observe(max(0.0, float(seconds)))  # type: ignore[arg-type]
