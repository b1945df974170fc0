"""The one backoff (receiver/backoff.py): its bounds as properties, and every retry layer
waiting by it: job retries, the provider client's in-job retries, a batch chunk's in-job
sink retries and the wait for Redis."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError

from nopoll.exceptions import TransientProviderError
from receiver.backoff import Backoff
from receiver.batches.budget import ChunkBudget, ChunkTicket
from receiver.batches.writer import DONE, SinkWriter
from receiver.config.settings import HttpConfig, ProviderConfig, RetryConfig
from receiver.metrics import Metrics
from receiver.providers import ProviderClient, ResponsesDialect
from receiver.queue._arq import Retry
from receiver.queue.enqueue import FETCH_RESPONSE
from receiver.redis.link import RedisLink
from receiver.worker.retry import retry_or_give_up


@pytest.fixture
def seeded() -> Iterator[None]:
    """tenacity draws from the ``random`` module: seed it, and put its state back after."""
    state = random.getstate()
    random.seed(20240611)
    yield
    random.setstate(state)


# --- the helper's bounds --------------------------------------------------------------------


def check_delay(backoff: Backoff, attempt: int, retry_after_s: float | None) -> None:
    """Every delay lies in [floor, max(floor, ceiling)]; the floor is the Retry-After,
    capped; the ceiling never passes max_s."""
    delay = backoff.delay(attempt, retry_after_s)
    cap = backoff.max_s if backoff.max_retry_after_s is None else backoff.max_retry_after_s
    floor = min(retry_after_s, cap) if retry_after_s and retry_after_s > 0 else 0.0
    assert backoff.floor(retry_after_s) == floor
    assert 0.0 <= backoff.ceiling(attempt) <= backoff.max_s
    assert floor <= delay <= max(floor, backoff.ceiling(attempt))
    if retry_after_s is not None and retry_after_s > 0:
        assert delay >= min(retry_after_s, cap)  # the provider's "not before" is kept
        assert delay <= max(cap, backoff.max_s)  # ... but never an unbounded wait


def test_every_delay_is_within_its_floor_and_cap(seeded: None) -> None:
    rng = random.Random(7)
    for _ in range(3000):
        backoff = Backoff(
            first_s=rng.choice([0.0, rng.uniform(0, 10)]),
            max_s=rng.choice([0.0, rng.uniform(0, 1000)]),
            max_retry_after_s=rng.choice([None, rng.uniform(0, 100)]),
        )
        retry_after = rng.choice([None, 0.0, rng.uniform(0, 2000)])
        check_delay(backoff, rng.randint(1, 300), retry_after)


def test_every_delay_is_within_its_floor_and_cap_hypothesis() -> None:
    seconds = st.floats(min_value=0, max_value=1e4, allow_nan=False)

    @given(
        first_s=seconds,
        max_s=seconds,
        max_retry_after_s=st.none() | seconds,
        attempt=st.integers(min_value=1, max_value=10_000),
        retry_after_s=st.none() | seconds,
    )
    def run(first_s, max_s, max_retry_after_s, attempt, retry_after_s) -> None:
        check_delay(Backoff(first_s, max_s, max_retry_after_s), attempt, retry_after_s)

    run()


def test_the_mean_delay_grows_with_the_attempt_until_the_cap(seeded: None) -> None:
    backoff = Backoff(first_s=1.0, max_s=100.0)
    means = [
        statistics.fmean(backoff.delay(attempt) for _ in range(4000)) for attempt in range(1, 10)
    ]
    for attempt, mean in enumerate(means, start=1):
        assert mean == pytest.approx(backoff.ceiling(attempt) / 2, rel=0.1)  # full jitter
    assert means[:8] == sorted(means[:8]) and len(set(means[:8])) == 8  # grows ...
    assert means[7] == pytest.approx(means[8], rel=0.1)  # ... until the cap (100 s)


def test_retry_after_is_a_floor_and_capped(seeded: None) -> None:
    backoff = Backoff(first_s=0.25, max_s=4.0, max_retry_after_s=10.0)
    assert all(8.0 <= backoff.delay(1, 8.0) <= 8.0 for _ in range(100))  # above the ceiling
    assert all(2.0 <= backoff.delay(5, 2.0) <= 4.0 for _ in range(100))  # jitter above it
    assert all(backoff.delay(1, 120.0) == 10.0 for _ in range(100))  # capped
    assert RetryConfig(base_delay_s=1, max_delay_s=300).delay(1, 1e6) == 300.0


# --- every layer waits by the helper --------------------------------------------------------


@dataclass
class Wait:
    backoff: Backoff
    attempt: int
    retry_after_s: float | None
    delay: float


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[Wait]:
    """Every delay the helper hands out, with the backoff and arguments it came from."""
    seen: list[Wait] = []
    real = Backoff.delay

    def spy(self: Backoff, attempt: int, retry_after_s: float | None = None) -> float:
        delay = real(self, attempt, retry_after_s)
        seen.append(Wait(self, attempt, retry_after_s, delay))
        return delay

    monkeypatch.setattr(Backoff, "delay", spy)
    return seen


async def test_job_retries_wait_by_the_helper(make_settings, waits: list[Wait]) -> None:
    settings = make_settings(fetch_retry={"max_tries": 5, "base_delay_s": 2, "max_delay_s": 60})
    ctx: dict[str, Any] = {
        "state": SimpleNamespace(settings=settings, metrics=Metrics()),
        "job_try": 3,
    }
    with pytest.raises(Retry) as info:
        await retry_or_give_up(ctx, FETCH_RESPONSE, {"provider": "sim"}, "busy", 1.5)
    [wait] = waits
    assert (wait.backoff, wait.attempt, wait.retry_after_s) == (Backoff(2.0, 60.0), 3, 1.5)
    assert 1.5 <= wait.delay <= 8.0
    assert info.value.defer_score == round(wait.delay * 1000)


async def test_the_provider_clients_in_job_retries_wait_by_the_helper(
    waits: list[Wait],
) -> None:
    answers = iter([503, 503, 200])
    requests = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal requests
        requests += 1
        status = next(answers)
        if status != 200:
            return httpx.Response(status, headers={"retry-after": "0.01"}, content=b"{}")
        return httpx.Response(200, content=b'{"id": "resp_1"}')

    config = ProviderConfig(dialect="openai", base_url="https://api.example/v1")
    http = HttpConfig(attempts=3, max_retry_after_s=7)
    client = ProviderClient("sim", config, http, transport=httpx.MockTransport(handler))
    try:
        assert await client.get_json("responses/resp_1") == {"id": "resp_1"}
    finally:
        await client.aclose()
    assert requests == 3
    assert [(w.attempt, w.retry_after_s) for w in waits] == [(1, 0.01), (2, 0.01)]
    assert {w.backoff for w in waits} == {Backoff(0.25, 4.0, 7.0)}
    assert all(0.01 <= w.delay <= w.backoff.ceiling(w.attempt) for w in waits)


async def test_a_response_fetch_is_one_request_per_job_try() -> None:
    requests = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal requests
        requests += 1
        return httpx.Response(500, content=b"{}")

    config = ProviderConfig(dialect="openai", base_url="https://api.example/v1")
    client = ProviderClient(
        "sim", config, HttpConfig(attempts=3), transport=httpx.MockTransport(handler)
    )
    try:
        with pytest.raises(TransientProviderError):
            await ResponsesDialect(client).fetch_response("resp_1")
    finally:
        await client.aclose()
    assert requests == 1  # the fetch job's own retry comes next


class _FailingSink:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.writes = 0

    async def write_part(self, part: int, envelopes: list[Any]) -> None:
        self.writes += 1
        if self.writes <= self.failures:
            raise OSError("sink down")


class _State:
    key = "nopoll:batch:sim:batch_1"

    def __init__(self) -> None:
        self.commits: list[tuple[str, int, Any]] = []

    async def commit(self, sink: str, number: int, *, pending: bool = False, handoff=None):
        self.commits.append((sink, number, handoff))


@pytest.mark.parametrize("failures", [2, 99])
async def test_a_batch_chunks_in_job_retries_wait_by_the_helper(
    make_settings, waits: list[Wait], failures: int
) -> None:
    settings = make_settings(
        sink_retry={"max_tries": 4, "base_delay_s": 0.01, "max_delay_s": 30},
        batch={"sink_attempts": 3},
    )
    sink = _FailingSink(failures)
    state = _State()
    writer = SinkWriter(
        "lake",
        -1,
        state,  # type: ignore[arg-type]
        settings=settings,
        fanout=SimpleNamespace(sinks={"lake": sink}, fingerprints={}),  # type: ignore[arg-type]
        dead_letters=None,  # type: ignore[arg-type]
        metrics=None,  # type: ignore[arg-type]
    )
    ticket = ChunkTicket(ChunkBudget(0), 0, 1)
    await writer.queue.put((0, [{"provider": "sim", "key": "batch_1/a"}], ticket))
    await writer.queue.put(DONE)
    await asyncio.wait_for(writer.run(), 10)

    assert sink.writes == min(failures + 1, 3)
    in_job = [w for w in waits if w.backoff.max_s == 5.0]
    assert [w.attempt for w in in_job] == [1, 2]  # between the three tries
    assert {w.backoff for w in in_job} == {Backoff(0.01, 5.0)}  # sink_retry, capped at 5 s
    assert all(w.delay <= w.backoff.ceiling(w.attempt) for w in in_job)
    [(_, _, handoff)] = state.commits
    if failures < 3:
        assert handoff is None and len(waits) == 2
    else:  # handed to a delivery job of its own, deferred by sink_retry's first wait
        assert [(w.backoff, w.attempt) for w in waits[2:]] == [(Backoff(0.01, 30.0), 1)]
        assert handoff.defer_s == waits[2].delay


async def test_waiting_for_redis_waits_by_the_helper(waits: list[Wait]) -> None:
    class Redis:
        pings = 0

        async def ping(self) -> bool:
            self.pings += 1
            if self.pings <= 2:
                raise RedisConnectionError("down")
            return True

    redis = Redis()
    link = RedisLink("test", max_wait_s=0.02)
    await asyncio.wait_for(link.wait(redis, first_s=0.005), 5)  # type: ignore[arg-type]
    assert redis.pings == 3 and link.up
    assert [(w.backoff, w.attempt) for w in waits] == [
        (Backoff(0.005, 0.02), 1),
        (Backoff(0.005, 0.02), 2),
    ]
