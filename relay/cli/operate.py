"""The operator's commands over the REST API: apps, executors, recoveries, the audit log."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from relay.cli.client import Api, api_command, print_json
from relay.cli.errors import EXIT_USAGE, CliError
from relay.cli.output import (
    ApiChoice,
    CountOrOff,
    DurationType,
    Off,
    age,
    ask,
    cell,
    clip,
    limit_option,
    offset_option,
    page_hint,
    seconds,
    shell_command,
    show_table,
    table,
    time_option,
    when,
    yes_option,
)

STATES = ("HEALTHY", "DISCONNECTED", "DEAD", "RECOVERING")
MILLISECOND = 0.001  # the unit of the retention settings the API takes (gcTimeThresholdMs, globalTimeoutMs)


@click.command()
@api_command
def whoami(api: Api) -> None:
    """The key in use: its org, name, permissions and apps."""
    me = api.call("GET", "/v2/whoami")
    if api.as_json:
        print_json(me)
        return
    apps = ", ".join(me["appNames"]) if me["appNames"] is not None else "every app"
    click.echo(f"org:         {cell(me['org'])}\nkey:         {cell(me['tokenName'])}")
    click.echo(f"permissions: {cell(', '.join(me['permissions']))}\napps:        {cell(apps)}")


@click.group(invoke_without_command=True)
@limit_option
@offset_option
@api_command
def apps(api: Api, limit: int, offset: int) -> None:
    """The org's apps, with their executors counted by state; show, set, create, delete one."""
    found = api.call("GET", api.org_path("apps"), params={"limit": limit, "offset": offset})
    if api.as_json:
        print_json(found)
        page_hint(len(found), limit, offset)  # stderr: the JSON on stdout stays whole
        return
    rows = [
        [
            a["name"],
            a["status"],
            *(a["executors"].get(s, 0) for s in STATES),
            seconds(grace_of(a)),
            a["recoverToLatestVersion"],
            when(a["createdAt"]),
        ]
        for a in found
    ]
    show_table(["app", "status", *STATES, "grace", "to latest", "created"], rows, f"no apps in org {api.org!r}")
    page_hint(len(found), limit, offset)


def grace_of(a: dict[str, Any]) -> float:
    """An app's grace period as set: ``executorTimeoutSecs`` is rounded up to whole seconds for
    Conductor's clients; an older Relay's has no ``gracePeriodSecs`` and served it exactly there."""
    return float(a.get("gracePeriodSecs", a["executorTimeoutSecs"]))


def _milliseconds(value: int | None) -> str | None:
    """A retention setting in milliseconds as the seconds it is (``86400s``); None when off."""
    return None if value is None else seconds(value / 1000)


def _show_app(a: dict[str, Any]) -> None:
    """An app as ``relay apps show`` and ``set`` print it: one setting a line."""
    by_state = ", ".join(f"{s} {a['executors'].get(s, 0)}" for s in STATES)
    by_version = ", ".join(
        f"{version}: " + " ".join(f"{s} {n}" for s, n in sorted(states.items()))
        for version, states in sorted(a["executorsByVersion"].items())
    )
    blocked = ", ".join(f"{reason} {n}" for reason, n in sorted(a["blocked"].items()))
    fields = [
        ("app", a["name"]),
        ("status", a["status"]),
        ("executors", by_state),
        ("versions", by_version),
        ("blocked", blocked),
        # Every language its executors run (more than one loses work: README); an older Relay's, one.
        ("language", ", ".join(a.get("languages") or []) or a["language"]),
        ("grace", seconds(grace_of(a))),
        ("to latest", a["recoverToLatestVersion"]),
        # Off (null) shows as "-"; the retention options take "off" for it.
        ("gc time", _milliseconds(a["gcTimeThresholdMs"])),
        ("gc rows", a["gcRowsThreshold"]),
        ("timeout", _milliseconds(a["globalTimeoutMs"])),
        ("created", when(a["createdAt"])),
    ]
    for name, value in fields:
        click.echo(f"{name + ':':10} {cell(value)}")


@apps.command("show")
@click.argument("app")
@api_command
def show_app(api: Api, app: str) -> None:
    """An app's settings, and its executors by state and by version."""
    found = api.call("GET", api.org_path("apps", app))
    if api.as_json:
        print_json(found)
    else:
        _show_app(found)


def _ms(secs: float | Off | None) -> int | Off | None:
    """A duration option in seconds as the API's milliseconds (off, or not given, as it is)."""
    return secs if secs is None or isinstance(secs, Off) else round(secs * 1000)


def _retention_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The retention settings (README "Retention"), as PATCH and PUT take them: ``off`` turns one off."""
    options = [
        click.option(
            "--gc-time",
            type=DurationType(off=True, smallest=MILLISECOND),
            help="Delete finished workflows that completed longer ago than this (gcTimeThresholdMs); off: never.",
        ),
        click.option(
            "--gc-rows",
            type=CountOrOff(),
            help="Keep only the newest this many finished workflows (gcRowsThreshold); off: all.",
        ),
        click.option(
            "--global-timeout",
            type=DurationType(off=True, smallest=MILLISECOND),
            help="Cancel unfinished workflows created longer ago than this (globalTimeoutMs); off: never.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _retention(gc_time: Any, gc_rows: Any, global_timeout: Any) -> dict[str, Any]:
    """The retention settings given (None: not given), by the API's names; ``off`` is null, which turns one off."""
    given = {"gcTimeThresholdMs": _ms(gc_time), "gcRowsThreshold": gc_rows, "globalTimeoutMs": _ms(global_timeout)}
    return {name: None if isinstance(value, Off) else value for name, value in given.items() if value is not None}


@apps.command("set")
@click.argument("app")
@click.option("--grace", type=DurationType(), help="The grace period (executorTimeoutSecs): 30s, 5m, 2h...")
@click.option(
    "--recover-to-latest/--no-recover-to-latest",
    default=None,
    help="Whether recovery may move workflows onto the app's latest version (recoverToLatestVersion).",
)
@_retention_options
@api_command
def set_app(
    api: Api,
    app: str,
    grace: float | None,
    recover_to_latest: bool | None,
    gc_time: Any,
    gc_rows: Any,
    global_timeout: Any,
) -> None:
    """Change an app's settings (PATCH); what is not given stays as it is. Prints the app as it is now."""
    body = {
        **({"executorTimeoutSecs": grace} if grace is not None else {}),
        **({"recoverToLatestVersion": recover_to_latest} if recover_to_latest is not None else {}),
        **_retention(gc_time, gc_rows, global_timeout),
    }
    if not body:
        raise CliError(
            "nothing to change: give --grace, --recover-to-latest or --no-recover-to-latest, --gc-time, --gc-rows"
            " or --global-timeout",
            EXIT_USAGE,
        )
    changed = api.call("PATCH", api.org_path("apps", app), body=body)
    if api.as_json:
        print_json(changed)
    else:
        _show_app(changed)


@apps.command("create")
@click.argument("app")
@_retention_options
@api_command
def create_app(api: Api, app: str, gc_time: Any, gc_rows: Any, global_timeout: Any) -> None:
    """Register an app before its executors connect (PUT; how to admit one with autoRegisterApps: false).
    Done also when it exists, its retention settings then set as given."""
    api.call("PUT", api.org_path("apps", app), body=_retention(gc_time, gc_rows, global_timeout) or None)
    if api.as_json:
        print_json({"name": app, "registered": True})  # the API answers with no body
        return
    click.echo(f"app {app!r} registered in org {api.org!r}")


@apps.command("delete")
@click.argument("app")
@yes_option
@api_command
def delete_app(api: Api, app: str, yes: bool) -> None:
    """Forget an app, its settings and its alert rules; refused (409) while Relay holds any executor
    of it, or when relay.yaml lists it."""
    # Asked first: its settings and its rules (their webhooks' secrets) are not to be had back.
    ask(
        f"Delete app {app!r} of org {api.org!r}, its settings and its alert rules?",
        yes,
        f"give --yes to delete app {app!r}",
    )
    api.call("DELETE", api.org_path("apps", app))
    if api.as_json:
        print_json({"name": app, "deleted": True})  # the API answers with no body
        return
    click.echo(f"app {app!r} deleted from org {api.org!r}")


def _state(executor: dict[str, Any]) -> str:
    """The state, and for one DISCONNECTED when it is declared DEAD unless it reconnects (the end
    of its grace period, ``graceEndsAt``): what on-call needs to know of a disconnection."""
    ends = executor.get("graceEndsAt")
    return f"{executor['state']} (dead at {when(ends)})" if ends else str(executor["state"])


def _since(executor: dict[str, Any]) -> str | None:
    """When the executor entered its present state."""
    state = executor["state"]
    if state == "HEALTHY":
        return executor["connectedAt"]  # type: ignore[no-any-return]
    if state == "DISCONNECTED":
        return executor["disconnectedAt"]  # type: ignore[no-any-return]
    return executor["deadAt"] or executor["disconnectedAt"]  # type: ignore[no-any-return]


@click.command()
@click.argument("app")
@click.option(
    "--state",
    type=ApiChoice(STATES),
    metavar="STATE",
    help=f"Only executors in this state: {', '.join(STATES)}.",
)
@limit_option
@offset_option
@api_command
def executors(api: Api, app: str, state: str | None, limit: int, offset: int) -> None:
    """An app's executors: state, version, host, the Relay instance holding them, since when. One
    DISCONNECTED says when it is declared DEAD unless it reconnects: "DISCONNECTED (dead at ...)"."""
    params = {"state": state.upper() if state else None, "limit": limit, "offset": offset}
    found = api.call("GET", api.org_path("apps", app, "executors"), params=params)
    if api.as_json:
        print_json(found)
        page_hint(len(found), limit, offset)  # stderr: the JSON on stdout stays whole
        return
    rows = [
        [
            e["executorId"],
            _state(e),
            e["applicationVersion"],
            e["hostname"],
            e["relayInstance"],
            age(_since(e)),
            e["blockedReason"],
        ]
        for e in found
    ]
    where = f"in state {state.upper()} " if state else ""
    show_table(
        ["executor", "state", "version", "host", "instance", "since", "blocked"],
        rows,
        f"no executors {where}in {api.org}/{app}",
    )
    page_hint(len(found), limit, offset)


@click.command()
@click.argument("app")
@click.argument("executor")
@click.option("--to-latest", is_flag=True, help="Allow recovery onto the app's latest version.")
@api_command
def recover(api: Api, app: str, executor: str, to_latest: bool) -> None:
    """Recover a DISCONNECTED or DEAD executor now (skips the rest of its grace period)."""
    body = {"toLatestVersion": True} if to_latest else None
    started = api.call("POST", api.org_path("apps", app, "executors", executor, "recover"), body=body)
    if api.as_json:
        print_json(started)
        return
    rid = cell(started["recoveryId"])
    # The command as a shell reads it back (cell's escapes, copied, would name another recovery).
    follow = shell_command("relay recoveries", [app, started["recoveryId"]])
    if started.get("newRun", True):
        click.echo(f"recovery {rid} started; follow it with: {follow}")
        return
    onto = " (onto the latest version if it must)" if to_latest else ""
    click.echo(f"recovery {rid} was running already: woken to try again now{onto}; follow it with: {follow}")


@click.command()
@click.argument("app")
@click.argument("recovery_id", required=False)
@click.option("--executor", help="Only the recoveries of this executor.")
@limit_option
@offset_option
@click.option("--desc", is_flag=True, help="Newest first.")
@api_command
def recoveries(
    api: Api, app: str, recovery_id: str | None, executor: str | None, limit: int, offset: int, desc: bool
) -> None:
    """An app's recoveries, oldest first (newest first with --desc); with RECOVERY_ID, that one and each attempt."""
    if recovery_id is not None:
        one = api.call("GET", api.org_path("apps", app, "recoveries", recovery_id))
        if api.as_json:
            print_json(one)
        else:
            _show_recovery(one)
        return
    params = {"executorId": executor, "limit": limit, "offset": offset, "sortDesc": "true" if desc else None}
    found = api.call("GET", api.org_path("apps", app, "recoveries"), params=params)
    if api.as_json:
        print_json(found)
        page_hint(len(found), limit, offset)  # stderr: the JSON on stdout stays whole
        return
    rows = []
    for r in found:
        last = r["attempts"][-1] if r["attempts"] else {}
        rows.append(
            [
                r["recoveryId"],
                r["executorId"],
                r["trigger"],
                r["status"],
                len(r["attempts"]),
                last.get("peerExecutorId"),
                last.get("outcome"),
                when(r["updatedAt"]),
            ]
        )
    show_table(
        ["recovery", "executor", "trigger", "status", "attempts", "last peer", "outcome", "updated"],
        rows,
        f"no recoveries in {api.org}/{app}",
    )
    page_hint(len(found), limit, offset)


def _show_recovery(r: dict[str, Any]) -> None:
    fields = [
        ("recovery", r["recoveryId"]),
        ("executor", r["executorId"]),
        ("run", r["run"]),
        ("version", r["applicationVersion"]),
        ("language", r.get("language")),  # not given by a Relay before its recoveries had it
        ("trigger", r["trigger"]),
        ("status", r["status"]),
        ("error", r["error"]),
        ("created", when(r["createdAt"])),
        ("updated", when(r["updatedAt"])),
    ]
    for name, value in fields:
        click.echo(f"{name + ':':10} {cell(value)}")
    if r["attempts"]:
        click.echo("\nattempts:")
        rows = [
            [a["attempt"], a["peerExecutorId"], a["mode"], a["outcome"], a["error"], when(a["at"])]
            for a in r["attempts"]
        ]
        click.echo(table(["#", "peer", "mode", "outcome", "error", "at"], rows))


@click.command()
@click.option("--app", help="Only this app's entries (a key scoped to apps must give one).")
@click.option("--executor", help="Only the entries about this executor.")
@click.option("--since", help="From this time: ISO 8601 (2026-01-31T12:00:00Z) or an age (15m, 2h, 7d).")
@click.option("--action", help="Only the entries of this action (executor.dead, recovery.dispatched...).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=1000, show_default=True)
@offset_option
@click.option("--desc", is_flag=True, help="Newest first.")
@click.option(
    "--until-id",
    type=click.IntRange(1, 2**63 - 1),
    help="Leave out entries after this one (newest first, the next pages of a first page: the hint gives it).",
)
@api_command
def audit(
    api: Api,
    app: str | None,
    executor: str | None,
    since: str | None,
    action: str | None,
    limit: int,
    offset: int,
    desc: bool,
    until_id: int | None,
) -> None:
    """The org's audit log, oldest first (newest first with --desc): every recovery action and every
    change made through the API.

    The DETAIL column is cut at 80 characters (ending in …); --json prints each entry's detail whole."""
    params = {
        "app": app,
        "executorId": executor,
        "since": time_option(since),
        "action": action,
        "limit": limit,
        "offset": offset,
        "sortDesc": "true" if desc else None,
        "untilId": until_id,
    }
    found = api.call("GET", api.org_path("audit"), params=params)
    # Newest first, entries audited meanwhile would push the next page's onto this one's: the next
    # page is read as of this one's newest entry.
    newest = until_id if until_id is not None else (found[0]["id"] if found else None)
    also = f" --until-id {newest}" if desc and newest is not None else ""
    if api.as_json:
        print_json(found)
        page_hint(len(found), limit, offset, also)  # stderr: the JSON on stdout stays whole
        return
    rows = [
        [
            when(e["at"]),
            e["action"],
            e["app"],
            e["executorId"],
            e["peerExecutorId"],
            e["actor"],
            clip(cell(e["detail"] or None), 80),
        ]
        for e in found
    ]
    show_table(["at", "action", "app", "executor", "peer", "actor", "detail"], rows, "no audit entries")
    page_hint(len(found), limit, offset, also)


@click.command()
@api_command
def instances(api: Api) -> None:
    """Relay's instances on this database and their leases, with how many of the org's executors each holds."""
    found = api.call("GET", api.org_path("instances"))
    if api.as_json:
        print_json(found)
        return
    rows = [
        [
            i["instanceId"],
            # A lease given up by a clean stop (a rolling restart, a scale-in) is not one that ran
            # out (a crash, a cut): a planned stop is not a lost instance.
            "held" if i["live"] else "released" if i["releasedAt"] else "expired",
            i["leaseEpoch"],
            when(i["leaseExpiresAt"]),
            when(i["startedAt"]),
            age(i["renewedAt"]),
            i["adoptedBy"],
            when(i["adoptedAt"]),
            i["executors"],
        ]
        for i in found
    ]
    show_table(
        ["instance", "lease", "epoch", "expires", "started", "renewed", "adopted by", "adopted", "executors"],
        rows,
        "no Relay instances",
    )
