"""The ``redis:`` config section: which Redis, and how long each role waits for it.

The URL is a secret (it may hold a password) and never prints. Each role is one kind of
client nopoll keeps; its timeouts are the ones it has always used (docs/configuration.md).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

from receiver.redis.schemes import pool_factory
from receiver.redis.sentinel import parse_sentinel_url

__all__ = ["ROLES", "RedisConfig", "RedisRole", "RedisTimeouts"]

RedisRole = Literal["queue", "api", "results", "health"]
"""``queue``: the arq pools (workers, their state, the CLI); ``api``: the API's client,
which fails fast so a request answers 503; ``results``: the results API's publishing sink;
``health``: the worker heartbeat."""
ROLES: tuple[RedisRole, ...] = get_args(RedisRole)


class RedisTimeouts(BaseModel):
    """How long one role waits to connect and for a reply (seconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_s: float = Field(gt=0, le=300)
    socket_s: float = Field(gt=0, le=3600)


class RedisConfig(BaseModel):
    """Where Redis is and each role's timeouts. ``url`` empty: the embedded server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: SecretStr = SecretStr("")
    """``redis://…``, ``rediss://…``, ``unix://…`` or a Sentinel set,
    ``redis+sentinel://host1:26379,host2:26379/service[/db]``
    (:mod:`receiver.redis.sentinel`); the top-level ``redis_url`` is the same setting."""
    queue: RedisTimeouts = RedisTimeouts(connect_s=5, socket_s=10)
    api: RedisTimeouts = RedisTimeouts(connect_s=2, socket_s=2)
    results: RedisTimeouts = RedisTimeouts(connect_s=5, socket_s=30)
    """Capped further by the results sink's own timeout (half a fetch job's)."""
    health: RedisTimeouts = RedisTimeouts(connect_s=5, socket_s=10)
    min_replicas_acked: int = Field(default=0, ge=0, le=16)
    """A callback's 2xx waits until this many replicas hold its enqueue (``WAIT``); fewer
    in ``wait_timeout_ms``: 503, the provider retries. 0: one Redis's word is enough."""
    wait_timeout_ms: int = Field(default=1000, ge=1, le=60_000)
    """How long an enqueue waits for the replicas (kept below the providers' timeouts)."""
    wait_aof: bool = False
    """Wait until the replicas wrote it to their append-only file (``WAITAOF``, Redis 7.2 and
    Valkey), not only received it; a server without it falls back to ``WAIT``."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        text = value.get_secret_value()
        lenient = bool(info.context and info.context.get("lenient"))
        if text and not (lenient and "${" in text):  # empty: embedded; a placeholder: unknown
            pool_factory(text)
            if text.partition("://")[0].lower().endswith("+sentinel"):
                parse_sentinel_url(text)  # its own words for what is wrong in it
        return value

    def timeouts(self, role: RedisRole) -> RedisTimeouts:
        """The timeouts of ``role``."""
        value: RedisTimeouts = getattr(self, role)
        return value
