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
from collections.abc import Iterable
from urllib.parse import quote

import click

from relay import __version__
from relay.cli import operate
from relay.cli.alerts import alerts
from relay.cli.client import url_secrets, without_password
from relay.cli.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, CliError, KeptSecrets
from relay.cli.output import visible
from relay.cli.serve import init, keys, serve
from relay.cli.tokens import tokens
from relay.cli.workflows import workflows


class _Relay(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        # Ctrl-C in a command as an Abort, as click.prompt raises it. Left to click's main, it wrote
        # a blank line to stderr first (to end the terminal's "^C"), two lines where stderr is a file
        # or a pipe: main writes that one at a terminal only.
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise click.Abort from exc


@click.group(cls=_Relay, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="relay")
def cli() -> None:
    """Relay: a self-hosted control plane for DBOS executors.

    The operator commands talk to a running Relay: --url (or RELAY_URL) and an API key,
    --key (or RELAY_API_KEY). Exit codes: 0 done, 1 other error, 2 usage or configuration,
    3 not found, 4 not allowed (401, 403), 5 unavailable (cannot connect, 502, 503, 504, 429),
    130 interrupted (Ctrl-C).
    """


for command in (serve, init, keys, operate.whoami, operate.apps, operate.executors, operate.recover,
                operate.recoveries, operate.audit, operate.instances, workflows, tokens, alerts):  # fmt: skip
    cli.add_command(command)


# click 8.2 and later: a group run with no command shows its help, as this error (exit 2).
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())
log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    kept = KeptSecrets()  # the command's context object: keep_secret adds to it

    def error(message: str) -> None:
        # Every error line, whatever its source: an answer's body or a transport error may quote
        # what the command sent (its key, its URL, a webhook's secret).
        click.echo(f"relay: {without_secrets(message, args, kept)}", err=True)

    try:
        result = cli.main(args=argv, prog_name="relay", standalone_mode=False, obj=kept)
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
    except click.Abort as exc:
        if not _interrupted(exc):
            click.echo("relay: aborted", err=True)  # end of input (Ctrl-D) at a question
            return EXIT_ERROR
        # At a terminal the line starts on a line of its own, not after the "^C" it echoed.
        start = "\n" if sys.stderr.isatty() else ""
        click.echo(f"{start}relay: interrupted", err=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # outside the command's own invoke (_Relay.invoke): after it, writing its answer
        click.echo("relay: interrupted", err=True)
        return EXIT_INTERRUPTED
    except Exception as exc:
        # A bug, or an error no command expected: one line, no traceback on the terminal, and no
        # secret from the command line. Where logging is set up (`relay serve`), the traceback goes
        # to the log at ERROR, where an operator looks for why a server stopped; elsewhere at DEBUG.
        level = logging.ERROR if logging.getLogger().handlers else logging.DEBUG
        log.log(level, "internal error", exc_info=True)
        error(f"internal error: {type(exc).__name__}: {exc}")
        return EXIT_ERROR
    return result if isinstance(result, int) else EXIT_OK


def _interrupted(exc: BaseException) -> bool:
    """Whether the Abort came of Ctrl-C: click.prompt raises it "from None", which leaves the
    KeyboardInterrupt as its context, not its cause."""
    return isinstance(exc.__cause__, KeyboardInterrupt) or isinstance(exc.__context__, KeyboardInterrupt)


# The options and environment variables that carry a secret, and those that carry a URL (its password):
# a webhook's too, which an answer may quote back percent-encoded, where no "@" shows it as one.
_SECRET_OPTIONS = {"--key": "RELAY_API_KEY", "--secret": "RELAY_WEBHOOK_SECRET"}
_URL_OPTIONS = {"--url": "RELAY_URL", "--webhook": None}
_SHORT = 6  # a secret shorter than this is masked where it stands alone only (below)


def without_secrets(text: str, argv: list[str], kept: Iterable[str] = ()) -> str:
    """``text`` on one line, without a secret the command was given: the API key (``--key``,
    ``RELAY_API_KEY``), a webhook's secret (``--secret``, ``RELAY_WEBHOOK_SECRET``, stdin), a URL's
    password (``--url``, ``RELAY_URL``, ``--webhook``, any URL in ``text``); each also as an answer
    could quote it: JSON-escaped, percent-encoded, with its control characters escaped. ``kept``:
    those the command noted as it ran (relay.cli.errors.keep_secret)."""
    given = {os.environ.get(env, "") for env in _SECRET_OPTIONS.values()}
    urls = [os.environ.get(env, "") for env in _URL_OPTIONS.values() if env is not None]
    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if not sep:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if name in _SECRET_OPTIONS:
            given.add(value)
        elif name in _URL_OPTIONS:
            urls.append(value)
    given |= {s for url in urls for s in url_secrets(url)} | set(kept)
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
