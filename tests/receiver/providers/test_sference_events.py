"""sference's completion events read into envelopes: what a whole event lands as, and
which events are not whole (their response is fetched by id instead)."""

from __future__ import annotations

from typing import Any

from receiver.providers.sference import CompletionEvent

CHAT = {
    "object": "chat.completion",
    "model": "m-1",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def _event(**more: Any) -> dict[str, Any]:
    base = {
        "completion_id": "019d58a7-2ece-7742-bc3e-69ba44168279",
        "response_id": "019d58a7-2ece-7742-bc3e-69ba44168280",
        "custom_id": "req-1",
        "status": "completed",
        "result": CHAT,
        "error": None,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "cost_micros": 60,
        "completed_at": "2026-04-04T10:12:09+00:00",
    }
    return {**base, **more}


def test_a_whole_completed_event_is_its_envelope() -> None:
    event = CompletionEvent.read(_event())
    assert event is not None and event.whole
    assert event.completed_at == 1775297529.0
    env = event.envelope("sf", tenant="team-a", received_at="2026-04-04T10:12:10.000Z")
    assert (env.kind, env.key, env.response_id, env.custom_id) == (
        "response",
        "019d58a7-2ece-7742-bc3e-69ba44168280",
        "019d58a7-2ece-7742-bc3e-69ba44168280",
        "req-1",
    )
    assert (env.status, env.usable, env.output_text, env.model) == ("completed", True, "hi", "m-1")
    assert (env.input_tokens, env.output_tokens) == (10, 5)  # the event's own counts first
    assert env.event_id == "feed:019d58a7-2ece-7742-bc3e-69ba44168279" and env.tenant == "team-a"
    assert env.metadata == {
        "completion_id": "019d58a7-2ece-7742-bc3e-69ba44168279",
        "custom_id": "req-1",
        "cost_micros": 60,
    }
    assert env.body == _event() and env.error is None


def test_a_failed_event_lands_with_its_error() -> None:
    event = CompletionEvent.read(
        _event(status="failed", result=None, error={"code": "timeout", "message": "too slow"})
    )
    assert event is not None and event.whole
    env = event.envelope("sf", tenant="default", received_at="2026-04-04T10:12:10.000Z")
    assert env.status == "failed" and not env.usable
    assert env.error == {"code": "timeout", "message": "too slow"} and env.output_text is None


def test_events_that_are_not_whole_are_fetched_by_id_or_skipped() -> None:
    bare = CompletionEvent.read(_event(result=None))
    assert bare is not None and not bare.whole  # completed, but no result in it: a GET
    running = CompletionEvent.read(_event(status="running"))
    assert running is not None and running.status is None and not running.whole
    row = CompletionEvent.read(_event(response_id=None))  # a batch row: no single response
    assert row is not None and row.response_id is None and not row.whole
    assert CompletionEvent.read(_event(completion_id="../x")) is None  # cannot be a cursor
    assert CompletionEvent.read("junk") is None
