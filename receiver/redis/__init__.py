"""Everything nopoll knows about talking to Redis: the ``redis:`` section, the one
connector every component gets its clients from, and the link that rides out an outage."""

from __future__ import annotations

from receiver.redis.config import ROLES, RedisConfig, RedisRole, RedisTimeouts
from receiver.redis.connector import RedisConnector
from receiver.redis.link import RedisLink, redis_settings_problems

__all__ = [
    "ROLES",
    "RedisConfig",
    "RedisConnector",
    "RedisLink",
    "RedisRole",
    "RedisTimeouts",
    "redis_settings_problems",
]
