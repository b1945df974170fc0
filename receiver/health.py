"""Sink health shared through Redis: workers publish it, ``/readyz`` shows it.

Every worker process writes the state of each sink it holds (``ok``, ``failing`` with the
last error, ``not opened``) into one Redis hash at each heartbeat; the API reads it. A
failing sink does not make the API unready: callbacks are still queued safely and the
sink is retried on its own. It is shown so that a sink that cannot start is seen at once.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import orjson
from redis.asyncio import Redis

from receiver.fanout import FanOut

__all__ = ["SINK_HEALTH_KEY", "publish_sink_health", "read_sink_health"]

SINK_HEALTH_KEY = "nopoll:health:sinks"
_WORKER = f"{socket.gethostname()}:{os.getpid()}"


async def publish_sink_health(redis: Redis, fanout: FanOut, ttl_s: float) -> None:
    """Write every sink's state (this process's view) with a TTL of ``ttl_s``."""
    fields = {
        name: orjson.dumps(
            {"state": s.state, "error": s.error, "since": round(s.since, 3), "worker": _WORKER}
        )
        for name, s in fanout.sinks.items()
    }
    if not fields:
        return
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(SINK_HEALTH_KEY, mapping=fields)
        pipe.expire(SINK_HEALTH_KEY, max(1, int(ttl_s)))
        await pipe.execute()


async def read_sink_health(redis: Redis) -> dict[str, Any]:
    """Each sink's last published state: ``ok``, ``failing: <error>`` or ``not opened``."""
    raw = await redis.hgetall(SINK_HEALTH_KEY)  # type: ignore[misc]
    out: dict[str, Any] = {}
    for name, value in sorted(raw.items()):
        data = orjson.loads(value)
        state = data.get("state")
        out[name.decode()] = f"failing: {data.get('error')}" if state == "failing" else state
    return out
