"""Error answers in each provider's own shape (a profile names which, see
:mod:`receiver.demo.profiles`).

- :func:`openai_error`: ``{"error": {"message", "type", "param", "code"}}``, as OpenAI, Sail
  and Valar send them (validation refusals are 400 ``invalid_request_error``).
- :func:`litestar_error`: sference's ``{"status_code", "detail", "extra"}`` (its framework's
  shape; ``extra`` only on a 400, as its contract's "Validation Exception" has it).

Anthropic's shape is :func:`receiver.demo.anthropic.anthropic_error`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["ErrorBody", "litestar_error", "openai_error"]

ErrorBody = Callable[..., bytes]
"""``(status, message, *, type=None, param=None, code=None) -> body``."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
}


def openai_error(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    """An OpenAI-style error body; ``type`` follows from ``status`` unless given."""
    kind = type or _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def litestar_error(status: int, message: str, **_: Any) -> bytes:
    """sference's error body (its type, param and code have no place in it)."""
    body: dict[str, Any] = {"status_code": status, "detail": message}
    if status == 400:
        body["extra"] = {}
    return orjson.dumps(body)
