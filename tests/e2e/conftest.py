from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from receiver.config.settings import WatchConfig
from receiver.watches.store import WatchStore
from tests.e2e.helpers import Processes
from tests.e2e.losses import BATCH
from tests.servers import missing


@pytest.fixture
def procs(tmp_path: Path, webhook_secret: str) -> Iterator[Processes]:
    env = {**os.environ, "SIM_SECRET": webhook_secret}
    p = Processes(tmp_path, env)
    yield p
    p.stop_all()


@pytest.fixture
def loss_stack(make_settings, redis_url, provider_sim, pg_url, pg_table, tmp_path):
    """Factory: (settings, simulator) for one provider ``sim`` in ``dialect``, Postgres (or
    ``sinks``) and small batches (``BATCH``): the loss-path tests' set-up."""

    def make(dialect: str = "openai", *, sinks: dict | None = None, **overrides):
        sim = provider_sim(api_key="sk-test-not-a-real-key")
        settings = make_settings(
            sim.base_url,
            redis_url=redis_url,
            sinks=sinks or {"warehouse": {"type": "sql", "url": pg_url, "table": pg_table}},
            batch=overrides.pop("batch", BATCH),
            **overrides,
        )
        provider = settings.providers["sim"].model_copy(update={"dialect": dialect})
        return settings.model_copy(update={"providers": {"sim": provider}}), sim

    return make


WATCH_FAST = {"first_poll_s": 0.3, "max_interval_s": 1.0, "rate_limit_rps": 50}
"""How the ``watch_stack`` provider polls unless told otherwise: quickly."""


@pytest.fixture
async def watch_stack(make_settings, redis_url, provider_sim, pg_url, pg_table, tmp_path):
    """Factory: (settings, simulator, watch store) with provider ``sim`` in ``dialect``
    polled as :data:`WATCH_FAST` with ``watch`` over it, landing in Postgres
    (``warehouse``) and JSONL files (``files``); without webhook secrets unless
    ``secrets``; ``provider`` sets more of the provider's fields."""
    clients: list[Redis] = []

    def make(
        dialect: str = "openai",
        *,
        secrets: bool = False,
        provider: dict | None = None,
        **watch,
    ):
        sim = provider_sim(api_key="sk-test-not-a-real-key")
        settings = make_settings(
            # the anthropic SDK's base_url is the server's root, the others' end in /v1
            sim.host_url if dialect == "anthropic" else sim.base_url,
            redis_url=redis_url,
            sinks={
                "warehouse": {"type": "sql", "url": pg_url, "table": pg_table},
                "files": {"type": "jsonl", "dir": str(tmp_path / "out")},
            },
            batch={"chunk_size": 100, "lease_s": 2},
        )
        config = settings.providers["sim"].model_copy(
            update={
                "dialect": dialect,
                "watch": WatchConfig(**{**WATCH_FAST, **watch}),
                **({} if secrets else {"webhook_secrets": []}),
                **(provider or {}),
            }
        )
        settings = settings.model_copy(update={"providers": {"sim": config}})
        client = Redis.from_url(redis_url)
        clients.append(client)
        return settings, sim, WatchStore(client)

    yield make
    for client in clients:
        await client.aclose()


SHOTS = os.environ.get("NOPOLL_UI_SCREENSHOTS")  # read at import: the tests clear NOPOLL_*
"""Where the browser tests put their screenshots (``docs/ui/`` is made that way)."""


@pytest.fixture
async def browser():
    """Debian's chromium under Playwright (a missing browser fails in CI, never skips)."""
    from playwright.async_api import async_playwright

    path = (
        os.environ.get("NOPOLL_TEST_CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
    )
    if not path:
        missing("no chromium browser: apt-get install chromium (scripts/test installs it)")
    async with async_playwright() as p:
        launched = await p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """``$NOPOLL_UI_SCREENSHOTS`` when set, else the test's own folder."""
    folder = Path(SHOTS or tmp_path / "shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
