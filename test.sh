#!/usr/bin/env bash
# Installs Relay with its test tools into .venv, then runs the linters, the
# type checker and the whole test suite (real PostgreSQL, real DBOS executors).
# Set RELAY_TEST_DATABASE_URL to use your own PostgreSQL instead of an embedded one, and PYTHON
# to make .venv with an interpreter other than python3 (3.11 or later).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || version=
case "$version" in
  3.1[1-9] | 3.[2-9][0-9]) ;;
  *)
    echo "test.sh: Relay needs Python 3.11 or later; '$python' is ${version:-not a Python that runs}." \
         "Name another interpreter with PYTHON (PYTHON=python3.11 ./test.sh)." >&2
    exit 1
    ;;
esac
"$python" -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -e ./protocol -e '.[test]'
# The console's browser tests drive Debian's chromium (Playwright's own browser download is not
# reachable from CI), and the fleet benchmark's small run goes once through Debian's haproxy.
# Installed here when missing; where that is impossible the run fails, it does not skip them.
missing=()
if ! command -v chromium >/dev/null 2>&1 && [ -z "${RELAY_CHROMIUM:-}" ]; then missing+=(chromium); fi
if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ]; then missing+=(haproxy); fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null || true
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo -n apt-get update -qq && sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null || true
  fi
  if ! command -v chromium >/dev/null 2>&1 && [ -z "${RELAY_CHROMIUM:-}" ]; then
    echo "test.sh: chromium is not installed and could not be installed (apt-get install -y chromium" \
         "needs root or passwordless sudo). The console's browser tests need it: install it, or set" \
         "RELAY_CHROMIUM to a Chromium binary." >&2
    exit 1
  fi
  if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ]; then
    echo "test.sh: haproxy is not installed and could not be installed (apt-get install -y haproxy" \
         "needs root or passwordless sudo). The fleet benchmark's small run needs it." >&2
    exit 1
  fi
fi
# Executors on DBOS's TypeScript SDK 5.2 (tests/test_typescript_sdk.py) and on 5.3 with Relay's
# open client, client-ts/ (tests/test_typescript_client.py), run on Node.js 20 or later, their
# packages installed by npm ci from the npm registry on first use (harness/ts_executor.py; the
# client from this folder, as a copy).
node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
if ! command -v npm >/dev/null 2>&1 || [ "$node_major" -lt 20 ]; then
  echo "test.sh: Node.js 20 or later and npm are needed (tests/test_typescript_sdk.py runs executors on" \
       "DBOS's TypeScript SDK, which needs Node.js 20; Debian 12's own nodejs package is 18)." >&2
  exit 1
fi
# Python keeps the bytecode it compiles (an image may set PYTHONDONTWRITEBYTECODE): the suite starts
# some 600 Python processes of this tree's code (Relay instances, executors, the CLI), and without it
# each compiled Relay's modules again (about 0.15 s of CPU per start) and each pytest worker rewrote
# the assertions of every test module and plugin again (about 9 s of CPU). One collection first, beside
# the linters (which use one core), writes them once for all.
unset PYTHONDONTWRITEBYTECODE
if [ $# -eq 0 ]; then
  .venv/bin/python -m pytest --collect-only -q -p no:xdist >/dev/null 2>&1 &
  warm=$!
fi
.venv/bin/ruff check relay workflows tests bench chaos harness protocol deploy client
.venv/bin/ruff format --check relay workflows tests bench chaos harness protocol deploy client
.venv/bin/mypy relay workflows chaos bench harness protocol/relay_protocol deploy
# relay_client is typed against the dbos it runs on (3.4), in its own venv (built once, cached).
.venv/bin/python -m harness.client_venv >/dev/null
(cd client && ../.venv-client/bin/mypy relay_client)
# With no arguments (CI), the suite runs on three workers (pytest-xdist), a file per worker at a
# time, each worker with its own embedded PostgreSQL; with arguments, as they are given. Three on
# two cores: most of a test's time is spent waiting for what Relay times (grace periods, leases),
# and two workers kept the cores busy less than half of the run. The workers take the slowest files
# first, not xdist's order (its count of tests per file), so no long file is left for the end
# (harness/schedule.py).
if [ $# -eq 0 ]; then
  wait "$warm" || true  # (a collection error is the run's to report, below)
  .venv/bin/python -m pytest -n "${RELAY_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder
else
  .venv/bin/python -m pytest "$@"
fi
# A plain run (CI's) is also gated by chaos: every recorded run that once found
# a bug is replayed, the grace-period mutant must be caught, then one fresh
# seeded run of the ci profile. Three lanes at once, each line of theirs marked with its
# lane: a chaos run mostly waits (about a third of a core for its Relay instances,
# executors and proxies), and each has its own folder, PostgreSQL, proxies and ports
# (a mutant runs from a copy of the tree). The fresh run has a lane of its own; the
# recorded runs are shared between the other two, longest first, each to the lane that
# ends sooner, the mutant's (its unmutated baseline and the mutant, about 70 s) counted
# first in the second. The gate fails if any lane does.
if [ $# -eq 0 ]; then
  mkdir -p .chaos
  export PYTHONUNBUFFERED=1  # each lane's lines as they come
  lanes=$(.venv/bin/python -c '
import json, sys
runs = sorted(((json.load(open(p))["profile"]["fault_secs"], p) for p in sys.argv[1:]), reverse=True)
ends, lane = [0.0, 70.0], ["", ""]
for secs, path in runs:
    n = ends.index(min(ends))
    ends[n] += secs
    lane[n] += path + " "
print(*lane, sep="\n")' chaos/runs/*.json)
  replays_1=$(sed -n 1p <<<"$lanes")
  replays_2=$(sed -n 2p <<<"$lanes")
  # Each lane runs all of its runs whatever one of them gave (set -e would end the lane at the first
  # that failed, and the log would lack the others' lines), and fails if any did.
  (
    failed=0
    for recorded in $replays_1; do
      .venv/bin/python -m chaos replay "$recorded" --out .chaos || failed=1
    done
    exit "$failed"
  ) 2>&1 | sed -u 's/^/[chaos replays] /' &
  replays=$!
  (
    failed=0
    # The grace-period mutant must fail its recorded run, which must pass unmutated.
    .venv/bin/python -m chaos mutants grace --baseline --out .chaos/mutants || failed=1
    for recorded in $replays_2; do
      .venv/bin/python -m chaos replay "$recorded" --out .chaos || failed=1
    done
    exit "$failed"
  ) 2>&1 | sed -u 's/^/[chaos mutant, replays] /' &
  mutant=$!
  .venv/bin/python -m chaos run --profile ci --out .chaos 2>&1 | sed -u 's/^/[chaos fresh run] /' &
  fresh=$!
  gate=0
  wait "$replays" || gate=1
  wait "$mutant" || gate=1
  wait "$fresh" || gate=1
  if [ "$gate" -ne 0 ]; then
    echo "test.sh: the chaos gate failed (see the lines marked [chaos ...] above)" >&2
    exit 1
  fi
fi
