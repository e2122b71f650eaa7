"""The liveness core: when to ping an executor and when to give up on it.

Free of I/O and of the clock: every method takes ``now`` (seconds on any
monotonic clock). The hub owns the socket and the clock and calls in; the
tests drive it with plain numbers.

The rule (contract section 4): Relay pings every ``ping_interval`` seconds, and
an executor from which nothing (no pong, no frame) has arrived for
``ping_wait`` seconds is disconnected.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LivenessDecision:
    """What the I/O layer should do now, and when to ask again."""

    send_ping: bool
    disconnect: bool
    wake_at: float


class LivenessMonitor:
    """Tracks one connection."""

    def __init__(self, ping_interval: float, ping_wait: float, now: float) -> None:
        if ping_interval <= 0 or ping_wait <= 0:
            raise ValueError("ping_interval and ping_wait must be positive")
        self.ping_interval = ping_interval
        self.ping_wait = ping_wait
        self.last_heard = now
        self.next_ping_at = now + ping_interval

    def heard(self, now: float) -> None:
        """Something (a pong or any frame) arrived from the executor."""
        if now > self.last_heard:
            self.last_heard = now

    @property
    def deadline(self) -> float:
        return self.last_heard + self.ping_wait

    def poll(self, now: float) -> LivenessDecision:
        if now >= self.deadline:
            return LivenessDecision(send_ping=False, disconnect=True, wake_at=now)
        send_ping = now >= self.next_ping_at
        if send_ping:
            self.next_ping_at = now + self.ping_interval
        return LivenessDecision(
            send_ping=send_ping,
            disconnect=False,
            wake_at=min(self.next_ping_at, self.deadline),
        )
