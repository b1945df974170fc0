"""Helpers shared by several of receiver's test modules (and bench/fuzz.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import orjson

from nopoll.envelope import Envelope, now_rfc3339
from receiver.config.settings import Settings
from receiver.queue.enqueue import (
    CallbackJob,
)
from receiver.redis import RedisConnector
from sinks.results import (
    RESULTS_SINK,
    ResultsSink,
    ResultsSinkConfig,
)
from tests.receiver.rawhttp import read_response
from tests.servers import running_api

WEEK_S = 7 * 86_400


T0 = 1_700_000_000.0  # a fixed "now" for the clock; buckets are 1 day wide for a week


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def job(webhook_id: str, response_id: str | None = None, provider: str = "p") -> CallbackJob:
    rid = response_id or f"r_{webhook_id}"
    kwargs = {"provider": provider, "response_id": rid, "event_id": webhook_id}
    return CallbackJob(provider, webhook_id, "fetch_response", f"resp:{provider}:{rid}", kwargs)


def envelope(key: str, *, tenant: str = "default", provider: str = "sim", **fields) -> Envelope:
    fields.setdefault("kind", "response")
    fields.setdefault("status", "completed")
    return Envelope(
        provider=provider,
        tenant=tenant,
        key=key,
        usable=fields["status"] == "completed",
        received_at=now_rfc3339(),
        fetched_at=now_rfc3339(),
        body={"id": key},
        **fields,
    )


def sink_for(url: str, **overrides) -> ResultsSink:
    config = {
        "stream_max_entries": 1000,
        "stream_retention_s": 3600,
        "latest_ttl_s": 120,
        **overrides,
    }
    redis = RedisConnector.from_url(url)
    return ResultsSink(
        RESULTS_SINK,
        ResultsSinkConfig(**config),
        connect=lambda s: redis.client("results", at_most_s=s),
    )


ADMIN_TOKEN = "admin-token-0123456789abcdef"
"""The admin token of the ``admin`` fixture's server."""

TOKEN = "consumer-token-all-0123456789"


TOKEN_A = "consumer-token-team-a-0123456789"


TOKENS = [{"token": TOKEN}, {"token": TOKEN_A, "tenant": "team-a"}]


TENANTS = {
    "tenants": {"team-a": {}, "team-b": {}},
    "tenant_keys": ["k" * 40],
}


def with_tokens(make_settings, redis_url: str, **overrides):
    """Settings with the two consumer tokens (and tenants team-a, team-b)."""
    raw = {"redis_url": redis_url, "consumer_tokens": TOKENS, **TENANTS, **overrides}
    return make_settings(**raw)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


class _ApiThread:
    """nopoll's app under uvicorn in a thread of its own (hypothesis tests are sync)."""

    def __init__(self, settings: Settings, redis_url: str) -> None:
        self._settings, self._redis_url = settings, redis_url
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.base = ""
        self.metrics: Any = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with running_api(self._settings, self._redis_url) as (base, metrics):
            self.base, self.metrics = base, metrics
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> _ApiThread:
        self._thread.start()
        assert self._ready.wait(20), "the API did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)

    def callbacks_counted(self) -> float:
        return sum(
            s.value
            for family in self.metrics.callbacks.collect()
            for s in family.samples
            if s.name.endswith("_total")
        )


def _not_http(value: bytes) -> bool:
    return any((c < 0x20 and c != 0x09) or c == 0x7F for c in value)


def _answer(raw: bytes) -> tuple[int, dict[str, Any] | None]:
    """(status, the JSON body, None when it is not JSON: uvicorn's own 400 for bad HTTP)."""
    status, body = read_response(raw)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return status, None
    return status, payload if isinstance(payload, dict) else None
