"""Completion webhooks (Sail, Valar): each provider account's webhook token, and the create
metadata that asks the provider to push a finished response.

A create carrying ``metadata.completion_webhook`` (nopoll's endpoint for the account) and
``metadata.webhook_token`` makes the provider POST the finished Response object there with
``Authorization: Bearer <token>``, best effort. The token is random, one per account
(``provider`` or ``provider@tenant``), made once and kept in Redis under
``nopoll:push-token:<account>``, so every process checks the same one. It is a secret:
never logged, and redacted from every envelope (:func:`nopoll.envelope.redact_push`).

See docs/watches.md (completion webhooks).
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

__all__ = ["PUSH_TOKEN_KEY", "PushTarget", "PushTokens"]

PUSH_TOKEN_KEY = "nopoll:push-token:"
_TOKEN_BYTES = 32
_RELOOK_S = 1.0
"""A token that does not match is looked up in Redis again at most this often per account
(another process may have just made the account's first one)."""


@dataclass(frozen=True, slots=True)
class PushTarget:
    """Where an account's finished responses are pushed, and the token they carry."""

    url: str
    token: str = field(repr=False)

    def asked(self, body: dict[str, Any]) -> dict[str, Any]:
        """The create body with the two metadata keys that ask for the push (string values,
        as both providers require), the body's other metadata kept."""
        metadata = dict(body.get("metadata") or {})
        metadata["completion_webhook"] = self.url
        metadata["webhook_token"] = self.token
        return {**body, "metadata": metadata}


class PushTokens:
    """The accounts' webhook tokens in Redis. :meth:`token` makes one where there is none;
    :meth:`check` compares a presented one in constant time, from a per-process cache."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._known: dict[str, tuple[bytes, float]] = {}

    async def token(self, account: str) -> str:
        """The account's token, made now if it has none (``SET NX``: every process and every
        run of ``nopoll submit`` agrees on the first one made)."""
        key = PUSH_TOKEN_KEY + account
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, secrets.token_urlsafe(_TOKEN_BYTES), nx=True)
            pipe.get(key)
            _, value = await pipe.execute()
        token = value.decode() if isinstance(value, bytes) else str(value)
        self._known[account] = (token.encode(), time.monotonic())
        return token

    async def check(self, account: str, presented: str) -> bool:
        """``presented`` is ``account``'s token. A miss reads Redis again (at most once a
        second per account); an account without a token matches nothing."""
        given = presented.encode()
        known = self._known.get(account)
        now = time.monotonic()
        if known is not None:
            if hmac.compare_digest(known[0], given):
                return True
            if now - known[1] < _RELOOK_S:
                return False
        value = await self.redis.get(PUSH_TOKEN_KEY + account)
        token = value if isinstance(value, bytes) else b""
        self._known[account] = (token, now)
        return bool(token) and hmac.compare_digest(token, given)
