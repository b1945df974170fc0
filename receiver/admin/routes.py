"""The admin API, ``/admin/v1``: register, list and end watches; submit requests
(:mod:`receiver.admin.submit`); the overview, batches and dead letters
(:mod:`receiver.admin.ops`).

Bearer tokens from ``admin_tokens``, checked by :func:`receiver.auth.bearer_auth`; with
none configured every ``/admin/v1`` route answers 404, as if it did not exist. A missing,
malformed or wrong token is 401 saying why. Bad input is a 4xx whose ``error`` names the
field; nothing a client sends gives a 500. ``GET /admin/v1/openapi.json`` describes the routes.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from nopoll.kinds import WATCHABLE_KINDS, WatchKind
from receiver.admin._http import account_problem, page_params, read_model
from receiver.admin.ops import MAX_BODY as _REPLAY_MAX_BODY
from receiver.admin.ops import OPS_OPENAPI, ReplayRequest, ops_routes
from receiver.admin.submit import MAX_BODY as _SUBMIT_MAX_BODY
from receiver.admin.submit import SUBMIT_OPENAPI, SubmitRequest, submit_endpoint
from receiver.auth import TokenBook, bearer_auth
from receiver.config.accounts import DEFAULT_TENANT
from receiver.config.settings import Settings
from receiver.console import Console
from receiver.queue.jobs import poll_job
from receiver.responses import ERROR_RESPONSE, json_answer, json_error
from receiver.watches.store import WatchStore, register_many

__all__ = ["BODY_CAPS", "JourneyAnswer", "WatchRequest", "admin_routes"]

_MAX_IDS = 10_000
_MAX_BODY = 4 * 1024 * 1024
_STATES = ("pending", "landed", "expired")
_TENANT = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ALL_TENANTS = "*"
_KIND_RULE = f"kind: must be {' or '.join(WATCHABLE_KINDS)}"
BODY_CAPS = {
    "/admin/v1/watches": _MAX_BODY,
    "/admin/v1/deadletters/replay": _REPLAY_MAX_BODY,
    "/admin/v1/submit": _SUBMIT_MAX_BODY,
}
"""The most of a request body each admin route that takes one reads (bytes)."""


class WatchRequest(BaseModel):
    """``POST /admin/v1/watches``: ids to watch."""

    model_config = ConfigDict(extra="forbid")

    provider: str = Field(description="a provider name from the config")
    kind: WatchKind
    ids: list[str] = Field(min_length=1, max_length=_MAX_IDS)
    expect_callback: bool | None = Field(
        default=None,
        description="poll only if no callback came within reconcile_after_s; "
        "default false (poll from first_poll_s)",
    )
    tenant: str = Field(
        default=DEFAULT_TENANT,
        description="the tenant whose account polls them (from tenants:, or default)",
    )


class WatchAnswer(BaseModel):
    watching: int = Field(description="new watches")
    already: int = Field(description="ids already watched or landed: nothing changed")
    invalid: list[dict[str, str]] = Field(description="ids refused, with the reason")


class JourneyEvent(BaseModel):
    model_config = ConfigDict(extra="allow")

    at: float = Field(description="when (Unix seconds)")
    step: Literal["callback", "fetch", "sink", "dead_letter", "replay"] = Field(
        description="callback: event, webhook_id, tenant, answer; fetch: kind, try, then "
        "status, or http and error (the provider's message); sink: sinks and failed, or "
        "sink with rows (a batch's: and chunks); dead_letter: letter, sink, error; "
        "replay: letter"
    )


class JourneyAnswer(BaseModel):
    provider: str
    tenant: str
    id: str = Field(description="the response or batch id the journey is of")
    asked: str = Field(description="what was asked for: an id, a row key or a webhook-id")
    kind: Literal[WatchKind, "unknown"]
    row: str | None = Field(description="the batch row key asked for, if one was")
    webhook_id: str | None = Field(description="the webhook-id asked for, if one was")
    events: list[JourneyEvent] = Field(description="oldest first; the newest 64 are kept")
    watch: dict[str, Any] | None = Field(description="its watch, as GET /admin/v1/watches")
    dead_letters: list[dict[str, Any]] = Field(description="kept now: replay them by id")
    result: str | None = Field(description="the results API's path of the stored envelope")
    envelope: dict[str, Any] | None = Field(description="a batch row's stored envelope")


def admin_routes(settings: Settings, redis: Redis) -> list[BaseRoute]:
    """The ``/admin/v1`` routes (all of them 404 when no admin token is configured)."""
    api = _AdminApi(settings, redis)
    admins = bearer_auth(TokenBook.of(settings), "admin")
    submit = submit_endpoint(settings, redis)
    return [
        *ops_routes(api.console, admins),
        Route(
            "/admin/v1/journey/{provider}/{id:path}",
            api.journey,
            methods=["GET"],
            middleware=admins,
        ),
        Route("/admin/v1/watches", api.add, methods=["POST"], middleware=admins),
        Route("/admin/v1/watches", api.listing, methods=["GET"], middleware=admins),
        Route(
            "/admin/v1/watches/{provider}/{kind}/{id:path}",
            api.remove,
            methods=["DELETE"],
            middleware=admins,
        ),
        Route("/admin/v1/openapi.json", api.openapi, methods=["GET"], middleware=admins),
        Route("/admin/v1/submit", submit, methods=["POST"], middleware=admins),
    ]


class _AdminApi:
    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.settings = settings
        self.store = WatchStore(redis, ended_ttl_s=settings.dedupe_ttl_s)
        self.console = Console(settings, redis)

    async def add(self, request: Request) -> Response:
        body = await read_model(request, WatchRequest)
        if isinstance(body, Response):
            return body
        if (problem := account_problem(self.settings, body.provider, body.tenant)) is not None:
            return problem
        if poll_job(body.kind) is None:  # watchable, but no fetch job says how to poll it
            return json_error(400, f"kind: a {body.kind} cannot be polled (no job polls it)")
        provider = self.settings.providers[body.provider]
        try:
            done = await register_many(
                self.store,
                body.provider,
                body.kind,
                body.ids,
                first_poll_s=provider.watch.first_poll_s,
                reconcile_after_s=provider.watch.reconcile_after_s,
                expect_callback=bool(body.expect_callback),
                tenant=body.tenant,
            )
        except (RedisError, OSError):
            return json_error(503, "Redis unreachable, retry later")
        invalid = [{"id": i[:300], "reason": r} for i, r in done.invalid]
        return json_answer(
            202, {"watching": done.watching, "already": done.already, "invalid": invalid}
        )

    async def listing(self, request: Request) -> Response:
        q = request.query_params
        if (kind := q.get("kind")) not in (None, *WATCHABLE_KINDS):
            return json_error(400, _KIND_RULE)
        if (state := q.get("state")) not in (None, *_STATES):
            return json_error(400, f"state: must be one of {', '.join(_STATES)}")
        provider = q.get("provider")
        if provider is not None and provider not in self.settings.providers:
            return json_error(400, f"provider: unknown provider {provider[:64]!r}")
        tenant = q.get("tenant", DEFAULT_TENANT)
        if tenant != _ALL_TENANTS and not _TENANT.fullmatch(tenant):
            return json_error(400, f"tenant: {_TENANT_RULE}, or * for every tenant")
        page = page_params(q, "cursor", 0, 100)
        if isinstance(page, Response):
            return page
        cursor, limit = page
        if not 0 <= cursor < 2**64:  # a Redis SCAN cursor is an unsigned 64-bit number
            return json_error(400, "cursor: must be a next_cursor this listing gave, or 0")
        try:
            watches, after = await self.store.scan(
                provider=provider,
                kind=kind,
                state=state,
                tenant=None if tenant == _ALL_TENANTS else tenant,
                cursor=cursor,
                count=limit,
            )
        except (RedisError, OSError):
            return json_error(503, "Redis unreachable, retry later")
        return json_answer(
            200,
            {"watches": [w.to_dict() for w in watches], "next_cursor": str(after or "")},
        )

    async def remove(self, request: Request) -> Response:
        p = request.path_params
        if p["kind"] not in WATCHABLE_KINDS:
            return json_error(400, _KIND_RULE)
        tenant = request.query_params.get("tenant", DEFAULT_TENANT)
        if not _TENANT.fullmatch(tenant):
            return json_error(400, f"tenant: {_TENANT_RULE}")
        try:
            deleted = await self.store.delete(p["provider"], p["kind"], p["id"], tenant)
        except (RedisError, OSError):
            return json_error(503, "Redis unreachable, retry later")
        return Response(status_code=204) if deleted else json_error(404, "no such watch")

    async def journey(self, request: Request) -> Response:
        provider, object_id = request.path_params["provider"], request.path_params["id"]
        tenant = request.query_params.get("tenant", DEFAULT_TENANT)
        if not _TENANT.fullmatch(tenant):
            return json_error(400, f"tenant: {_TENANT_RULE}")
        if (problem := account_problem(self.settings, provider, tenant)) is not None:
            return problem
        if not 1 <= len(object_id) <= 600:
            return json_error(400, "id: must be 1 to 600 characters")
        try:
            found = await self.console.journey(provider, object_id, tenant)
        except (RedisError, OSError):
            return json_error(503, "Redis unreachable, retry later")
        if found is None:
            days = self.settings.journey_ttl_s / 86_400
            return json_error(
                404,
                f"nothing known of {object_id[:300]!r} at {provider} for tenant {tenant!r}: "
                f"no callback, fetch, watch, dead letter or stored result (a journey is kept "
                f"{days:g} days after its last event)",
            )
        return json_answer(200, found)

    async def openapi(self, request: Request) -> Response:
        return json_answer(200, OPENAPI)


_TENANT_RULE = "must be default or a tenant name ([A-Za-z0-9_-]{1,64})"


def _params(*names: str) -> list[dict[str, Any]]:
    return [
        {"name": n, "in": "query", "required": False, "schema": {"type": "string"}} for n in names
    ]


_ERROR = ERROR_RESPONSE
_AUTH = {"401": _ERROR, "404": {"description": "no admin token is configured"}}
_TENANT_PARAM: dict[str, Any] = {
    "name": "tenant",
    "in": "query",
    "required": False,
    "schema": {"type": "string", "default": DEFAULT_TENANT},
    "description": "whose watches: each tenant's watch of an id is its own",
}

_JOURNEY_SCHEMA = JourneyAnswer.model_json_schema(ref_template="#/components/schemas/{model}")
_JOURNEY_DEFS: dict[str, Any] = _JOURNEY_SCHEMA.pop("$defs", {})

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "nopoll admin API", "version": "1"},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "WatchRequest": WatchRequest.model_json_schema(),
            "WatchAnswer": WatchAnswer.model_json_schema(),
            "SubmitRequest": SubmitRequest.model_json_schema(),
            "ReplayRequest": ReplayRequest.model_json_schema(),
            "JourneyAnswer": _JOURNEY_SCHEMA,
            **_JOURNEY_DEFS,
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/admin/v1/watches": {
            "post": {
                "summary": "Watch ids: poll them until they are terminal, then land them",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/WatchRequest"}
                        }
                    },
                },
                "responses": {
                    "202": {
                        "description": "registered",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/WatchAnswer"}
                            }
                        },
                    },
                    "400": _ERROR,
                    "503": _ERROR,
                    **_AUTH,
                },
            },
            "get": {
                "summary": "List watches (a page; follow next_cursor until it is empty)",
                "parameters": [
                    *_params("provider", "kind", "state", "cursor", "limit"),
                    _TENANT_PARAM | {"description": _TENANT_PARAM["description"] + "; * for all"},
                ],
                "responses": {
                    "200": {"description": "a page of watches"},
                    "400": _ERROR,
                    "503": _ERROR,
                    **_AUTH,
                },
            },
        },
        "/admin/v1/watches/{provider}/{kind}/{id}": {
            "delete": {
                "summary": "Stop watching one id (the watch of one tenant)",
                "parameters": [
                    *(
                        {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                        for n in ("provider", "kind", "id")
                    ),
                    _TENANT_PARAM,
                ],
                "responses": {
                    "204": {"description": "ended"},
                    "404": _ERROR,
                    "400": _ERROR,
                    "401": _ERROR,
                    "503": _ERROR,
                },
            }
        },
        "/admin/v1/journey/{provider}/{id}": {
            "get": {
                "summary": "Where is my result? The journey of one id: callbacks, fetch tries, "
                "sinks, watch, dead letters and the stored envelope's link",
                "parameters": [
                    {
                        "name": "provider",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                        "description": "a response id, batch id, {batch_id}/{custom_id} row key "
                        "or a callback's webhook-id",
                    },
                    _TENANT_PARAM | {"description": "whose id: each tenant's journeys are its own"},
                ],
                "responses": {
                    "200": {
                        "description": "the journey",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/JourneyAnswer"}
                            }
                        },
                    },
                    "400": _ERROR,
                    "404": _ERROR,
                    "401": _ERROR,
                    "503": _ERROR,
                },
            }
        },
        "/admin/v1/submit": SUBMIT_OPENAPI,
        **OPS_OPENAPI,
        "/admin/v1/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": {"description": "OpenAPI"}, **_AUTH},
            }
        },
    },
}
