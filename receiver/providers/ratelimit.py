"""A shared rate limit, summed over every process through Redis: the watch polls of one
provider (``watch.rate_limit_rps``), and each provider account's request budget
(:mod:`receiver.providers.budget`).

:class:`RateLimiter` is GCRA with no burst, as reservations: one Lua call takes the next
free slot (at least ``1 / rate`` after the previous, plus :data:`JITTER_ALLOWANCE_S`) on
Redis's own clock and says how long until it. A ``429`` pauses the whole limit in every
process (:meth:`RateLimiter.pause`, a :class:`SharedPause`); a caller whose slot comes
during a pause waits it out and books again.

See docs/watches.md (the rate limit), which also says why not the ``limits`` package.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

__all__ = ["JITTER_ALLOWANCE_S", "NoSlot", "RateLimiter", "SharedPause"]

JITTER_ALLOWANCE_S = 0.1
"""Slots are ``(1 + this) / rate`` apart rather than ``1 / rate``: requests that set out
or are seen up to 100 ms late (a busy event loop, the network, the provider's own queue)
still cannot bring ``rate + 1`` requests into one second at the provider. It costs 10 %
of the rate (at 5 %, two busy workers on two cores were seen to put 51 GETs into one
second at 50/s)."""

# KEYS: 1 next-slot key, 2 pause key. ARGV: 1 interval (us), 2 longest wait (us)
# Returns the microseconds until the reserved slot (0: now), or, when there is none within
# the longest wait (nothing reserved), -1 - the microseconds until the next free one.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local slot = tonumber(redis.call('GET', KEYS[1]) or '0')
local paused = tonumber(redis.call('GET', KEYS[2]) or '0')
if slot < now then slot = now end
if slot < paused then slot = paused end
if slot - now > tonumber(ARGV[2]) then return -1 - (slot - now) end
local interval = tonumber(ARGV[1])
redis.call('SET', KEYS[1], slot + interval,
           'PX', math.floor((slot - now + interval) / 1000) + 1000)
return slot - now
"""

# KEYS: 1 pause key. Returns the microseconds the provider is still paused for (0: not).
_PAUSED_FOR = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local paused = tonumber(redis.call('GET', KEYS[1]) or '0')
if paused > now then return paused - now end
return 0
"""

# KEYS: 1 pause key. ARGV: 1 pause (microseconds)
_PAUSE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local until_us = now + tonumber(ARGV[1])
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if until_us > current then
  redis.call('SET', KEYS[1], until_us, 'PX', math.floor(tonumber(ARGV[1]) / 1000) + 1000)
end
return 1
"""


_MAX_REBOOKS = 8
"""Pauses waited out by one acquire at most (each one a 429's Retry-After)."""


class NoSlot(TimeoutError):
    """No slot is free within the caller's longest wait (nothing was reserved)."""

    def __init__(self, message: str, *, free_in_s: float) -> None:
        super().__init__(message)
        self.free_in_s = free_in_s
        """Seconds until the next free slot, as it stood when asked."""


class SharedPause:
    """A pause of every request under one name, in every process (a 429's Retry-After)."""

    def __init__(self, redis: Redis, name: str) -> None:
        self.redis = redis
        self.key = f"nopoll:rate:{name}:pause"

    async def pause(self, seconds: float) -> None:
        """Hold every request for ``seconds`` from now (a longer pause already set stays)."""
        await self.redis.eval(  # type: ignore[misc]
            _PAUSE, 1, self.key, str(max(1, int(seconds * 1_000_000)))
        )

    async def left_s(self) -> float:
        """Seconds the pause still holds (0: none)."""
        paused_us = int(await self.redis.eval(_PAUSED_FOR, 1, self.key))  # type: ignore[misc]
        return max(0, paused_us) / 1_000_000


class RateLimiter:
    """At most ``rate_per_s`` requests per second under ``name`` (a provider's polls, or a
    provider account's every request), across processes."""

    def __init__(self, redis: Redis, name: str, rate_per_s: float) -> None:
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")
        self.redis = redis
        self.name = name
        self.rate_per_s = rate_per_s
        self._interval_us = max(1, round((1 + JITTER_ALLOWANCE_S) * 1_000_000 / rate_per_s))
        self.paused = SharedPause(redis, name)
        self._keys = (f"nopoll:rate:{name}", self.paused.key)
        self.waited_s = 0.0
        """Seconds callers spent waiting for a grant (for the rate-limit-wait metric)."""

    async def _book(self, limit_s: float) -> float:
        """Seconds until the slot just reserved; :class:`NoSlot` when none is free within
        ``limit_s``."""
        wait_us = int(
            await self.redis.eval(  # type: ignore[misc]
                _RESERVE, 2, *self._keys, str(self._interval_us), str(int(limit_s * 1e6))
            )
        )
        if wait_us < 0:
            raise NoSlot(
                f"no request slot for {self.name} within {limit_s:g} s",
                free_in_s=(-1 - wait_us) / 1_000_000,
            )
        return wait_us / 1_000_000

    async def reserve(self, *, limit_s: float = 300.0) -> float | None:
        """Reserve the next slot: seconds until it (0: now), or None when there is none
        within ``limit_s`` (nothing is reserved then)."""
        try:
            return await self._book(limit_s)
        except NoSlot:
            return None

    async def acquire(self, *, limit_s: float = 300.0) -> float:
        """Wait for this request's slot; returns the seconds waited. :class:`NoSlot` (a
        TimeoutError) when none is free within ``limit_s``. A pause that began while it
        slept (a 429 another request got) is waited out, then a new slot is booked."""
        waited = 0.0
        for _ in range(_MAX_REBOOKS):
            wait_s = await self._book(max(limit_s - waited, 0.0))
            if not wait_s:
                return waited
            self.waited_s += wait_s
            waited += wait_s
            await asyncio.sleep(wait_s)
            if await self.paused.left_s() <= 0:
                return waited
        return waited

    async def pause(self, seconds: float) -> None:
        """Hold every request under this name for ``seconds`` (a 429's Retry-After)."""
        await self.paused.pause(seconds)
