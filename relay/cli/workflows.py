"""``relay workflows``: an app's workflows through Conductor's API (served by the app's executors).

``list`` takes Conductor's filters (``POST .../workflows/search``). ``cancel`` and
``resume`` take workflow ids, or filters that select them (all of the matches, read first,
a page at a time from the last page's creation time, with a count on stderr, then changed
in batches through the bulk routes, with a progress bar); a selection by filters asks for
confirmation, or ``--yes``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from relay.cli.client import Api, api_command, print_json
from relay.cli.errors import EXIT_USAGE, CliError
from relay.cli.output import (
    ApiChoice,
    ask,
    cell,
    clip,
    duration_ms,
    limit_option,
    offset_option,
    page_hint,
    show_table,
    time_option,
    when,
)
from relay.core.times import us_iso

STATUSES = ("PENDING", "ENQUEUED", "DELAYED", "SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED")
SEARCH_PAGE = 1000  # the API's largest page
FILTERS = ("status", "name", "queue", "since", "until", "version", "executor", "prefix")


@click.group()
def workflows() -> None:
    """An app's workflows: list, get, steps, cancel, resume, fork."""


def _filters(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--status",
            multiple=True,
            type=ApiChoice(STATUSES),
            metavar="STATUS",
            help=f"Only this status (repeat for several): {', '.join(STATUSES)}.",
        ),
        click.option("--name", multiple=True, help="Only this workflow name (repeat for several)."),
        click.option("--queue", multiple=True, help="Only workflows of this queue (repeat for several)."),
        click.option("--since", help="Created at or after: ISO 8601, or an age (15m, 2h, 7d)."),
        click.option("--until", help="Created at or before: ISO 8601, or an age (15m, 2h, 7d)."),
        click.option("--version", multiple=True, help="Only this application version (repeat for several)."),
        click.option("--executor", multiple=True, help="Only workflows of this executor (repeat for several)."),
        click.option("--prefix", help="Only workflow ids starting so."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _search(filters: dict[str, Any], ids: Sequence[str] = ()) -> dict[str, Any]:
    """Conductor's WorkflowSearchBody for the filters given (the others left out)."""
    body: dict[str, Any] = {
        "workflowIds": list(ids) or None,
        "status": [s.upper() for s in filters["status"]] or None,
        "workflowName": list(filters["name"]) or None,
        "queueName": list(filters["queue"]) or None,
        "appVersion": list(filters["version"]) or None,
        "executorId": list(filters["executor"]) or None,
        "workflowIdPrefix": [filters["prefix"]] if filters["prefix"] else None,
        "startTime": time_option(filters["since"]),
        "endTime": time_option(filters["until"]),
    }
    return {k: v for k, v in body.items() if v is not None}


def _filtered(filters: dict[str, Any]) -> bool:
    return any(filters[name] for name in FILTERS)


@workflows.command("list")
@click.argument("app")
@_filters
@limit_option
@offset_option
@click.option("--desc", is_flag=True, help="Newest first.")
@api_command
def list_workflows(api: Api, app: str, limit: int, offset: int, desc: bool, **filters: Any) -> None:
    """An app's workflows, oldest first, filtered as Conductor's API filters them."""
    body = {**_search(filters), "limit": limit, "offset": offset, "sortDesc": desc}
    found = api.call("POST", api.org_path("apps", app, "workflows", "search"), body=body)
    if api.as_json:
        print_json(found)
        page_hint(len(found), limit, offset)  # stderr: the JSON on stdout stays whole
        return
    rows = [
        [
            w["workflowId"],
            w["status"],
            w["workflowName"],
            w["queueName"],
            w["appVersion"],
            w["executorId"],
            when(w["createdAt"]),
            when(w["updatedAt"]),
        ]
        for w in found
    ]
    headers = ["workflow", "status", "name", "queue", "version", "executor", "created", "updated"]
    show_table(headers, rows, f"no workflows match in {api.org}/{app}")
    page_hint(len(found), limit, offset)


@workflows.command("get")
@click.argument("app")
@click.argument("workflow_id")
@click.option("--no-data", is_flag=True, help="Leave out the input and the output.")
@api_command
def get_workflow(api: Api, app: str, workflow_id: str, no_data: bool) -> None:
    """One workflow, with its input, output and error."""
    params = {"loadInput": "false", "loadOutput": "false"} if no_data else None
    w = api.call("GET", api.org_path("apps", app, "workflows", workflow_id), params=params)
    if api.as_json:
        print_json(w)
        return
    fields = [
        ("workflow", w["workflowId"]),
        ("status", w["status"]),
        ("name", w["workflowName"]),
        ("class", w["workflowClass"]),
        ("queue", w["queueName"]),
        ("version", w["appVersion"]),
        ("executor", w["executorId"]),
        ("parent", w["parentWorkflowId"]),
        ("forked from", w["forkedFrom"]),
        ("created", when(w["createdAt"])),
        ("updated", when(w["updatedAt"])),
        ("completed", when(w["completedAt"]) if w["completedAt"] else None),
        ("input", w["input"]),
        ("output", w["output"]),
        ("error", w["error"]),
    ]
    for name, value in fields:
        click.echo(f"{name + ':':12} {cell(value)}")


@workflows.command("steps")
@click.argument("app")
@click.argument("workflow_id")
@api_command
def steps(api: Api, app: str, workflow_id: str) -> None:
    """A workflow's steps, in order: name, outcome, child workflow, when and how long.

    A durable sleep not over yet, in a PENDING workflow, is SLEEPING until its wake time (TOOK: the whole sleep).

    The OUTPUT OR ERROR column is cut at 60 characters (ending in …); --json prints them whole."""
    found = api.call("GET", api.org_path("apps", app, "workflows", workflow_id, "steps"))
    if api.as_json:
        print_json(found)
        return
    rows = []
    # A durable sleep (DBOS.sleep) is recorded as it begins, its wake time as its completion (so
    # that TOOK is the sleep): in a workflow still PENDING, one whose completion is ahead is asleep.
    now = datetime.now(UTC)
    ahead = {
        s["stepId"]
        for s in found
        if not s["error"] and s["completedAt"] and datetime.fromisoformat(s["completedAt"]) > now
    }
    if ahead:
        params = {"loadInput": "false", "loadOutput": "false"}
        if api.call("GET", api.org_path("apps", app, "workflows", workflow_id), params=params)["status"] != "PENDING":
            ahead = set()
    for s in found:
        outcome = "ERROR" if s["error"] else ("SUCCESS" if s["completedAt"] or s["output"] is not None else "-")
        shown = clip(cell(s["error"] or s["output"]), 60)
        if s["stepId"] in ahead:
            # Its output is the wake time as DBOS stores it, seconds since 1970 (1796614730.408226):
            # said as the time it wakes, as the console says "sleeping until".
            outcome, shown = "SLEEPING", f"until {when(s['completedAt'])}"
        rows.append(
            [
                s["stepId"],
                s["stepName"],
                outcome,
                shown,
                s["childWorkflowId"],
                when(s["startedAt"]),
                duration_ms(s["startedAt"], s["completedAt"]),
            ]
        )
    show_table(
        ["step", "name", "outcome", "output or error", "child", "started", "took"],
        rows,
        f"no steps recorded for workflow {workflow_id!r}",
    )


def _matching(api: Api, app: str, search: dict[str, Any], verb: str) -> list[str]:
    """Every workflow the search selects, oldest first, read a page at a time, each one once.

    The API sorts by creation time alone (to the millisecond) and pages by offset. Paged by offset,
    a selection loses a workflow whenever one already read leaves it (a PENDING one finishes) and
    the next page's start moves past one not yet read; and workflows created in the same
    millisecond may come in another order on the next page, one taken twice and one never. So each
    page starts at the creation time of the page before's last workflow (that millisecond's
    workflows are read again, and taken once). Only a whole page created in one millisecond makes
    that millisecond read by offset, after which the next page starts past it.
    """
    path = api.org_path("apps", app, "workflows", "search")
    selected: dict[str, None] = {}
    start, offset = search.get("startTime"), 0
    within: str | None = None  # the millisecond read by offset, if any
    while True:
        bounds = {"startTime": start} if within is None else {"startTime": _ms(within), "endTime": _ms(within)}
        body = {**search, **{k: v for k, v in bounds.items() if v}, "limit": SEARCH_PAGE, "offset": offset}
        page = api.call("POST", path, body=body)
        selected.update(dict.fromkeys(w["workflowId"] for w in page))
        if len(page) < SEARCH_PAGE:
            if within is None:
                return list(selected)
            start, offset, within = _ms(within, after=True), 0, None
            continue
        first, last = page[0]["createdAt"], page[-1]["createdAt"]
        if last is None:  # no creation time to start from (beyond the year 9999): by offset
            offset += len(page)
        elif within is not None or first == last:
            within, offset = last, offset + len(page)
        else:
            start, offset = _ms(last), 0
        # A selection of several pages takes a while: say how far it has come.
        click.echo(f"selecting the workflows to {verb}: {len(selected)} so far", err=True)


def _ms(created_at: str, after: bool = False) -> str:
    """A bound of the search on the millisecond of ``created_at`` (or the next one, ``after``). The
    SDKs bring a bound to milliseconds, truncating (the Python SDK's ``int(... * 1000)``) or
    rounding: a quarter of a millisecond past lands on that millisecond either way."""
    return us_iso(datetime.fromisoformat(created_at) + timedelta(milliseconds=1.25 if after else 0.25))


def _select(api: Api, app: str, ids: Sequence[str], filters: dict[str, Any], verb: str, yes: bool) -> list[str]:
    """The ids to act on: those given, or every workflow the filters select (confirmed)."""
    if not _filtered(filters):
        if not ids:
            raise CliError(
                f"name the workflows to {verb}, or select them with filters (--status, --name...)", EXIT_USAGE
            )
        return list(dict.fromkeys(ids))
    selected = _matching(api, app, _search(filters, ids), verb)
    if selected:
        ask(
            f"{verb.capitalize()} {len(selected)} workflows of {api.org}/{app}?",
            yes,
            f"the filters select {len(selected)} workflows; give --yes to {verb} them",
        )
    return selected


def _act(
    api: Api, app: str, ids: list[str], verb: str, single: dict[str, Any], bulk: dict[str, Any], batch_size: int
) -> None:
    """One workflow through its own route; several through the bulk route, ``batch_size`` at a time."""
    if len(ids) == 1:
        api.call("POST", api.org_path("apps", app, "workflows", ids[0], verb), body=single or None)
        return
    batches = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
    path = api.org_path("apps", app, "workflows", f"bulk-{verb}")
    done = 0
    label = f"{verb} {len(ids)} workflows"
    with click.progressbar(length=len(ids), label=label, file=sys.stderr, hidden=len(batches) == 1) as bar:
        for batch in batches:
            try:
                api.call("POST", path, body={"workflowIds": batch, **bulk})
            except CliError as exc:
                raise CliError(f"{verb}: {done} of {len(ids)} done, then: {exc.message}", exc.exit_code) from exc
            done += len(batch)
            bar.update(len(batch))


Bodies = tuple[dict[str, Any], dict[str, Any]]  # the single route's body, the bulk route's


def _bulk_command(
    verb: str, past: str, extra: list[Callable[[Callable[..., Any]], Callable[..., Any]]]
) -> Callable[[Callable[..., Bodies]], click.Command]:
    """A command acting on workflows chosen by id or by filter; ``func`` turns its own options into bodies."""

    def command(func: Callable[..., Bodies]) -> click.Command:
        @click.argument("app")
        @click.argument("workflow_ids", nargs=-1)
        @_filters
        @click.option("--yes", is_flag=True, help="Do not ask before acting on what filters select.")
        @click.option(
            "--batch-size",
            type=click.IntRange(1, 1000),
            default=100,
            show_default=True,
            help="Workflows per bulk request.",
        )
        @api_command
        def run(api: Api, app: str, workflow_ids: tuple[str, ...], yes: bool, batch_size: int, **options: Any) -> None:
            filters = {name: options.pop(name) for name in FILTERS}
            single, bulk = func(**options)
            ids = _select(api, app, workflow_ids, filters, verb, yes)
            if ids:
                _act(api, app, ids, verb, single, bulk, batch_size)
            if api.as_json:
                print_json({"action": verb, "workflowIds": ids})
            elif not ids:
                click.echo("no workflows match: nothing to do", err=True)
            else:
                click.echo(f"{past} {len(ids)} workflow{'s' if len(ids) != 1 else ''}:")
                click.echo("\n".join(f"  {cell(i)}" for i in ids))

        for decorate in reversed(extra):
            run = decorate(run)
        run.__doc__ = func.__doc__
        return workflows.command(verb)(run)

    return command


@_bulk_command("cancel", "cancelled", [click.option("--children", is_flag=True, help="Cancel their children too.")])
def cancel(children: bool) -> Bodies:
    """Cancel workflows: the ids given, or all those the filters select."""
    return {"cancelChildren": True} if children else {}, {"cancelChildren": children}


@_bulk_command("resume", "resumed", [click.option("--to-queue", help="Resume them on this queue.")])
def resume(to_queue: str | None) -> Bodies:
    """Resume workflows (cancelled or failed ones, from their last step): the ids given, or those the filters select."""
    return ({"queueName": to_queue}, {"queueName": to_queue}) if to_queue else ({}, {})


@workflows.command("fork")
@click.argument("app")
@click.argument("workflow_id")
@click.option("--from-step", type=click.IntRange(0), default=0, show_default=True,
              help="Run again from this step (0: the first, in either SDK's numbering).")  # fmt: skip
@click.option("--to-version", help="Run the fork on this application version.")
@click.option("--new-id", help="The fork's workflow id (default: a new UUID).")
@click.option("--queue", help="Enqueue the fork on this queue.")
@api_command
def fork(
    api: Api,
    app: str,
    workflow_id: str,
    from_step: int,
    to_version: str | None,
    new_id: str | None,
    queue: str | None,
) -> None:
    """Start a new workflow from one of a workflow's steps (the steps before it keep their recorded outputs)."""
    body = {"startStep": from_step, "appVersion": to_version, "newWorkflowId": new_id, "queueName": queue}
    made = api.call(
        "POST",
        api.org_path("apps", app, "workflows", workflow_id, "fork"),
        body={k: v for k, v in body.items() if v is not None},
    )
    if api.as_json:
        print_json(made)
        return
    click.echo(f"forked {cell(workflow_id)} from step {from_step}: {cell(made['workflowId'])}")
