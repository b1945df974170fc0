"""Normalizing provider objects into result envelopes (docs/envelope.md's rules)."""

from __future__ import annotations

from nopoll.envelope import (
    BatchRow,
    chat_output_text,
    envelope_from_response,
    envelope_from_row,
    response_output_text,
    row_key,
)
from receiver.demo.simulator import make_response


def env(body: dict):
    return envelope_from_response(
        body, provider="p", received_at="2026-01-01T00:00:00.000Z", event_id="msg_1"
    )


def test_completed_response() -> None:
    e = env(make_response("resp_1", text="hello", metadata={"label": "x"}))
    assert (e.kind, e.key, e.response_id, e.status, e.usable) == (
        "response",
        "resp_1",
        "resp_1",
        "completed",
        True,
    )
    assert e.output_text == "hello"
    assert (e.input_tokens, e.output_tokens) == (21, 7)
    assert e.metadata == {"label": "x"} and e.event_id == "msg_1" and e.body["id"] == "resp_1"
    assert e.error is None and e.incomplete_reason is None and e.model == "sim-model-1"


def test_output_text_joins_message_parts_without_separator_and_skips_reasoning() -> None:
    body = {
        "output": [
            {"type": "reasoning", "content": [{"type": "output_text", "text": "THINK"}]},
            {
                "type": "message",
                "content": [
                    {"type": "output_text", "text": "a"},
                    {"type": "refusal", "refusal": "no"},
                    {"type": "output_text", "text": "b"},
                ],
            },
            {"type": "message", "content": [{"type": "output_text", "text": "c"}]},
        ]
    }
    assert response_output_text(body) == "abc"
    assert response_output_text({"output": [{"type": "reasoning"}]}) is None
    assert response_output_text({"output": []}) is None


def test_incomplete_max_output_tokens_with_text_is_usable() -> None:
    e = env(
        make_response("r", status="incomplete", incomplete_reason="max_output_tokens", text="par")
    )
    assert e.status == "incomplete" and e.usable and e.incomplete_reason == "max_output_tokens"


def test_incomplete_without_text_or_other_reason_is_not_usable() -> None:
    assert not env(
        make_response("r", status="incomplete", incomplete_reason="max_output_tokens", text=None)
    ).usable
    assert not env(
        make_response("r", status="incomplete", incomplete_reason="content_filter", text="x")
    ).usable


def test_failed_response_carries_error() -> None:
    e = env(
        make_response(
            "r",
            status="failed",
            text=None,
            error={"code": "server_error", "message": "boom", "extra": 1},
        )
    )
    assert e.status == "failed" and not e.usable and e.output_text is None
    assert e.error == {"code": "server_error", "message": "boom"}


def test_missing_usage_gives_null_tokens() -> None:
    body = make_response("r")
    del body["usage"]
    e = env(body)
    assert e.input_tokens is None and e.output_tokens is None


def test_chat_completion_text() -> None:
    assert chat_output_text({"choices": [{"message": {"content": "hi"}}]}) == "hi"
    assert chat_output_text({"choices": []}) is None
    assert chat_output_text({}) is None


def row(custom_id, index: int):
    return envelope_from_row(
        BatchRow(index, custom_id, "completed", body=make_response(f"resp_{index}")),
        provider="p",
        batch_id="batch_1",
        received_at="2026-01-01T00:00:00.000Z",
        event_id=None,
    )


def test_row_keys_are_one_to_one_with_custom_id_or_index() -> None:
    """Index-keyed rows are ``~{i}``; a custom_id starting with ``~`` gets one more, so no
    custom_id can take an index row's key (before: index 3 and custom_id "3" were both
    ``batch_1/3`` and one overwrote the other in every upserting sink)."""
    cases = [
        (None, 3, "batch_1/~3"),
        ("3", 7, "batch_1/3"),
        ("~3", 8, "batch_1/~~3"),
        ("~~3", 9, "batch_1/~~~3"),
        (None, 0, "batch_1/~0"),
        ("0", 1, "batch_1/0"),
        ("a~b", 2, "batch_1/a~b"),
    ]
    for custom_id, index, key in cases:
        e = row(custom_id, index)
        assert e.key == key == row_key("batch_1", custom_id, index)
        assert e.custom_id == custom_id and e.batch_id == "batch_1"
    assert len({row(c, i).key for c, i, _ in cases}) == len(cases)
