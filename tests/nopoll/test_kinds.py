"""The kinds table agrees with what the receiver queues and takes today."""

from __future__ import annotations

import typing

from nopoll.envelope import Envelope
from nopoll.kinds import (
    DEFAULT_KIND,
    KINDS,
    ROW_KINDS,
    SINGLE_KINDS,
    SUMMARY_KINDS,
    WATCHABLE_KINDS,
    Kind,
    WatchKind,
    kind_of_event,
    kind_of_job_id,
)
from receiver.queue.enqueue import BATCHES_QUEUE, FETCH_BATCH, FETCH_RESPONSE, JOBS_QUEUE
from receiver.webhooks.endpoint import BATCH_EVENTS, RESPONSE_EVENTS


def test_every_kind_is_a_name_envelopes_take() -> None:
    assert set(KINDS) == set(typing.get_args(Kind))
    assert Envelope.__dataclass_fields__["kind"].type in ("Kind", Kind)


def test_fetched_kinds_name_the_receivers_jobs_and_queues() -> None:
    assert (KINDS["response"].job, KINDS["response"].queue) == (FETCH_RESPONSE, JOBS_QUEUE)
    assert (KINDS["batch"].job, KINDS["batch"].queue) == (FETCH_BATCH, BATCHES_QUEUE)
    assert KINDS["batch_row"].job is None


def test_events_and_job_ids_parse_to_their_kind() -> None:
    assert all(kind_of_event(e) is KINDS["response"] for e in RESPONSE_EVENTS)
    assert all(kind_of_event(e) is KINDS["batch"] for e in BATCH_EVENTS)
    assert kind_of_event("response.created") is None
    assert kind_of_job_id("resp:openai:resp_1") is KINDS["response"]
    assert kind_of_job_id("batch:sail@team-a:b1") is KINDS["batch"]
    assert kind_of_job_id("deliver:pg:abc") is None


def test_watch_kinds_are_the_watchable_rows() -> None:
    assert set(typing.get_args(WatchKind)) == set(WATCHABLE_KINDS)
    assert DEFAULT_KIND in WATCHABLE_KINDS


def test_a_row_kind_is_a_row_of_a_summary_kind() -> None:
    for info in KINDS.values():
        if info.row_of is not None:
            assert KINDS[info.row_of].summary
            assert not info.summary and not info.watchable and info.job is None


def test_the_derived_sets_split_the_kinds_by_their_rows() -> None:
    for info in KINDS.values():  # each kind in exactly the set its row says
        member = (info.name in SINGLE_KINDS, info.name in SUMMARY_KINDS, info.name in ROW_KINDS)
        assert member == (info.single, info.summary, info.row_of is not None)
    assert set(SINGLE_KINDS) | set(SUMMARY_KINDS) | set(ROW_KINDS) == set(KINDS)
    # today's rows, as users know them
    assert {"response", "batch_row", "batch"} <= set(KINDS)
    assert "response" in SINGLE_KINDS and "batch" in SUMMARY_KINDS and "batch_row" in ROW_KINDS
