"""Keys managed at run time, as DBOS Conductor's tokens API has them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from pydantic import AfterValidator, Field, Strict

from relay.api.common import NO_NUL, Body, ConductorBody, Ctx, DecodedRoute, PathId, WholePage, permitted, storable
from relay.api.shapes import Shape, one_of
from relay.auth import KeyGrant, Permission
from relay.core.times import us_iso
from relay.store.keys import TokenRecord

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/tokens")
TokenName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


async def _reader(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.TOKEN_READ)


async def _writer(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.TOKEN_WRITE)


Reader = Annotated[KeyGrant, Depends(_reader)]
Writer = Annotated[KeyGrant, Depends(_writer)]


AppName = Annotated[str, Field(min_length=1, max_length=256, pattern=NO_NUL), AfterValidator(storable)]


class CreateToken(ConductorBody):
    appNames: (
        list[Annotated[str, Field(min_length=1, max_length=256, pattern=NO_NUL), AfterValidator(storable)]] | None
    ) = None
    permissions: list[Annotated[Permission, Strict(False)]] | None = None  # by value


class RenameToken(Body):
    newName: TokenName


class Token(Shape):
    """Conductor's Token (``tokenName``, ``appIds``, ``permissions``, ``createdAt``), with Relay's
    ``appNames`` (null: every app) and ``source`` (``config`` for relay.yaml's keys)."""

    tokenName: str
    appIds: list[str]
    appNames: list[str] | None
    permissions: list[Permission]
    createdAt: str | None
    source: str = one_of("config", "api", "generated")


class TokenCreated(Shape):
    token: str
    tokenName: str


def token(record: TokenRecord) -> Token:
    return Token(
        tokenName=record.name,
        # Conductor names apps by id; Relay's apps are known by name, so both carry the names.
        appIds=record.apps or [],
        appNames=record.apps,
        permissions=record.permissions,
        createdAt=us_iso(record.created_at),
        source=record.source,
    )


@router.get("")
async def list_tokens(org: str, ctx: Ctx, who: Reader, page: WholePage) -> list[Token]:
    """The org's keys; for a key scoped to apps, only the keys scoped to some of its apps."""
    return [token(t) for t in await ctx.keys.list_tokens(org, page.limit, page.offset, within=who.apps)]


@router.post("/{token_name}", status_code=201)
async def create_token(
    org: str, token_name: TokenName, ctx: Ctx, who: Writer, body: CreateToken | None = None
) -> TokenCreated:
    """A new key; its secret is in this answer and nowhere else (Relay keeps only its SHA-256)."""
    body = body or CreateToken()
    created = await ctx.tokens.create(org, token_name, body.appNames, body.permissions, who)
    return TokenCreated(token=created.secret, tokenName=created.record.name)


@router.patch("/{token_name}")
async def rename_token(org: str, token_name: PathId, body: RenameToken, ctx: Ctx, who: Writer) -> Token:
    """403 for a key beyond the caller's powers (permissions it lacks, apps outside its scope)."""
    return token(await ctx.tokens.rename(org, token_name, body.newName, who))


@router.delete("/{token_name}", status_code=204)
async def delete_token(org: str, token_name: PathId, ctx: Ctx, who: Writer) -> Response:
    """Refused at once by every instance (within about a second); the sockets it opened are closed.
    403 for a key beyond the caller's powers (permissions it lacks, apps outside its scope)."""
    await ctx.tokens.delete(org, token_name, who)
    return Response(status_code=204)
