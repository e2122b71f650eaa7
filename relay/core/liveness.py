"""The liveness core: when to ping an executor and when to give up on it.

Free of I/O and of the clock: every method takes ``now`` (seconds on any
monotonic clock). The hub owns the socket and the clock and calls in; the
tests drive it with plain numbers.

The rule (contract section 4): Relay pings every ``ping_interval`` seconds, and
an executor from which nothing (no pong, no frame) has arrived for
``ping_wait`` seconds is disconnected.

A ping that goes out late (an instance so busy that the connection's turn came
after its ping was due, as under a group failure of thousands) does not count
against the executor: it is given ``ping_wait - ping_interval`` seconds from the
first ping sent since it was last heard, the answer window an on-time ping gets.
With pings on time this changes nothing; later pings never extend the window.
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
        self.pinged_at: float | None = None  # the first ping sent since last heard

    def heard(self, now: float) -> None:
        """Something (a pong or any frame) arrived from the executor."""
        if now > self.last_heard:
            self.last_heard = now
            if self.pinged_at is not None and self.pinged_at <= now:
                self.pinged_at = None

    @property
    def deadline(self) -> float:
        deadline = self.last_heard + self.ping_wait
        if self.pinged_at is not None:
            deadline = max(deadline, self.pinged_at + self.ping_wait - self.ping_interval)
        return deadline

    def poll(self, now: float) -> LivenessDecision:
        send_ping = now >= self.next_ping_at
        if send_ping:
            self.next_ping_at = now + self.ping_interval
            if self.pinged_at is None:
                self.pinged_at = now
        if now >= self.deadline:
            return LivenessDecision(send_ping=False, disconnect=True, wake_at=now)
        return LivenessDecision(
            send_ping=send_ping,
            disconnect=False,
            wake_at=min(self.next_ping_at, self.deadline),
        )
