"""The provider simulator with a provider's rate-limit contract in front, for the tests of
each account's request budget.

:class:`LimitedSimulator` is :class:`~receiver.demo.simulator.ProviderSimulator` (the same
routes, on a real HTTP server on 127.0.0.1) behind a small ASGI layer that:

- logs every request with its arrival time, method, path and API key (:attr:`log`);
- adds headers to chosen answers (:meth:`stamp`): Valar's ``X-RateLimit-Limit``,
  ``X-RateLimit-Remaining`` and ``X-RateLimit-Reset``, say;
- refuses chosen requests before the simulator sees them (:meth:`refuse`): ``429`` with
  ``Retry-After``, or Valar's and OpenAI's ``insufficient_quota`` bodies
  (:data:`VALAR_QUOTA`, :data:`OPENAI_QUOTA`).

Self-contained on purpose: the simulator itself learns Valar's headers on another branch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from receiver.demo.simulator import ProviderSimulator

__all__ = ["OPENAI_QUOTA", "VALAR_QUOTA", "LimitedSimulator", "Seen", "max_in_any_second"]

VALAR_QUOTA = {
    "error": {
        "type": "insufficient_quota",
        "message": "monthly spend quota exceeded for this organization",
    }
}
"""Valar's 429 body for its spend cap (limits.mdx, ``c6185994``): the code in ``type``."""
OPENAI_QUOTA = {
    "error": {
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
}
"""OpenAI's: the code in ``code`` (and ``type``)."""

_Scope = MutableMapping[str, Any]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Seen:
    """One request as it arrived."""

    at: float
    method: str
    path: str
    key: str


@dataclass
class _Rule:
    method: str
    prefix: str
    first: int
    """Only the first this many matching requests (0: every one)."""
    after: int = 0
    """... once this many matching requests went through untouched."""
    matched: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 0
    body: dict[str, Any] | None = None

    def applies(self, method: str, path: str) -> bool:
        """Counts the request; True when this rule acts on it."""
        if (self.method and method != self.method) or not path.startswith(self.prefix):
            return False
        self.matched += 1
        if self.matched <= self.after:
            return False
        return not self.first or self.matched - self.after <= self.first


class LimitedSimulator(ProviderSimulator):
    """The simulator behind the rate-limit layer (see the module docs)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log: list[Seen] = []
        self._stamps: list[_Rule] = []
        self._refusals: list[_Rule] = []
        self._lock = threading.Lock()

    def stamp(
        self, prefix: str, headers: dict[str, str], *, method: str = "", first: int = 0
    ) -> None:
        """Add ``headers`` to the answers of requests whose path starts with ``prefix``
        (``first``: to the first N only)."""
        with self._lock:
            self._stamps.append(_Rule(method, prefix, first, headers=headers))

    def refuse(
        self,
        prefix: str,
        *,
        status: int = 429,
        body: dict[str, Any] | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
        method: str = "",
        first: int = 0,
        after: int = 0,
    ) -> None:
        """Answer ``status`` with ``body`` (JSON) to requests whose path starts with
        ``prefix``, the simulator never seeing them: the first ``first`` of them (0: all),
        once ``after`` went through."""
        extra = dict(headers or {})
        if retry_after is not None:
            extra["retry-after"] = f"{retry_after:g}"
        body = body if body is not None else {"error": {"message": "slow down"}}
        rule = _Rule(method, prefix, first, after, headers=extra, status=status, body=body)
        with self._lock:
            self._refusals.append(rule)

    def lift(self) -> None:
        """Refuse nothing any more."""
        with self._lock:
            self._refusals.clear()

    def seen(self, path_prefix: str = "", *, method: str = "", key: str = "") -> list[Seen]:
        """The requests that arrived whose path starts with ``path_prefix``."""
        with self._lock:
            return [
                s
                for s in self.log
                if s.path.startswith(path_prefix)
                and (not method or s.method == method)
                and (not key or s.key == key)
            ]

    def _app(self) -> Any:
        inner = super()._app()

        async def app(scope: _Scope, receive: Any, send: _Send) -> None:
            if scope["type"] != "http":
                await inner(scope, receive, send)
                return
            method, path = scope["method"], scope["path"]
            key = ""
            for name, value in scope.get("headers") or []:
                if name == b"authorization":
                    key = value.decode("latin-1").partition(" ")[2]
            with self._lock:
                self.log.append(Seen(time.time(), method, path, key))
                refusal = next((r for r in self._refusals if r.applies(method, path)), None)
                stamps = [r for r in self._stamps if r.applies(method, path)]
            if refusal is not None:
                await _answer(send, refusal, stamps)
                return
            if not stamps:
                await inner(scope, receive, send)
                return

            async def stamped(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), *_headers(stamps)]
                await send(message)

            await inner(scope, receive, stamped)

        return app


def _headers(rules: list[_Rule]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for r in rules for k, v in r.headers.items()]


async def _answer(send: _Send, refusal: _Rule, stamps: list[_Rule]) -> None:
    content = orjson.dumps(refusal.body)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
        *_headers([refusal]),
        *_headers(stamps),
    ]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


def max_in_any_second(stamps: list[float]) -> int:
    """The most of ``stamps`` (times in seconds) in any one-second window."""
    stamps = sorted(stamps)
    best, start = 0, 0
    for end, t in enumerate(stamps):
        while t - stamps[start] >= 1.0:
            start += 1
        best = max(best, end - start + 1)
    return best
