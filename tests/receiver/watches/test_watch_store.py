"""The watch store against real Redis: registration, due-taking with leases, and the
arbitration between a poll and a callback that makes every watch land exactly once."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from receiver.watches.store import WatchStore, due_key


@pytest.fixture
async def store(redis_url):
    client = Redis.from_url(redis_url)
    yield WatchStore(client, ended_ttl_s=60)
    await client.aclose()


async def test_registering_twice_or_after_landing_changes_nothing(store):
    assert await store.register("p", "response", "r1", first_poll_in_s=0)
    assert not await store.register("p", "response", "r1", first_poll_in_s=0)
    await store.finish("p", "response", "r1", "landed")
    assert not await store.register("p", "response", "r1", first_poll_in_s=0)
    watch = await store.get("p", "response", "r1")
    assert watch is not None and watch.state == "landed"


async def test_a_watch_is_taken_only_when_due_and_by_one_poller(store):
    await store.register("p", "response", "later", first_poll_in_s=60)
    await store.register("p", "response", "now", first_poll_in_s=0)
    first, second = await asyncio.gather(
        store.take_due("p", limit=10, lease_s=30), store.take_due("p", limit=10, lease_s=30)
    )
    assert sorted(w.id for w in first + second) == ["now"]  # one poller, not two
    assert (first + second)[0].polls == 1
    assert 25 < (await store.next_due_in_s("p") or 0) <= 30  # the taken one, leased ahead


async def test_a_poller_killed_mid_poll_loses_nothing(store):
    await store.register("p", "response", "r1", first_poll_in_s=0)
    [taken] = await store.take_due("p", limit=10, lease_s=0.2)
    assert await store.take_due("p", limit=10, lease_s=0.2) == []  # leased
    await asyncio.sleep(0.3)  # the poller died: its lease ran out
    [again] = await store.take_due("p", limit=10, lease_s=0.2)
    assert again.id == taken.id and again.polls == 2


async def test_a_rescheduled_watch_waits_its_interval(store):
    await store.register("p", "batch", "b1", first_poll_in_s=0)
    [watch] = await store.take_due("p", limit=1, lease_s=30)
    await store.reschedule(watch, in_s=5, status="in_progress")
    stored = await store.get("p", "batch", "b1")
    assert stored is not None and stored.state == "pending" and stored.status == "in_progress"
    assert await store.take_due("p", limit=1, lease_s=30) == []
    assert 4 < (await store.next_due_in_s("p") or 0) <= 5


async def test_a_callback_first_stops_the_poll_from_delivering(store):
    await store.register("p", "response", "r1", first_poll_in_s=0)
    [watch] = await store.take_due("p", limit=1, lease_s=30)
    assert await store.callback_arrived("p", "response", "r1") == "callback"
    assert not await store.claim_landing(watch, "completed", lease_s=30)
    assert await store.take_due("p", limit=1, lease_s=30) == []  # no more polling


async def test_a_poll_first_makes_the_callback_skip(store):
    await store.register("p", "response", "r1", first_poll_in_s=0)
    [watch] = await store.take_due("p", limit=1, lease_s=30)
    assert await store.claim_landing(watch, "completed", lease_s=30)
    assert await store.callback_arrived("p", "response", "r1") == "landing"
    await store.finish("p", "response", "r1", "landed")
    assert await store.callback_arrived("p", "response", "r1") == "landed"
    assert await store.callback_arrived("p", "response", "other") == "none"


async def test_a_landing_whose_poller_died_comes_due_again(store, redis_sync_client):
    await store.register("p", "response", "r1", first_poll_in_s=0)
    [watch] = await store.take_due("p", limit=1, lease_s=30)
    assert await store.claim_landing(watch, "completed", lease_s=0.2)
    await asyncio.sleep(0.3)
    [again] = await store.take_due("p", limit=1, lease_s=30)
    assert again.id == "r1"
    await store.finish("p", "response", "r1", "landed")
    assert redis_sync_client.zcard(due_key("p")) == 0
    assert redis_sync_client.ttl("nopoll:watch:p:response:r1") > 0


async def test_scan_filters_and_counts(store):
    for i in range(30):
        await store.register("p", "response", f"r{i}", first_poll_in_s=60)
    await store.register("p", "batch", "b1", first_poll_in_s=60)
    await store.register("q", "response", "x", first_poll_in_s=60)
    await store.finish("p", "response", "r0", "landed")
    await store.finish("p", "response", "r1", "expired")
    landed, _ = await store.scan(provider="p", state="landed")
    assert [w.id for w in landed] == ["r0"]
    batches, _ = await store.scan(kind="batch")
    assert [(w.provider, w.id) for w in batches] == [("p", "b1")]
    assert await store.counts("p") == {"pending": 29, "landed": 1, "expired": 1}
    assert await store.delete("p", "batch", "b1")
    assert not await store.delete("p", "batch", "b1")


async def test_a_callback_whose_job_never_lands_hands_the_id_back_to_polling(store):
    await store.register("p", "response", "r1", first_poll_in_s=0)
    assert await store.callback_arrived("p", "response", "r1", recheck_s=0.2) == "callback"
    assert await store.take_due("p", limit=1, lease_s=30) == []  # the callback's job works
    watch = await store.get("p", "response", "r1")
    assert watch is not None and watch.to_dict()["state"] == "pending"
    assert watch.to_dict()["phase"] == "callback"
    await asyncio.sleep(0.3)  # its retries ran out (a dead letter): polling takes over
    [again] = await store.take_due("p", limit=1, lease_s=30)
    assert again.id == "r1" and again.state == "polling"
    assert await store.claim_landing(again, "completed", lease_s=30)


async def test_ended_counts_move_with_a_replayed_expired_watch(store):
    await store.register("p", "response", "r1", first_poll_in_s=0)
    await store.finish("p", "response", "r1", "expired")
    assert await store.counts("p") == {"pending": 0, "landed": 0, "expired": 1}
    assert await store.callback_arrived("p", "response", "r1") == "callback"  # replayed
    assert (await store.counts("p"))["pending"] == 1
    await store.finish("p", "response", "r1", "landed")
    await store.finish("p", "response", "r1", "landed")  # twice: counted once
    assert await store.counts("p") == {"pending": 0, "landed": 1, "expired": 0}


async def test_a_take_without_a_request_is_not_counted_as_a_poll(store):
    await store.register("p", "response", "r1", first_poll_in_s=0)
    [watch] = await store.take_due("p", limit=1, lease_s=30)
    await store.reschedule(watch, in_s=0, status=None, polled=False)
    [again] = await store.take_due("p", limit=1, lease_s=30)
    assert again.polls == 1


async def test_a_callback_before_the_watch_keeps_a_later_registration_from_polling(store):
    # nopoll submit registers an id after its create answered: a fast result may have
    # been called back (and landed) by then
    assert await store.callback_arrived("p", "response", "fast") == "none"
    await store.finish("p", "response", "fast", "landed", status="completed", via="callback")
    assert not await store.register("p", "response", "fast", first_poll_in_s=0)
    watch = await store.get("p", "response", "fast")
    assert watch is not None and watch.state == "landed"
    assert await store.take_due("p", limit=10, lease_s=30) == []
    assert (await store.counts("p"))["landed"] == 1

    assert await store.callback_arrived("p", "response", "slow") == "none"  # still landing
    assert await store.register("p", "response", "slow", first_poll_in_s=0)
    assert await store.take_due("p", limit=10, lease_s=30) == []  # its job lands it
    await store.finish("p", "response", "slow", "landed", via="callback")
    watch = await store.get("p", "response", "slow")
    assert watch is not None and watch.state == "landed"


async def test_each_tenants_watch_of_one_id_is_its_own_in_one_due_set(store, redis_sync_client):
    for tenant in ("default", "team-a", "team-b"):
        assert await store.register("p", "response", "r1", first_poll_in_s=0, tenant=tenant)
    # the default tenant's keys are what they always were; the others' are provider@tenant
    assert redis_sync_client.exists("nopoll:watch:p:response:r1")
    assert redis_sync_client.exists("nopoll:watch:p@team-a:response:r1")
    assert sorted(redis_sync_client.zrange(due_key("p"), 0, -1)) == [
        b"response:r1",
        b"response:r1@team-a",
        b"response:r1@team-b",
    ]
    # team-a's callback: team-a's watch only
    assert await store.callback_arrived("p", "response", "r1", tenant="team-a") == "callback"
    taken = await store.take_due("p", limit=10, lease_s=30)
    assert sorted((w.tenant, w.state) for w in taken) == [
        ("default", "polling"),
        ("team-b", "polling"),
    ]
    await store.finish("p", "response", "r1", "landed", tenant="team-a", via="callback")
    by_tenant = {t: await store.get("p", "response", "r1", t) for t in ("default", "team-a")}
    assert {t: w.state for t, w in by_tenant.items() if w} == {
        "default": "polling",
        "team-a": "landed",
    }
    # a poll of team-b lands team-b's; the default tenant's goes on
    [team_b] = [w for w in taken if w.tenant == "team-b"]
    assert await store.claim_landing(team_b, "completed", lease_s=30)
    await store.end(team_b, "landed", via="poll")
    assert await store.callback_arrived("p", "response", "r1", tenant="team-b") == "landed"
    assert await store.callback_arrived("p", "response", "r1") == "callback"
    listed, _ = await store.scan(provider="p", tenant=None)
    assert sorted((w.tenant, w.state) for w in listed) == [
        ("default", "callback"),
        ("team-a", "landed"),
        ("team-b", "landed"),
    ]
    only_b, _ = await store.scan(tenant="team-b")
    assert [w.tenant for w in only_b] == ["team-b"]
    assert await store.delete("p", "response", "r1", "team-a")
    assert await store.get("p", "response", "r1", "team-a") is None
    assert await store.get("p", "response", "r1") is not None


async def test_a_tenants_watch_registered_before_watches_were_scoped_is_still_its_own(
    store, redis_sync_client
):
    # as stored before: under the default tenant's keys, the tenant in the hash
    redis_sync_client.hset(
        "nopoll:watch:p:response:old",
        mapping={"state": "pending", "polls": 0, "registered_at": 0, "tenant": "team-a"},
    )
    redis_sync_client.zadd(due_key("p"), {"response:old": 0})
    [watch] = await store.take_due("p", limit=10, lease_s=30)
    assert (watch.tenant, watch.keyed_as) == ("team-a", "default")  # polled with team-a's key
    await store.reschedule(watch, in_s=0, status="in_progress")
    [watch] = await store.take_due("p", limit=10, lease_s=30)
    assert watch.polls == 2
    await store.end(watch, "landed", via="poll")
    assert redis_sync_client.hget("nopoll:watch:p:response:old", "state") == b"landed"
    assert redis_sync_client.zcard(due_key("p")) == 0
