"""A stray worker, started with another config whose sink has the same name but another
destination, never writes the deliveries it takes there: it hands each back to a worker
whose sink is the one the delivery was queued for, and says so. Real `nopoll worker`
processes, two verifying webhook subscribers, the provider simulator."""

from __future__ import annotations

import base64
import secrets

import pytest
from redis.asyncio import Redis

from tests.e2e.helpers import wait_for
from tests.subscriber import Subscriber

pytestmark = pytest.mark.slow

N = 20


def _keys(subscriber: Subscriber, skip: int = 0) -> set[str]:
    keys: set[str] = set()
    for delivery in subscriber.deliveries[skip:]:
        payload = delivery.payload
        for item in payload if isinstance(payload, list) else [payload]:
            keys.add(str(item["key"]))
    return keys


async def test_a_stray_worker_hands_back_deliveries_for_a_same_name_sink_it_has_otherwise(
    procs, tmp_path, provider_sim, redis_url
):
    from receiver.watches.store import WatchStore

    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    # the deployment's subscriber refuses the first POST of every result: each becomes a
    # delivery of its own, which either worker may take
    ours = await Subscriber(secret, script=[500] * N).start()
    strays = await Subscriber(secret).start()
    sim = provider_sim()
    common = (
        f"redis_url: '{redis_url}'\n"
        "sink_retry: {max_tries: 20, base_delay_s: 0.2, max_delay_s: 0.5}\n"
        "worker: {poll_delay_s: 0.01, health_check_interval_s: 1}\n"
    )
    provider = (
        f"    dialect: openai\n    base_url: {sim.base_url}\n    rate_limit_rps: null\n"
        "    watch: {first_poll_s: 0.5, max_interval_s: 1}\n"
    )
    main = tmp_path / "main.yaml"
    main.write_text(
        f"{common}data_dir: {tmp_path / 'main'}\nproviders:\n  sim:\n{provider}"
        f"sinks:\n  hook: {{type: http, url: '{ours.url()}', secret: '{secret}'}}\n"
    )
    stray = tmp_path / "stray.yaml"  # another provider; its sink named hook points elsewhere
    stray.write_text(
        f"{common}data_dir: {tmp_path / 'stray'}\nproviders:\n  other:\n{provider}"
        f"sinks:\n  hook: {{type: http, url: '{strays.url()}', secret: '{secret}'}}\n"
    )
    try:
        procs.start("worker", "--config", str(stray))
        procs.start("worker", "--config", str(main))
        ids = [f"resp_stray_{i:02d}" for i in range(N)]
        for rid in ids:
            sim.add_response(rid)
        redis = Redis.from_url(redis_url)
        try:
            assert all(
                await WatchStore(redis).register_all("sim", "response", ids, first_poll_in_s=0)
            )
        finally:
            await redis.aclose()

        async def delivered() -> bool | None:
            return (_keys(ours, skip=N) | _keys(strays)) >= set(ids) or None

        await wait_for(delivered, timeout=60, interval=0.2)
        assert sorted(_keys(strays)) == [], "written by the stray worker to its own hook"
        assert _keys(ours, skip=N) == set(ids)
        assert all(d.verified for d in ours.deliveries)
        # the stray took some of the deliveries and said why it left them
        assert "differs from" in procs.logs(), procs.logs()[-3000:]
    finally:
        await ours.stop()
        await strays.stop()
