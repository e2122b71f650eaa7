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
never a traceback, and never a secret the command was given (:func:`without_secrets`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from urllib.parse import quote

import click

from relay import __version__
from relay.cli import operate
from relay.cli.alerts import alerts
from relay.cli.client import url_secrets, without_password
from relay.cli.errors import EXIT_ERROR, EXIT_OK, CliError, forget_secrets, kept_secrets
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
    args = argv if argv is not None else sys.argv[1:]
    forget_secrets()

    def error(message: str) -> None:
        # Every error line, whatever its source: an answer's body or a transport error may quote
        # what the command sent (its key, its URL, a webhook's secret).
        click.echo(f"relay: {without_secrets(message, args)}", err=True)

    try:
        result = cli.main(args=argv, prog_name="relay", standalone_mode=False)
    except CliError as exc:
        error(exc.message)
        return exc.exit_code
    except _NO_ARGS_IS_HELP as exc:
        exc.show()
        return int(exc.exit_code)
    except click.UsageError as exc:
        # One line, as every other error: click's own shows the usage and a hint over three.
        hint = f" (see '{exc.ctx.command_path} -h')" if exc.ctx is not None else ""
        error(f"{exc.format_message().rstrip('.')}{hint}")
        return exc.exit_code
    except click.ClickException as exc:
        error(exc.format_message())
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
        error(f"internal error: {type(exc).__name__}: {exc}")
        return EXIT_ERROR
    return result if isinstance(result, int) else EXIT_OK


# The options and environment variables that carry a secret, and those that carry a URL (its password).
_SECRET_OPTIONS = {"--key": "RELAY_API_KEY", "--secret": "RELAY_WEBHOOK_SECRET"}
_URL_OPTIONS = {"--url": "RELAY_URL"}
_SHORT = 6  # a secret shorter than this is masked where it stands alone only (below)


def without_secrets(text: str, argv: list[str]) -> str:
    """``text`` on one line, without a secret the command was given: the API key (``--key``,
    ``RELAY_API_KEY``), a webhook's secret (``--secret``, ``RELAY_WEBHOOK_SECRET``, stdin), a URL's
    password (``--url``, ``RELAY_URL``, any URL in ``text``); each also as an answer could quote it:
    JSON-escaped, percent-encoded, with its control characters escaped."""
    given = {os.environ.get(env, "") for env in _SECRET_OPTIONS.values()}
    urls = [os.environ.get(env, "") for env in _URL_OPTIONS.values()]
    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if not sep:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if name in _SECRET_OPTIONS:
            given.add(value)
        elif name in _URL_OPTIONS:
            urls.append(value)
    given |= {s for url in urls for s in url_secrets(url)} | kept_secrets()
    forms = set()
    for secret in {s.strip() for s in given} | given:
        forms |= {secret, visible(secret), json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1],
                  quote(secret, safe="")}  # fmt: skip
    text = without_password(text)
    for form in sorted(forms - {""}, key=len, reverse=True):
        # One of a few characters (a test's key "k", a URL's password "pw") is masked where it stands
        # alone only: masked inside words, it left no line readable ("webhoo***").
        alone = len(form) < _SHORT
        text = re.sub(rf"(?<!\w){re.escape(form)}(?!\w)", "***", text) if alone else text.replace(form, "***")
    return visible(" ".join(text.split()))
