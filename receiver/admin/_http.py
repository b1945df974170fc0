"""What the admin routes share: a body read under a cap, JSON answers, and the first
validation error said as ``field: what is wrong``."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["first_error", "json_answer", "json_error", "read_capped"]


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


def json_answer(status: int, payload: Any) -> Response:
    return Response(orjson.dumps(payload), status, media_type="application/json")


def json_error(status: int, message: str) -> Response:
    return json_answer(status, {"error": message})


def first_error(exc: ValidationError) -> str:
    """``where: what`` of the first error (``body: not valid JSON``, ``x: unknown field``)."""
    err = exc.errors(include_input=False, include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "json_invalid":
        return "body: not valid JSON"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    return f"{where}: {str(err['msg']).removeprefix('Value error, ')}"
