"""The operator's part of the admin API: what ``/ui`` shows, as JSON.

``GET /admin/v1/overview``, ``GET /admin/v1/batches``, ``GET /admin/v1/feeds``,
``GET /admin/v1/deadletters``
(paginated: ``offset``, ``limit``, ``sink``) and ``POST /admin/v1/deadletters/replay``
(``{"ids": [...]}``, ``{"sink": "warehouse"}`` or ``{"all": true}``). They read and act
through :class:`receiver.console.Console`, as the status page does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from redis.exceptions import RedisError
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from receiver.admin._http import page_params, read_model
from receiver.console import MAX_OFFSET, Console
from receiver.responses import ERROR_RESPONSE, json_answer, json_error

__all__ = ["MAX_BODY", "OPS_OPENAPI", "ReplayRequest", "ops_routes"]

MAX_BODY = 1024 * 1024


class ReplayRequest(BaseModel):
    """``POST /admin/v1/deadletters/replay``: which dead letters to queue again."""

    model_config = ConfigDict(extra="forbid")

    ids: list[str] | None = Field(default=None, min_length=1, max_length=10_000)
    sink: str | None = Field(default=None, description="every letter of this sink")
    all: bool = Field(default=False, description="every dead letter")

    @model_validator(mode="after")
    def _one_selector(self) -> ReplayRequest:
        chosen = [self.ids is not None, self.sink is not None, self.all]
        if sum(chosen) != 1:
            raise ValueError("give exactly one of ids, sink or all")
        return self


def ops_routes(console: Console, admins: Sequence[Middleware]) -> list[BaseRoute]:
    """The routes, each behind the admin token check ``admins`` (a route middleware)."""

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                result: Response = await handler(request)
            except (RedisError, OSError):
                return json_error(503, "Redis unreachable, retry later")
            return result

        return endpoint

    async def overview(request: Request) -> Response:
        return json_answer(200, await console.overview())

    async def batches(request: Request) -> Response:
        return json_answer(200, await console.batches())

    async def feeds(request: Request) -> Response:
        return json_answer(200, {"feeds": await console.feeds()})

    async def letters(request: Request) -> Response:
        q = request.query_params
        page = page_params(q, "offset", 0, 50)
        if isinstance(page, Response):
            return page
        offset, limit = page
        if not 0 <= offset <= MAX_OFFSET:
            return json_error(400, f"offset: must be 0 to {MAX_OFFSET}")
        sink = q.get("sink")
        if sink is not None and sink not in console.sink_names():
            return json_error(400, f"sink: unknown sink {sink[:64]!r}")
        return json_answer(200, await console.dead_letters(offset=offset, limit=limit, sink=sink))

    async def replay(request: Request) -> Response:
        body = await read_model(request, ReplayRequest)
        if isinstance(body, Response):
            return body
        if body.sink is not None and body.sink not in console.sink_names():
            return json_error(400, f"sink: unknown sink {body.sink[:64]!r}")
        return json_answer(200, await console.replay(ids=body.ids, sink=body.sink))

    return [
        Route("/admin/v1/overview", guarded(overview), methods=["GET"], middleware=admins),
        Route("/admin/v1/batches", guarded(batches), methods=["GET"], middleware=admins),
        Route("/admin/v1/feeds", guarded(feeds), methods=["GET"], middleware=admins),
        Route("/admin/v1/deadletters", guarded(letters), methods=["GET"], middleware=admins),
        Route("/admin/v1/deadletters/replay", guarded(replay), methods=["POST"], middleware=admins),
    ]


_WHY = ERROR_RESPONSE
_AUTH = {"401": _WHY, "404": {"description": "no admin token is configured"}, "503": _WHY}


def _query(*names: str) -> list[dict[str, Any]]:
    return [
        {"name": n, "in": "query", "required": False, "schema": {"type": "string"}} for n in names
    ]


OPS_OPENAPI: dict[str, Any] = {
    "/admin/v1/overview": {
        "get": {
            "summary": "Callbacks and results per minute (last hour), queues, processes, "
            "sinks, dead letters and watches",
            "responses": {"200": {"description": "the overview"}, **_AUTH},
        }
    },
    "/admin/v1/batches": {
        "get": {
            "summary": "Batches in progress and finished: rows per sink, rate, ETA",
            "responses": {"200": {"description": "running and finished batches"}, **_AUTH},
        }
    },
    "/admin/v1/feeds": {
        "get": {
            "summary": "Each followed completion feed (sference): who holds it, its cursors, "
            "its lag and the results it landed",
            "responses": {"200": {"description": "the feeds"}, **_AUTH},
        }
    },
    "/admin/v1/deadletters": {
        "get": {
            "summary": "A page of dead letters, newest first",
            "parameters": _query("offset", "limit", "sink"),
            "responses": {"200": {"description": "total and letters"}, "400": _WHY, **_AUTH},
        }
    },
    "/admin/v1/deadletters/replay": {
        "post": {
            "summary": "Queue dead letters again: by ids, one sink's, or all",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ReplayRequest"}}
                },
            },
            "responses": {"200": {"description": "replayed and kept"}, "400": _WHY, **_AUTH},
        }
    },
}
