"""Each provider account's request budget: one rate for every request nopoll makes there,
paced by the provider's rate-limit headers and paused by its 429s, shared by every process
through Redis.

:class:`AccountBudget` holds a :class:`~receiver.providers.ratelimit.RateLimiter` under
``nopoll:rate:<account>:account``; :class:`~receiver.providers.client.ProviderClient`
takes a slot before each request (:meth:`AccountBudget.take`) and reports each answer
(:meth:`AccountBudget.pause_after`). An account without a rate takes no slots, yet its
pauses still hold. A request that gets no slot within ``wait_s`` is not sent:
:class:`NoRequestSlot` says when one would be free.

See docs/watches.md (one budget per provider account).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

from nopoll.exceptions import TransientProviderError
from nopoll.wire import retry_after_s
from receiver.config.accounts import scoped
from receiver.config.settings import ProviderConfig
from receiver.metrics import Metrics
from receiver.providers.ratelimit import NoSlot, RateLimiter, SharedPause

__all__ = [
    "IN_FLIGHT_S",
    "MAX_HEADER_PAUSE_S",
    "MAX_PAUSE_S",
    "PAUSE_LOOK_S",
    "WAIT_S",
    "AccountBudget",
    "NoRequestSlot",
    "account_budget",
    "rate_pause_s",
]

log = logging.getLogger("nopoll.providers")

WAIT_S = 900.0
"""The longest a request waits for its slot unless its caller says otherwise: work that can
wait (a batch's rows, result streams, creates). Requests in flight are bounded
(:meth:`AccountBudget.useful_concurrency`), so the queue of slots stays far shorter."""
MAX_HEADER_PAUSE_S = 60.0
"""The longest pause ``X-RateLimit-Remaining: 0`` causes (one request's worth of a bucket
refills in far less; a larger figure is taken as this)."""
MAX_PAUSE_S = 300.0
"""The longest pause a 429's ``Retry-After`` causes."""
PAUSE_LOOK_S = 1.0
"""How often a process looks at the shared pause of an account without a rate."""
IN_FLIGHT_S = 10.0
"""Requests of one kind in flight at once to a budgeted account: at most what the budget
lets through in this long. More would only wait for slots, holding them (a cancelled
waiter's slot is lost to everyone)."""

_REMAINING = "x-ratelimit-remaining"
_RESET = "x-ratelimit-reset"
_LIMIT = "x-ratelimit-limit"


class NoRequestSlot(TransientProviderError):
    """No slot of the account's budget within the request's longest wait: nothing was sent.
    ``retry_after_s`` is how long until one would be free."""

    def __init__(self, *, provider: str, path: str, wait_s: float, free_in_s: float) -> None:
        super().__init__(
            f"no request slot of the account's budget within {wait_s:g} s "
            f"(the next in {free_in_s:.1f} s); nothing was sent",
            provider=provider,
            path=path,
            retry_after_s=free_in_s,
        )
        self.unsent = True


def _number(headers: Mapping[str, str], name: str) -> float | None:
    """A header's value as a finite number of 0 or more; None when absent or junk."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def rate_pause_s(headers: Mapping[str, str]) -> float:
    """How long ``X-RateLimit-Remaining: 0`` asks the account to pause: the time one
    request's worth of the bucket refills, ``Reset / max(1, Limit - Remaining)`` (``Reset``,
    seconds until the bucket is full, alone when ``Limit`` is absent or junk), at most
    :data:`MAX_HEADER_PAUSE_S`. 0: requests left, or no usable headers (ints or floats
    are read; anything else is ignored)."""
    if _REMAINING not in headers:  # the usual answer: one lookup
        return 0.0
    remaining = _number(headers, _REMAINING)
    if remaining is None or remaining >= 1:
        return 0.0
    reset = _number(headers, _RESET)
    if reset is None:
        return 0.0
    limit = _number(headers, _LIMIT)
    pause = reset / max(1.0, limit - remaining) if limit is not None else reset
    return min(pause, MAX_HEADER_PAUSE_S)


class AccountBudget:
    """The request budget of one provider account (see the module docs).

    ``provider`` names the metrics (one series per provider, whatever the tenants);
    ``account`` the Redis keys (:func:`~receiver.config.accounts.scoped`); ``rate_per_s``
    None: no slots, only pauses."""

    def __init__(
        self,
        redis: Redis,
        provider: str,
        account: str,
        rate_per_s: float | None,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        self.provider = provider
        self.account = account
        self.rate_per_s = rate_per_s
        name = f"{account}:account"
        self._limiter = RateLimiter(redis, name, rate_per_s) if rate_per_s else None
        self._shared = SharedPause(redis, name)
        self._metrics = metrics
        self._paused_until = 0.0
        """Until when (monotonic) this process knows the account is paused."""
        self._looked = -math.inf
        self._look: asyncio.Task[None] | None = None

    def free_now(self) -> bool:
        """True when a request may go now without asking Redis: the account has no rate
        and no pause this process knows of. Starts a look at the shared pause, in the
        background, at most every :data:`PAUSE_LOOK_S`."""
        if self._limiter is not None:
            return False
        now = time.monotonic()
        if now - self._looked >= PAUSE_LOOK_S:
            self._looked = now
            if self._look is None or self._look.done():
                self._look = asyncio.get_running_loop().create_task(self._look_at_pause())
        return self._paused_until <= now

    async def _look_at_pause(self) -> None:
        try:
            left = await self._shared.left_s()
        except (RedisError, OSError) as exc:  # only the other processes' pauses are missed
            log.debug("cannot read the pause of %s: %s", self.account, type(exc).__name__)
            return
        if left > 0:
            self._paused_until = max(self._paused_until, time.monotonic() + left)

    async def take(self, path: str, wait_s: float | None = None) -> None:
        """Wait for this request's slot (and out any pause), at most ``wait_s``
        (:data:`WAIT_S` by default); :class:`NoRequestSlot` when there is none in time."""
        wait_s = WAIT_S if wait_s is None else wait_s
        if self._limiter is None:
            left = self._paused_until - time.monotonic()
            if left <= 0:
                return
            if left > wait_s:
                raise NoRequestSlot(
                    provider=self.provider, path=path, wait_s=wait_s, free_in_s=left
                )
            self._waited(left)
            await asyncio.sleep(left)
            return
        try:
            waited = await self._limiter.acquire(limit_s=wait_s)
        except NoSlot as exc:
            raise NoRequestSlot(
                provider=self.provider, path=path, wait_s=wait_s, free_in_s=exc.free_in_s
            ) from None
        if waited:
            self._waited(waited)

    def _waited(self, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.rate_limit_wait_seconds.labels(self.provider).inc(seconds)

    def pause_after(self, status: int, headers: Mapping[str, str], *, quota: bool = False) -> float:
        """How long the account pauses after an answer with ``status`` and ``headers``
        (0: not at all); ``quota``: the answer refused for ``insufficient_quota``."""
        pause = rate_pause_s(headers)
        if status == 429 and not quota:
            asked = retry_after_s(headers)
            pause = max(pause, min(MAX_PAUSE_S, 1.0 if asked is None else asked))
        return pause

    async def pause(self, seconds: float) -> None:
        """Hold every request of the account, in every process, for ``seconds`` (at most
        :data:`MAX_PAUSE_S`). This process holds at once, even when Redis cannot take it."""
        seconds = min(seconds, MAX_PAUSE_S)
        self._paused_until = max(self._paused_until, time.monotonic() + seconds)
        if self._metrics is not None:
            self._metrics.rate_limit_pauses.labels(self.provider).inc()
        try:
            await self._shared.pause(seconds)
        except (RedisError, OSError) as exc:
            log.debug("cannot share the pause of %s: %s", self.account, type(exc).__name__)

    def useful_concurrency(self, wanted: int) -> int:
        """``wanted`` requests in flight at once, or fewer: what the budget lets through in
        :data:`IN_FLIGHT_S` (at least one)."""
        if self.rate_per_s is None:
            return wanted
        return max(1, min(wanted, math.ceil(self.rate_per_s * IN_FLIGHT_S)))

    async def aclose(self) -> None:
        """Stop a look at the shared pause still under way (the Redis client is not ours)."""
        if self._look is not None and not self._look.done():
            self._look.cancel()
            await asyncio.gather(self._look, return_exceptions=True)


def account_budget(
    redis: Redis,
    provider: str,
    tenant: str,
    config: ProviderConfig,
    metrics: Metrics | None = None,
) -> AccountBudget:
    """The budget of ``tenant``'s account at ``provider`` (``config``: as that tenant uses
    it, :func:`~receiver.config.accounts.tenant_provider`)."""
    return AccountBudget(
        redis, provider, scoped(provider, tenant), config.rate_limit_rps, metrics=metrics
    )
