"""The comparison servers of ``bench/ingest.py``, each an ASGI app factory for uvicorn.

Run by ``uvicorn --factory --app-dir bench _apps:<factory>``; they read
``NOPOLL_BENCH_SECRET`` (a ``whsec_`` secret) and ``BENCH_REDIS_URL`` from the environment.

- :func:`baseline`: reads the body and answers 200: the floor of Starlette + uvicorn.
- :func:`verify_only`: nopoll's :class:`receiver.webhooks.verify.Verifier`, then 202.
- :func:`stock_arq`: verify, then arq's standard ``ArqRedis.enqueue_job`` (WATCH, EXISTS,
  MULTI/EXEC per request), then 202: what "just use arq" costs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import orjson
from arq.connections import ArqRedis, RedisSettings, create_pool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from nopoll.exceptions import VerificationError
from nopoll.wire import decode_webhook_secret
from receiver.webhooks.verify import Verifier

ARQ_QUEUE = "bench:arq"
"""The stock arq case's queue (not nopoll's), in the same Redis database 13."""


def _json(status: int, payload: dict[str, Any]) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


async def _healthz(request: Request) -> Response:
    return _json(200, {"status": "ok"})


def _verifier() -> Verifier:
    return Verifier([decode_webhook_secret(os.environ["NOPOLL_BENCH_SECRET"])], 300)


def _app(webhook: Any, lifespan: Any = None) -> Starlette:
    return Starlette(
        routes=[
            Route("/webhooks/{provider}", webhook, methods=["POST"]),
            Route("/healthz", _healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def baseline() -> Starlette:
    """A no-op POST handler: read the body, answer 200."""

    async def webhook(request: Request) -> Response:
        await request.body()
        return _json(200, {"status": "ok"})

    return _app(webhook)


def verify_only() -> Starlette:
    """Standard Webhooks signature check only, then 202."""
    verifier = _verifier()

    async def webhook(request: Request) -> Response:
        body = await request.body()
        try:
            verifier.verify(request.headers, body)
        except VerificationError as exc:
            return _json(401, {"error": str(exc)})
        return _json(202, {"status": "verified"})

    return _app(webhook)


def stock_arq() -> Starlette:
    """Verify, parse, then arq's own ``enqueue_job`` per request, then 202."""
    verifier = _verifier()
    settings = RedisSettings.from_dsn(os.environ["BENCH_REDIS_URL"])
    state: dict[str, ArqRedis] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        state["pool"] = await create_pool(settings, default_queue_name=ARQ_QUEUE)
        try:
            yield
        finally:
            await state["pool"].aclose()

    async def webhook(request: Request) -> Response:
        body = await request.body()
        try:
            webhook_id = verifier.verify(request.headers, body)
        except VerificationError as exc:
            return _json(401, {"error": str(exc)})
        event = orjson.loads(body)
        response_id = event["data"]["id"]
        job = await state["pool"].enqueue_job(
            "fetch_response",
            provider="bench",
            response_id=response_id,
            event_id=webhook_id,
            _job_id=f"resp:bench:{response_id}",
        )
        if job is None:
            return _json(200, {"status": "already_queued"})
        return _json(202, {"status": "queued", "id": response_id})

    return _app(webhook, lifespan)
