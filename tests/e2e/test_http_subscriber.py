"""The ``http`` sink under a real ``nopoll serve``: a subscriber that answers every delivery
with a huge body costs the process the first few KiB of it, not the body (a 256 MiB answer
once took a worker from 100 to 579 MiB)."""

from __future__ import annotations

import base64
import secrets

import httpx

from tests.e2e.helpers import await_ready, wait_for, write_config
from tests.servers import free_port
from tests.subscriber import Subscriber

HUGE = 256 * 1024 * 1024
GROWTH_MB = 64
"""What the process's peak memory may grow by over three deliveries: room for the
allocator and the first requests, far below one answer."""


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def test_a_subscribers_huge_answer_is_not_read_whole(
    procs, tmp_path, provider_sim, redis_url, signed_callback
):
    hook_secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    subscriber = await Subscriber(hook_secret, body_bytes=HUGE).start()
    sim = provider_sim()
    ids = [f"resp_huge_answer_{i}" for i in range(3)]
    for object_id in ids:
        sim.add_response(object_id)
    sinks = f"  hook: {{type: http, url: '{subscriber.url()}', secret: '${{HOOK_SECRET}}'}}\n"
    config = write_config(tmp_path, sim.base_url, redis_url=redis_url, sinks=sinks)
    procs.env.update(HOOK_SECRET=hook_secret)
    port = free_port()
    try:
        serve = procs.start("serve", "--config", str(config), "--port", str(port))
        await await_ready(port)
        before = _peak_rss_mb(serve.pid)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for object_id in ids:
                body, headers = signed_callback(object_id)
                r = await client.post("/webhooks/sim", content=body, headers=headers)
                assert r.status_code == 202, r.text

        async def delivered() -> bool | None:
            return len(subscriber.deliveries) >= len(ids) or None

        await wait_for(delivered, timeout=30)
        await wait_for(lambda: _done(procs.logs(), ids), timeout=30)
        grown = _peak_rss_mb(serve.pid) - before
        assert serve.poll() is None
    finally:
        await subscriber.stop()
    assert sorted(d.payload["key"] for d in subscriber.deliveries) == ids  # each once, verified
    assert all(d.verified for d in subscriber.deliveries)
    assert subscriber.body_sent < HUGE // 4, subscriber.body_sent  # three answers, cut short
    assert grown < GROWTH_MB, f"peak RSS grew {grown:.0f} MB"


async def _done(logs: str, ids: list[str]) -> bool | None:
    """Every id's landing logged: its delivery is over, answer and all."""
    return all(f"sim/{i} landed" in logs for i in ids) or None
