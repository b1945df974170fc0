"""Riding out a Redis outage: know whether Redis answers, log once per change, wait well.

No nopoll process exits because Redis went away. While it is down the API answers 503
and ``/readyz`` is not ready; workers stop polling, wait with jittered exponential
backoff (capped at a few seconds, so work resumes quickly once Redis is back) and carry on
by themselves. Each side logs one line when Redis goes away and one when it is back,
not one per failed request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from receiver.backoff import Backoff

__all__ = ["RedisLink", "redis_settings_problems"]

log = logging.getLogger("nopoll.redis")


class RedisLink:
    """Whether Redis answered the last time someone asked, as seen by one component."""

    def __init__(self, component: str, *, max_wait_s: float = 5.0) -> None:
        self.component = component
        self.up = True
        self.down_since: float | None = None
        self._max_wait_s = max_wait_s

    def lost(self, exc: BaseException) -> None:
        """Redis failed a command: log it if it was up until now."""
        if self.up:
            self.up = False
            self.down_since = time.monotonic()
            log.warning(
                "%s: Redis unreachable (%s); waiting for it to come back",
                self.component,
                type(exc).__name__,
            )

    def back(self) -> None:
        """Redis answered: log it if it was down."""
        if not self.up:
            down_for = time.monotonic() - (self.down_since or time.monotonic())
            self.up = True
            self.down_since = None
            log.warning("%s: Redis is back after %.1f s", self.component, down_for)

    async def wait(
        self, redis: Redis, *, on_try: Callable[[], None] | None = None, first_s: float = 0.1
    ) -> None:
        """Return once Redis answers a PING; retry with full-jitter exponential backoff
        from ``first_s`` up to ``max_wait_s``."""
        backoff = Backoff(first_s, self._max_wait_s)
        attempt = 0
        while True:
            if on_try is not None:
                on_try()
            try:
                await redis.ping()
            except (RedisError, OSError) as exc:
                self.lost(exc)
            else:
                self.back()
                return
            attempt += 1
            await asyncio.sleep(backoff.delay(attempt))


async def redis_settings_problems(redis: Redis) -> tuple[list[str], list[str]]:
    """(refusals, warnings) about the Redis settings nopoll's guarantees rest on.

    A ``maxmemory-policy`` other than ``noeviction`` lets Redis evict queued jobs and
    remembered webhook-ids under memory pressure: a refusal. No persistence at all (no
    AOF, no RDB snapshots) loses every queued callback on a restart: a warning. A Redis
    that refuses ``CONFIG GET`` (some managed services) gets a warning to check by hand.
    """
    try:
        policy = await redis.config_get("maxmemory-policy")
        persistence = await redis.config_get("appendonly")
        persistence.update(await redis.config_get("save"))
    except (RedisError, OSError) as exc:
        return [], [
            f"cannot read Redis settings ({type(exc).__name__}): make sure maxmemory-policy "
            "is noeviction and persistence (appendonly yes) is on"
        ]
    refusals, warnings = [], []
    value = _text(policy.get("maxmemory-policy"))
    if value and value != "noeviction":
        refusals.append(
            f"Redis maxmemory-policy is {value!r}: under memory pressure it may evict queued "
            "jobs and remembered webhook-ids. Set it to noeviction (CONFIG SET "
            "maxmemory-policy noeviction, or maxmemory-policy noeviction in redis.conf); "
            "redis_policy_check: warn starts anyway"
        )
    if _text(persistence.get("appendonly")) != "yes" and not _text(persistence.get("save")):
        warnings.append(
            "Redis keeps nothing on disk (appendonly no, no save points): a Redis restart "
            "loses every queued callback; turn on appendonly yes"
        )
    return refusals, warnings


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
