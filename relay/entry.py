"""The ``relay`` command's entry point (the console script and ``python -m relay``).

Light on purpose: it imports the CLI (click, httpx, PyYAML: most of a second on a loaded
machine) itself, so that a Ctrl-C while they load is one line and exit 130, as one during a command
is (:func:`relay.cli.main`), not a traceback through the imports.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from relay.cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("relay: interrupted\n")
        return 130  # relay.cli.errors.EXIT_INTERRUPTED, which is not imported yet
    return run()
