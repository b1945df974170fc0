"""Rate limits on the webhook route, per client address and per provider (off by default).

With ``api.client_rps`` (or ``api.provider_rps``) set, an address (a provider's route of
one tenant) sending more than that in a sliding one-second window gets ``429`` with ``Retry-After``
before its body is read, and its connection is closed. The counters are the ``limits``
package's, in this process's memory: each API process limits on its own. The address is
the peer, or ``X-Forwarded-For`` from ``api.trusted_proxies``; one that is not an IP
address counts as ``unknown``.

See docs/security.md (rate limits on the webhook route).
"""

from __future__ import annotations

import ipaddress
import math
import time

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import SlidingWindowCounterRateLimiter
from starlette.types import Scope

from receiver.config.settings import ApiConfig
from receiver.webhooks.wire import Reply, Then

__all__ = ["WebhookLimits", "client_address"]


def client_address(scope: Scope) -> str:
    """The request's client as a normalized IP address, or ``unknown`` when it is not one."""
    client = scope.get("client")
    try:
        return str(ipaddress.ip_address(client[0])) if client else "unknown"
    except ValueError:
        return "unknown"


class WebhookLimits:
    """Checks one webhook request against the configured limits; raises a 429 Reply."""

    def __init__(self, config: ApiConfig) -> None:
        self._limiter = SlidingWindowCounterRateLimiter(MemoryStorage())
        self._client = RateLimitItemPerSecond(config.client_rps) if config.client_rps else None
        self._provider = (
            RateLimitItemPerSecond(config.provider_rps) if config.provider_rps else None
        )
        self.enabled = self._client is not None or self._provider is not None

    def check_client(self, client: str) -> None:
        """Count this request against its address; Reply(429) when over the limit."""
        if self._client is not None and not self._limiter.hit(self._client, "c", client):
            self._refuse(self._client, ("c", client), "this address", self._client.amount)

    def check_provider(self, provider: str, tenant: str) -> None:
        """Count this request against its endpoint (the provider's route of ``tenant``: junk
        sent to one tenant's endpoint spends nobody else's); Reply(429) when over."""
        if self._provider is None:
            return
        key = ("p", provider, tenant)
        if not self._limiter.hit(self._provider, *key):
            self._refuse(self._provider, key, "this provider", self._provider.amount)

    def _refuse(self, item: RateLimitItemPerSecond, key: tuple[str, ...], who: str, n: int) -> None:
        reset = self._limiter.get_window_stats(item, *key).reset_time
        wait = max(1, math.ceil(reset - time.time()))
        raise Reply(
            429,
            {"error": f"too many requests from {who}: at most {n} a second, retry later"},
            "rate_limited",
            then=Then.DRAIN_AND_CLOSE,
            headers=[(b"retry-after", str(wait).encode())],
        )
