"""A small run of each of issue 15's benchmarks, so that their code keeps working.

Each runs as an operator runs it (``python -m bench.X``), against real Relay processes and
the session's PostgreSQL, with tens of executors. The figures are not judged against the
targets (two loaded cores decide those); what is checked is that each run finishes and
reports every figure, and the outcomes that do not depend on speed: every victim
recovered and deleted, every executor of a killed instance back, nothing declared DEAD
that had not failed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.postgres import Postgres

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def run_bench(postgres: Postgres, module: str, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "RELAY_TEST_DATABASE_URL": postgres.admin_url}
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{module} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def line(output: str, pattern: str) -> re.Match[str]:
    match = re.search(pattern, output, re.MULTILINE)
    assert match is not None, f"no line matching {pattern!r} in:\n{output}"
    return match


def test_failover_mass_failure_small(postgres: Postgres) -> None:
    out = run_bench(postgres, "bench.failover", "--kill9", "0", "--sigstop", "0", "--warmup", "0", "--mass", "40",
                    "--settle", "0.5", "--mass-instances", "2")  # fmt: skip
    line(out, r"^machine: \d+ CPUs")
    line(out, rf"^every victim recovered and deleted {NUMBER} s after the abort .*, -?{NUMBER} s beyond")
    for milestone in ("DEAD", "recovery reply \\(survivor sent\\)", "recovered \\(recovery.succeeded\\)"):
        line(out, rf"^  {milestone} +20 ")
    line(out, r"^recovery frames received by the 20 survivors: \d+, covering 20 of 20 victims")
    line(out, r"^survivors still HEALTHY afterwards: 20/20$")
    # Both instances held some of the victims and report their CPU.
    line(out, r"^  phase +secs +relay-1 +relay-2 +client +machine$")
    for phase in (
        "before the abort \\(the settle\\)",
        "the grace \\(abort to its end\\)",
        "after it \\(to the last gone\\)",
    ):
        line(out, rf"^  {phase} +{NUMBER}( +{NUMBER}){{4}}$")
    after = line(out, rf"^  after it \(to the last gone\) +{NUMBER} +({NUMBER}) +({NUMBER}) +{NUMBER} +{NUMBER}$")
    assert float(after.group(1)) > 0 and float(after.group(2)) > 0, after.group(0)  # each instance's own CPU
    victims = rf"relay-1 ({NUMBER}) ms, -?{NUMBER} net \(\d+\), relay-2 ({NUMBER}) ms, -?{NUMBER} net \(\d+\)"
    held = line(out, rf"^  instance CPU per victim it held, abort to the last gone \(net: .*\): {victims}$")
    assert float(held.group(1)) > 0 and float(held.group(2)) > 0, held.group(0)


def test_durable_small(postgres: Postgres) -> None:
    out = run_bench(postgres, "bench.durable", "--workflows", "20", "--concurrency", "5", "--stats-wait", "0")
    line(out, r"^20 workflows of 3 steps, 5 at a time; per workflow:$")
    cpu: dict[str, float] = {}
    for variant in ("dbos", "dbos-1", "bare"):
        row = line(out, rf"^{variant} +({NUMBER}) +({NUMBER})( +{NUMBER}){{3}} +({NUMBER}) +{NUMBER}$")
        assert float(row.group(1)) > 0 and float(row.group(2)) > 0, row.group(0)
        # Each workflow is at least its row's insert and update and a check and a record per step
        # (a count taken too early can only add the warm-up round's).
        assert float(row.group(4)) >= 2 + 2 * 3, row.group(0)
        cpu[variant] = float(row.group(2))
    ratio = float(line(out, rf"^DBOS's CPU per workflow is ({NUMBER})x the bare transactions'").group(1))
    assert ratio == pytest.approx(cpu["dbos"] / cpu["bare"], rel=0.05, abs=0.1), (ratio, cpu)


def test_connections_small(postgres: Postgres) -> None:
    # A settle of 0.2 s, not 2: forty sockets' memory is not what is checked here, the figures' being printed is.
    out = run_bench(postgres, "bench.connections", "--sizes", "40", "--idle-secs", "0.5", "--rounds", "2",
                    "--settle-secs", "0.2")  # fmt: skip
    header = line(out, r"^server +conns +failed +handshakes/s +KiB/conn +idle CPU %$")
    rows = re.findall(rf"^(relay|bare) +40 +0 +({NUMBER}) +(-?{NUMBER}) +({NUMBER})", out, re.M)
    assert sorted(r[0] for r in rows) == ["bare", "bare", "relay", "relay"], f"after {header.group(0)!r}:\n{out}"
    assert all(float(r[1]) > 0 for r in rows), out
    rates = {server: [float(r[1]) for r in rows if r[0] == server] for server in ("relay", "bare")}
    pairs = sorted((relay / bare, relay, bare) for relay, bare in zip(rates["relay"], rates["bare"], strict=True))
    ratios = [r for r, _, _ in pairs]
    # The table prints whole handshakes a second, so a ratio taken from it is off by up to half a
    # handshake in each rate (a fresh CI run: 2.94 printed against 2.932 from rates near 100/s),
    # plus the printed ratio's own rounding.
    slacks = [r * (0.5 / relay + 0.5 / bare) + 0.006 for r, relay, bare in pairs]
    ratio = line(out, rf"^ratios at 40: relay/bare handshake rate ({NUMBER}) \(median of 2 rounds, ({NUMBER}) to"
                      rf" ({NUMBER}); target >= 0.8\), memory -?{NUMBER}")  # fmt: skip
    for printed, expected, allowed in zip((float(ratio.group(i)) for i in (2, 3)), ratios, slacks, strict=True):
        assert printed == pytest.approx(expected, abs=allowed), (ratios, ratio.group(0))
    assert float(ratio.group(1)) == pytest.approx(sum(ratios) / 2, abs=sum(slacks) / 2), (ratios, ratio.group(0))
    # CPU times come in clock ticks (10 ms): over 40 handshakes a tick is 0.25 ms of each figure, and
    # the medians are taken figure by figure. The processes' sum may pass the machine's by a tick of
    # each of the three (a fresh CI run had 0.63 + 0.38 against 0.75), not by more.
    slack = 3 * (1000 / os.sysconf("SC_CLK_TCK")) / 40
    for server in ("relay", "bare"):
        cpu = line(out, rf"^  CPU ms per handshake, {server}: server ({NUMBER}), client ({NUMBER}),"
                        rf" whole machine ({NUMBER}) \(medians\)$")  # fmt: skip
        server_ms, client_ms, machine_ms = (float(cpu.group(i)) for i in (1, 2, 3))
        assert 0 < server_ms and 0 < client_ms and server_ms + client_ms <= machine_ms * 1.2 + slack, cpu.group(0)
    line(out, r"^  \d+ open, 0 failed; all held after")
    line(out, rf"^  closes absorbed .*: registry up to date {NUMBER} s, grace periods started {NUMBER} s,"
              rf" their durable timers recorded {NUMBER} s$")  # fmt: skip


@pytest.mark.parametrize("balancer", ["python", "haproxy"])
def test_fleet_small(postgres: Postgres, balancer: str) -> None:
    out = run_bench(postgres, "bench.fleet", "--executors", "60", "--idle-secs", "1", "--mass-grace", "1",
                    "--recovery-timeout", "30", "--balancer", balancer)  # fmt: skip
    kind = "haproxy" if balancer == "haproxy" else "balancer"
    line(out, rf"^open file limit \d+; 60 executors, 3 instances, 1 {kind} process\(es\) on one port$")
    line(out, rf"^all 60 HEALTHY in the registry after {NUMBER} s: \d+ handshakes/s")
    holds = [int(m.group(1)) for m in re.finditer(r"^  relay-\d: holds (\d+); RSS", out, re.M)]
    assert sorted(holds) == [20, 20, 20], out  # the balancer's round robin
    line(out, rf"^idle, every connection held, pings every 20 s: CPU over {NUMBER} s .*client {NUMBER}")
    line(out, r"^== instance loss: kill -9 relay-3, which holds 20 executors")
    line(out, rf"^all 20 HEALTHY on the other instances {NUMBER} s after the kill")
    line(out, rf"^  by the registry's own clock, the last of them was written HEALTHY {NUMBER} s after the kill;")
    line(out, r"^  API requests through the balancer every 100 ms: \d+ sent, \d+ failed")
    line(out, r"^== mass failure: 12 of 60 executors killed at once")
    line(out, rf"^the registry held none of them {NUMBER} s after the abort")
    for milestone in ("DEAD", "recovered \\(recovery.succeeded\\)", "record deleted"):
        line(out, rf"^  {milestone} +12 ")
    line(out, r"^  recovery frames: \d+ to \d+ of 48 survivors, covering 12 of 12 victims")
    line(out, r"^executors declared DEAD that had not failed, over the whole run: 0 ")


def test_storm_small(postgres: Postgres) -> None:
    out = run_bench(postgres, "bench.storm", "--executors", "20", "--wait", "60")
    line(out, r"^machine: \d+ CPUs")
    line(out, rf"^20 executors DEAD, each recovery waiting for a peer, {NUMBER} s after the loss")
    line(out, rf"^every recovery record ended: {NUMBER} s; Relay CPU {NUMBER} s")
