"""A tenant flooding the dead-letter store (callbacks signed for ids its provider does not
know become permanent letters) must not grow it without bound nor make every team view
read every letter. Letters are capped and expire per tenant, the drops are counted, and a
tenant's page, counts and a journey's letters read only what they show. Real Redis; what
is read is measured by Redis's own count of bytes sent."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from receiver.config.sections import DeadLetterConfig
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import FETCH_RESPONSE
from tests.dead_letters import keep_letter


async def _keep(letters: DeadLetters, tenant: str, response_id: str, **kw: Any) -> Any:
    """One failed fetch of ``tenant``'s response ``response_id``."""
    kwargs = {"provider": "sim", "response_id": response_id, "tenant": tenant}
    return await keep_letter(letters, FETCH_RESPONSE, keys=[response_id], kwargs=kwargs, **kw)


@pytest.fixture
def dropped() -> list[tuple[str, str, int]]:
    return []


def capped(redis: Redis, dropped: list[tuple[str, str, int]], **limits: Any) -> DeadLetters:
    return DeadLetters(
        redis,
        limits=DeadLetterConfig(**limits),
        on_dropped=lambda tenant, reason, n: dropped.append((tenant, reason, n)),
    )


async def test_a_tenants_letters_are_capped_oldest_first_and_counted(redis: Redis, dropped):
    letters = capped(redis, dropped, max_per_tenant=20)
    ours = [await _keep(letters, "default", f"r{i}") for i in range(5)]
    flood = [await _keep(letters, "team-a", f"x{i}") for i in range(40)]
    kept = {d.id for d in await letters.find()}
    assert kept == {d.id for d in ours} | {d.id for d in flood[-20:]}  # the newest 20
    assert await letters.by_tenant() == {"default": 5, "team-a": 20}
    assert sum(n for t, r, n in dropped if (t, r) == ("team-a", "cap")) == 20
    assert not [d for d in dropped if d[0] == "default"]
    assert await letters.count() == 25


async def test_old_letters_expire_and_are_counted(redis: Redis, dropped):
    letters = capped(redis, dropped, ttl_s=1)
    await _keep(letters, "team-a", "old")
    await asyncio.sleep(1.2)
    await letters.expire()  # what a worker runs every minute
    assert await letters.count() == 0 and await letters.by_tenant() == {}
    assert dropped == [("team-a", "expired", 1)]


async def _bytes_sent(redis: Redis) -> int:
    return int((await redis.info("stats"))["total_net_output_bytes"])


async def test_a_tenants_views_read_only_its_own_letters(redis: Redis, dropped):
    letters = capped(redis, dropped)
    for i in range(2000):  # the operator's own, many
        await _keep(letters, "default", f"r{i}", error="e" * 300)
    mine = [await _keep(letters, "team-a", f"x{i}") for i in range(3)]
    reads = {}
    for name, view in {
        "page": lambda: letters.page(tenant="team-a"),
        "find": lambda: letters.find(tenant="team-a"),
        "counts": letters.by_tenant,
        "journey": lambda: letters.of_journey("sim", "x1", "team-a"),
    }.items():
        before = await _bytes_sent(redis)
        found = await view()
        reads[name] = await _bytes_sent(redis) - before
        if name == "page":
            assert [d.id for d in found[0]] == [d.id for d in reversed(mine)] and found[1] == 3
        if name == "journey":
            assert [d.id for d in found] == [mine[1].id]
    # 2,000 letters are ~1 MB: each view reads a few KB at most
    assert max(reads.values()) < 50_000, reads


async def test_letters_kept_before_the_tenant_index_are_filed_by_the_first_trim(
    redis: Redis, dropped
):
    """A letter as an older nopoll kept it (in the store and its index only) is filed
    under its tenant by the first trim, and counted once."""
    letter = {
        "id": "0" * 32,
        "sink": "fetch",
        "provider": "sim",
        "keys": ["old"],
        "attempts": 3,
        "error": "kept by an older nopoll",
        "function": FETCH_RESPONSE,
        "kwargs": {"provider": "sim", "response_id": "old", "tenant": "team-a"},
        "created_at": 1.0e9,
    }
    await redis.hset("nopoll:dlq", letter["id"], orjson.dumps(letter))
    await redis.zadd("nopoll:dlq:index", {letter["id"]: time.time()})
    letters = capped(redis, dropped, ttl_s=None)
    assert await letters.by_tenant() == {}
    await letters.expire()
    await letters.expire()  # the second trim files nothing again
    assert await letters.by_tenant() == {"team-a": 1}
    page, total = await letters.page(tenant="team-a")
    assert total == 1 and page[0].id == letter["id"]
