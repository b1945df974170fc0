"""Valar's request limits for the provider simulator (its limits page: a leaky bucket per
account, a spend cap), around every route as ASGI middleware.

:class:`RateLimits` with ``per_min`` gives each API key a bucket of ``per_min`` requests
draining at ``per_min`` a minute, with ``X-RateLimit-Limit``, ``-Remaining`` and
``-Reset`` (a duration) on every answer, and a 429 ``rate_limit_exceeded`` with
``Retry-After`` when full. :attr:`RateLimits.quota_exceeded` makes every request a 429
``insufficient_quota``. With neither, it does nothing.

See docs/providers.md (Valar) and docs/watches.md (one budget per provider account).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from receiver.demo.errors import openai_error

__all__ = ["RateLimits"]

_Scope = dict[str, Any]


class RateLimits:
    """The leaky buckets, by API key, and the spend-cap switch."""

    def __init__(self, per_min: int | None = None) -> None:
        if per_min is not None and per_min < 1:
            raise ValueError(
                f"rate_limit_per_min must be at least 1 (None: no limit), got {per_min}"
            )
        self.per_min = per_min
        self.quota_exceeded = False
        """Set to answer every request 429 ``insufficient_quota`` (the spend cap is reached)."""
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str) -> tuple[bool, dict[str, str]]:
        """Let one request of ``key`` in, if its bucket has room: (let in, the headers of
        its answer)."""
        assert self.per_min is not None
        capacity, rate = float(self.per_min), self.per_min / 60.0
        with self._lock:
            now = time.monotonic()
            level, at = self._buckets.get(key, (0.0, now))
            level = max(0.0, level - (now - at) * rate)
            room = level + 1 <= capacity + 1e-9
            if room:
                level += 1
            self._buckets[key] = (level, now)
        headers = {
            "x-ratelimit-limit": str(self.per_min),
            "x-ratelimit-remaining": str(max(0, math.floor(capacity - level + 1e-9))),
            "x-ratelimit-reset": str(math.ceil(level / rate - 1e-9)),
        }
        if not room:
            headers["retry-after"] = str(max(1, math.ceil((level + 1 - capacity) / rate)))
        return room, headers

    def wrap(self, app: Any) -> Any:
        """``app`` behind the limits (an ASGI application)."""

        async def limited(scope: _Scope, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or (self.per_min is None and not self.quota_exceeded):
                await app(scope, receive, send)
                return
            room, headers = True, dict[str, str]()
            if self.per_min is not None:
                room, headers = self.take(_api_key(scope))
            if not room:
                message = "request rate limit exceeded for this organization"
                await _refuse(send, headers, openai_error(429, message, type="rate_limit_exceeded"))
                return
            if self.quota_exceeded:
                message = "monthly spend quota exceeded for this organization"
                await _refuse(send, headers, openai_error(429, message, type="insufficient_quota"))
                return

            async def send_with_headers(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    extra = [(k.encode(), v.encode()) for k, v in headers.items()]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await send(message)

            await app(scope, receive, send_with_headers)

        return limited


def _api_key(scope: _Scope) -> str:
    """The request's API key (a bucket each; requests without one share a bucket)."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return str(value.decode(errors="replace").partition(" ")[2])
        if name == b"x-api-key":
            return str(value.decode(errors="replace"))
    return ""


async def _refuse(send: Any, headers: dict[str, str], body: bytes) -> None:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    raw += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 429, "headers": raw})
    await send({"type": "http.response.body", "body": body})
