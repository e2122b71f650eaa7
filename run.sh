#!/usr/bin/env bash
# Installs Relay into .venv and runs it on an embedded PostgreSQL under
# $RELAY_HOME (default ./.relay). Extra arguments go to `relay serve`.
# The install (editable, so code changes need none) is made again only when the
# packaging files change: later starts need no package index.
set -euo pipefail
cd "$(dirname "$0")"
stamp=.venv/.relay-install
wanted=$(cat pyproject.toml protocol/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/relay ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -e ./protocol -e .
  echo "$wanted" > "$stamp"
fi
exec .venv/bin/relay serve "$@"
