"""``python -m chaos run [--profile NAME] [--seed N] [--out DIR] [--client]``, ``python -m chaos replay FILE``
and ``python -m chaos mutants [NAME ...] [--baseline]``.

``--client``: the executors run on dbos 3.4 with relay_client instead of the 3.2
SDK's own conductor client. Exit 0 only if every check holds (for mutants: every mutant caught,
every baseline passed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from chaos.mutants import run_mutants
from chaos.run import relay_errors, run
from chaos.schedule import PROFILES, Fault, Profile, make_schedule


def _report(result: dict[str, Any]) -> int:
    print(json.dumps(result["figures"], indent=2))
    for exit_ in result["unplanned_instance_exits"]:
        print(f"instance {exit_['instance']} exited outside a fault (code {exit_['exit_code']}); started again")
    errors = relay_errors(Path(result["workdir"]))
    if errors:
        print("Relay logged errors:\n  " + "\n  ".join(errors))
    if result["violations"]:
        print(f"FAILED: {len(result['violations'])} violations")
        for violation in result["violations"][:50]:
            print(f"  - {violation}")
        return 1
    print(f"chaos run passed: seed {result['seed']}, profile {result['profile']['name']}, "
          f"{'relay_client on dbos 3.4, ' if result.get('client') else ''}"
          f"{result['duration_secs']} s")  # fmt: skip
    return 0


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

    if args.command == "mutants":
        return run_mutants(args.names, args.baseline, args.out)

    if args.command == "run":
        seed = args.seed if args.seed is not None else random.randrange(1_000_000)
        profile = PROFILES[args.profile]
        schedule = make_schedule(seed, profile)
        client = args.client
    else:
        recorded = json.loads(args.file.read_text())
        seed, profile = recorded["seed"], Profile.from_json(recorded["profile"])
        schedule = [Fault(**f) for f in recorded["schedule"]]
        client = bool(recorded.get("client", False))
    executors = "dbos 3.4 with relay_client" if client else "dbos 3.2"
    print(f"chaos {args.command}: seed {seed}, profile {profile.name}, {len(schedule)} faults, {executors}", flush=True)
    return _report(run(profile, seed, schedule, args.out, client))


if __name__ == "__main__":
    sys.exit(main())
