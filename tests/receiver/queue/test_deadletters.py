"""The dead-letter store against a real Redis: letters are kept whole and found by sink and
key; a replay queues each letter's job on its own function's queue and forgets the letter
in the same step; a letter whose work nothing runs is kept."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from receiver.queue._arq import JOB_KEY, job_deserializer
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import (
    BATCHES_QUEUE,
    DELIVER,
    FETCH_BATCH,
    FETCH_RESPONSE,
    JOBS_QUEUE,
)
from tests.dead_letters import keep_letter


@pytest.fixture
def letters(redis: Redis) -> DeadLetters:
    return DeadLetters(redis)


async def test_a_letter_is_kept_whole_and_counted(letters: DeadLetters) -> None:
    assert await letters.count() == 0 and await letters.find() == []
    envelopes = {"sink": "warehouse", "envelopes": [{"key": "resp_1"}]}
    kept = await keep_letter(
        letters, DELIVER, "warehouse", ["resp_1"], envelopes, attempts=12, error="x" * 5000
    )
    [found] = await letters.find()
    assert found == kept
    assert (found.sink, found.provider, found.keys) == ("warehouse", "sim", ["resp_1"])
    assert (found.attempts, found.function) == (12, DELIVER)
    assert found.kwargs == envelopes
    assert found.error == "x" * 2000  # cut: an error message is not a payload
    assert await letters.count() == 1


async def test_letters_are_found_by_sink_and_key_oldest_first(letters: DeadLetters) -> None:
    a = await keep_letter(letters, DELIVER, "warehouse", ["resp_1", "resp_2"])
    b = await keep_letter(letters, DELIVER, "lake", ["resp_2"])
    c = await keep_letter(letters, FETCH_RESPONSE, "fetch", ["resp_3"])
    assert [d.id for d in await letters.find()] == [a.id, b.id, c.id]
    assert [d.id for d in await letters.find(sink="warehouse")] == [a.id]
    assert [d.id for d in await letters.find(key="resp_2")] == [a.id, b.id]
    assert [d.id for d in await letters.find(sink="lake", key="resp_2")] == [b.id]
    assert [d.id for d in await letters.find(sink="fetch", key="resp_3")] == [c.id]
    assert await letters.find(sink="lake", key="resp_1") == []
    assert await letters.find(key="resp") == []  # a key matches whole, not as a prefix
    assert await letters.count() == 3


async def test_replay_routes_each_function_to_its_queue_and_forgets_the_letter(
    letters: DeadLetters, redis: Redis
) -> None:
    response = await keep_letter(letters, FETCH_RESPONSE, "fetch", ["resp_1"], {"response_id": "r"})
    batch = await keep_letter(letters, FETCH_BATCH, "fetch", ["batch_1"], {"batch_id": "batch_1"})
    delivery = await keep_letter(letters, DELIVER, "lake", ["resp_2"], {"sink": "lake"})
    assert await letters.replay([response, batch, delivery]) == 3

    assert await letters.count() == 0 and await letters.find() == []
    queued = {
        JOBS_QUEUE: {m.decode() for m in await redis.zrange(JOBS_QUEUE, 0, -1)},
        BATCHES_QUEUE: {m.decode() for m in await redis.zrange(BATCHES_QUEUE, 0, -1)},
    }
    assert queued == {
        JOBS_QUEUE: {f"replay:{response.id}", f"replay:{delivery.id}"},
        BATCHES_QUEUE: {f"replay:{batch.id}"},  # a batch fetch runs where batches run
    }
    for letter in (response, batch, delivery):
        payload = job_deserializer(await redis.get(JOB_KEY + f"replay:{letter.id}"))
        assert payload["f"] == letter.function and payload["k"] == letter.kwargs
        assert payload["t"] is None  # from the first try again


async def test_replay_forgets_only_the_letters_it_queued(
    letters: DeadLetters, redis: Redis
) -> None:
    replayed = await keep_letter(letters, FETCH_RESPONSE, "fetch", ["resp_1"])
    other = await keep_letter(letters, DELIVER, "lake", ["resp_2"])
    orphan = await keep_letter(letters, "", "lake", ["resp_3"])  # its payload expired: no function
    assert await letters.replay([replayed, orphan]) == 1
    # each letter is either still kept or its job is queued, never neither nor both
    for letter, queued in ((replayed, True), (other, False), (orphan, False)):
        job = await redis.exists(JOB_KEY + f"replay:{letter.id}")
        kept = [d.id for d in await letters.find()].count(letter.id)
        assert (job, kept) == ((1, 0) if queued else (0, 1))
    assert await redis.zcard(JOBS_QUEUE) == 1 and await redis.zcard(BATCHES_QUEUE) == 0
    assert await letters.count() == 2


async def test_a_letter_knows_its_tenant_and_pages_filter_by_it(letters: DeadLetters) -> None:
    a_fetch = await keep_letter(letters, FETCH_RESPONSE, kwargs={"provider": "sim", "tenant": "a"})
    a_delivery = await keep_letter(
        letters, DELIVER, "db", kwargs={"sink": "db", "envelopes": [{"key": "k", "tenant": "a"}]}
    )
    by_id = await keep_letter(letters, FETCH_RESPONSE, kwargs={"provider": "sim@b"})
    default = await keep_letter(letters, FETCH_RESPONSE)
    assert [a_fetch.tenant, a_delivery.tenant, by_id.tenant, default.tenant] == [
        "a",
        "a",
        "b",
        "default",
    ]
    page, total = await letters.page(tenant="a")
    assert total == 2 and [d.id for d in page] == [a_delivery.id, a_fetch.id]  # newest first
    page, total = await letters.page(tenant="a", sink="fetch")
    assert total == 1 and [d.id for d in page] == [a_fetch.id]
    page, total = await letters.page(tenant="a", offset=1, limit=1)
    assert total == 2 and [d.id for d in page] == [a_fetch.id]
    assert await letters.by_tenant() == {"a": 2, "b": 1, "default": 1}
    assert [d.id for d in await letters.find(tenant="b")] == [by_id.id]


async def test_a_long_error_keeps_the_providers_reason_whole(letters: DeadLetters) -> None:
    said = '; the provider said: "No response found with id resp_1"'
    kept = await keep_letter(letters, FETCH_RESPONSE, error="x" * 5000 + said)
    [stored] = await letters.get([kept.id])
    assert len(stored.error) == 2000 and stored.error.endswith("\u2026" + said)
