"""``api.trusted_proxies`` under the real ``nopoll api`` process: ``X-Forwarded-For`` picks
the rate-limit bucket only when it comes from a trusted proxy, and junk in it never
picks a bucket of its own."""

from __future__ import annotations

import httpx

from tests.e2e.helpers import await_ready, write_config
from tests.servers import free_port


async def _start_api(procs, tmp_path, redis_url: str, api: str) -> str:
    config = write_config(
        tmp_path, "http://127.0.0.1:9/v1", redis_url=redis_url, extra=f"api: {api}\n"
    )
    port = free_port()
    procs.start("api", "--config", str(config), "--port", str(port))
    await await_ready(port)
    return f"http://127.0.0.1:{port}"


async def _codes(base: str, forwarded_for: list[str]) -> list[int]:
    """One unsigned callback per X-Forwarded-For value, from 127.0.0.1, as fast as it goes."""
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        return [
            (
                await client.post(
                    "/webhooks/sim", content=b"{}", headers={"x-forwarded-for": value}
                )
            ).status_code
            for value in forwarded_for
        ]


async def test_without_trusted_proxies_x_forwarded_for_does_not_pick_the_bucket(
    procs, tmp_path, redis_url
):
    base = await _start_api(procs, tmp_path, redis_url, "{client_rps: 3}")
    codes = await _codes(base, [f"10.0.0.{i}" for i in range(10)])
    assert codes[:3] == [401] * 3 and 429 in codes[3:], codes  # one bucket: 127.0.0.1


async def test_with_a_trusted_proxy_x_forwarded_for_picks_the_bucket_and_junk_shares_one(
    procs, tmp_path, redis_url
):
    base = await _start_api(
        procs, tmp_path, redis_url, "{client_rps: 3, trusted_proxies: ['127.0.0.1']}"
    )
    codes = await _codes(base, [f"10.0.0.{i}" for i in range(10)])
    assert codes == [401] * 10  # ten clients behind the proxy, one request each
    junk = [f"junk-{i}" for i in range(5)] + ["999.1.1.1", ",", "x, ,y", "[::1", "a" * 300]
    codes = await _codes(base, junk)
    assert set(codes) <= {401, 429} and 429 in codes, codes  # never a bucket per junk value
    codes = await _codes(base, ["10.0.1.1, 127.0.0.1", "10.0.1.1:1234"])
    assert codes == [401, 401]  # the first untrusted hop; a port is not part of the address
