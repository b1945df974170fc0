"""The jobs' payloads (receiver.queue.jobs): each round-trips through its kwargs, and the
kwargs keep the keys, function names and job ids that queued jobs and dead letters
written by earlier versions carry (plus their version, ``v``)."""

from __future__ import annotations

import pytest

from nopoll.kinds import KINDS, kind_of_job_id
from receiver.config.settings import Settings
from receiver.queue.enqueue import BATCHES_QUEUE, JOBS_QUEUE
from receiver.queue.jobs import (
    JOBS,
    PAYLOAD_VERSION,
    DeliverJob,
    FetchBatch,
    FetchResponse,
    PayloadVersionError,
    fetch_from_job_id,
    letter_target,
    parse_job_id,
)

AT = "2026-11-29T10:00:00.000Z"
COMMON = {"provider", "event_id", "received_at", "v"}


def test_a_fetch_payload_round_trips_through_its_kwargs() -> None:
    response = FetchResponse(provider="sim", event_id="msg_1", received_at=AT, response_id="r")
    batch = FetchBatch(
        provider="sim",
        received_at=AT,
        tenant="acme",
        batch_id="b",
        event_type="batch.failed",
        from_watch=True,
    )
    for job in (response, batch):
        assert type(job).from_kwargs(job.to_kwargs()) == job
    deliver = DeliverJob("jsonl", [{"key": "k"}], "nopoll:batch:x", 3, 3)
    assert DeliverJob.from_kwargs(deliver.to_kwargs()) == deliver


def test_a_retry_or_dead_letter_carries_every_key() -> None:
    response = FetchResponse(provider="sim", received_at=AT, response_id="r")
    batch = FetchBatch(provider="sim", received_at=AT, batch_id="b")
    assert set(response.to_kwargs()) == {*COMMON, "tenant", "response_id"}
    assert set(batch.to_kwargs()) == {*COMMON, "tenant", "batch_id", "event_type", "from_watch"}
    assert batch.runner_kwargs() == {
        "provider": "sim",
        "event_id": None,
        "received_at": AT,
        "tenant": "default",
        "batch_id": "b",
    }


def test_a_callback_queues_the_keys_and_ids_it_always_did() -> None:
    response = FetchResponse.callback("sim", "resp_1", "msg_1")
    assert (response.provider, response.webhook_id) == ("sim", "msg_1")
    assert (response.function, response.job_id, response.queue) == (
        "fetch_response",
        "resp:sim:resp_1",
        JOBS_QUEUE,
    )
    assert set(response.kwargs) == {*COMMON, "response_id"}  # no tenant: the default one
    assert response.kwargs["event_id"] == "msg_1"
    batch = FetchBatch.callback("sim", "batch_1", "msg_2", event_type="batch.expired")
    assert (batch.function, batch.job_id, batch.queue) == (
        "fetch_batch",
        "batch:sim:batch_1",
        BATCHES_QUEUE,
    )
    assert set(batch.kwargs) == {*COMMON, "batch_id", "event_type"}
    assert batch.kwargs["event_type"] == "batch.expired"
    # another tenant's: its own scope, job id and dedupe scope, and the tenant key
    other = FetchBatch.callback("sim", "batch_1", "msg_3", tenant="acme", event_type="x")
    assert (other.provider, other.job_id) == ("sim@acme", "batch:sim@acme:batch_1")
    assert set(other.kwargs) == {*COMMON, "tenant", "batch_id", "event_type"}
    assert FetchResponse.callback("sim", "r", "m", tenant="acme").job_id == "resp:sim@acme:r"


def test_a_poll_queues_the_keys_and_ids_it_always_did() -> None:
    response = FetchResponse(provider="sim", received_at=AT, tenant="acme", response_id="r")
    assert set(response.polled().kwargs) == {*COMMON, "tenant", "response_id"}
    batch = FetchBatch(provider="sim", received_at=AT, batch_id="b", from_watch=True).polled()
    assert (batch.function, batch.job_id, batch.queue) == (
        "fetch_batch",
        "batch:sim:b",
        BATCHES_QUEUE,
    )
    assert batch.kwargs == {
        "provider": "sim",
        "event_id": None,
        "received_at": AT,
        "tenant": "default",
        "batch_id": "b",
        "from_watch": True,
        "v": 1,
    }


def test_a_fetch_job_is_known_by_its_id_alone() -> None:
    assert fetch_from_job_id("resp:sim@acme:r_1", received_at=AT) == (
        "fetch_response",
        {"provider": "sim@acme", "response_id": "r_1", "event_id": None, "received_at": AT, "v": 1},
    )
    assert fetch_from_job_id("batch:sim:b:1", received_at=AT) == (
        "fetch_batch",
        {"provider": "sim", "batch_id": "b:1", "event_id": None, "received_at": AT, "v": 1},
    )
    for other in ("deliver:jsonl:abc", "resp:sim", "resp:sim:", "nothing"):
        assert fetch_from_job_id(other, received_at=AT) is None


def test_the_fetch_jobs_agree_with_the_kinds_table() -> None:
    fetched = {k.job: k for k in KINDS.values() if k.job is not None}
    assert {name for name, spec in JOBS.items() if spec.kind is not None} == set(fetched)
    for name, kind in fetched.items():
        spec = JOBS[name]
        assert (spec.name, spec.kind, spec.queue) == (name, kind.name, kind.queue)
        assert (spec.id_prefix, spec.id_field) == (kind.id_prefix, kind.id_field)
        assert spec.payload.from_kwargs  # a payload class of its own
        assert getattr(spec.payload, "kind", None) == kind.name
        assert kind_of_job_id(spec.job_id("sim", "x")) is kind


def test_every_job_id_parses_back_to_its_job() -> None:
    delivery = DeliverJob("jsonl", [{"key": "k"}], "nopoll:batch:x", 3, 3).handoff(defer_s=0)
    summary = DeliverJob("pg", []).summary("nopoll:batch:x")
    fetch = FetchResponse(provider="sim", tenant="acme", received_at=AT, response_id="r")
    for job_id, function, named in (
        (delivery.job_id, "deliver", "jsonl"),
        (summary.job_id, "deliver", "pg"),
        (fetch.job_id, "fetch_response", "sim@acme"),
        ("batch:sim:b:1", "fetch_batch", "sim"),
    ):
        parsed = parse_job_id(job_id)
        assert parsed is not None
        assert (parsed.spec.name, parsed.named) == (function, named)
    assert (delivery.job_id, summary.job_id) == (
        "deliver:jsonl:nopoll:batch:x:3",
        "deliver:pg:nopoll:batch:x:summary",
    )
    assert parse_job_id("replay:abc") is None
    assert parse_job_id("resp:") is None


def test_a_jobs_rules_and_letter_come_from_its_row() -> None:
    settings = Settings()
    assert JOBS["fetch_batch"].rules(settings).deadline_s == settings.batch.job_timeout_s
    assert JOBS["deliver"].rules(settings).retry == settings.sink_retry
    assert JOBS["fetch_response"].rules(settings).retry == settings.fetch_retry
    envelope = {"key": "k1", "provider": "sim"}
    assert letter_target("deliver", {"sink": "pg", "envelopes": [envelope, "junk"]}) == (
        "pg",
        "sim",
        ["k1"],
    )
    fetch = FetchBatch(provider="sim", received_at=AT, batch_id="b").to_kwargs()
    assert letter_target("fetch_batch", fetch) == ("fetch", "sim", ["b"])
    # a payload it cannot read is still filed by what its kwargs name
    unreadable = {"provider": "sim", "response_id": "r", "received_at": AT, "surprise": 1}
    assert letter_target("fetch_response", unreadable) == ("fetch", "sim", ["r"])


def test_a_payload_carries_its_version_and_reads_one_without_it_as_version_1() -> None:
    response = FetchResponse(provider="sim", received_at=AT, response_id="r")
    deliver = DeliverJob("jsonl", [{"key": "k"}])
    for job in (response, deliver):
        kwargs = job.to_kwargs()
        assert kwargs["v"] == PAYLOAD_VERSION == 1
        old = {k: v for k, v in kwargs.items() if k != "v"}  # as older versions queue it
        assert type(job).from_kwargs(old) == job


def test_a_payload_of_a_future_version_is_refused_by_name() -> None:
    for job_type, kwargs in (
        (FetchResponse, {"provider": "sim", "received_at": AT, "response_id": "r", "v": 99}),
        (FetchBatch, {"provider": "sim", "received_at": AT, "batch_id": "b", "v": "2"}),
        (DeliverJob, {"sink": "jsonl", "envelopes": [], "v": 99}),
    ):
        with pytest.raises(PayloadVersionError, match=r"payload version (99|'2')") as caught:
            job_type.from_kwargs(kwargs)
        assert caught.value.version == kwargs["v"]


def test_a_letter_of_a_shorter_payload_still_names_its_journey() -> None:
    # a dead letter kept before every field was carried (no received_at, no v) is still
    # on the journey of the object it names; one that names no object is on none
    from receiver.queue.jobs import journeys_of

    short = {"provider": "sim", "response_id": "resp_1", "tenant": "team-a"}
    assert journeys_of("fetch_response", short) == [("sim", "team-a", "resp_1")]
    assert journeys_of("fetch_batch", {"provider": "sim", "batch_id": "b_1"}) == [
        ("sim", "default", "b_1")
    ]
    assert journeys_of("fetch_response", {"provider": "sim"}) == []
    assert journeys_of("no_such_job", short) == []
