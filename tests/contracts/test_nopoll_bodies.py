"""What nopoll sends, judged by the contracts' request models: the body ``nopoll submit``
makes of a line, and the batch create body it makes of a batch file, for sference, Sail and
Valar (built by nopoll's own code, as ``nopoll submit`` and ``POST /admin/v1/submit`` do)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from receiver.providers import dialect_type
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
