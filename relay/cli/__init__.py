"""The ``relay`` command line (contract section 6), built on click.

- ``relay serve``, ``relay init``, ``relay keys new``: run Relay and make its
  keys (:mod:`relay.cli.serve`);
- the operator's commands over the REST API, in the manner of ``kubectl`` and
  ``dbosctl``: ``relay whoami``, ``apps``, ``executors``, ``recover``,
  ``recoveries``, ``audit`` (:mod:`relay.cli.operate`), ``relay workflows ...``
  (:mod:`relay.cli.workflows`) and ``relay tokens ...`` (:mod:`relay.cli.tokens`).
  Tables for people, ``--json`` for scripts.

The exit codes are in :mod:`relay.cli.errors`; errors are one line on stderr,
never a traceback.
"""

from __future__ import annotations

import click

from relay import __version__
from relay.cli import operate
from relay.cli.errors import EXIT_ERROR, EXIT_OK, CliError
from relay.cli.serve import init, keys, serve
from relay.cli.tokens import tokens
from relay.cli.workflows import workflows


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="relay")
def cli() -> None:
    """Relay: a self-hosted control plane for DBOS executors.

    The operator commands talk to a running Relay: --url (or RELAY_URL) and an API key,
    --key (or RELAY_API_KEY). Exit codes: 0 done, 1 other error, 2 usage or configuration,
    3 not found, 4 not allowed (401, 403), 5 unavailable (cannot connect, 502, 503, 504, 429).
    """


for command in (serve, init, keys, operate.whoami, operate.apps, operate.executors, operate.recover,
                operate.recoveries, operate.audit, workflows, tokens):  # fmt: skip
    cli.add_command(command)


def main(argv: list[str] | None = None) -> int:
    try:
        result = cli.main(args=argv, prog_name="relay", standalone_mode=False)
    except (click.ClickException, CliError) as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        click.echo("relay: aborted", err=True)
        return EXIT_ERROR
    return result if isinstance(result, int) else EXIT_OK
