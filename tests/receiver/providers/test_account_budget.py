"""Each provider account's request budget: every request nopoll makes there (polls, fetches,
row GETs, streams, creates) takes a slot of one shared budget, paced by the provider's
rate-limit headers and paused by its 429s; a quota refusal is permanent. Against the real
simulator (behind :class:`~tests.limited_provider.LimitedSimulator`) and real Redis."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from nopoll.exceptions import ProviderError, QuotaExceeded, TransientProviderError
from receiver.config.accounts import DEFAULT_TENANT
from receiver.config.settings import HttpConfig, ProviderConfig, Settings, load_settings
from receiver.metrics import Metrics
from receiver.providers import ProviderClient, ResponsesDialect
from receiver.providers.budget import (
    MAX_HEADER_PAUSE_S,
    AccountBudget,
    NoRequestSlot,
    account_budget,
    rate_pause_s,
)
from receiver.redis import RedisConnector
from receiver.worker.state import build_state
from tests.limited_provider import OPENAI_QUOTA, VALAR_QUOTA, max_in_any_second

KEY = "sk-test-not-a-real-key"


def _settings(sim: Any, redis_url: str, dialect: str, **provider: Any) -> Settings:
    return load_settings(
        None,
        env={},
        overrides={
            "redis_url": redis_url,
            "providers": {
                "sim": {"dialect": dialect, "base_url": sim.base_url, "api_key": KEY, **provider}
            },
            "sinks": {"files": {"type": "jsonl", "dir": "/tmp/nopoll-budget-unused"}},
            "http": {"attempts": 3, "connect_timeout_s": 2, "read_timeout_s": 5},
        },
    )


def _client(sim: Any, redis: Redis, dialect: str = "valar", **provider: Any) -> ProviderClient:
    """A client of account ``sim`` with its budget, as the worker builds it."""
    config = ProviderConfig(dialect=dialect, base_url=sim.base_url, api_key=KEY, **provider)
    budget = account_budget(redis, "sim", DEFAULT_TENANT, config)
    return ProviderClient("sim", config, HttpConfig(attempts=3), budget=budget)


# --- the rate-limit headers ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "pause"),
    [
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "30", "x-ratelimit-limit": "60"}, 0.5),
        ({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "4"}, 4.0),  # no Limit: all of it
        (
            {"x-ratelimit-remaining": "0.0", "x-ratelimit-reset": "2.5", "x-ratelimit-limit": "5"},
            0.5,
        ),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "3", "x-ratelimit-limit": "x"}, 3.0),
        ({"x-ratelimit-remaining": "1", "x-ratelimit-reset": "30", "x-ratelimit-limit": "60"}, 0.0),
        ({"x-ratelimit-remaining": "0"}, 0.0),  # no Reset: nothing to pace by
        ({"x-ratelimit-remaining": "none", "x-ratelimit-reset": "30"}, 0.0),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "soon"}, 0.0),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "-5"}, 0.0),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "nan"}, 0.0),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "inf"}, 0.0),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1e9"}, MAX_HEADER_PAUSE_S),
        ({}, 0.0),
    ],
)
def test_remaining_zero_pauses_for_one_requests_worth_of_the_reset(
    headers: dict[str, str], pause: float
) -> None:
    import httpx

    assert rate_pause_s(httpx.Headers(headers)) == pytest.approx(pause)


# --- no budget: no cost -------------------------------------------------------------------


async def test_an_account_without_a_budget_costs_no_redis_call_per_get(provider_sim, redis_url):
    """openai has no documented fixed request rate: its account has no budget, and a
    callback's fetch gains no Redis round trip (counted on the worker's own Redis client,
    which the budget uses)."""
    sim = provider_sim(api_key=KEY)
    ids = [f"resp_free_{i}" for i in range(300)]
    for rid in ids:
        sim.add_response(rid)
    state = build_state(
        _settings(sim, redis_url, "openai"), RedisConnector.from_url(redis_url), Metrics()
    )
    calls: list[Any] = []
    send = state.redis.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        calls.append(args[0])
        return await send(*args, **options)

    state.redis.execute_command = counted  # type: ignore[method-assign]
    dialect = state.dialects["sim"]
    try:
        assert dialect.client.budget is not None and dialect.client.budget.rate_per_s is None
        started = time.monotonic()
        for rid in ids:
            assert (await dialect.fetch_response(rid))["id"] == rid
        took = time.monotonic() - started
        await asyncio.sleep(0)
    finally:
        await state.aclose()
    assert sim.request_count("/v1/responses/") == 300
    # at most one look at the account's shared 429 pause a second, in the background
    assert len(calls) <= 1 + took, calls


async def test_a_budgeted_account_takes_a_slot_for_each_get(limited_sim, redis_url):
    """The same count with a budget: one script call per GET (so the count above is honest)."""
    sim = limited_sim(api_key=KEY)
    for i in range(20):
        sim.add_response(f"resp_paid_{i}")
    settings = _settings(sim, redis_url, "valar", rate_limit_rps=1000)
    state = build_state(settings, RedisConnector.from_url(redis_url), Metrics())
    calls: list[Any] = []
    send = state.redis.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        calls.append(args[0])
        return await send(*args, **options)

    state.redis.execute_command = counted  # type: ignore[method-assign]
    try:
        for i in range(20):
            await state.dialects["sim"].fetch_response(f"resp_paid_{i}")
    finally:
        await state.aclose()
    assert len([c for c in calls if c in ("EVALSHA", "EVAL")]) >= 20


# --- the budget holds -------------------------------------------------------------------------


async def test_every_request_kind_shares_the_accounts_budget(limited_sim, redis_url):
    """Polls, batch objects, row GETs, result streams and creates of one account, all at
    once from two clients (two processes' worth): never more than the budget in any
    second at the provider."""
    sim = limited_sim(api_key=KEY)
    for i in range(8):
        sim.add_response(f"resp_mix_{i}")
    sim.add_batch("valar", "batch_mix", 8)
    sim.add_batch("sference", "batch_lines", 3)
    redis_a, redis_b = Redis.from_url(redis_url), Redis.from_url(redis_url)
    a, b = _client(sim, redis_a, rate_limit_rps=5), _client(sim, redis_b, rate_limit_rps=5)

    async def lines(client: ProviderClient) -> None:
        async for _ in client.stream_lines("batches/batch_lines/results.jsonl"):
            pass

    async def create(client: ProviderClient, i: int) -> None:
        body = orjson.dumps({"model": "m-1", "input": "hi", "background": True})
        status, _, _ = await client.post_once(
            "responses", body, content_type="application/json", idempotency_key=f"k-{i}"
        )
        assert status == 200

    work = [
        *(
            ResponsesDialect(c).fetch_response(f"resp_mix_{i}")
            for i, c in zip(range(8), [a, b] * 4, strict=True)
        ),
        a.get_json("batches/batch_mix"),
        *(b.get_json(f"batches/batch_mix/row-{i:06d}") for i in range(6)),
        lines(a),
        lines(b),
        *(create(c, i) for i, c in zip(range(4), [a, b] * 2, strict=True)),
    ]
    try:
        await asyncio.gather(*work)
    finally:
        for c in (a, b):
            await c.aclose()
        for r in (redis_a, redis_b):
            await r.aclose()
    stamps = [s.at for s in sim.seen("/v1/")]
    assert len(stamps) == 21
    assert max_in_any_second(stamps) <= 5


async def test_a_request_that_gets_no_slot_in_time_is_not_sent(limited_sim, redis_url):
    sim = limited_sim(api_key=KEY)
    sim.add_response("resp_slot")
    redis = Redis.from_url(redis_url)
    c = _client(sim, redis, rate_limit_rps=1)
    try:
        await ResponsesDialect(c).fetch_response("resp_slot")  # takes the first slot
        await ResponsesDialect(c).fetch_response("resp_slot", wait_s=5)  # waits ~1.1 s
        with pytest.raises(NoRequestSlot) as info:
            await ResponsesDialect(c).fetch_response("resp_slot", wait_s=0.2)
    finally:
        await c.aclose()
        await redis.aclose()
    assert isinstance(info.value, TransientProviderError)
    assert info.value.retry_after_s is not None and 0.2 < info.value.retry_after_s <= 1.2
    assert len(sim.seen("/v1/responses/resp_slot")) == 2


# --- paced by the headers, paused by 429s ---------------------------------------------------

_PAUSED = """
import asyncio, sys, time
from redis.asyncio import Redis
from receiver.config.accounts import DEFAULT_TENANT
from receiver.config.settings import HttpConfig, ProviderConfig
from receiver.providers import ProviderClient
from receiver.providers.budget import account_budget

async def main(redis_url, base_url, rate):
    redis = Redis.from_url(redis_url)
    config = ProviderConfig(dialect="valar", base_url=base_url, api_key="KEY",
                            rate_limit_rps=float(rate) if rate != "none" else None)
    client = ProviderClient("sim", config, HttpConfig(),
                            budget=account_budget(redis, "sim", DEFAULT_TENANT, config))
    print("ready", flush=True)
    sys.stdin.readline()
    await client.get_json("responses/resp_second")
    print("done", flush=True)
    await client.aclose()
    await redis.aclose()

asyncio.run(main(*sys.argv[1:]))
""".replace("KEY", KEY)


async def test_remaining_zero_pauses_the_account_in_another_process(limited_sim, redis_url):
    """An answer with ``X-RateLimit-Remaining: 0`` and ``X-RateLimit-Reset: 3`` (no Limit)
    holds the account's next request for 3 s, also in another process."""
    sim = limited_sim(api_key=KEY)
    sim.add_response("resp_first")
    sim.add_response("resp_second")
    sim.stamp("/v1/responses/resp_first", {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "3"})
    other = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", _PAUSED, redis_url, sim.base_url, "100"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    redis = Redis.from_url(redis_url)
    c = _client(sim, redis, rate_limit_rps=100)
    try:
        assert other.stdout is not None and other.stdin is not None
        assert await other.stdout.readline() == b"ready\n"
        await c.get_json("responses/resp_first")
        answered = time.time()
        other.stdin.write(b"go\n")
        await other.stdin.drain()
        assert await other.stdout.readline() == b"done\n"
        await c.get_json("responses/resp_first")  # this process is held as well
    finally:
        if other.returncode is None:
            other.kill()
        await other.wait()
        await c.aclose()
        await redis.aclose()
    [second] = sim.seen("/v1/responses/resp_second")
    assert second.at - answered >= 2.8
    again = sim.seen("/v1/responses/resp_first")[1]
    assert again.at - answered >= 2.8


@pytest.mark.parametrize("rate", [5.0, None], ids=["budget", "no-budget"])
async def test_a_429_pauses_every_request_kind_of_the_account(limited_sim, redis_url, rate):
    """A poll's 429 with ``Retry-After: 2`` holds the account's fetches, row GETs, streams
    and creates for 2 s, with or without a budget (a pause needs no rate)."""
    sim = limited_sim(api_key=KEY)
    sim.add_response("resp_busy")
    sim.add_response("resp_next")
    sim.add_batch("valar", "batch_held", 3)
    sim.add_batch("sference", "batch_held_lines", 2)
    sim.refuse("/v1/responses/resp_busy", retry_after=2, first=1)
    redis = Redis.from_url(redis_url)
    dialect = "valar" if rate else "openai"
    c = _client(sim, redis, dialect, rate_limit_rps=rate)

    async def lines() -> None:
        async for _ in c.stream_lines("batches/batch_held_lines/results.jsonl"):
            pass

    body = orjson.dumps({"model": "m-1", "input": "hi", "background": True})
    try:
        with pytest.raises(TransientProviderError) as info:
            await ResponsesDialect(c).fetch_response("resp_busy")
        assert info.value.status == 429
        refused = time.time()
        await asyncio.gather(
            ResponsesDialect(c).fetch_response("resp_next"),
            c.get_json("batches/batch_held"),
            c.get_json("batches/batch_held/row-000001"),
            lines(),
            c.post_once("responses", body, content_type="application/json", idempotency_key="k"),
        )
    finally:
        await c.aclose()
        await redis.aclose()
    later = [s for s in sim.log if s.at > refused]
    assert len(later) == 5
    assert min(s.at for s in later) - refused >= 1.9


async def test_a_429_pause_reaches_another_process_of_an_account_without_budget(
    limited_sim, redis_url
):
    """Without a budget no request waits for Redis: another process learns of the pause
    within a second (its look at the shared pause runs beside its requests)."""
    sim = limited_sim(api_key=KEY)
    sim.add_response("resp_busy")
    sim.add_response("resp_other")
    sim.refuse("/v1/responses/resp_busy", retry_after=3, first=1)
    redis_a, redis_b = Redis.from_url(redis_url), Redis.from_url(redis_url)
    a, b = _client(sim, redis_a, "openai"), _client(sim, redis_b, "openai")
    try:
        await b.get_json("responses/resp_other")  # b has looked once, before any pause
        with pytest.raises(TransientProviderError):
            await a.get_json("responses/resp_busy", attempts=1)
        refused = time.time()
        await asyncio.sleep(1.1)
        await b.get_json("responses/resp_other")  # goes: its look is due, not done yet
        await asyncio.sleep(0.5)  # the look (one script call) has come back
        await b.get_json("responses/resp_other")  # held by what its look found
    finally:
        for c in (a, b):
            await c.aclose()
        for r in (redis_a, redis_b):
            await r.aclose()
    last = sim.seen("/v1/responses/resp_other")[-1]
    assert last.at - refused >= 2.8


# --- quota: no retry helps ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body"),
    [(429, VALAR_QUOTA), (429, OPENAI_QUOTA), (402, VALAR_QUOTA), (403, OPENAI_QUOTA)],
    ids=["valar-429", "openai-429", "402", "403"],
)
async def test_insufficient_quota_is_permanent_with_the_providers_words(
    limited_sim, redis_url, status, body
):
    sim = limited_sim(api_key=KEY)
    sim.add_response("resp_quota")
    sim.add_response("resp_after")
    sim.refuse("/v1/responses/resp_quota", status=status, body=body, retry_after=1)
    redis = Redis.from_url(redis_url)
    c = _client(sim, redis, rate_limit_rps=50)
    try:
        with pytest.raises(QuotaExceeded) as info:
            await c.get_json("responses/resp_quota", attempts=3)
        started = time.monotonic()
        await c.get_json("responses/resp_after")  # a quota refusal is no rate signal
        took = time.monotonic() - started
        with pytest.raises(QuotaExceeded) as created:
            sim.refuse("/v1/responses", status=status, body=body, method="POST")
            await c.post_once(
                "responses", b"{}", content_type="application/json", idempotency_key="k"
            )
    finally:
        await c.aclose()
        await redis.aclose()
    assert not isinstance(info.value, TransientProviderError)
    assert isinstance(info.value, ProviderError) and info.value.status == status
    assert body["error"]["message"] in str(info.value)
    assert "insufficient_quota" in str(info.value)
    assert len(sim.seen("/v1/responses/resp_quota")) == 1  # not retried
    assert took < 0.9  # no pause: the refusal's Retry-After: 1 is not waited out
    assert body["error"]["message"] in str(created.value)


async def test_a_plain_429_is_still_transient(limited_sim, redis_url):
    sim = limited_sim(api_key=KEY)
    sim.add_response("resp_rate")
    limited = {"error": {"type": "rate_limit_exceeded", "message": "request rate limit exceeded"}}
    sim.refuse("/v1/responses/resp_rate", body=limited, retry_after=0.2, first=1)
    redis = Redis.from_url(redis_url)
    c = _client(sim, redis, rate_limit_rps=50)
    try:
        assert (await c.get_json("responses/resp_rate", attempts=2))["id"] == "resp_rate"
    finally:
        await c.aclose()
        await redis.aclose()
    assert len(sim.seen("/v1/responses/resp_rate")) == 2


# --- tenants --------------------------------------------------------------------------------


async def test_a_tenant_accounts_budget_is_its_own(limited_sim, redis_url):
    """The default account and team-a's (its own key) each get 2 requests a second: each
    stays within it, together they make twice that; a pause of one holds only that one."""
    sim = limited_sim(api_key=[KEY, "sk-team-a"])
    for i in range(40):
        sim.add_response(f"resp_t_{i}")
    settings = load_settings(
        None,
        env={},
        overrides={
            "redis_url": redis_url,
            "providers": {
                "sim": {
                    "dialect": "valar",
                    "base_url": sim.base_url,
                    "api_key": KEY,
                    "rate_limit_rps": 2,
                }
            },
            "tenants": {"team-a": {"providers": {"sim": {"api_key": "sk-team-a"}}}},
            "tenant_keys": ["k" * 32],
            "sinks": {"files": {"type": "jsonl", "dir": "/tmp/nopoll-budget-unused"}},
        },
    )
    state = build_state(settings, RedisConnector.from_url(redis_url), Metrics())
    mine, theirs = state.dialect("sim"), state.dialect("sim", "team-a")
    assert mine is not None and theirs is not None
    budget = theirs.client.budget
    assert isinstance(budget, AccountBudget) and budget.account == "sim@team-a"
    try:
        await mine.client.budget.pause(3.0)  # type: ignore[union-attr]
        paused = time.time()
        keys: set[str] = set()

        async def look() -> None:
            await asyncio.sleep(3.5)  # both accounts are booking slots now
            keys.update([k.decode() async for k in state.redis.scan_iter("nopoll:rate:sim*")])

        await asyncio.gather(
            *(mine.fetch_response(f"resp_t_{i}") for i in range(0, 8)),
            *(theirs.fetch_response(f"resp_t_{i}") for i in range(20, 28)),
            look(),
        )
    finally:
        await state.aclose()
    default = [s.at for s in sim.seen("/v1/", key=KEY)]
    team = [s.at for s in sim.seen("/v1/", key="sk-team-a")]
    assert len(default) == len(team) == 8
    assert max_in_any_second(default) <= 2 and max_in_any_second(team) <= 2
    assert min(team) - paused < 1.0  # team-a was not held by the default account's pause
    assert min(default) - paused >= 2.9
    assert max_in_any_second(default + team) > 2  # two budgets, not one
    assert {"nopoll:rate:sim:account", "nopoll:rate:sim@team-a:account"} <= keys
