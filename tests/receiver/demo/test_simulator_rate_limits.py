"""Valar's request limits in the simulator, over real HTTP (:mod:`tests.contracts.valar`):
the ``X-RateLimit-*`` headers on every answer, a leaky bucket per API key, 429
``rate_limit_exceeded`` with ``Retry-After`` when it is full, the spend-cap switch (429
``insufficient_quota``), and nothing of it when no limit is set."""

from __future__ import annotations

import math
import time
from typing import Any

import httpx

from tests.contracts import valar
from tests.contracts._strict import parse

KEYS = ("sk-one", "sk-two")
BODY = {"model": "m-1", "input": "hello", "background": True}


def client(sim: Any, key: str = KEYS[0]) -> httpx.Client:
    auth = {"authorization": f"Bearer {key}"}
    return httpx.Client(base_url=sim.base_url, headers=auth, timeout=10, trust_env=False)


def limited(answer: httpx.Response, kind: str) -> valar.RateLimitHeaders:
    assert answer.status_code == 429, answer.text
    assert parse(valar.RateLimited, answer.content).error.type == kind
    return valar.RateLimitHeaders.of(answer.headers)


def test_every_answer_counts_down_then_a_full_bucket_is_a_429(provider_sim):
    sim = provider_sim(api_key=list(KEYS), dialect="valar", rate_limit_per_min=60)
    sim.add_response("resp_1")
    sim.add_batch("valar", "batch_1", 2)
    with client(sim) as c:
        answers = [c.post("/responses", json=BODY), c.get("/batches/batch_1")]
        answers += [c.get("/responses/resp_1") for _ in range(57)]
        answers.append(c.get("/responses/resp_missing"))  # a 404 counts too
        full = c.get("/responses/resp_1")
    with client(sim, KEYS[1]) as other:
        own_bucket = other.get("/responses/resp_1")
    headers = [valar.RateLimitHeaders.of(a.headers) for a in answers]
    assert [a.status_code for a in answers] == [202, 200, *[200] * 57, 404]
    assert [h.remaining for h in headers] == list(range(59, -1, -1))
    assert all(h.limit == 60 and h.retry_after is None for h in headers)
    assert 55 <= headers[-1].reset <= 61  # seconds until the bucket is empty again
    refused = limited(full, "rate_limit_exceeded")
    assert refused.remaining == 0 and refused.retry_after == 1
    assert own_bucket.status_code == 200
    assert valar.RateLimitHeaders.of(own_bucket.headers).remaining == 59


def test_the_bucket_drains_at_the_limits_rate(provider_sim):
    sim = provider_sim(api_key=KEYS[0], dialect="valar", rate_limit_per_min=120)
    sim.add_response("resp_1")
    with client(sim) as c:
        started, burst = time.monotonic(), []
        for _ in range(200):  # until the first 429: the bucket holds 120, refilling 2/s
            burst.append(c.get("/responses/resp_1").status_code)
            if burst[-1] == 429:
                break
        took_s = time.monotonic() - started
        retry = float(c.get("/responses/resp_1").headers["retry-after"])
        time.sleep(retry)
        after = c.get("/responses/resp_1")
    served = burst.index(429)
    assert set(burst[:served]) == {200} and retry == 1
    # the 120 of the full bucket, and what drained meanwhile (a loaded machine is slower)
    assert 120 <= served <= 120 + math.ceil(took_s * 2) + 1, (served, took_s)
    assert after.status_code == 200
    assert valar.RateLimitHeaders.of(after.headers).remaining in (0, 1)


def test_the_spend_cap_refuses_creates_and_gets(provider_sim):
    sim = provider_sim(api_key=KEYS[0], dialect="valar", rate_limit_per_min=60)
    sim.add_response("resp_1")
    with client(sim) as c:
        assert c.get("/responses/resp_1").status_code == 200
        sim.limits.quota_exceeded = True
        create = limited(c.post("/responses", json=BODY), "insufficient_quota")
        get = limited(c.get("/responses/resp_1"), "insufficient_quota")
        sim.limits.quota_exceeded = False
        assert c.get("/responses/resp_1").status_code == 200
    assert create.retry_after is None and get.retry_after is None  # waiting does not help
    assert sim.creations("responses") == 0


def test_the_spend_cap_alone_needs_no_rate_limit(provider_sim):
    sim = provider_sim(dialect="valar")
    sim.limits.quota_exceeded = True
    answer = httpx.get(f"{sim.base_url}/batches", timeout=10, trust_env=False)
    assert answer.status_code == 429 and "x-ratelimit-limit" not in answer.headers
    assert parse(valar.RateLimited, answer.content).error.type == "insufficient_quota"


def test_without_a_limit_there_are_no_headers(provider_sim):
    sim = provider_sim(dialect="valar")
    sim.add_response("resp_1")
    with client(sim) as c:
        answers = [c.get("/responses/resp_1") for _ in range(80)]
    assert {a.status_code for a in answers} == {200}
    assert not any(k.startswith("x-ratelimit") for a in answers for k in a.headers)
