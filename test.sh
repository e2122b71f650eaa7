#!/usr/bin/env bash
# Installs Relay with its test tools into .venv, then runs the linters, the
# type checker and the whole test suite (real PostgreSQL, real DBOS executors).
# Set RELAY_TEST_DATABASE_URL to use your own PostgreSQL instead of an embedded one.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
.venv/bin/ruff check relay workflows tests bench
.venv/bin/ruff format --check relay workflows tests bench
.venv/bin/mypy relay workflows
.venv/bin/python -m pytest "$@"
