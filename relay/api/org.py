"""What the console needs to know about the caller and about Relay itself."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from relay.api.common import ApiError, Ctx, DecodedRoute, authenticated, permitted
from relay.auth import KeyGrant, Permission
from relay.core.times import us_iso

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}", tags=["org"])
# Routes about the caller that name no org: a client holding only a key (the CLI) starts here.
caller_router = APIRouter(route_class=DecodedRoute, prefix="/v2", tags=["org"])


async def _member(request: Request, org: str) -> KeyGrant:
    grant = authenticated(request)
    if grant.org != org:
        raise ApiError(403, "forbidden", f"this API key has no access to org {org!r}")
    return grant


async def _org_reader(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.ORGANIZATION_READ)


Member = Annotated[KeyGrant, Depends(_member)]


async def _any_key(request: Request) -> KeyGrant:
    return authenticated(request)


AnyKey = Annotated[KeyGrant, Depends(_any_key)]
OrgReader = Annotated[KeyGrant, Depends(_org_reader)]


class WhoAmI(BaseModel):
    org: str
    tokenName: str
    permissions: list[str]
    appNames: list[str] | None  # None: every app of the org


class UserProfile(WhoAmI):
    """Conductor's UserProfile (``getCurrentUser``), for the calling key, with whoami's members beside
    it. Relay has keys, not users: the key is the identity (``name`` its name, ``createdAt`` when it
    was made; null for a key deleted in the second before the key ring heard of it), and what a
    user of a hosted account has and a key has not (an email, a subscription plan) is null, not made
    up."""

    name: str
    email: str | None
    orgName: str
    orgId: str  # Relay knows an org by its name, as an app's orgId has it
    subscriptionPlan: str | None
    createdAt: str | None


class Instance(BaseModel):
    instanceId: str
    live: bool
    leaseEpoch: int
    leaseExpiresAt: str | None
    startedAt: str | None
    renewedAt: str | None
    adoptedBy: str | None
    adoptedAt: str | None
    releasedAt: str | None  # given up by a clean stop (None once the instance starts again)
    executors: int  # this org's executors whose records name the instance


@router.get("/whoami", response_model=WhoAmI)
async def whoami(org: str, who: Member) -> WhoAmI:
    """The calling key: its permissions and apps (the console shows only what it may do)."""
    return WhoAmI(
        org=who.org,
        tokenName=who.name,
        permissions=sorted(p.value for p in who.permissions),
        appNames=sorted(who.apps) if who.apps is not None else None,
    )


@caller_router.get("/whoami", response_model=WhoAmI)
async def whoami_any_org(who: AnyKey) -> WhoAmI:
    """The calling key, of whichever org: its org, name, permissions and apps (401 without a valid key)."""
    return await whoami(who.org, who)


@caller_router.get("/users/me", response_model=UserProfile)
async def current_user(ctx: Ctx, who: AnyKey) -> UserProfile:
    """Conductor's "get current user", for the calling key (401 without a valid key). ``dbosctl
    whoami`` prints it, and dbosctl's other commands take their org from its ``orgName`` when their
    profile names none: without it, a profile needed ``--org`` for every command."""
    record = await ctx.keys.record(who.key_id)
    me = await whoami(who.org, who)
    return UserProfile(
        **me.model_dump(),
        name=who.name,
        email=None,
        orgName=who.org,
        orgId=who.org,
        subscriptionPlan=None,
        createdAt=us_iso(record.created_at) if record is not None else None,
    )


@router.get("/permissions", response_model=list[Permission])
async def grantable_permissions(org: str, _: Member) -> list[Permission]:
    """Conductor's "list grantable permissions" (``dbosctl permission list``): every permission a key
    may be given, as the names ``POST .../tokens/{name}`` takes (Conductor's documentation gives no
    shape for it). Any key of the org may read it, as it may read its own (``whoami``): the catalogue
    is Conductor's public one, the same for every org."""
    return list(Permission)  # in the order Conductor's documentation lists them


@router.get("/instances", response_model=list[Instance])
async def instances(org: str, ctx: Ctx, who: OrgReader) -> list[Instance]:
    """Relay's instances and their leases, with how many of this org's executors each holds (of
    the key's apps, for a key limited to apps)."""
    rows = await ctx.instances.list_with_executors(org, who.apps)
    return [
        Instance(
            instanceId=r["instance_id"],
            live=bool(r["live"]),
            leaseEpoch=int(r["lease_epoch"]),
            leaseExpiresAt=us_iso(r["lease_expires_at"]),
            startedAt=us_iso(r["started_at"]),
            renewedAt=us_iso(r["renewed_at"]),
            adoptedBy=r["adopted_by"],
            adoptedAt=us_iso(r["adopted_at"]),
            releasedAt=us_iso(r["released_at"]),
            executors=int(r["executors"]),
        )
        for r in rows
    ]
