"""What the ``relay`` command exits with, and its one-line errors.

Scripts can rely on these codes:

====  =======================================================================
0     done
1     any other error: the API refused the change (409), the executor failed
      it (501), an unexpected answer, a TLS certificate the client does not
      trust (certificate verify failed)
2     usage or configuration: a bad option or argument, no API key, a bad
      relay.yaml, a file ``relay init`` would overwrite, a ``delete`` or a
      selection by filters without ``--yes`` when stdin is not a terminal, a
      request the API found invalid (400, 422), a --url at a server that is
      not Relay (a 404 page)
3     not found (404, from Relay): no such app, executor, recovery, workflow, key or
      alerting rule
4     not allowed: the key is missing or unknown (401) or lacks the
      permission, the org or the app (403)
5     unavailable, try again later: Relay cannot be reached or timed out, the
      app has no healthy executor (503), no executor answered (502, 504),
      too many requests (429)
130   interrupted (Ctrl-C): one line, ``relay: interrupted``
====  =======================================================================
"""

from __future__ import annotations

import click

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_DENIED = 4
EXIT_UNAVAILABLE = 5
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 and the signal's number, as a shell reports a process it ended

_BY_STATUS = {
    400: EXIT_USAGE,
    401: EXIT_DENIED,
    403: EXIT_DENIED,
    404: EXIT_NOT_FOUND,
    422: EXIT_USAGE,
    429: EXIT_UNAVAILABLE,
    502: EXIT_UNAVAILABLE,
    503: EXIT_UNAVAILABLE,
    504: EXIT_UNAVAILABLE,
}


def exit_code_for(status: int) -> int:
    """The exit code for an HTTP error status."""
    return _BY_STATUS.get(status, EXIT_ERROR)


class KeptSecrets(set[str]):
    """The secrets a command was given that its options do not show (a webhook's secret read from
    stdin, the API key and a URL's password as the client took them): no error line may print one
    (relay.cli.without_secrets, which finds those given as options or in the environment itself).
    ``main`` gives each command its own, as the click context's object: it lives as long as that one
    command, and two commands run at once in one process (as the tests run them) do not share it."""


def keep_secret(value: str | None) -> None:
    """Note ``value`` as a secret no error line of the command being run may print."""
    ctx = click.get_current_context(silent=True)
    if value and ctx is not None:  # outside a command (an Api made by a test) no error line is printed
        ctx.ensure_object(KeptSecrets).add(value)


class CliError(Exception):
    """An error the command reports in one line on stderr (``relay: ...``), with its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
