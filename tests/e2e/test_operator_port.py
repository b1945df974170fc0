"""What operators read, kept from the public port: ``/readyz`` there says whether the API
is ready and each sink's state, never a sink's error text (it names hosts, users,
paths); with ``api.operator_port`` set, ``/metrics`` (per-tenant token usage, sink
errors) and the detailed ``/readyz`` are served only on that port. ``nopoll api`` as a
real process, a real Redis."""

from __future__ import annotations

import httpx
import orjson
import redis as redis_sync

from receiver.fanout.health import SINK_HEALTH_KEY
from tests.e2e.helpers import await_ready, write_config
from tests.servers import free_port

SECRET_HOST = "db.internal.example"


def _failing_sink(redis_url: str) -> None:
    client = redis_sync.Redis.from_url(redis_url)
    try:
        state = {"state": "failing", "error": f"connect to {SECRET_HOST}:5432 refused"}
        client.hset(SINK_HEALTH_KEY, "warehouse", orjson.dumps({**state, "since": 1.0}))
    finally:
        client.close()


async def test_the_public_readyz_shows_no_sink_error(procs, tmp_path, provider_sim, redis_url):
    config = write_config(tmp_path, provider_sim().base_url, redis_url=redis_url)
    port = free_port()
    procs.start("api", "--config", str(config), "--port", str(port))
    await await_ready(port)
    _failing_sink(redis_url)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        ready = await client.get("/readyz")
    assert ready.json()["sinks"] == {"warehouse": "failing"}
    assert SECRET_HOST not in ready.text


async def test_the_operator_port_serves_metrics_and_details(
    procs, tmp_path, provider_sim, redis_url
):
    operator = free_port()
    config = write_config(
        tmp_path,
        provider_sim().base_url,
        redis_url=redis_url,
        extra=f"api: {{operator_port: {operator}}}\n",
    )
    port = free_port()
    procs.start("api", "--config", str(config), "--port", str(port))
    await await_ready(port)
    _failing_sink(redis_url)
    async with httpx.AsyncClient(timeout=10) as client:
        public = await client.get(f"http://127.0.0.1:{port}/metrics")
        assert public.status_code == 404 and "api.operator_port" in public.json()["error"]
        metrics = await client.get(f"http://127.0.0.1:{operator}/metrics")
        assert metrics.status_code == 200 and "nopoll_callbacks_total" in metrics.text
        detailed = await client.get(f"http://127.0.0.1:{operator}/readyz")
        assert detailed.status_code == 200 and SECRET_HOST in detailed.json()["sinks"]["warehouse"]
        assert SECRET_HOST not in (await client.get(f"http://127.0.0.1:{port}/readyz")).text
