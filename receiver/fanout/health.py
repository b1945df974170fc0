"""Sink health shared through Redis: workers publish it, ``/readyz`` shows it; the
``/readyz`` and ``/metrics`` pages of the web app.

Every worker process writes the state of each sink it holds (``ok``, ``failing`` with the
last error, ``not opened``) into one Redis hash at each heartbeat; the API reads it. A
failing sink does not make the API unready: callbacks are still queued safely and the
sink is retried on its own. It is shown so that a sink that cannot start is seen at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response

from receiver.fanout.fanout import FanOut
from receiver.metrics import CONTENT_TYPE_LATEST, Metrics
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import HEALTH_CHECK_KEY, JOBS_QUEUE
from receiver.queue.jobs import JOBS
from receiver.responses import json_answer
from receiver.watches.store import WatchStore

__all__ = [
    "SINK_HEALTH_KEY",
    "metrics_page",
    "publish_sink_health",
    "queue_depths",
    "read_sink_health",
    "readiness_page",
]

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


async def sink_states(redis: Redis) -> dict[str, dict[str, Any]]:
    """What the workers last published of each sink: ``state``, ``error``, ``since``,
    ``worker``."""
    raw = await redis.hgetall(SINK_HEALTH_KEY)  # type: ignore[misc]
    return {name.decode(): orjson.loads(value) for name, value in sorted(raw.items())}


async def read_sink_health(redis: Redis, *, errors: bool = True) -> dict[str, Any]:
    """Each sink's last published state: ``ok``, ``failing: <error>`` (``failing``
    without ``errors``: the public ``/readyz``) or ``not opened``."""
    out: dict[str, Any] = {}
    for name, data in (await sink_states(redis)).items():
        state = data.get("state")
        failing = state == "failing" and errors
        out[name] = f"failing: {data.get('error')}" if failing else state
    return out


def _long_queue_gauge(queue: str) -> str:
    """The gauge of a long-jobs queue, named for the kind its first job fetches
    (``nopoll_batch_queue_jobs``): a job added to the queue later leaves the name as it is."""
    first = next(spec for spec in JOBS.values() if spec.queue == queue)
    return f"nopoll_{first.kind or first.name}_queue_jobs"


_LONG_QUEUES = {
    queue: _long_queue_gauge(queue)
    for queue in dict.fromkeys(spec.queue for spec in JOBS.values())
    if queue != JOBS_QUEUE
}
"""Every queue of :data:`~receiver.queue.jobs.JOBS` but the short jobs', with its gauge."""


async def queue_depths(redis: Redis) -> dict[str, float]:
    """Ready and deferred short jobs (due now vs. waiting for a retry time), and the jobs on
    each other queue of :data:`~receiver.queue.jobs.JOBS` (the batches')."""
    now_ms = int(time.time() * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zcount(JOBS_QUEUE, "-inf", now_ms)
        pipe.zcard(JOBS_QUEUE)
        for queue in _LONG_QUEUES:
            pipe.zcard(queue)
        pipe.zrangebyscore(JOBS_QUEUE, "-inf", now_ms, start=0, num=1, withscores=True)
        pipe.exists(HEALTH_CHECK_KEY)
        ready, total, *long_jobs, oldest, heartbeat = await pipe.execute()
    return {
        "nopoll_queue_ready_jobs": float(ready),
        "nopoll_queue_deferred_jobs": float(total - ready),
        **{gauge: float(n) for gauge, n in zip(_LONG_QUEUES.values(), long_jobs, strict=True)},
        # how long the oldest job due now has waited for a worker (0: none waits)
        "nopoll_queue_oldest_ready_age_seconds": max(0.0, (now_ms - oldest[0][1]) / 1000)
        if oldest
        else 0.0,
        "nopoll_worker_heartbeat": float(bool(heartbeat)),
    }


def readiness_page(
    redis: Redis, worker_heartbeat_key: str | None, min_replicas: int = 0, *, errors: bool
) -> Callable[..., Any]:
    """``GET /readyz``: Redis answers as a writable primary with at least ``min_replicas``
    replicas (and the worker's heartbeat is there, where it runs); the sinks' health is
    shown but not required (callbacks queue safely meanwhile), their error text only with
    ``errors`` (the operator port's)."""

    async def readyz(request: Request) -> Response:
        checks: dict[str, str] = {}
        try:
            checks["redis"] = await primary_state(redis, min_replicas)
        except (RedisError, OSError) as exc:
            checks["redis"] = f"unreachable ({type(exc).__name__})"
        if worker_heartbeat_key is not None and checks["redis"] == "ok":
            try:
                alive = await redis.exists(worker_heartbeat_key)
            except (RedisError, OSError):
                alive = 0
            checks["worker"] = "ok" if alive else "no heartbeat"
        ready = all(v == "ok" for v in checks.values())
        body: dict[str, Any] = {"ready": ready, **checks}
        if checks["redis"] == "ok":
            with contextlib.suppress(RedisError, OSError):
                body["sinks"] = await read_sink_health(redis, errors=errors)
        return json_answer(200 if ready else 503, body)

    return readyz


async def primary_state(redis: Redis, min_replicas: int = 0) -> str:
    """``ok`` when ``redis`` is a primary with at least ``min_replicas`` replicas, else why
    not. A replica (a primary demoted by a failover, still answering) drops the pool's idle
    connections, so the next ones look for the primary again."""
    role = await redis.execute_command("ROLE")  # type: ignore[no-untyped-call]
    name = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
    if name != "master":
        await redis.connection_pool.disconnect(inuse_connections=False)
        return f"not a writable primary (it is a {name} now): looking for the primary"
    replicas = len(role[2]) if len(role) > 2 and isinstance(role[2], list) else 0
    if replicas < min_replicas:
        return f"{replicas} replica(s) connected, redis.min_replicas_acked asks for {min_replicas}"
    return "ok"


def metrics_page(redis: Redis, metrics: Metrics, providers: list[str]) -> Callable[..., Any]:
    """``GET /metrics``: Prometheus text, with the queue depths and watches read now."""
    watches = WatchStore(redis)
    letters = DeadLetters(redis)

    async def metrics_endpoint(request: Request) -> Response:
        try:
            metrics.set_queue_depths(await queue_depths(redis))
            metrics.set_watch_counts({p: await watches.counts(p) for p in providers})
            metrics.set_dead_letters_kept(await letters.kept_by_sink())
        except (RedisError, OSError):
            metrics.set_queue_depths(None)
            metrics.set_watch_counts(None)
            metrics.set_dead_letters_kept(None)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return metrics_endpoint
