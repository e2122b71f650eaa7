#!/usr/bin/env bash
# Installs Relay into .venv and runs it on an embedded PostgreSQL under
# $RELAY_HOME (default ./.relay). Extra arguments go to `relay serve`.
# The install (editable, so code changes need none) is made again only when the
# packaging files change: later starts need no package index.
# PYTHON names the interpreter .venv is made with (default python3; 3.11 or later).
set -euo pipefail
cd "$(dirname "$0")"
stamp=.venv/.relay-install
wanted=$(cat pyproject.toml protocol/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/relay ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  python=${PYTHON:-python3}
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || version=
  case "$version" in
    3.1[1-9] | 3.[2-9][0-9]) ;;
    *)
      echo "run.sh: Relay needs Python 3.11 or later; '$python' is ${version:-not a Python that runs}." \
           "Name another interpreter with PYTHON (PYTHON=python3.11 ./run.sh)." >&2
      exit 1
      ;;
  esac
  "$python" -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -e ./protocol -e .
  echo "$wanted" > "$stamp"
fi
exec .venv/bin/relay serve "$@"
