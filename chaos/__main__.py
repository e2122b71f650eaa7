"""``python -m chaos run [--profile NAME] [--seed N] [--out DIR] [--client]``, ``python -m chaos replay FILE``
and ``python -m chaos mutants [NAME ...] [--baseline]``.

``--client``: the executors run on dbos 3.4 with relay_client instead of the 3.2
SDK's own conductor client.

Exit codes, so that a CI can tell Relay's failures from the harness's:

- 0: every check held (for mutants: every mutant caught, every baseline passed);
- 1: Relay broke a promise (violations), or a mutant was missed (or a baseline failed);
- 2: bad input, refused before any fleet starts (a recording missing, cut short, not a recording,
  of a newer format or an unknown field, or that cannot be played as written; an unknown mutant;
  a negative seed);
- 3: the harness could not run (PostgreSQL unreachable, a process that did not start, a mutant's
  replay that left no verdict): no verdict on Relay;
- 128 + N: stopped by signal N (SIGTERM, SIGHUP; SIGINT is 130), the fleet stopped first.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from chaos.mutants import run_mutants
from chaos.record import BadRecording, check_seed, read_recording
from chaos.run import HarnessFailed, Interrupted, relay_errors, run
from chaos.schedule import PROFILES, make_schedule

PASSED, VIOLATIONS, BAD_INPUT, HARNESS_FAILED = 0, 1, 2, 3
SHOWN = 50  # violations printed; the record has them all


def _report(result: dict[str, Any]) -> int:
    print(json.dumps(result["figures"], indent=2))
    for exit_ in result["unplanned_instance_exits"]:
        print(f"instance {exit_['instance']} exited outside a fault (code {exit_['exit_code']}); started again")
    errors = relay_errors(Path(result["workdir"]))
    if errors:
        print("Relay logged errors:\n  " + "\n  ".join(errors))
    record = result.get("record", "the run's record")
    violations = result["violations"]
    if violations:
        print(f"FAILED: {len(violations)} violations")
        for violation in violations[:SHOWN]:
            print(f"  - {violation}")
        if len(violations) > SHOWN:
            print(f"  ... {len(violations) - SHOWN} more in {record}")
        print(f"logs (Relay's and the executors'): {result['workdir']}")
        print(f"record: {record}")
        return VIOLATIONS
    print(f"chaos run passed: seed {result['seed']}, profile {result['profile']['name']}, "
          f"{'relay_client on dbos 3.4, ' if result.get('client') else ''}"
          f"{result['duration_secs']} s")  # fmt: skip
    return PASSED


def _stop_on_signals() -> None:
    """SIGTERM and SIGHUP (CI's timeout, a runner's cancel, a closed terminal) become Interrupted,
    raised in the main thread, so that the fleet is stopped and every atexit hook runs. Only the
    first: a second one while stopping is ignored, so that stopping is not cut short."""
    fired: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def _guarded(work: Callable[[], int]) -> int:
    """Runs ``work``, turning a harness failure or a signal into its exit code and a one-line message."""
    try:
        return work()
    except HarnessFailed as exc:
        print(f"chaos: the harness could not run: {exc}; run folder {exc.workdir} "
              f"(traceback in {exc.workdir / 'harness-error.txt'})", file=sys.stderr)  # fmt: skip
        return HARNESS_FAILED
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        where = f"; run folder {exc.workdir}" if isinstance(exc, Interrupted) and exc.workdir else ""
        print(f"chaos: stopped by {signal.Signals(signum).name}, everything it started stopped{where}", file=sys.stderr)
        return 128 + signum


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos")
    sub = parser.add_subparsers(dest="command", required=True)
    run_cmd = sub.add_parser("run", help="a fresh seeded run")
    run_cmd.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    run_cmd.add_argument("--seed", type=int, default=None)
    run_cmd.add_argument("--out", type=Path, default=Path(".chaos"))
    run_cmd.add_argument("--client", action="store_true", help="executors on dbos 3.4 through relay_client")
    replay = sub.add_parser("replay", help="run a recorded schedule again")
    replay.add_argument("file", type=Path)
    replay.add_argument("--out", type=Path, default=Path(".chaos"))
    mutants = sub.add_parser("mutants", help="replay recorded runs with deliberate bugs; each must fail")
    mutants.add_argument("names", nargs="*", help="only these mutants (default: all)")
    mutants.add_argument("--baseline", action="store_true", help="also replay each recording unmutated: it must pass")
    mutants.add_argument("--out", type=Path, default=Path(".chaos/mutants"))
    args = parser.parse_args(argv)
    _stop_on_signals()

    if args.command == "mutants":
        return _guarded(lambda: run_mutants(args.names, args.baseline, args.out))

    try:
        if args.command == "run":
            seed = check_seed(args.seed if args.seed is not None else random.randrange(1_000_000))
            profile, client = PROFILES[args.profile], args.client
            schedule = make_schedule(seed, profile)
        else:
            recording = read_recording(args.file)
            seed, profile, schedule, client = recording.seed, recording.profile, recording.schedule, recording.client
    except (BadRecording, ValueError) as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return BAD_INPUT
    executors = "dbos 3.4 with relay_client" if client else "dbos 3.2"
    print(f"chaos {args.command}: seed {seed}, profile {profile.name}, {len(schedule)} faults, {executors}", flush=True)
    replaying = args.command == "replay"
    return _guarded(lambda: _report(run(profile, seed, schedule, args.out, client, replay=replaying)))


if __name__ == "__main__":
    sys.exit(main())
