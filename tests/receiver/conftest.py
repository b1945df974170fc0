"""Fixtures shared by the receiver's tests."""

from __future__ import annotations

import httpx
import pytest

from tests.receiver.helpers import ADMIN_TOKEN
from tests.servers import running_api


@pytest.fixture
async def api(make_settings, redis_url):
    """An httpx client on nopoll's app under a real server (4 KiB body cap); its
    ``metrics`` attribute is the app's metrics."""
    settings = make_settings(redis_url=redis_url, max_body_bytes=4096)
    async with (
        running_api(settings, redis_url) as (base, metrics),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        client.metrics = metrics  # type: ignore[attr-defined]
        yield client


@pytest.fixture
def results_settings(make_settings, redis_url):
    """Factory: settings with the results API's two consumer tokens (``with_tokens``)."""
    from tests.receiver.helpers import with_tokens

    return lambda **overrides: with_tokens(make_settings, redis_url, **overrides)


@pytest.fixture
async def published(redis_url):
    """The ``_results`` sink, as the worker runs it."""
    from tests.receiver.helpers import sink_for

    async with sink_for(redis_url) as sink:
        yield sink


@pytest.fixture
async def admin(make_settings, redis_url):
    """An HTTP client of the admin API (its token sent), under a real server and Redis."""
    settings = make_settings(
        redis_url=redis_url, admin_tokens=[ADMIN_TOKEN, "second-token-0123456789"]
    )
    async with (
        running_api(settings, redis_url) as (base, _),
        httpx.AsyncClient(
            base_url=base, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
        ) as client,
    ):
        yield client
