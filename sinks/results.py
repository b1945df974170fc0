"""The built-in ``_results`` sink: publishes every envelope for the results API (``/v1``).

The worker adds it when ``consumer_tokens`` are set. Each write is one round trip that
sets the latest key (:func:`latest_key`), appends to :data:`STREAM` (a tenant's envelope
also to its own stream, same id) and publishes on :data:`CHANNEL`, then trims. Each entry
names the one before it in its stream (``prev``) and :data:`LAST_ID` keeps the newest,
so a resuming reader knows exactly whether it missed trimmed entries.
A retried write appends again: stream consumers dedupe on ``(tenant, provider, key)``.

See docs/consumers.md (retention and Redis memory, trimmed history).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

import orjson
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from nopoll.exceptions import SinkError
from sinks.base import SinkBase, SinkConfig

if TYPE_CHECKING:
    from nopoll.envelope import Envelope

__all__ = [
    "CHANNEL",
    "LAST_ID",
    "LATEST_PREFIX",
    "RESULTS_SINK",
    "STREAM",
    "TENANT_SUFFIX",
    "ResultsSink",
    "ResultsSinkConfig",
    "latest_key",
    "reference",
]

RESULTS_SINK = "_results"
"""The sink's name (in metrics, dead letters and ``nopoll dlq``)."""
STREAM = "nopoll:results:stream"
"""The stream of every landed envelope, in landing order."""
LAST_ID = "nopoll:results:last_id"
"""The id of the stream's newest entry (kept even when trimming empties the stream)."""
CHANNEL = "nopoll:results:landed"
"""Pub/sub channel: each message is the latest key of an envelope that just landed."""
LATEST_PREFIX = "nopoll:results:latest:"
TENANT_SUFFIX = ":t:"
"""``<STREAM>:t:<tenant>`` and ``<LAST_ID>:t:<tenant>``: one tenant's own stream (the
same entries, under the same ids, as in :data:`STREAM`) and its newest id, written for
every tenant but ``default``: a tenant's token catches up from its own."""
_PER_CALL = 500

# KEYS[1]: the stream; KEYS[2]: its last id; KEYS[3..]: each envelope's latest key.
# ARGV: ttl_s, max_entries, retention_ms, channel, tenant suffix; then per envelope
# tenant, provider, kind, status, envelope JSON, and '' or the reference the stream
# carries instead of a large envelope. A large envelope's JSON is '' here: its latest key
# was set by a plain SET just before, in the same trip (see ResultsSink.write).
# A tenant's entry (not default's) is added to its own stream too, under the same id,
# its prev naming that stream's previous entry.
_PUBLISH = """
local stream, ttl, maxlen = KEYS[1], ARGV[1], ARGV[2]
local retention, channel, suffix = tonumber(ARGV[3]), ARGV[4], ARGV[5]
local function newest(last_key, s)
  local id = redis.call('GET', last_key)
  if id then return id end
  local last = redis.call('XREVRANGE', s, '+', '-', 'COUNT', 1)[1]
  return last and last[1] or '0-0'
end
local prev = newest(KEYS[2], stream)
local tenants = {}
for i = 3, #KEYS do
  local a = 6 + (i - 3) * 6
  local tenant, ref = ARGV[a], ARGV[a + 5]
  if ARGV[a + 4] ~= '' then redis.call('SET', KEYS[i], ARGV[a + 4], 'EX', ttl) end
  local field, carried = 'envelope', ARGV[a + 4]
  if ref ~= '' then field, carried = 'ref', ref end
  prev = redis.call('XADD', stream, '*', 'tenant', tenant, 'provider', ARGV[a + 1],
                    'kind', ARGV[a + 2], 'status', ARGV[a + 3], 'prev', prev,
                    field, carried)
  if tenant ~= 'default' then
    local own = stream .. suffix .. tenant
    local last_key = KEYS[2] .. suffix .. tenant
    local tprev = tenants[tenant] or newest(last_key, own)
    redis.call('XADD', own, prev, 'tenant', tenant, 'provider', ARGV[a + 1],
               'kind', ARGV[a + 2], 'status', ARGV[a + 3], 'prev', tprev,
               field, carried)
    tenants[tenant] = prev
  end
  redis.call('PUBLISH', channel, KEYS[i])
end
redis.call('SET', KEYS[2], prev)
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local oldest = string.format('%.0f', now_ms - retention)
redis.call('XTRIM', stream, 'MAXLEN', '~', maxlen)
redis.call('XTRIM', stream, 'MINID', '~', oldest)
for tenant, id in pairs(tenants) do
  local own = stream .. suffix .. tenant
  redis.call('SET', KEYS[2] .. suffix .. tenant, id)
  redis.call('XTRIM', own, 'MAXLEN', '~', maxlen)
  redis.call('XTRIM', own, 'MINID', '~', oldest)
end
return #KEYS - 2
"""


def reference(env: Envelope, size: int) -> bytes:
    """What the stream carries for a large envelope (``event: result-ref``): where the
    results API reads it whole, and what a reader filters on."""
    path = f"/v1/results/{quote(env.provider, safe='')}/{quote(env.key, safe='/')}"
    if env.tenant != "default":
        path += f"?tenant={quote(env.tenant, safe='')}"
    fields = {"ref": path, "tenant": env.tenant, "provider": env.provider, "key": env.key}
    return orjson.dumps({**fields, "kind": env.kind, "status": env.status, "bytes": size})


def latest_key(tenant: str, provider: str, key: str) -> str:
    """Where the latest envelope of (tenant, provider, key) is kept. Tenant and provider
    names cannot contain ``:``, so distinct triples never share a key."""
    return f"{LATEST_PREFIX}{tenant}:{provider}:{key}"


class ResultsSinkConfig(SinkConfig):
    """Built by the worker from ``results:``; never from ``sinks:``. Which Redis is not in
    it: the sink is handed a ``connect`` that makes its client."""

    type: Literal["_results"] = "_results"
    stream_max_entries: int
    stream_retention_s: int
    latest_ttl_s: int
    stream_inline_bytes: int = 262_144
    """An envelope larger than this (as JSON) is carried by the stream as a reference
    (:func:`reference`) rather than whole; the latest key holds it whole."""


class ResultsSink(SinkBase):
    """Publishes envelopes to Redis for the results API (see the module docs).

    ``connect(timeout_s)`` makes the Redis client it publishes with, every timeout at most
    ``timeout_s`` (the config's); the sink closes it."""

    config_model = ResultsSinkConfig
    config: ResultsSinkConfig

    def __init__(self, name: str, config: SinkConfig, *, connect: Callable[[float], Redis]) -> None:
        super().__init__(name, config)
        self._connect = connect
        self._redis: Redis | None = None
        self._sha = hashlib.sha1(_PUBLISH.encode()).hexdigest()

    async def open(self) -> None:
        self._redis = self._connect(self.config.timeout_s)

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        if not envelopes:
            return
        if self._redis is None:
            await self.open()
        assert self._redis is not None
        head = (
            self.config.latest_ttl_s,
            self.config.stream_max_entries,
            self.config.stream_retention_s * 1000,
            CHANNEL,
            TENANT_SUFFIX,
        )
        calls: list[tuple[Any, ...]] = []
        for start in range(0, len(envelopes), _PER_CALL):
            part = envelopes[start : start + _PER_CALL]
            call: list[Any] = [STREAM, LAST_ID]  # str, int and bytes (redis-py says str)
            keys = [latest_key(env.tenant, env.provider, env.key) for env in part]
            call += keys
            call += head
            for env, key in zip(part, keys, strict=True):
                call += (env.tenant, env.provider, env.kind, env.status)
                # copied to its size: orjson's bytes keep its whole growing buffer (about
                # 130 KB for a 13 KB envelope) while the call waits for its round trip
                data = bytes(memoryview(orjson.dumps(env.to_dict())))
                if len(data) <= self.config.stream_inline_bytes:
                    call += (data, b"")
                    continue
                # A large envelope goes in a plain SET ahead of the script: Redis keeps
                # the value it read off the socket as it is, where the script would copy
                # it twice while every other client waits (16 ms for 6 MB).
                calls.append(("SET", key, data, "EX", self.config.latest_ttl_s))
                call += (b"", reference(env, len(data)))
            calls.append(("EVALSHA", self._sha, len(part) + 2, *call))
        try:
            await self._run(self._redis, calls)
        except (RedisError, OSError) as exc:
            message = f"publishing to Redis failed: {type(exc).__name__}"
            raise SinkError(message, sink=self.name) from exc

    async def _run(self, redis: Redis, calls: list[tuple[Any, ...]]) -> None:
        """The commands in one round trip; a Redis that lost its scripts (a restart) gets
        the publish script loaded again."""
        for attempt in (1, 2):
            try:
                async with redis.pipeline(transaction=False) as pipe:
                    for command in calls:
                        pipe.execute_command(*command)
                    await pipe.execute()
                return
            except NoScriptError:
                if attempt == 2:
                    raise
                await redis.script_load(_PUBLISH)

    async def aclose(self) -> None:
        if self._redis is not None:
            redis, self._redis = self._redis, None
            await redis.aclose()
