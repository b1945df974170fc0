"""The anthropic dialect's parsing, request building and splitting, and its config."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from nopoll.envelope import envelope_from_row
from receiver.config import ProviderConfig
from receiver.providers.anthropic import (
    AnthropicDialect,
    auth_headers,
    batch_request,
    create_body,
    parse_line,
    split,
)


def _row(result: dict) -> object:
    line = orjson.dumps({"custom_id": "r1", "result": result})
    row = parse_line(0, line)
    return envelope_from_row(
        row,
        provider="p",
        batch_id="msgbatch_1",
        received_at="t",
        event_id=None,
        fields=AnthropicDialect.normalize(row.body),  # as the batch runner reads its rows
    )


def _message(stop_reason: str = "end_turn", content=None) -> dict:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": content
        if content is not None
        else [
            {"type": "text", "text": "Hello"},
            {"type": "tool_use", "id": "t", "name": "f", "input": {}},
            {"type": "text", "text": " world"},
        ],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 25},
    }


def test_result_types_map_to_statuses_with_text_usage_and_errors():
    ok = _row({"type": "succeeded", "message": _message()})
    assert (ok.key, ok.status, ok.usable, ok.output_text) == (
        "msgbatch_1/r1",
        "completed",
        True,
        "Hello world",
    )
    assert (ok.input_tokens, ok.output_tokens, ok.model, ok.response_id) == (
        10,
        25,
        "claude-x",
        "msg_1",
    )
    cut = _row({"type": "succeeded", "message": _message("max_tokens")})
    assert (cut.status, cut.incomplete_reason, cut.usable) == (
        "incomplete",
        "max_output_tokens",
        True,
    )
    empty = _row({"type": "succeeded", "message": _message("max_tokens", content=[])})
    assert (empty.status, empty.usable, empty.output_text) == ("incomplete", False, None)
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    failed = _row({"type": "errored", "error": error})
    assert (failed.status, failed.error) == (
        "failed",
        {"code": "invalid_request_error", "message": "bad"},
    )
    assert _row({"type": "canceled"}).status == "cancelled"
    assert _row({"type": "expired"}).status == "expired"
    odd = _row({"type": "vanished"})
    assert odd.status == "failed" and odd.error["code"] == "unknown_status"


def test_auth_is_the_sdks_bearer_or_x_api_key_for_older_versions():
    assert auth_headers("k", None) == {
        "anthropic-version": "2026-10-21",
        "authorization": "Bearer k",
    }
    assert auth_headers("k", "2023-06-01") == {"anthropic-version": "2023-06-01", "x-api-key": "k"}


def test_config_takes_api_version_only_for_anthropic_and_no_webhook_secrets():
    ProviderConfig(dialect="anthropic", base_url="https://api.anthropic.com")
    with pytest.raises(ValidationError, match="sends no callbacks"):
        ProviderConfig(
            dialect="anthropic",
            base_url="https://api.anthropic.com",
            webhook_secrets=["whsec_" + "A" * 44],
        )
    with pytest.raises(ValidationError, match="only the anthropic dialect"):
        ProviderConfig(dialect="openai", base_url="https://x/v1", api_version="2023-06-01")


def test_a_chat_line_becomes_messages_params_and_what_cannot_be_expressed_is_named():
    line = {
        "custom_id": "a-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "m",
            "max_completion_tokens": 5,
            "stop": "END",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ],
        },
    }
    request, custom_id, error = batch_request(line)
    assert error is None and custom_id == "a-1"
    assert request["params"] == {
        "model": "m",
        "max_tokens": 5,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "again"}]},
        ],
        "stop_sequences": ["END"],
    }
    late_system = {**line, "body": {**line["body"], "messages": [*line["body"]["messages"]]}}
    late_system["body"]["messages"].append({"role": "system", "content": "x"})
    assert "after the conversation started" in batch_request(late_system)[2]
    responses = {**line, "url": "/v1/responses"}
    assert "only /v1/chat/completions" in batch_request(responses)[2]
    assert "custom_id" in batch_request({**line, "custom_id": "x" * 65})[2]
    native = {"custom_id": "n", "params": {"model": "m", "max_tokens": 1, "messages": []}}
    assert batch_request(native) == (native, "n", None)
    assert (
        "params.max_tokens: required"
        in batch_request({"custom_id": "n", "params": {"model": "m", "messages": []}})[2]
    )


def test_split_keeps_every_part_under_both_limits_in_file_order():
    items = [
        orjson.dumps({"custom_id": f"c{i}", "params": {"x": "y" * (i % 7)}}) for i in range(50)
    ]
    limit = 200
    parts = list(split(items, max_requests=6, max_bytes=limit))
    assert [x for part in parts for x in part] == items
    for part in parts:
        assert len(part) <= 6 and len(create_body(part)) <= limit
        assert orjson.loads(create_body(part))["requests"][0]


def test_an_ended_message_batch_is_cancelled_expired_or_completed_by_what_it_says() -> None:
    dialect = AnthropicDialect.__new__(AnthropicDialect)  # batch_facts reads no client
    base = {"processing_status": "ended", "cancel_initiated_at": None}
    counts = {"processing": 0, "succeeded": 8, "errored": 1, "canceled": 0, "expired": 1}
    assert dialect.batch_facts({**base, "request_counts": counts}).status == "completed"
    cancelled = {**base, "cancel_initiated_at": "2026-12-01T10:00:00Z", "request_counts": counts}
    assert dialect.batch_facts(cancelled).status == "cancelled"
    expired = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 10}
    assert dialect.batch_facts({**base, "request_counts": expired}).status == "expired"
    assert dialect.batch_facts(cancelled).request_counts == counts
