"""Everything nopoll knows about talking to Redis: the link that rides out an outage."""

from __future__ import annotations

from receiver.redis.link import RedisLink, redis_settings_problems

__all__ = ["RedisLink", "redis_settings_problems"]
