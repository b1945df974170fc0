"""Connection slots: ``api.limit_concurrency`` counted in open connections, part of them
kept for the providers' callbacks whatever other clients do with theirs.

:class:`ConnectionSlots` wraps uvicorn's HTTP protocol (:meth:`~ConnectionSlots.protocol`)
and the app (:meth:`~ConnectionSlots.guard`); uvicorn's own limit is left off. See
docs/security.md (connection slots).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["PROBES", "ConnectionSlots"]

PROBES = frozenset({"/healthz", "/readyz"})
"""Probe paths: served up to the limit, and their connection always closed after."""
_WEBHOOKS = "/webhooks/"
_RETRY_AFTER_S = "5"


async def _refuse(send: Send, why: str) -> None:
    """503 with ``Retry-After`` and ``connection: close``, the body saying ``why``."""
    body = orjson.dumps({"error": why})
    headers = [
        (b"content-type", b"application/json"),
        (b"retry-after", _RETRY_AFTER_S.encode()),
        (b"connection", b"close"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _refusing(why: str) -> ASGIApp:
    """An app answering every request with :func:`_refuse`."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await _refuse(send, why)

    return app


class ConnectionSlots:
    """Open connections of one API process, in all and per client address.

    - ``/webhooks/...`` requests are served while fewer than ``limit`` connections are
      open (uvicorn's rule for every request).
    - Any other request is answered 503 with ``connection: close`` once ``limit -
      reserve`` are open: the last ``reserve`` connections are the providers'.
    - Probes (:data:`PROBES`) are served up to ``limit`` and always close their
      connection, so they never hold one.
    - One client address (not a trusted proxy) holds at most ``per_client`` connections;
      one beyond it takes no slot, and its first request is answered 503 and closed.
    - A connection that sends nothing for ``idle_s`` after it opened is closed (uvicorn
      times out only connections idle after a response)."""

    def __init__(
        self,
        *,
        limit: int,
        reserve: int,
        per_client: int,
        trusted: Sequence[str] = (),
        idle_s: float = 5.0,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.limit, self.reserve, self.per_client, self.idle_s = limit, reserve, per_client, idle_s
        self._trusted = [ipaddress.ip_network(n, strict=False) for n in trusted]
        self.open = 0
        self.by_client: dict[str, int] = {}
        self._on_refused = on_refused
        """Told each refusal's reason: ``client`` (an address over ``per_client``),
        ``reserve`` (a request that is not a callback beyond ``limit - reserve``) or
        ``limit`` (any request at ``limit``)."""

    def _refused(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

    def _is_trusted(self, peer: str) -> bool:
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in network for network in self._trusted)

    def connect(self, peer: str | None) -> bool:
        """A connection opened from ``peer``: counted (True), or refused (False)."""
        if peer is not None and not self._is_trusted(peer):
            held = self.by_client.get(peer, 0)
            if held >= self.per_client:
                self._refused("client")
                return False
            self.by_client[peer] = held + 1
        self.open += 1
        return True

    def disconnect(self, peer: str | None) -> None:
        """A counted connection closed."""
        self.open -= 1
        if peer is not None and peer in self.by_client:
            left = self.by_client[peer] - 1
            if left > 0:
                self.by_client[peer] = left
            else:
                del self.by_client[peer]

    def admit(self, path: str) -> str | None:
        """Why a request for ``path`` is refused now (None: served)."""
        if self.open >= self.limit:
            self._refused("limit")
            return f"all {self.limit} connections of this API process are taken; retry"
        if path.startswith(_WEBHOOKS) or path in PROBES:
            return None
        if self.open >= self.limit - self.reserve:
            self._refused("reserve")
            return (
                f"the connections left ({self.reserve} of {self.limit}) are kept for "
                "provider callbacks (api.reserved_for_webhooks); retry"
            )
        return None

    def guard(self, app: ASGIApp) -> ASGIApp:
        """``app`` behind :meth:`admit`; probes answered with ``connection: close``."""
        return _Guard(app, self)

    def protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's HTTP protocol class, counting its connections here."""
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        slots = self

        class SlottedProtocol(AutoHTTPProtocol):  # type: ignore[valid-type,misc]
            _slot_peer: str | None = None
            _slot_counted = False
            _slot_idle: asyncio.TimerHandle | None = None

            def connection_made(self, transport: Any) -> None:
                super().connection_made(transport)
                peer = self.client[0] if self.client else None
                if slots.connect(peer):
                    self._slot_peer, self._slot_counted = peer, True
                else:  # not counted: its first request is answered 503, then it closes
                    self.app = _refusing(
                        f"this address holds {slots.per_client} connections already "
                        "(api.max_connections_per_client); reuse one"
                    )
                self._slot_idle = self.loop.call_later(slots.idle_s, self._slot_silent)

            def data_received(self, data: bytes) -> None:
                if self._slot_idle is not None:
                    self._slot_idle.cancel()
                    self._slot_idle = None
                super().data_received(data)

            def connection_lost(self, exc: Exception | None) -> None:
                if self._slot_idle is not None:
                    self._slot_idle.cancel()
                    self._slot_idle = None
                if self._slot_counted:
                    self._slot_counted = False
                    slots.disconnect(self._slot_peer)
                super().connection_lost(exc)

            def _slot_silent(self) -> None:
                self._slot_idle = None
                if not self.transport.is_closing():
                    self.transport.close()

        return SlottedProtocol


class _Guard:
    """The app behind :meth:`ConnectionSlots.admit`."""

    def __init__(self, app: ASGIApp, slots: ConnectionSlots) -> None:
        self.app, self.slots = app, slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        why = self.slots.admit(path)
        if why is not None:
            await _refuse(send, why)
            return
        if path not in PROBES:
            await self.app(scope, receive, send)
            return

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, closing)
