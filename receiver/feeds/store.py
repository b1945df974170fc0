"""Completion feeds: who follows each account's feeds, and how far it has read.

:class:`FeedStore` owns the feed keys of one provider account: the hold (one worker at a
time, renewed; a killed holder's lapses), each feed's cursor (the account's own, ``-``,
and each stream a submit made), the streams to follow, and what the admin API shows. A
cursor moves only in the Lua call that checks the hold, so a holder that lost its hold
never moves it.

See docs/watches.md (the completion feed); the keys are in docs/capacity.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from receiver.config.accounts import DEFAULT_TENANT, scoped, tenant_providers
from receiver.config.settings import ProviderConfig, Settings

__all__ = [
    "ACCOUNT_FEED",
    "NEW",
    "FeedAccount",
    "FeedState",
    "FeedStore",
    "feed_accounts",
    "feed_key",
]

ACCOUNT_FEED = "-"
"""The account's own feed (its requests outside streams), beside its streams' feeds."""
STREAM_KEEP_S = 25 * 3600.0
"""A stream is followed this long after it was made: its window (24 h) and an hour more."""
NEW = ""
"""A feed's cursor before its first completion: every completion it names is new."""


def feed_key(account: str, part: str) -> str:
    return f"nopoll:feed:{account}:{part}"


@dataclass(frozen=True, slots=True)
class FeedAccount:
    """One provider account whose feeds are followed."""

    provider: str
    tenant: str
    config: ProviderConfig

    @property
    def name(self) -> str:
        return scoped(self.provider, self.tenant)


def feed_accounts(settings: Settings) -> list[FeedAccount]:
    """Every account whose provider follows a feed: the providers' own and the tenants'."""
    found = [
        FeedAccount(name, DEFAULT_TENANT, cfg)
        for name, cfg in settings.providers.items()
        if cfg.follows_feed
    ]
    found += [
        FeedAccount(provider, tenant, cfg)
        for (tenant, provider), cfg in tenant_providers(settings).items()
        if cfg.follows_feed
    ]
    return found


_TAKE = """
local held = redis.call('GET', KEYS[1])
if held == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('HSET', KEYS[2], 'holder', ARGV[1], 'held_since', ARGV[3])
  return 1
end
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('HDEL', KEYS[2], 'holder', 'held_since')
  return 1
end
return 0
"""
_ADVANCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[3], 'landed', ARGV[4])
redis.call('HSET', KEYS[3], 'read_at', ARGV[5])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[3], 'last_completed_at', ARGV[6]) end
return 1
"""


@dataclass(frozen=True, slots=True)
class FeedState:
    """One account's feeds as the admin API and ``/ui`` show them."""

    account: str
    holder: str | None
    held_since: float | None
    cursors: dict[str, str]
    """Each feed's cursor (the last completion read), ``-`` the account's own."""
    landed: int
    read_at: float | None
    """When a page was last read."""
    last_completed_at: float | None
    """When the newest completion read had finished (the feed's lag is now minus this,
    while completions come)."""

    def to_dict(self, now: float) -> dict[str, Any]:
        lag = None if self.last_completed_at is None else max(0.0, now - self.last_completed_at)
        return {
            "account": self.account,
            "holder": self.holder,
            "held_for_s": None if self.held_since is None else round(now - self.held_since, 1),
            "feeds": [
                {"stream": None if f == ACCOUNT_FEED else f, "cursor": c or None}
                for f, c in sorted(self.cursors.items())
            ],
            "landed": self.landed,
            "read_ago_s": None if self.read_at is None else round(now - self.read_at, 1),
            "lag_s": None if lag is None else round(lag, 1),
        }


class FeedStore:
    """The feed keys of every account (see the module docs)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def take(self, account: str, holder: str, hold_s: float) -> bool:
        """Hold ``account``'s feeds for ``hold_s`` (again, when ``holder`` holds them);
        False when another worker holds them."""
        keys = (feed_key(account, "hold"), feed_key(account, "info"))
        taken = await self.redis.eval(  # type: ignore[misc]
            _TAKE, 2, *keys, holder, str(int(hold_s * 1000)), f"{time.time():.3f}"
        )
        return bool(taken)

    async def release(self, account: str, holder: str) -> None:
        """Give the feeds up at once (a worker stopping), when ``holder`` holds them."""
        keys = (feed_key(account, "hold"), feed_key(account, "info"))
        await self.redis.eval(_RELEASE, 2, *keys, holder)  # type: ignore[misc]

    async def cursors(self, account: str) -> dict[str, str | None]:
        """Each feed to follow and its cursor: the account's own (None: never read, it
        starts at its newest completion) and each stream's (None: none read yet, every
        completion it names is new); streams past their window are dropped."""
        now = time.time()
        key, streams = feed_key(account, "cursors"), feed_key(account, "streams")
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(streams, "-inf", now - STREAM_KEEP_S)
            pipe.hgetall(key)
            pipe.zrangebyscore(streams, now - STREAM_KEEP_S, "+inf")
            old, stored, live = await pipe.execute()
        if old:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(streams, *old)
                pipe.hdel(key, *old)
                await pipe.execute()
        cursors = {k.decode(): v.decode() for k, v in stored.items() if k not in old}
        found: dict[str, str | None] = {ACCOUNT_FEED: cursors.get(ACCOUNT_FEED)}
        for stream in live:
            found[stream.decode()] = cursors.get(stream.decode(), NEW)
        return found

    async def follow_stream(self, account: str, stream_id: str) -> None:
        """Follow ``stream_id`` (a stream nopoll made for a submit) from its first
        completion, for its window."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(feed_key(account, "streams"), {stream_id: time.time()}, nx=True)
            pipe.hsetnx(feed_key(account, "cursors"), stream_id, NEW)
            await pipe.execute()

    async def advance(
        self,
        account: str,
        holder: str,
        feed: str,
        cursor: str,
        *,
        landed: int,
        last_completed_at: float | None,
    ) -> bool:
        """Move ``feed``'s cursor to ``cursor`` once what it covers is durable; False (and
        nothing moved) when ``holder`` no longer holds the account's feeds."""
        keys = (feed_key(account, "hold"), feed_key(account, "cursors"), feed_key(account, "info"))
        moved = await self.redis.eval(  # type: ignore[misc]
            _ADVANCE,
            3,
            *keys,
            holder,
            feed,
            cursor,
            str(landed),
            f"{time.time():.3f}",
            "" if last_completed_at is None else f"{last_completed_at:.3f}",
        )
        return bool(moved)

    async def state(self, account: str) -> FeedState:
        """What the admin API and ``/ui`` show of ``account``'s feeds."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(feed_key(account, "info"))
            pipe.hgetall(feed_key(account, "cursors"))
            pipe.get(feed_key(account, "hold"))
            info, cursors, holder = await pipe.execute()
        text = {k.decode(): v.decode() for k, v in info.items()}
        return FeedState(
            account,
            holder.decode() if holder else None,
            _float(text.get("held_since")) if holder else None,
            {k.decode(): v.decode() for k, v in cursors.items()},
            int(text.get("landed") or 0),
            _float(text.get("read_at")),
            _float(text.get("last_completed_at")),
        )


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None
