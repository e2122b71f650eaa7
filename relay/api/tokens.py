"""Keys managed at run time, as DBOS Conductor's tokens API has them."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from relay.api.common import Ctx, Page, PathId, actor, iso, permitted
from relay.auth import KeyGrant, Permission
from relay.store.keys import TokenRecord

router = APIRouter(prefix="/v2/orgs/{org}/tokens")
TokenName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


def _reader(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.TOKEN_READ)


def _writer(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.TOKEN_WRITE)


Reader = Annotated[KeyGrant, Depends(_reader)]
Writer = Annotated[KeyGrant, Depends(_writer)]


class CreateToken(BaseModel):
    model_config = ConfigDict(extra="forbid")

    appNames: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = None
    permissions: list[Permission] | None = None


class RenameToken(BaseModel):
    model_config = ConfigDict(extra="forbid")

    newName: TokenName


def token_json(record: TokenRecord) -> dict[str, Any]:
    return {
        "tokenName": record.name,
        # Conductor names apps by id; Relay's apps are known by name, so both carry the names.
        "appIds": record.apps or [],
        "appNames": record.apps,
        "permissions": [p.value for p in record.permissions],
        "createdAt": iso(record.created_at),
        "source": record.source,
    }


@router.get("")
async def list_tokens(org: str, ctx: Ctx, _: Reader, page: Page) -> list[dict[str, Any]]:
    return [token_json(t) for t in await ctx.keys.list_tokens(org, page.limit, page.offset)]


@router.post("/{token_name}", status_code=201)
async def create_token(
    org: str, token_name: TokenName, ctx: Ctx, who: Writer, body: CreateToken | None = None
) -> dict[str, str]:
    """A new key; its secret is in this answer and nowhere else (Relay keeps only its SHA-256)."""
    body = body or CreateToken()
    created = await ctx.tokens.create(org, token_name, body.appNames, body.permissions, who)
    return {"token": created.secret, "tokenName": created.record.name}


@router.patch("/{token_name}")
async def rename_token(org: str, token_name: PathId, body: RenameToken, ctx: Ctx, who: Writer) -> dict[str, Any]:
    return token_json(await ctx.tokens.rename(org, token_name, body.newName, actor(who)))


@router.delete("/{token_name}", status_code=204)
async def delete_token(org: str, token_name: PathId, ctx: Ctx, who: Writer) -> Response:
    """Refused at once by every instance (within about a second); the sockets it opened are closed."""
    await ctx.tokens.delete(org, token_name, actor(who))
    return Response(status_code=204)
