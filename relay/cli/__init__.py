"""The ``relay`` command line (contract section 6), built on click.

- ``relay serve``, ``relay init``, ``relay keys new``: run Relay and make its
  keys (:mod:`relay.cli.serve`);
- the operator's commands over the REST API, in the manner of ``kubectl`` and
  ``dbosctl``: ``relay whoami``, ``apps [...]``, ``executors``, ``recover``,
  ``recoveries``, ``audit``, ``instances`` (:mod:`relay.cli.operate`), ``relay workflows ...``
  (:mod:`relay.cli.workflows`), ``relay tokens ...`` (:mod:`relay.cli.tokens`) and
  ``relay alerts ...`` (:mod:`relay.cli.alerts`).
  Tables for people, ``--json`` for scripts.

The exit codes are in :mod:`relay.cli.errors`; errors are one line on stderr,
never a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from relay import __version__
from relay.cli import operate
from relay.cli.alerts import alerts
from relay.cli.client import without_password
from relay.cli.errors import EXIT_ERROR, EXIT_OK, CliError
from relay.cli.output import visible
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
                operate.recoveries, operate.audit, operate.instances, workflows, tokens, alerts):  # fmt: skip
    cli.add_command(command)


# click 8.2 and later: a group run with no command shows its help, as this error (exit 2).
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())
log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    try:
        result = cli.main(args=argv, prog_name="relay", standalone_mode=False)
    except CliError as exc:
        exc.show()
        return exc.exit_code
    except _NO_ARGS_IS_HELP as exc:
        exc.show()
        return int(exc.exit_code)
    except click.UsageError as exc:
        # One line, as every other error: click's own shows the usage and a hint over three.
        hint = f" (see '{exc.ctx.command_path} -h')" if exc.ctx is not None else ""
        click.echo(f"relay: {exc.format_message().rstrip('.')}{hint}", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        click.echo(f"relay: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.Abort:
        click.echo("relay: aborted", err=True)
        return EXIT_ERROR
    except Exception as exc:
        # A bug, or an error no command expected: one line, no traceback on the terminal, and no
        # secret from the command line. Where logging is set up (`relay serve`), the traceback goes
        # to the log at ERROR, where an operator looks for why a server stopped; elsewhere at DEBUG.
        level = logging.ERROR if logging.getLogger().handlers else logging.DEBUG
        log.log(level, "internal error", exc_info=True)
        message = without_secrets(f"{type(exc).__name__}: {exc}", argv if argv is not None else sys.argv[1:])
        click.echo(f"relay: internal error: {message}", err=True)
        return EXIT_ERROR
    return result if isinstance(result, int) else EXIT_OK


def without_secrets(text: str, argv: list[str]) -> str:
    """``text`` on one line, without the API key in use (``--key``, ``RELAY_API_KEY``) or a URL's password."""
    keys = {os.environ.get("RELAY_API_KEY", "")}
    for i, arg in enumerate(argv):
        if arg == "--key" and i + 1 < len(argv):
            keys.add(argv[i + 1])
        elif arg.startswith("--key="):
            keys.add(arg.removeprefix("--key="))
    for key in sorted({k.strip() for k in keys} - {""}, key=len, reverse=True):
        text = text.replace(key, "***")
    return visible(" ".join(without_password(text).split()))
