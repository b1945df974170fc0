"""The contract models themselves: objects of the contracts' own shapes pass, and one
unknown field, one missing required field or one value outside a pattern fails."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from tests.contracts import sail, sference, valar
from tests.contracts._strict import parse

UUID = "019d58a7-2ece-7742-bc3e-69ba44168280"
ISO = "2026-04-04T10:12:09+00:00"
DETAILS = {"cached_tokens": 0, "reasoning_tokens": 0}
USAGE = {
    "input_tokens": 3,
    "input_tokens_details": DETAILS,
    "output_tokens": 1,
    "output_tokens_details": DETAILS,
    "total_tokens": 4,
}
SAIL_RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1_767_225_600,
    "status": "pending",
    "model": "m",
    "metadata": {},
    "usage": USAGE,
}
SFERENCE_BATCH = {
    "id": UUID,
    "status": "pending",
    "window": "24h",
    "request_count": 1,
    "created_at": ISO,
    "updated_at": ISO,
    "completed_at": None,
}
SFERENCE_RESPONSE = {"id": UUID, "created_at": 1, "model": "m", "status": "in_progress"}
VALID: list[tuple[Any, Any]] = [
    (sference.ResponseItem, SFERENCE_RESPONSE),
    (sference.BatchResponse, SFERENCE_BATCH),
    (sference.BatchListResponse, {"items": [SFERENCE_BATCH]}),
    (sference.ErrorResponse, {"status_code": 404, "detail": "Not Found"}),
    (sference.ErrorResponse, {"status_code": 400, "detail": "Bad Request", "extra": {}}),
    (sference.StreamCreateRequest, {"name": "daily"}),
    (
        sference.BatchResultRow,
        {"status": "completed", "result_json": {"choices": []}, "error_json": None},
    ),
    (sail.ResponseObject, SAIL_RESPONSE),
    (sail.BatchList, [{"id": "b", "request_counts": 2, "created_at": 1, "label": "job-1"}]),
    (
        sail.BatchStatus,
        {
            "id": "b",
            "request_counts": 2,
            "created_at": 1,
            "request_status": {"a": {"status": "COMPLETED"}, "b": {"status": "RUNNING"}},
        },
    ),
    (
        sail.CreateBatchRequest,
        {"endpoint": "/v1/responses", "requests": [{"custom_id": "q-1", "params": {}}]},
    ),
    (sail.ErrorResponse, {"error": {"message": "m", "type": "invalid_request_error"}}),
    (valar.CreateResponseRequest, {"model": "m", "input": "x", "metadata": {"job": "42"}}),
    (valar.RateLimited, {"error": {"type": "insufficient_quota", "message": "spend cap"}}),
]
INVALID: list[tuple[Any, Any, str]] = [
    (sference.ResponseItem, {**SFERENCE_RESPONSE, "status": "queued"}, "status"),
    (sference.ResponseItem, {**SFERENCE_RESPONSE, "id": "resp_1"}, "UUID"),
    (sference.BatchResponse, {**SFERENCE_BATCH, "created_at": 1}, "created_at"),
    (sference.BatchResponse, {**SFERENCE_BATCH, "object": "batch"}, "object"),
    (sail.ResponseObject, {**SAIL_RESPONSE, "background": True}, "background"),
    (sail.ResponseObject, {k: v for k, v in SAIL_RESPONSE.items() if k != "usage"}, "usage"),
    (
        sail.ResponseObject,
        {**SAIL_RESPONSE, "usage": {**USAGE, "input_tokens_details": {"cached_tokens": 0}}},
        "reasoning_tokens",
    ),
    (sail.BatchSummary, {"id": "b", "request_counts": {"total": 2}, "created_at": 1}, ""),
    (sail.BatchSummary, {"id": "b", "request_counts": 2, "created_at": 1, "label": "a b"}, ""),
    (
        sail.CreateBatchRequest,
        {"endpoint": "/v1/responses", "requests": [{"custom_id": "Q1", "params": {}}]},
        "custom_id",
    ),
    (
        sail.CreateBatchRequest,
        {"endpoint": "/v1/chat/completions", "requests": [{"custom_id": "q", "params": {}}]},
        "endpoint",
    ),
    (valar.CreateResponseRequest, {"model": "m", "input": "x", "store": False}, "store"),
    (sail.ErrorResponse, {"error": {"message": "m"}}, "type"),
]


@pytest.mark.parametrize(("model", "data"), VALID)
def test_objects_of_the_contracts_shapes_pass(model, data):
    parse(model, orjson.dumps(data))


@pytest.mark.parametrize(("model", "data", "field"), INVALID)
def test_one_wrong_field_fails_and_is_named(model, data, field):
    with pytest.raises(ValidationError) as raised:
        parse(model, orjson.dumps(data))
    assert field in str(raised.value)


def test_rate_limit_headers_are_read_in_any_case():
    headers = {"X-RateLimit-Limit": "60", "x-ratelimit-remaining": "0", "X-RateLimit-Reset": "3"}
    got = valar.RateLimitHeaders.of({**headers, "Retry-After": "1", "content-type": "x"})
    assert (got.limit, got.remaining, got.reset, got.retry_after) == (60, 0, 3, 1)
    with pytest.raises(ValidationError):
        valar.RateLimitHeaders.of({**headers, "X-RateLimit-Reset": "1767225600.5"})
