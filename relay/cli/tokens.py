"""``relay tokens``: the org's keys, through the tokens API (Conductor's name for them)."""

from __future__ import annotations

from typing import Any

import click

from relay.auth import ADMIN, CONDUCTOR, VIEWER, Permission
from relay.cli.client import Api, api_command, print_json
from relay.cli.errors import EXIT_USAGE, CliError
from relay.cli.output import ask, cell, limit_option, offset_option, page_hint, show_table, when, yes_option

ROLES = {"admin": ADMIN, "viewer": VIEWER, "conductor": CONDUCTOR}


def _kind(permissions: list[str]) -> str:
    """``admin``, ``viewer`` or ``conductor`` when the permissions are exactly a role's; else the list."""
    held = frozenset(permissions)
    for role, granted in ROLES.items():
        if held == {p.value for p in granted}:
            return role
    return ",".join(sorted(held)) or "-"


@click.group()
def tokens() -> None:
    """The org's keys: list, create, delete (the tokens API)."""


@tokens.command("list")
@limit_option
@offset_option
@api_command
def list_tokens(api: Api, limit: int, offset: int) -> None:
    """The org's keys (never their secrets): permissions, apps, where each came from."""
    found = api.call("GET", api.org_path("tokens"), params={"limit": limit, "offset": offset})
    if api.as_json:
        print_json(found)
        page_hint(len(found), limit, offset)  # stderr: the JSON on stdout stays whole
        return
    rows = [
        [
            t["tokenName"],
            _kind(t["permissions"]),
            ",".join(t["appNames"]) if t["appNames"] is not None else "*",
            t["source"],
            when(t["createdAt"]),
        ]
        for t in found
    ]
    show_table(["name", "permissions", "apps", "source", "created"], rows, f"no keys in org {api.org!r}")
    page_hint(len(found), limit, offset)


@tokens.command("create")
@click.argument("name")
@click.option("--role", type=click.Choice(sorted(ROLES)), help="admin, viewer, or conductor (websocket.connect).")
@click.option(
    "--permission",
    "permissions",
    multiple=True,
    type=click.Choice([p.value for p in Permission]),
    help="A permission (repeat for several), instead of a role.",
)
@click.option("--app", "apps", multiple=True, help="Limit the key to this app (repeat for several).")
@api_command
def create(api: Api, name: str, role: str | None, permissions: tuple[str, ...], apps: tuple[str, ...]) -> None:
    """Create a key; its secret is printed this once. With neither --role nor --permission: a conductor key."""
    if role and permissions:
        raise CliError("give --role or --permission, not both", EXIT_USAGE)
    body: dict[str, Any] = {}
    if role:
        body["permissions"] = sorted(p.value for p in ROLES[role])
    elif permissions:
        body["permissions"] = sorted(set(permissions))
    if apps:
        body["appNames"] = list(apps)
    made = api.call("POST", api.org_path("tokens", name), body=body or None)
    if api.as_json:
        print_json(made)
        return
    click.echo(f"key {made['tokenName']!r} created in org {api.org!r}; its secret, shown this once:")
    click.echo(f"  {cell(made['token'])}")


@tokens.command("delete")
@click.argument("name")
@yes_option
@api_command
def delete(api: Api, name: str, yes: bool) -> None:
    """Delete a key: every instance refuses it within about a second, and the sockets it opened are closed."""
    # Asked first, as the other deletes are: a key is not to be had back, and its executors are cut off.
    ask(f"Delete key {name!r} of org {api.org!r}? Its executors' sockets are closed.", yes,
        f"give --yes to delete key {name!r}")  # fmt: skip
    api.call("DELETE", api.org_path("tokens", name))
    if api.as_json:
        print_json({"tokenName": name, "deleted": True})
        return
    click.echo(f"key {name!r} deleted from org {api.org!r}")
