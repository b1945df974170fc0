"""What nopoll sends, judged by the contracts' request models: the body ``nopoll submit``
makes of a line, and the batch create body it makes of a batch file, for sference, Sail and
Valar (built by nopoll's own code, as ``nopoll submit`` and ``POST /admin/v1/submit`` do)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from receiver.providers import dialect_type
from receiver.providers.push import PushTarget
from receiver.submit.batch import build_batch
from receiver.submit.creates import create_body
from tests.contracts import sail, sference, valar
from tests.contracts._strict import parse

LINE = b'{"model": "m-1", "input": "hello", "custom_id": "q-1", "max_output_tokens": 64}'
RESPONSE_MODELS: dict[str, Any] = {
    "sference": sference.ResponseCreateRequest,
    "sail": sail.CreateResponseRequest,
    "valar": valar.CreateResponseRequest,
}
BATCH_MODELS: dict[str, Any] = {
    "sference": sference.BatchCreateRequest,
    "sail": sail.CreateBatchRequest,
    "valar": valar.CreateBatchRequest,
}


@pytest.mark.parametrize("dialect", list(RESPONSE_MODELS))
def test_a_submitted_line_is_a_create_body_the_contract_takes(dialect):
    body, custom_id, error = create_body(LINE)
    assert error is None and custom_id == "q-1"
    parsed = parse(RESPONSE_MODELS[dialect], orjson.dumps(body))
    assert parsed.background is True


@pytest.mark.parametrize("dialect", ["sail", "valar"])
def test_a_line_asking_for_a_completion_webhook_is_a_body_the_contract_takes(dialect):
    body, _, _ = create_body(LINE)
    assert body is not None
    target = PushTarget("https://nopoll.example.com/webhooks/sail", "t0ken-" + "x" * 40)
    parsed = parse(RESPONSE_MODELS[dialect], orjson.dumps(target.asked(body)))
    assert parsed.metadata is not None
    assert parsed.metadata.completion_webhook == target.url
    assert parsed.metadata.webhook_token == target.token
    assert parsed.metadata.model_extra == {"custom_id": "q-1"}  # the line's own kept


def _batch_body(dialect: str, name: str = "batch.jsonl") -> bytes:
    lines = [
        (
            i,
            orjson.dumps(
                {
                    "custom_id": f"q-{i}",
                    "method": "POST",
                    "url": "/v1/responses",
                    "body": {"model": "m-1", "input": f"question {i}"},
                }
            ),
        )
        for i in range(1, 4)
    ]
    kind = dialect_type(dialect)
    batch = build_batch(lines, dialect)
    assert not batch.rejected
    [call] = kind(None).create_calls(batch, name, "d" * 64, {})  # type: ignore[arg-type]
    assert call.path == "batches"
    return call.content


@pytest.mark.parametrize("dialect", ["sference", "sail", "valar"])
def test_a_submitted_batch_file_is_a_batch_body_the_contract_takes(dialect):
    content = _batch_body(dialect)
    parsed = parse(BATCH_MODELS[dialect], content)
    assert [r.custom_id for r in parsed.requests] == ["q-1", "q-2", "q-3"]
    for item in orjson.loads(content)["requests"]:
        row = item["body"] if dialect == "sference" else item["params"]
        parse(RESPONSE_MODELS[dialect], orjson.dumps(row))


@pytest.mark.parametrize("dialect", ["sail", "valar"])
@pytest.mark.parametrize("name", ["my evals (v2).jsonl", "données.jsonl", "x" * 300 + ".jsonl"])
def test_the_batch_label_fits_the_contract_whatever_the_file_is_called(dialect, name):
    parse(BATCH_MODELS[dialect], _batch_body(dialect, name))


async def test_a_sference_submit_makes_its_stream_and_creates_in_it_as_the_contract_says(
    provider_sim,
):
    """sference promises no idempotency, so ``nopoll submit`` creates in a stream of its
    own: the stream create and the create made in it, as the simulator received them,
    are what the contract takes; and the stream's ids are found again by listing it."""
    from receiver.config.sections import HttpConfig
    from receiver.config.settings import ProviderConfig
    from receiver.providers import ProviderClient, dialect_for

    sim = provider_sim(dialect="sference", api_key="sk-test")
    config = ProviderConfig(dialect="sference", base_url=sim.base_url, api_key="sk-test")
    client = ProviderClient("sim", config, HttpConfig())
    try:
        sference_dialect = dialect_for("sference", client)
        group = await sference_dialect.submit_group("nopoll-sim-0123456789ab")
        body, _, _ = create_body(LINE)
        grouped = sference_dialect.in_group(body, group)
        status, content, _ = await client.post_once(
            "responses",
            orjson.dumps(grouped),
            content_type="application/json",
            idempotency_key="k-1",
        )
        assert status == 200, content
        created = orjson.loads(content)["id"]
        assert await sference_dialect.group_ids(group) == {created}
    finally:
        await client.aclose()
    [stream] = sim.creates.received("/v1/streams")
    parse(sference.StreamCreateRequest, orjson.dumps(stream.body))
    [made] = sim.creates.received("/v1/responses")
    parsed = parse(sference.ResponseCreateRequest, orjson.dumps(made.body))
    assert parsed.metadata is not None and str(parsed.metadata.stream_id) == group
