"""JSON answers, the same on every route: ``json_answer`` for a payload, ``json_error`` for
``{"error": why}`` (every 4xx says why), and the OpenAPI description of that error body."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["ERROR_RESPONSE", "json_answer", "json_error"]


def json_answer(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status, headers, media_type="application/json")


def json_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return json_answer(status, {"error": message}, headers)


ERROR_RESPONSE: dict[str, Any] = {
    "description": "why",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"error": {"type": "string"}},
                "required": ["error"],
            }
        }
    },
}
"""An error answer in an OpenAPI document."""
