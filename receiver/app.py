"""The web app's composition root: the webhook endpoint (:mod:`receiver.webhooks.endpoint`)
in front of the Starlette app (health, readiness, metrics, the admin and results APIs and
``/ui``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from receiver.admin.routes import BODY_CAPS as ADMIN_BODY_CAPS
from receiver.admin.routes import admin_routes
from receiver.config.settings import Settings
from receiver.fanout.health import metrics_page as _metrics_page
from receiver.fanout.health import readiness_page as _readiness
from receiver.metrics import Metrics
from receiver.providers.push import PushTokens
from receiver.queue.enqueue import Enqueuer, ReplicaWait
from receiver.responses import json_answer, json_error
from receiver.results.routes import results_routes
from receiver.ui import MAX_FORM, ui_routes
from receiver.webhooks.endpoint import WebhookDispatch, WebhookEndpoint
from receiver.webhooks.wire import BoundedBodies, ReadDeadlines

__all__ = ["create_app", "operator_app"]

log = logging.getLogger("nopoll.app")


def _body_cap(path: str) -> int:
    """The most of a request body a route reads: the admin API's own caps, else 64 KiB
    (the ``/ui`` forms'; no other route reads a body)."""
    return ADMIN_BODY_CAPS.get(path, MAX_FORM)


async def _not_post(request: Request) -> Response:  # pragma: no cover - Starlette answers 405
    return json_answer(405, {"error": "use POST"})


async def _healthz(request: Request) -> Response:
    return json_answer(200, {"status": "ok"})


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 (a path or method nopoll does not serve), as JSON."""
    assert isinstance(exc, HTTPException)
    return json_error(exc.status_code, exc.detail, exc.headers)


async def _client_left(request: Request, exc: Exception) -> Response:
    """A client that closed its connection before sending its whole body: the request just
    ends (the answer goes nowhere), as no error of the server's."""
    log.debug(
        "%s %s: the client left before sending its whole body", request.method, request.url.path
    )
    return json_answer(400, {"error": "client disconnected before sending the whole body"})


def _public_metrics(settings: Settings, redis: Redis, metrics: Metrics) -> Callable[..., Any]:
    """``/metrics`` on the public port: the page, or 404 when the operator port serves it."""
    if settings.api.operator_port is None:
        return _metrics_page(redis, metrics, list(settings.providers))

    async def elsewhere(request: Request) -> Response:
        return json_error(404, "served on the operator port (api.operator_port)")

    return elsewhere


def operator_app(
    settings: Settings, *, redis: Redis, metrics: Metrics, worker_heartbeat_key: str | None
) -> ASGIApp:
    """What ``api.operator_port`` serves: ``/metrics``, ``/readyz`` with the sinks' error
    text, and ``/healthz``; nothing a provider or consumer calls."""
    wanted = settings.redis
    readyz = _readiness(redis, worker_heartbeat_key, wanted.min_replicas_acked, errors=True)
    routes = [
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", _metrics_page(redis, metrics, list(settings.providers)), methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


def create_app(
    settings: Settings,
    *,
    redis: Redis,
    metrics: Metrics,
    enqueuer: Enqueuer | None = None,
    worker_heartbeat_key: str | None = None,
    lifespan: Callable[[Starlette], Any] | None = None,
) -> ASGIApp:
    """The ASGI app. ``worker_heartbeat_key`` makes /readyz also check the worker."""
    wanted = settings.redis
    replicas = (
        ReplicaWait(wanted.min_replicas_acked, wanted.wait_timeout_ms, aof=wanted.wait_aof)
        if wanted.min_replicas_acked
        else None
    )
    enqueuer = enqueuer or Enqueuer(
        redis,
        dedupe_ttl_s=settings.dedupe_ttl_s,
        job_expiry_s=settings.job_expiry_s,
        journey_ttl_s=settings.journey_ttl_s,
        replicas=replicas,
    )
    routes = [
        # POSTs never reach this route (see WebhookDispatch); other methods get Starlette's 405.
        Route("/webhooks/{provider}", _not_post, methods=["POST"]),
        Route("/webhooks/t/{token}", _not_post, methods=["POST"]),
        Route("/healthz", _healthz, methods=["GET"]),
        Route(
            "/readyz",
            _readiness(redis, worker_heartbeat_key, wanted.min_replicas_acked, errors=False),
            methods=["GET"],
        ),
        Route("/metrics", _public_metrics(settings, redis, metrics), methods=["GET"]),
        *admin_routes(settings, redis),
        *results_routes(settings, redis),
        *ui_routes(settings, redis),
    ]
    starlette = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, ClientDisconnect: _client_left},
    )
    bounded = BoundedBodies(starlette, _body_cap, ReadDeadlines(settings.api.body_timeout_s))
    webhooks = WebhookEndpoint(settings, enqueuer, metrics, PushTokens(redis))
    return WebhookDispatch(webhooks, starlette, bounded)
