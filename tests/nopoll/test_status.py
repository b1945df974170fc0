"""One table of provider statuses: every spelling each dialect's documents use, per dialect."""

from __future__ import annotations

import pytest

from nopoll.envelope import batch_summary_envelope, envelope_from_response
from nopoll.status import STATUSES, row_status, unfinished_status, unknown_status

RECEIVED = "2026-12-01T00:00:00.000Z"

# What each provider documents, and what nopoll makes of it (None: not finished yet).
RESPONSES = {  # the Responses API object's ``status``, the same in every dialect
    "queued": None,
    "in_progress": None,
    "completed": "completed",
    "incomplete": "incomplete",
    "failed": "failed",
    "cancelled": "cancelled",
    "canceled": "cancelled",  # the US spelling some SDKs use
    "COMPLETED": "completed",
    "expired": "expired",
}
BATCHES = {
    "openai": {
        "validating": None,
        "in_progress": None,
        "finalizing": None,
        "cancelling": None,
        "completed": "completed",
        "failed": "failed",
        "expired": "expired",
        "cancelled": "cancelled",
    },
    "sference": {
        "in_progress": None,
        "completed": "completed",
        "failed": "failed",
        "expired": "expired",
        "cancelled": "cancelled",
    },
    "sail": {"in_progress": None, "completed": "completed", "COMPLETED": "completed"},
    "valar": {"queued": None, "in_progress": None, "completed": "completed"},
    "anthropic": {"in_progress": None, "canceling": None, "ended": "completed"},
}
ROWS = {
    "sference": {"completed": "completed", "failed": "failed", "cancelled": "cancelled"},
    "sail": {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled"},
    "valar": {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled"},
    "anthropic": {
        "succeeded": "completed",
        "errored": "failed",
        "canceled": "cancelled",
        "expired": "expired",
    },
}


@pytest.mark.parametrize(("spelling", "expected"), RESPONSES.items())
def test_every_response_status(spelling: str, expected: str | None) -> None:
    response = {"id": "resp_1", "status": spelling, "output": []}
    if expected is None:
        assert unfinished_status(response) == spelling
        return
    assert unfinished_status(response) is None
    env = envelope_from_response(response, provider="p", received_at=RECEIVED)
    assert env.status == expected
    assert env.usable is (expected == "completed")


@pytest.mark.parametrize(
    ("dialect", "spelling", "expected"),
    [(d, s, e) for d, table in BATCHES.items() for s, e in table.items()],
)
def test_every_batch_status_per_dialect(dialect: str, spelling: str, expected: str | None) -> None:
    batch = {"id": "batch_1", "status": spelling}
    if expected is None:
        assert unfinished_status(batch, "batch") == spelling
        return
    assert unfinished_status(batch, "batch") is None
    env = batch_summary_envelope(
        batch, provider="p", batch_id="batch_1", received_at=RECEIVED, event_id=None, counts={}
    )
    assert env.status == expected


@pytest.mark.parametrize(
    ("dialect", "spelling", "expected"),
    [(d, s, e) for d, table in ROWS.items() for s, e in table.items()],
)
def test_every_row_status_per_dialect(dialect: str, spelling: str, expected: str) -> None:
    assert row_status(spelling) == expected
    assert unknown_status(spelling) is None


def test_what_nopoll_does_not_know() -> None:
    # not final: fetched again later, never stored
    assert unfinished_status({"status": "paused"}) == "paused"
    assert unfinished_status({"status": "ended"}) == "ended"  # only a batch ends
    assert unfinished_status({}) == "<none>"
    assert unfinished_status({"status": "x" * 500}) == "x" * 64
    # a row of a finished batch: failed, saying why
    assert row_status("weird") == "failed"
    assert unknown_status("weird") == {
        "code": "unknown_status",
        "message": "row status 'weird' is not a final status nopoll knows",
    }
    assert row_status(None, "completed") == "completed"


def test_every_status_nopoll_writes_is_one_the_stream_can_ask_for() -> None:
    written = {e for e in RESPONSES.values() if e} | {
        e for t in (*BATCHES.values(), *ROWS.values()) for e in t.values() if e
    }
    assert written == set(STATUSES)
