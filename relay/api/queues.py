"""An app's queues, as its executors declare them (Conductor's Queue shape)."""

from __future__ import annotations

from fastapi import APIRouter

from relay.api import shapes
from relay.api.common import ApiError, Caller, Ctx, DecodedRoute, PathId, answered, not_the_apps
from relay.core.ids import owned_by
from relay_protocol import GetQueueReply, GetQueueRequest, ListQueuesBody, ListQueuesReply, ListQueuesRequest

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/apps/{app}/queues", tags=["queues"])


@router.get("", response_model=list[shapes.Queue])
async def list_queues(org: str, app: str, ctx: Ctx, _: Caller) -> list[shapes.Queue]:
    ask = ListQueuesRequest(body=ListQueuesBody(application_name=owned_by(app)))
    reply = answered(await ctx.gateway.ask(org, app, lambda: ask, ListQueuesReply))
    return [shapes.queue(q) for q in reply.output]


@router.get("/{queue_name}", response_model=shapes.Queue)
async def get_queue(org: str, app: str, queue_name: PathId, ctx: Ctx, _: Caller) -> shapes.Queue:
    reply = answered(await ctx.gateway.ask(org, app, lambda: GetQueueRequest(name=queue_name), GetQueueReply))
    if reply.output is None or not_the_apps(app, reply.output.application_name):
        raise ApiError(404, "not_found", f"no queue {queue_name!r} in app {app!r}")
    return shapes.queue(reply.output)
