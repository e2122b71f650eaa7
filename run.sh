#!/usr/bin/env bash
# Installs Relay into .venv and runs it on an embedded PostgreSQL under
# $RELAY_HOME (default ./.relay). Extra arguments go to `relay serve`.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -e ./protocol -e .
exec .venv/bin/relay serve "$@"
