"""What the admin routes share: a body read under a cap into a model, and the first
validation error said as ``field: what is wrong``."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from receiver.responses import json_error

__all__ = ["first_error", "read_capped", "read_model"]

_M = TypeVar("_M", bound=BaseModel)


async def read_capped(request: Request, limit: int) -> bytes | None:
    """The whole body, or None as soon as it (by its Content-Length or as read) passes
    ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            return None
    return bytes(raw)


async def read_model(
    request: Request, model: type[_M], limit: int, too_large: str = ""
) -> _M | Response:
    """The body read under ``limit`` and validated as ``model``, or the 413 or 400 that
    says why not (``too_large`` is added to the 413's reason)."""
    raw = await read_capped(request, limit)
    if raw is None:
        return json_error(413, f"body: larger than {limit} bytes{too_large}")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        return json_error(400, first_error(exc))


def first_error(exc: ValidationError) -> str:
    """``where: what`` of the first error (``body: not valid JSON``, ``x: unknown field``)."""
    err = exc.errors(include_input=False, include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "json_invalid":
        return "body: not valid JSON"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    return f"{where}: {str(err['msg']).removeprefix('Value error, ')}"
