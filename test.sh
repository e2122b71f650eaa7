#!/usr/bin/env bash
# Installs Relay with its test tools into .venv, then runs the linters, the
# type checker and the whole test suite (real PostgreSQL, real DBOS executors).
# Set RELAY_TEST_DATABASE_URL to use your own PostgreSQL instead of an embedded one.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -e ./protocol -e '.[test]'
.venv/bin/ruff check relay workflows tests bench chaos harness protocol
.venv/bin/ruff format --check relay workflows tests bench chaos harness protocol
.venv/bin/mypy relay workflows chaos bench harness protocol/relay_protocol
.venv/bin/python -m pytest "$@"
# A plain run (CI's) is also gated by chaos: every recorded run that once found
# a bug is replayed, the grace-period mutant must be caught, then one fresh
# seeded run of the ci profile.
if [ $# -eq 0 ]; then
  for recorded in chaos/runs/*.json; do
    .venv/bin/python -m chaos replay "$recorded" --out .chaos
  done
  # The grace-period mutant must fail its recorded run, which must pass unmutated.
  .venv/bin/python -m chaos mutants grace --baseline --out .chaos/mutants
  .venv/bin/python -m chaos run --profile ci --out .chaos
fi
