"""Alerting rules, as DBOS Conductor's API has them, with Relay's kinds and destinations.

``GET`` lists relay.yaml's rules (read-only) and the API's together. A rule's
webhook is shown as its scheme, host and port with ``secretSet``: its path,
query and secret never appear in an answer (nor in the audit log or Relay's
log). The secret is in the answer to the ``POST`` that made it, once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Response
from pydantic import AfterValidator, ConfigDict, Field, Strict, ValidationError

from relay.api.common import (
    NO_NUL,
    Admin,
    ApiError,
    Body,
    Caller,
    ConductorBody,
    Ctx,
    DecodedRoute,
    JsonInteger,
    PathId,
    QueueOrScheduleName,
    WholePage,
    actor,
    error_response,
)
from relay.api.shapes import Shape
from relay.config import AlertRuleConfig, Duration, DurationOrZero
from relay.config import Count as ConfigCount
from relay.core.alerts import (
    CONDUCTOR_PARAMS,
    MAX_SECRET,
    MIN_SECRET,
    PARAMS,
    SECRET_PATTERN,
    SECRET_RULE,
    Kind,
    valid_secret,
)
from relay.core.times import us_iso
from relay.domain.alerts import destination_of
from relay.store.alerts import RuleRecord, interval_secs

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/apps/{app}/alerting-rules")

# Where a field of relay.yaml's rule is in the API's body, for a 422's ``errors``.
BODY_FIELDS = {
    "kind": "ruleType",
    "webhook": "webhook",
    "secret": "secret",
    "format": "format",
    "receiverApp": "receivingAppName",
    "minIntervalSecs": "minIntervalSecs",
}


# The bounds are relay.yaml's (relay.config): durations finite and at most ten years (PostgreSQL
# computes now() minus them), counts what a 32-bit integer holds; a queue's name is the workflow
# API's (relay_protocol.MAX_QUEUE_OR_SCHEDULE_NAME_BYTES), so a rule can watch any queue the API reads.
Count = Annotated[ConfigCount, JsonInteger]
WorkflowName = Annotated[str, Field(min_length=1, max_length=1024, pattern=NO_NUL)]
QueueName = Annotated[QueueOrScheduleName, Field(min_length=1)]


class RuleMetadata(Body):
    """A rule's parameters, by Relay's names or Conductor's (``workflow_name``, ``threshold``,
    ``period_secs``, ``queue_name``, ``threshold_secs``); each kind takes its own (README "Alerts")."""

    workflowName: WorkflowName | None = None
    workflow_name: WorkflowName | None = None
    count: Count | None = None
    threshold: Count | None = None
    windowSecs: Duration | None = None
    period_secs: Duration | None = None
    queueName: QueueName | None = None
    queue_name: QueueName | None = None
    thresholdSecs: Duration | None = None
    threshold_secs: Duration | None = None
    forSecs: DurationOrZero | None = None
    reason: Literal["no_healthy_peer", "version_upgrade_not_allowed", "no_peer_of_its_language"] | None = None
    attempts: Count | None = None


def _by_type_and_destination(schema: dict[str, Any]) -> None:
    """The body's document: one shape per rule type and destination (``oneOf``), so that a body the
    document allows is one Relay takes. Each type takes its own ``ruleMetadata`` members (a member
    of another type may only be null); a ``webhook`` excludes ``receivingAppName``; ``secret`` and
    ``format: slack`` go with a webhook only; an UnresponsiveApplication rule without a webhook
    names its ``receivingAppName`` (an app with no executor cannot take its own alert). What no
    document can say: a webhook's host must resolve to an address ``alerts.allowedDestinations``
    allows (a 422 otherwise), and ``receivingAppName`` must be another app of the org (a 404)."""
    members: dict[str, Any] = schema.pop("properties")
    for key in ("type", "required", "additionalProperties"):
        schema.pop(key, None)
    metadata_members = RuleMetadata.model_json_schema()["properties"]
    null = {"type": "null"}

    def given(member: str) -> dict[str, Any]:
        """A member's schema without its null (it must be there)."""
        return next(s for s in members[member]["anyOf"] if s != null)

    variants = []
    for kind in Kind:
        takes = {*PARAMS[kind], *CONDUCTOR_PARAMS.get(kind, {})}
        metadata = {
            "type": "object",
            "properties": {name: s if name in takes else null for name, s in metadata_members.items()},
            "additionalProperties": False,
        }
        # A parameter by one of its names: Conductor's and Relay's both given (not null) say it twice.
        twice = [
            {"not": {"required": [a, b], "properties": {a: {"not": null}, b: {"not": null}}}}
            for a, b in CONDUCTOR_PARAMS.get(kind, {}).items()
        ]
        if twice:
            metadata["allOf"] = twice
        common = {**members, "ruleType": {"const": kind.value}, "ruleMetadata": {"anyOf": [metadata, null]}}
        to_webhook = {**common, "webhook": given("webhook"), "receivingAppName": null}
        to_app = {**common, "webhook": null, "secret": null, "format": {"const": "json"}}
        needs_receiver = kind is Kind.UNRESPONSIVE_APPLICATION
        if needs_receiver:
            to_app["receivingAppName"] = given("receivingAppName")
        variants += [
            {"title": f"{kind.value} to a webhook", "type": "object", "properties": to_webhook,
             "required": ["ruleType", "webhook"], "additionalProperties": False},
            {"title": f"{kind.value} to an app's executors", "type": "object", "properties": to_app,
             "required": ["ruleType", *(["receivingAppName"] if needs_receiver else [])],
             "additionalProperties": False},
        ]  # fmt: skip
    schema["oneOf"] = variants


def _secret(value: str) -> str:
    if not valid_secret(value):
        raise ValueError(SECRET_RULE)  # in words: the pattern says it to a program
    return value


# The pattern in the document only, so that its refusal names the rule rather than quoting the pattern.
Secret = Annotated[
    str,
    Field(min_length=MIN_SECRET, max_length=MAX_SECRET, json_schema_extra={"pattern": SECRET_PATTERN}),
    AfterValidator(_secret),
]


class CreateAlertingRule(ConductorBody):
    """Conductor's ``CreateAlertInputBody`` (``ruleType``, ``ruleMetadata``, ``minIntervalSecs``,
    ``receivingAppName``) and Relay's ``webhook``, ``secret`` (else one is made) and ``format``."""

    model_config = ConfigDict(json_schema_extra=_by_type_and_destination)  # and Body's own

    ruleType: Annotated[Kind, Strict(False)]  # by value
    ruleMetadata: RuleMetadata | None = None
    minIntervalSecs: DurationOrZero | None = None
    receivingAppName: Annotated[str, Field(min_length=1, max_length=256, pattern=NO_NUL)] | None = None
    webhook: Annotated[str, Field(min_length=1, max_length=2048, pattern=NO_NUL)] | None = None
    secret: Secret | None = None
    format: Literal["json", "slack"] = "json"


class AlertingRule(Shape):
    """Conductor's ``AlertingRule`` (``id`` to ``lastFiredAt``) and Relay's members beside it. A rule
    to a webhook has ``webhook`` (its scheme, host and port only), ``format`` and ``secretSet``; a rule
    to an app's executors has ``receiverApp``. ``secret`` is in the answer to the ``POST`` that drew
    it, and nowhere else."""

    id: str
    appId: str
    receivingAppId: str | None
    ruleType: Kind
    ruleMetadata: dict[str, Any]
    minIntervalSecs: int | float
    lastFiredAt: str | None
    org: str
    app: str
    kind: Kind
    source: Literal["config", "api"]
    readOnly: bool
    webhook: str | None = None
    format: Literal["json", "slack"] | None = None
    secretSet: bool | None = None
    receiverApp: str | None = None
    createdAt: str | None
    createdBy: str | None
    secret: str | None = None


def _number(value: float) -> float | int:
    return int(value) if value.is_integer() else value


def rule_json(record: RuleRecord) -> dict[str, Any]:
    """Conductor's ``AlertingRule``, and Relay's members beside it."""
    return {
        "id": record.id,
        "appId": record.app,
        "receivingAppId": record.receiver_app,
        "ruleType": record.kind.value,
        "ruleMetadata": record.params,
        "minIntervalSecs": _number(interval_secs(record.min_interval_secs)),  # an infinity is no JSON
        "lastFiredAt": us_iso(record.last_fired_at),
        "org": record.org,
        "app": record.app,
        "kind": record.kind.value,
        "source": record.source,
        "readOnly": record.source == "config",
        **destination_of(record),
        "createdAt": us_iso(record.created_at),
        "createdBy": record.created_by,
    }


def _invalid(errors: list[dict[str, str]]) -> Response:
    detail = "; ".join(f"{e['location']}: {e['message']}" for e in errors)
    return error_response(422, "invalid_request", detail, errors=errors)


def _rule_fields(body: CreateAlertingRule) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """relay.yaml's fields of the rule the body describes; Conductor's names in ``ruleMetadata``
    (``workflow_name``, ``threshold``, ``period_secs``, ``queue_name``, ``threshold_secs``) are taken
    as Relay's, and ``*`` as any workflow or queue."""
    fields: dict[str, Any] = {"kind": body.ruleType, "format": body.format}
    for name, value in {"webhook": body.webhook, "secret": body.secret, "receiverApp": body.receivingAppName,
                        "minIntervalSecs": body.minIntervalSecs}.items():  # fmt: skip
        if value is not None:
            fields[name] = value
    errors = []
    aliases = CONDUCTOR_PARAMS.get(body.ruleType, {})
    given = body.ruleMetadata.model_dump(exclude_none=True) if body.ruleMetadata else {}
    given_as: dict[str, tuple[str, Any]] = {}  # a parameter is given by one of its names
    for key, value in given.items():
        name = aliases.get(key, key)
        other = given_as.setdefault(name, (key, value))
        if other[0] != key:
            message = f"given as both {other[0]} and {key} (Relay's name and Conductor's): give one"
            errors.append({"location": f"body.ruleMetadata.{key}", "message": message})
        elif name not in PARAMS[body.ruleType]:
            takes = ", ".join(PARAMS[body.ruleType]) or "no parameters"
            message = f"not a parameter of {body.ruleType.value} (it takes {takes})"
            errors.append({"location": f"body.ruleMetadata.{key}", "message": message})
        elif not (name in ("workflowName", "queueName") and value == "*"):
            fields[name] = value
    return fields, errors


def _locations(exc: ValidationError) -> list[dict[str, str]]:
    errors = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        where = f"body.{BODY_FIELDS.get(field, f'ruleMetadata.{field}')}" if field else "body"
        errors.append({"location": where, "message": str(err["msg"]).removeprefix("Value error, ")})
    return errors


# The members a rule has (a webhook's or an app's), no nulls for those it has not.
@router.get("", response_model=list[AlertingRule], response_model_exclude_unset=True)
async def list_rules(org: str, app: str, ctx: Ctx, _: Caller, page: WholePage) -> list[dict[str, Any]]:
    if not await ctx.apps.exists(org, app):
        raise ApiError(404, "not_found", f"no app {app!r} in org {org!r}")
    return [rule_json(r) for r in await ctx.alert_rules.store.list_rules(org, app, page.limit, page.offset)]


@router.post("", status_code=201, response_model=AlertingRule, response_model_exclude_unset=True)
async def create_rule(org: str, app: str, body: CreateAlertingRule, ctx: Ctx, who: Admin) -> Any:
    """A rule; 422 when its webhook's destination is not allowed (alerts.allowedDestinations), 403 when
    the key is limited to apps and its receiving app is not one of them, 404 when that app does not exist."""
    fields, errors = _rule_fields(body)
    if errors:
        return _invalid(errors)
    try:
        rule = AlertRuleConfig.model_validate(fields)
    except ValidationError as exc:
        return _invalid(_locations(exc))
    receiver = rule.receiver_app  # None: a webhook, or the rule's own app (which the key may touch)
    if receiver is not None and who.apps is not None and receiver not in who.apps:
        # Before the app is looked for: a 404 would tell a limited key which apps exist.
        raise ApiError(403, "forbidden", f"this API key has no access to app {receiver!r} (receivingAppName)")
    refused = await ctx.alert_rules.refusal(org, app, rule)
    if refused is not None:
        return _invalid([{"location": refused[0], "message": refused[1]}])
    created = await ctx.alert_rules.create(org, app, rule, actor(who))
    answer = rule_json(created.record)
    if created.secret is not None:
        answer["secret"] = created.secret  # made by Relay: shown here and nowhere else
    return answer


@router.delete("/{rule_id}", status_code=204)
async def delete_rule(org: str, app: str, rule_id: PathId, ctx: Ctx, who: Admin) -> Response:
    """204; 409 for a rule of relay.yaml (change it there), 404 for no such rule."""
    await ctx.alert_rules.delete(org, app, rule_id, actor(who))
    return Response(status_code=204)
