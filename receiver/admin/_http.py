"""What the admin routes share: the prologue of a route that takes a body (the body as a
model, or the 400 that says why not), the check of a request's provider and tenant, a
page's query numbers, and the first validation error said as ``field: what is wrong``.

A body reaches a route already bounded: the app reads every body through
:class:`receiver.webhooks.wire.BoundedBodies`, under the route's cap (:data:`BODY_CAPS`
of :mod:`receiver.admin.routes`), answering 413 or 408 itself. The bearer token is
checked before the route runs (:func:`receiver.auth.bearer_auth`).
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import Response

from receiver.config.accounts import tenant_problem
from receiver.config.settings import Settings
from receiver.responses import json_error

__all__ = ["account_problem", "first_error", "page_params", "read_model"]

_M = TypeVar("_M", bound=BaseModel)


async def read_model(request: Request, model: type[_M]) -> _M | Response:
    """The body validated as ``model``, or the 400 that says why not."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        return json_error(400, first_error(exc))


def account_problem(settings: Settings, provider: str, tenant: str) -> Response | None:
    """The 400 for a provider that is not configured, or a tenant without an account
    there; None when both are fine."""
    if provider not in settings.providers:
        known = ", ".join(sorted(settings.providers)) or "none"
        return json_error(400, f"provider: unknown provider {provider!r} (known: {known})")
    if (problem := tenant_problem(settings, tenant, provider)) is not None:
        return json_error(400, f"tenant: {problem}")
    return None


def page_params(
    query: QueryParams, start: str, start_default: int, limit_default: int
) -> tuple[int, int] | Response:
    """A page's ``start`` (``offset``, ``cursor``) and ``limit`` (1 to 1000) from the
    query, or the 400 that says which is wrong. The start's own range is the caller's."""
    try:
        first = int(query.get(start, str(start_default)))
        limit = int(query.get("limit", str(limit_default)))
    except ValueError:
        return json_error(400, f"{start} and limit: must be whole numbers")
    if not 1 <= limit <= 1000:
        return json_error(400, "limit: must be 1 to 1000")
    return first, limit


def first_error(exc: ValidationError) -> str:
    """``where: what`` of the first error (``body: not valid JSON``, ``x: unknown field``)."""
    err = exc.errors(include_input=False, include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "json_invalid":
        return "body: not valid JSON"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    return f"{where}: {str(err['msg']).removeprefix('Value error, ')}"
