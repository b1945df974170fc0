"""schemathesis against nopoll's own OpenAPI document (``GET /openapi.json``: ``/v1`` and
``/admin/v1``), every operation called over real HTTP on a running API with real Redis and
the provider simulator behind it. Property: never a 5xx, and every 4xx says why.

Two things are left out of the generated calls, each tested on its own elsewhere: the
live stream (``GET /v1/results/stream`` never ends by design) and ``?wait`` (a held
request of up to 60 s per case).
"""

from __future__ import annotations

import copy

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from receiver.config.settings import load_settings
from receiver.demo.simulator import ProviderSimulator
from tests.receiver.helpers import _ApiThread

ADMIN = "schema-admin-token-0123456789"
CONSUMER = "schema-consumer-token-0123456789"


@pytest.fixture(scope="module")
def api_server(_redis_base_url, tmp_path_factory):
    sim = ProviderSimulator(api_key="sk-schema").start()
    settings_ = load_settings(
        None,
        env={},
        overrides={
            "redis_url": _redis_base_url,
            "data_dir": str(tmp_path_factory.mktemp("schema") / "data"),
            "providers": {
                "sim": {
                    "dialect": "openai",
                    "base_url": sim.base_url,
                    "api_key": "sk-schema",
                    "webhook_secrets": ["whsec_c2NoZW1hLXRlc3Qtc2VjcmV0LTAxMjM0NQ=="],
                }
            },
            "sinks": {"files": {"type": "jsonl", "dir": str(tmp_path_factory.mktemp("o"))}},
            "admin_tokens": [ADMIN],
            "consumer_tokens": [{"token": CONSUMER}],
            "fetch_retry": {"max_tries": 2, "base_delay_s": 0.05, "max_delay_s": 0.1},
        },
    )
    try:
        with _ApiThread(settings_, _redis_base_url) as server:
            yield server
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def api_schema(api_server):
    document = httpx.get(f"{api_server.base}/openapi.json", timeout=10).json()
    document = copy.deepcopy(document)
    document["paths"].pop("/v1/results/stream", None)
    for path in document["paths"].values():
        for operation in path.values():
            if isinstance(operation, dict) and "parameters" in operation:
                operation["parameters"] = [
                    p for p in operation["parameters"] if p.get("name") != "wait"
                ]
    return schemathesis.openapi.from_dict(document)


def test_no_generated_call_gets_a_5xx(api_schema, api_server):
    """Every operation of the document, 40 generated cases each (hypothesis through
    schemathesis' strategies; its pytest plugin is not used)."""
    called: dict[str, int] = {}

    def checker(name: str, strategy):
        @given(case=strategy)
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            token = ADMIN if case.path.startswith("/admin/") else CONSUMER
            response = case.call(
                base_url=api_server.base, headers={"authorization": f"Bearer {token}"}, timeout=30
            )
            called[name] += 1
            assert response.status_code < 500, (name, response.status_code, response.text[:300])
            if 400 <= response.status_code < 500 and response.content:
                assert response.json().get("error"), (name, response.text[:300])

        return check

    for result in api_schema.get_all_operations():
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"
        called[name] = 0
        checker(name, operation.as_strategy())()
    assert len(called) >= 10, called  # the document's operations, /v1 and /admin/v1
    assert all(n > 0 for n in called.values()), called
