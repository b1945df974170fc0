"""The results API, ``/v1``: results for consumers without Kafka.

``GET /v1/results/{provider}/{key}`` answers the latest envelope of a result (``?wait``:
:mod:`receiver.results.wait`); ``GET /v1/results/stream`` streams every envelope that
lands (:mod:`receiver.results.stream`); ``GET /openapi.json`` documents ``/v1`` and
``/admin/v1``. Tokens are ``consumer_tokens`` (:func:`receiver.auth.bearer_auth`; none:
404). Held requests are capped per token and per process, below the connections that
callbacks need (429 beyond). A tenant's token sees that tenant's results only. What is
published is :mod:`sinks.results`.

See docs/consumers.md and docs/http.md (results API).
"""

from __future__ import annotations

import asyncio
import math
import re

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive

from nopoll.envelope import DEFAULT_TENANT
from nopoll.kinds import kind_names
from nopoll.status import STATUSES
from receiver.auth import TokenBook, TokenUser, bearer_auth
from receiver.config.settings import ConsumerToken, Settings
from receiver.responses import json_error
from receiver.results.openapi import openapi_document
from receiver.results.stream import (
    EventStream,
    Filter,
    StreamHub,
    Subscriber,
    events,
    last_id,
    parse_id,
    whole,
)
from receiver.results.wait import Landings, Waiter
from sinks.results import latest_key

__all__ = ["results_routes"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KINDS = frozenset(kind_names())
_STATUSES = frozenset(STATUSES)
_PING_S = 15
_SEND_TIMEOUT_S = 30
_RETRY_AFTER_S = 5


def _not_landed() -> Response:
    return json_error(404, "not landed")


def results_routes(settings: Settings, redis: Redis) -> list[BaseRoute]:
    """The ``/v1`` routes and ``/openapi.json`` (the /v1 routes answer 404 when no
    consumer token is configured)."""
    api = _ResultsApi(settings, redis)
    consumers = bearer_auth(TokenBook.of(settings), "consumer")
    document = orjson.dumps(openapi_document(settings.results.max_wait_s))

    async def openapi(request: Request) -> Response:
        return Response(document, media_type="application/json")

    return [
        Route("/v1/results/stream", api.stream, methods=["GET"], middleware=consumers),
        Route("/v1/results/{provider}/{key:path}", api.get, methods=["GET"], middleware=consumers),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


class _ResultsApi:
    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.redis = redis
        self.max_wait_s = settings.results.max_wait_s
        self.consumers = settings.consumer_tokens
        self.landings = Landings(redis)
        self.hub = StreamHub(redis)
        self.held = _HeldRequests(settings.results.max_held, settings.results.max_held_per_token)

    def consumer(self, request: Request) -> ConsumerToken:
        """The consumer token of the request (checked by :func:`bearer_auth`)."""
        user = request.user
        assert isinstance(user, TokenUser)
        return self.consumers[user.holder.index]

    async def get(self, request: Request) -> Response:
        consumer = self.consumer(request)
        query = request.query_params
        wait_s: float | None = None
        if "wait" in query:
            wait_s = _seconds(query["wait"])
            if wait_s is None or not 0 < wait_s <= self.max_wait_s:
                return json_error(
                    400, f"wait: must be a number of seconds above 0, at most {self.max_wait_s:g}"
                )
        provider, key = request.path_params["provider"], request.path_params["key"]
        tenant = query.get("tenant") or consumer.tenant or DEFAULT_TENANT
        visible = consumer.tenant in (None, tenant)
        if not (visible and _NAME.fullmatch(tenant) and _NAME.fullmatch(provider) and key):
            # another tenant's result, or one that cannot exist: answered as not landed
            if wait_s is not None:
                who = id(consumer)
                if (refused := self.held.take(who)) is not None:
                    return refused
                try:
                    await _held(request.receive, wait_s)
                finally:
                    self.held.give_back(who)
            return _not_landed()
        name = latest_key(tenant, provider, key)
        try:
            value = await whole(self.redis.get(name))
            if value is None and wait_s is not None:
                who = id(consumer)
                if (refused := self.held.take(who)) is not None:
                    return refused
                try:
                    value = await self._wait(request.receive, name, wait_s)
                finally:
                    self.held.give_back(who)
        except (RedisError, OSError):
            return json_error(503, "Redis unreachable, retry later")
        if value is None:
            return _not_landed()
        return Response(value, media_type="application/json")

    async def _wait(self, receive: Receive, name: str, wait_s: float) -> bytes | None:
        """Wait for ``name`` to land, or for the client to go away."""
        waiter = Waiter()
        watcher = asyncio.create_task(_until_gone(receive, waiter))
        try:
            return await self.landings.wait(name, wait_s, waiter)
        finally:
            watcher.cancel()

    async def stream(self, request: Request) -> Response:
        consumer = self.consumer(request)
        query = request.query_params
        values: dict[str, frozenset[bytes] | None] = {}
        for field, allowed in (
            ("tenant", None),
            ("provider", None),
            ("kind", _KINDS),
            ("status", _STATUSES),
        ):
            given = {v.strip() for raw in query.getlist(field) for v in raw.split(",")} - {""}
            bad = sorted(v for v in given if not _NAME.fullmatch(v))
            if allowed is not None:
                bad = sorted(given - allowed)
            if bad:
                return json_error(400, f"{field}: {bad[0][:64]!r} is not a valid value")
            values[field] = frozenset(v.encode() for v in given) or None
        if consumer.tenant is not None:
            own = frozenset({consumer.tenant.encode()})
            if values["tenant"] not in (None, own):
                return json_error(403, f"tenant: this token sees tenant {consumer.tenant!r} only")
            values["tenant"] = own
        raw_id = request.headers.get("last-event-id") or query.get("last_event_id") or ""
        after = parse_id(raw_id) if raw_id.strip() else None
        if raw_id.strip() and after is None:
            return json_error(400, "last_event_id: not a stream entry id (like 1700000000000-0)")
        try:
            start = after if after is not None else parse_id(await last_id(self.redis))
        except (RedisError, OSError):
            return json_error(503, "Redis unreachable, retry later")
        assert start is not None
        who = id(consumer)
        if (refused := self.held.take(who)) is not None:
            return refused
        sub = Subscriber(Filter(**values), start)
        return EventStream(
            events(self.hub, self.redis, sub),
            send_timeout_s=_SEND_TIMEOUT_S,
            on_close=lambda: self.held.give_back(who),
            ping=_PING_S,
            sep="\n",
        )


class _HeldRequests:
    """The held requests (waits and streams) of this process: per token and in all. A
    token is its config entry (``id`` of its :class:`ConsumerToken`: a token is configured
    once, start-up refuses it twice)."""

    def __init__(self, most: int, per_token: int) -> None:
        self.most, self.per_token = most, per_token
        self.total = 0
        self.by_token: dict[int, int] = {}

    def take(self, who: int) -> Response | None:
        """Count one more for token ``who``, or the 429 refusing it."""
        mine = self.by_token.get(who, 0)
        if mine >= self.per_token:
            why = (
                f"this token holds {mine} streams and waits already, at most "
                f"{self.per_token} at once per token (results.max_held_per_token)"
            )
        elif self.total >= self.most:
            why = (
                f"this API process holds {self.total} streams and waits already, at most "
                f"{self.most} at once (results.max_held; the rest of its connections are "
                "kept for callbacks)"
            )
        else:
            self.total += 1
            self.by_token[who] = mine + 1
            return None
        headers = {"retry-after": str(_RETRY_AFTER_S)}
        return json_error(429, f"too many held requests: {why}; retry once one ends", headers)

    def give_back(self, who: int) -> None:
        self.total -= 1
        left = self.by_token[who] - 1
        if left:
            self.by_token[who] = left
        else:
            del self.by_token[who]


def _seconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


async def _until_gone(receive: Receive, waiter: Waiter) -> None:
    """Abandon ``waiter`` when the client disconnects (a GET has no body to read first)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            waiter.abandon()
            return


async def _held(receive: Receive, seconds: float) -> None:
    """Hold a request that will never find anything as long as one that might."""
    waiter = Waiter()
    watcher = asyncio.create_task(_until_gone(receive, waiter))
    try:
        async with asyncio.timeout(seconds):
            await waiter.sleep()
    except TimeoutError:
        pass
    finally:
        watcher.cancel()
