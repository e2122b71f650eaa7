"""The pure cores: liveness timing and the executor lifecycle. No I/O, no sleep."""

from __future__ import annotations

import pytest

from relay.core.lifecycle import ExecutorEvent, ExecutorState, IllegalTransition, check_transition, states_allowing
from relay.core.liveness import LivenessMonitor


def test_first_ping_after_one_interval() -> None:
    m = LivenessMonitor(ping_interval=20, ping_wait=25, now=100.0)
    d = m.poll(100.0)
    assert (d.send_ping, d.disconnect, d.wake_at) == (False, False, 120.0)
    d = m.poll(120.0)
    assert d.send_ping and not d.disconnect
    assert d.wake_at == 125.0  # the deadline comes before the next ping


def test_pongs_keep_it_alive_forever() -> None:
    m = LivenessMonitor(ping_interval=20, ping_wait=25, now=0.0)
    now = 0.0
    pings = 0
    for _ in range(1000):
        d = m.poll(now)
        assert not d.disconnect
        if d.send_ping:
            pings += 1
            m.heard(now + 0.01)  # the pong
        now = d.wake_at
    assert pings > 100


def test_silence_disconnects_exactly_at_ping_wait_after_last_heard() -> None:
    m = LivenessMonitor(ping_interval=20, ping_wait=25, now=0.0)
    assert m.poll(20.0).send_ping
    m.heard(20.05)
    # The process stops here: no more pongs.
    d = m.poll(40.0)
    assert d.send_ping and not d.disconnect
    assert d.wake_at == pytest.approx(45.05)
    assert not m.poll(45.04).disconnect
    assert m.poll(45.05).disconnect


def test_any_frame_counts_as_heard_and_time_never_goes_back() -> None:
    m = LivenessMonitor(ping_interval=1, ping_wait=3, now=0.0)
    m.heard(2.5)
    m.heard(1.0)  # a late report of an older frame
    assert m.last_heard == 2.5
    for now in (3.0, 4.0, 5.0, 5.4):  # pinging every second, no answer
        assert not m.poll(now).disconnect
    assert m.poll(5.5).disconnect


def test_a_ping_sent_late_gets_the_whole_answer_window() -> None:
    # The instance was too busy to ping at 20: its ping goes out at 26, after the executor's
    # deadline by last heard (25). It has the 5 s an on-time ping gives to answer.
    m = LivenessMonitor(ping_interval=20, ping_wait=25, now=0.0)
    d = m.poll(26.0)
    assert d.send_ping and not d.disconnect
    assert d.wake_at == 31.0
    assert not m.poll(30.99).disconnect
    m.heard(30.5)  # the pong
    assert not m.poll(31.0).disconnect
    assert m.deadline == 55.5


def test_a_late_ping_unanswered_disconnects_at_the_end_of_its_window() -> None:
    m = LivenessMonitor(ping_interval=20, ping_wait=25, now=0.0)
    assert m.poll(26.0).send_ping
    assert not m.poll(30.99).disconnect
    assert m.poll(31.0).disconnect


def test_pings_on_time_never_extend_the_deadline() -> None:
    # Short intervals: each ping's window (ping_wait - ping_interval) reaches past the deadline by
    # last heard, but only the first ping since the executor was last heard counts.
    m = LivenessMonitor(ping_interval=1, ping_wait=3, now=0.0)
    now, pings = 0.0, 0
    while True:
        d = m.poll(now)
        if d.disconnect:
            break
        pings += d.send_ping
        now = d.wake_at
    assert now == 3.0
    assert pings == 2


def test_wake_is_never_in_the_past_when_nothing_is_due() -> None:
    m = LivenessMonitor(ping_interval=0.2, ping_wait=1.0, now=0.0)
    now = 0.0
    while True:
        d = m.poll(now)
        if d.disconnect:
            break
        assert d.wake_at > now
        now = d.wake_at
    assert now == pytest.approx(1.0)


def test_invalid_timings_are_refused() -> None:
    with pytest.raises(ValueError):
        LivenessMonitor(ping_interval=0, ping_wait=1, now=0)


S, E = ExecutorState, ExecutorEvent


@pytest.mark.parametrize(
    ("state", "event", "after"),
    [
        (None, E.CONNECTED, S.HEALTHY),
        (S.HEALTHY, E.LOST, S.DISCONNECTED),
        (S.DISCONNECTED, E.CONNECTED, S.HEALTHY),
        (S.DISCONNECTED, E.GRACE_EXPIRED, S.DEAD),
        (S.DEAD, E.RECOVERY_SENT, S.RECOVERING),
        (S.RECOVERING, E.RECOVERY_FAILED, S.DEAD),
        (S.DEAD, E.CONNECTED, S.HEALTHY),
        (None, E.STRANDED, S.DEAD),  # the reconciler brings a deleted executor's record back
    ],
)
def test_allowed_transitions(state: ExecutorState | None, event: ExecutorEvent, after: ExecutorState) -> None:
    assert check_transition(state, event) is after


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.HEALTHY, E.GRACE_EXPIRED),  # a connected executor is never declared dead
        (S.DISCONNECTED, E.LOST),
        (S.DEAD, E.LOST),
        (S.HEALTHY, E.RECOVERY_SENT),  # recovering a live executor would double-run its work
        (None, E.LOST),
        (S.HEALTHY, E.STRANDED),  # an executor with a record is never the reconciler's
        (S.DISCONNECTED, E.STRANDED),
    ],
)
def test_illegal_transitions(state: ExecutorState | None, event: ExecutorEvent) -> None:
    with pytest.raises(IllegalTransition):
        check_transition(state, event)


def test_guard_states_for_updates() -> None:
    assert states_allowing(E.LOST) == [S.HEALTHY]
    assert states_allowing(E.GRACE_EXPIRED) == [S.DISCONNECTED]
    assert set(states_allowing(E.CONNECTED)) == set(S)
