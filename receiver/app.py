"""The web app: ``POST /webhooks/{provider}``, health, readiness and metrics.

A callback gets a 2xx only once its job is durably in Redis; anything else tells the
provider to retry. Status codes are DESIGN.md's table; every 4xx body says why, and
nothing a client sends can produce a 500.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from receiver.config import Settings
from receiver.envelope import now_rfc3339
from receiver.exceptions import VerificationError
from receiver.metrics import CONTENT_TYPE_LATEST, Metrics
from receiver.providers import safe_id
from receiver.queue import (
    BATCHES_QUEUE,
    CallbackJob,
    EnqueueOutcome,
    Enqueuer,
    batch_job_id,
    response_job_id,
)
from receiver.verify import Verifier

__all__ = ["BATCH_EVENTS", "RESPONSE_EVENTS", "create_app"]

log = logging.getLogger("nopoll.app")

RESPONSE_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
)
BATCH_EVENTS = frozenset({"batch.completed", "batch.failed", "batch.cancelled", "batch.expired"})
_WEBHOOK_ID = re.compile(r"[\x21-\x7e]{1,256}")


def _json(status: int, payload: dict[str, Any]) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(
    settings: Settings,
    *,
    redis: Redis,
    metrics: Metrics,
    enqueuer: Enqueuer | None = None,
    worker_heartbeat_key: str | None = None,
    lifespan: Callable[[Starlette], Any] | None = None,
) -> Starlette:
    """The Starlette app. ``worker_heartbeat_key`` makes /readyz also check the worker."""
    verifiers = {
        name: Verifier(cfg.secret_keys(), cfg.tolerance_s)
        for name, cfg in settings.providers.items()
    }
    enqueuer = enqueuer or Enqueuer(
        redis, dedupe_ttl_s=settings.dedupe_ttl_s, job_expiry_s=settings.job_expiry_s
    )
    max_body = settings.max_body_bytes
    callbacks = metrics.callbacks
    verify_seconds = metrics.verify_seconds
    enqueue_seconds = metrics.enqueue_seconds

    async def webhook(request: Request) -> Response:
        provider = request.path_params["provider"]
        verifier = verifiers.get(provider)
        if verifier is None:
            callbacks.labels("unknown", "404").inc()
            return _json(404, {"error": "unknown provider"})

        def reject(status: int, reason: str, outcome: str | None = None) -> Response:
            callbacks.labels(provider, outcome or str(status)).inc()
            return _json(status, {"error": reason})

        try:
            body = await _read_body(request, max_body)
        except _TooLarge:
            return reject(413, f"body is larger than {max_body} bytes")
        except ClientDisconnect:
            return reject(400, "client disconnected before sending the whole body")

        started = time.perf_counter()
        try:
            webhook_id = verifier.verify(request.headers, body)
        except VerificationError as exc:
            return reject(401, str(exc))
        finally:
            verify_seconds.observe(time.perf_counter() - started)
        if not _WEBHOOK_ID.fullmatch(webhook_id):
            return reject(400, "webhook-id must be 1-256 printable ASCII characters without spaces")

        try:
            event = orjson.loads(body)  # orjson rejects invalid UTF-8
        except orjson.JSONDecodeError:
            return reject(400, "body is not UTF-8 JSON")
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return reject(400, "body must be a JSON object with a string 'type'")
        event_type = event["type"]
        if event_type not in RESPONSE_EVENTS and event_type not in BATCH_EVENTS:
            callbacks.labels(provider, "ignored").inc()
            return _json(
                202, {"status": "ignored", "reason": f"event type {event_type!r} is not handled"}
            )
        data = event.get("data")
        object_id = data.get("id") if isinstance(data, dict) else None
        if not safe_id(object_id):
            return reject(400, "data.id must match [A-Za-z0-9_.:-]{1,256}")
        assert isinstance(object_id, str)

        received_at = now_rfc3339()
        if event_type in RESPONSE_EVENTS:
            job = CallbackJob(
                provider=provider,
                webhook_id=webhook_id,
                function="fetch_response",
                job_id=response_job_id(provider, object_id),
                kwargs={
                    "provider": provider,
                    "response_id": object_id,
                    "event_id": webhook_id,
                    "received_at": received_at,
                },
            )
        else:
            job = CallbackJob(
                provider=provider,
                webhook_id=webhook_id,
                function="fetch_batch",
                job_id=batch_job_id(provider, object_id),
                kwargs={
                    "provider": provider,
                    "batch_id": object_id,
                    "event_id": webhook_id,
                    "received_at": received_at,
                    "event_type": event_type,
                },
                queue=BATCHES_QUEUE,
            )
        started = time.perf_counter()
        try:
            outcome = await enqueuer.enqueue(job)
        except (RedisError, OSError) as exc:
            log.warning("enqueue failed, answering 503: %s", type(exc).__name__)
            return reject(503, "queue unavailable, retry later", "unavailable")
        enqueue_seconds.observe(time.perf_counter() - started)
        if outcome is EnqueueOutcome.DUPLICATE:
            callbacks.labels(provider, "duplicate").inc()
            return _json(200, {"status": "duplicate"})
        callbacks.labels(provider, "accepted").inc()
        status = "queued" if outcome is EnqueueOutcome.ENQUEUED else "already_queued"
        return _json(202, {"status": status, "id": object_id})

    async def healthz(request: Request) -> Response:
        return _json(200, {"status": "ok"})

    async def readyz(request: Request) -> Response:
        checks: dict[str, str] = {}
        try:
            await redis.ping()
            checks["redis"] = "ok"
        except (RedisError, OSError) as exc:
            checks["redis"] = f"unreachable ({type(exc).__name__})"
        if worker_heartbeat_key is not None and checks["redis"] == "ok":
            try:
                alive = await redis.exists(worker_heartbeat_key)
            except (RedisError, OSError):
                alive = 0
            checks["worker"] = "ok" if alive else "no heartbeat"
        ready = all(v == "ok" for v in checks.values())
        return _json(200 if ready else 503, {"ready": ready, **checks})

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/webhooks/{provider}", webhook, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
