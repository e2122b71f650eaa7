"""``relay alerts``: an app's alerting rules, through Conductor's alerting-rules API (README "Alerts").

A rule's webhook is shown as the API shows it, its scheme, host and port: its path, query and
secret never are. The secret Relay draws for a rule made without one is in the answer to the
``POST`` only, and ``create`` prints it that once, as ``relay tokens create`` prints a key.
"""

from __future__ import annotations

import sys
from typing import Any

import click
from click.core import ParameterSource

from relay.cli.client import Api, api_command, print_json
from relay.cli.errors import EXIT_USAGE, CliError, keep_secret
from relay.cli.output import (
    ApiChoice,
    DurationType,
    ask,
    cell,
    limit_option,
    offset_option,
    page_hint,
    seconds,
    show_table,
    when,
    yes_option,
)
from relay.core.alerts import CONDUCTOR_PARAMS, PARAMS, SECRET_RULE, Kind

# Each parameter's type, by its default (relay.core.alerts.PARAMS): a float is a duration in seconds,
# an int a count, None a name (workflowName, queueName, reason). Conductor's names take their type.
_TYPES: dict[str, type | None] = {
    name: None if default is None else type(default) for params in PARAMS.values() for name, default in params.items()
}
_TYPES.update({alias: _TYPES[name] for aliases in CONDUCTOR_PARAMS.values() for alias, name in aliases.items()})
# Each kind's parameters in README's order.
_ORDER = {kind.value: list(params) for kind, params in PARAMS.items()}


@click.group()
def alerts() -> None:
    """An app's alerting rules (relay.yaml's and the API's): list, create, delete."""


def _params(rule: dict[str, Any]) -> str | None:
    """The rule's parameters in short (``count=3 windowSecs=300s``), in the order README gives them
    (the API's JSON has them in PostgreSQL's order); those left to their "any" (null) left out."""
    given: dict[str, Any] = rule["ruleMetadata"]
    order = _ORDER.get(rule["kind"], [])
    names = [n for n in order if n in given] + [n for n in given if n not in order]
    shown = [f"{n}={seconds(given[n]) if n.endswith('Secs') else given[n]}" for n in names if given[n] is not None]
    return " ".join(shown) or None


def _destination(rule: dict[str, Any]) -> str:
    """A webhook's scheme, host and port (its format when Slack's), or the app whose executors take the alerts."""
    if rule.get("webhook") is not None:
        return str(rule["webhook"]) + (" (slack)" if rule.get("format") == "slack" else "")
    return f"app {rule.get('receiverApp')}"


@alerts.command("list")
@click.argument("app")
@limit_option
@offset_option
@api_command
def list_rules(api: Api, app: str, limit: int, offset: int) -> None:
    """An app's rules: kind, parameters, destination (never a webhook's path or secret), minimum
    interval, source (config: relay.yaml's, read-only; api), when one last fired."""
    path = api.org_path("apps", app, "alerting-rules")
    found = api.call("GET", path, params={"limit": limit, "offset": offset})
    if api.as_json:
        print_json(found)
        page_hint(len(found), limit, offset)  # stderr: the JSON on stdout stays whole
        return
    rows = [
        [
            r["id"],
            r["kind"],
            _params(r),
            _destination(r),
            seconds(r["minIntervalSecs"]),
            r["source"],
            when(r["lastFiredAt"]),
        ]
        for r in found
    ]
    show_table(
        ["id", "kind", "parameters", "destination", "min interval", "source", "last fired"],
        rows,
        f"no alerting rules in {api.org}/{app}",
    )
    page_hint(len(found), limit, offset)


def _param_value(name: str, value: str) -> Any:
    """A ``--param``'s value as the API takes it: a duration (``5m``) in seconds, a count as a
    number. One that does not parse is sent as it is, for the API to refuse in its own words (422)."""
    kind = _TYPES.get(name)
    try:
        if kind is float:
            return DurationType().convert(value, None, None)
        if kind is int:
            return int(value)
    except (click.BadParameter, ValueError):
        pass
    return value


@alerts.command("create")
@click.argument("app")
@click.option(
    "--kind",
    required=True,
    type=ApiChoice([k.value for k in Kind]),
    metavar="KIND",
    help=f"The rule's kind: {', '.join(Kind)} (README: Alerts).",
)
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="NAME=VALUE",
    help="A parameter of the kind (repeat for several): workflowName, count, windowSecs, queueName, "
    "thresholdSecs, forSecs, reason, attempts (or Conductor's names); durations as 30s, 5m.",
)
@click.option("--webhook", metavar="URL", help="Send the alerts to this URL (else to an app's executors).")
@click.option(
    "--receiver-app", metavar="APP", help="Send the alerts to this app's executors (default: the rule's own app)."
)
@click.option(
    "--secret",
    envvar="RELAY_WEBHOOK_SECRET",
    show_envvar=True,
    help=f"The webhook's signing key: {SECRET_RULE} (default: one drawn by Relay, printed once). "
    "Given here it is in the shell's history and the process list: prefer --secret-stdin.",
)
@click.option(
    "--secret-stdin",
    is_flag=True,
    help="Read the webhook's signing key from stdin (its one line; at a terminal, asked for without echo).",
)
@click.option("--format", "fmt", type=click.Choice(["json", "slack"]), help="The webhook's body (default json).")
@click.option(
    "--min-interval",
    type=DurationType(),
    help="At least this long between two alerts about the same subject (default 5m); 0 for none.",
)
@api_command
def create_rule(
    api: Api,
    app: str,
    kind: str,
    params: tuple[str, ...],
    webhook: str | None,
    receiver_app: str | None,
    secret: str | None,
    secret_stdin: bool,
    fmt: str | None,
    min_interval: float | None,
) -> None:
    """Create a rule of APP. Its webhook's signing secret, when Relay draws it, is printed this once."""
    # The parameters and the destination before the secret: refused after --secret-stdin, a secret
    # typed twice at a terminal was asked for in vain.
    if webhook is not None and receiver_app is not None:
        # The API's refusal too (a webhook excludes receivingAppName), in the options' names.
        raise CliError("give --webhook or --receiver-app, not both: a rule sends its alerts to one", EXIT_USAGE)
    metadata: dict[str, Any] = {}
    for param in params:
        name, sep, value = param.partition("=")
        if not sep or not name:
            raise CliError(f"--param {param!r}: give it as NAME=VALUE (count=3, windowSecs=5m)", EXIT_USAGE)
        if name in metadata:
            raise CliError(f"--param {name} is given twice", EXIT_USAGE)
        metadata[name] = _param_value(name, value)
    source = click.get_current_context().get_parameter_source("secret")
    if secret_stdin:
        secret = _secret_from_stdin(webhook, given_too=source is ParameterSource.COMMANDLINE)
    elif webhook is None and source is ParameterSource.ENVIRONMENT:
        # RELAY_WEBHOOK_SECRET is for webhook rules: sent with one to an app's executors, the API
        # refused the rule (a secret applies to a webhook only). One given as --secret still goes.
        secret = None
    if secret is not None and not secret.strip():
        raise CliError(f"the webhook's secret is blank: {SECRET_RULE}; or give none for Relay to draw one",
                       EXIT_USAGE)  # fmt: skip
    keep_secret(secret)
    body = {
        "ruleType": kind,  # as Kind spells it: click's choice gives its own spelling back
        "ruleMetadata": metadata or None,
        "minIntervalSecs": min_interval,
        "webhook": webhook,
        "receivingAppName": receiver_app,
        "secret": secret,
        "format": fmt,
    }
    made = api.call(
        "POST", api.org_path("apps", app, "alerting-rules"), body={k: v for k, v in body.items() if v is not None}
    )
    if api.as_json:
        print_json(made)
        return
    click.echo(f"rule {cell(made['id'])} created in {api.org}/{app}: {made['kind']} to {cell(_destination(made))}")
    if made.get("secret"):
        click.echo("its webhook's signing secret (X-Relay-Signature), shown this once:")
        click.echo(f"  {cell(made['secret'])}")


def _secret_from_stdin(webhook: str | None, given_too: bool) -> str:
    """The secret ``--secret-stdin`` reads: stdin's one line (its line end left off, as ``docker login
    --password-stdin`` leaves it), or at a terminal one typed twice without echo. Refused (exit 2)
    before anything is read when it cannot be used."""
    if given_too:
        raise CliError("give --secret or --secret-stdin, not both", EXIT_USAGE)
    if webhook is None:
        raise CliError("--secret-stdin goes with --webhook: a secret signs a webhook's deliveries only", EXIT_USAGE)
    if sys.stdin.isatty():
        text = str(click.prompt("Webhook secret", hide_input=True, confirmation_prompt=True, err=True))
    else:
        text = sys.stdin.read()
    text = text.removesuffix("\n").removesuffix("\r")
    keep_secret(text)  # before any refusal: none of its lines may quote it
    if not text:
        raise CliError("--secret-stdin: stdin is empty (pipe the secret in: ... --secret-stdin < secret.txt)",
                       EXIT_USAGE)  # fmt: skip
    if "\n" in text or "\r" in text:
        raise CliError("--secret-stdin: stdin has more than one line; a secret is one line", EXIT_USAGE)
    return text


@alerts.command("delete")
@click.argument("app")
@click.argument("rule_id")
@yes_option
@api_command
def delete_rule(api: Api, app: str, rule_id: str, yes: bool) -> None:
    """Delete one of the API's rules (relay.yaml's are changed there: 409); the alerts it left open are resolved."""
    # Asked first: a rule made again draws a new secret, which its webhook's receiver must then be given.
    ask(f"Delete alerting rule {rule_id!r} of {api.org}/{app}?", yes, f"give --yes to delete alerting rule {rule_id!r}")
    api.call("DELETE", api.org_path("apps", app, "alerting-rules", rule_id))
    if api.as_json:
        print_json({"id": rule_id, "deleted": True})  # the API answers with no body
        return
    click.echo(f"alerting rule {rule_id!r} deleted from {api.org}/{app}")
