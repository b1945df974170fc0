"""``/metrics`` of a real API and worker: the dead letters kept now (a gauge read from Redis
at scrape time), and ``nopoll_dead_letters_total``, which counts work that became a dead
letter once: a replayed letter that fails again is kept again, not counted again."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from receiver.queue._arq import arq_pool
from receiver.queue.deadletter import DeadLetters
from receiver.redis import RedisConnector
from tests.e2e.helpers import await_ready, post, queues_empty, wait_for, write_config
from tests.servers import free_port

SECRET = "s" * 32


def _samples(text: str, name: str) -> dict[str, float]:
    """``{sink: value}`` of one metric's samples."""
    return {
        s.labels.get("sink", ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def test_kept_gauge_and_a_replay_failing_again_counted_once(
    procs, tmp_path, provider_sim, redis_url, signed_callback
):
    sim = provider_sim()
    sim.add_response("resp_dl")
    dead = free_port()  # nothing listens: every write fails
    config = write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=f"  audit: {{type: http, url: 'http://127.0.0.1:{dead}/', secret: '{SECRET}'}}\n",
        extra="sink_retry: {max_tries: 2, base_delay_s: 0.05, max_delay_s: 0.1}\n",
    )
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    base = f"http://127.0.0.1:{port}"
    pool = arq_pool(RedisConnector.from_url(redis_url))
    letters = DeadLetters(pool)
    try:
        async with httpx.AsyncClient(timeout=10) as client:

            async def scrape() -> str:
                return (await client.get(f"{base}/metrics")).text

            before = await scrape()
            assert _samples(before, "nopoll_dead_letters_kept") == {}
            body, headers = signed_callback("resp_dl")
            assert (await post(base, body, headers)).status_code == 202

            async def kept():
                found = await letters.find(sink="audit")
                return found if found and await queues_empty(redis_url) else None

            await wait_for(kept, timeout=30)
            text = await scrape()
            assert _samples(text, "nopoll_dead_letters_kept") == {"audit": 1.0}
            assert _samples(text, "nopoll_dead_letters_total") == {"audit": 1.0}
            assert re.search(r"^# TYPE nopoll_dead_letters_kept gauge$", text, re.MULTILINE)

            # replayed while the sink still fails: the letter comes back, counted once
            [first] = await letters.find(sink="audit")
            assert await letters.replay([first]) == 1

            async def back_again():
                found = await letters.find(sink="audit")
                return found if found and found[0].id != first.id else None

            await wait_for(back_again, timeout=30)
            await wait_for(lambda: queues_empty(redis_url), timeout=30)
            text = await scrape()
            assert _samples(text, "nopoll_dead_letters_kept") == {"audit": 1.0}
            assert _samples(text, "nopoll_dead_letters_total") == {"audit": 1.0}
    finally:
        await pool.aclose()
