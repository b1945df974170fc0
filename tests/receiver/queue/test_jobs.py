"""The jobs' payloads (receiver.queue.jobs): each round-trips through its kwargs, and the
kwargs keep the keys, function names and job ids that queued jobs and dead letters
written by earlier versions carry."""

from __future__ import annotations

from receiver.queue.enqueue import BATCHES_QUEUE, JOBS_QUEUE
from receiver.queue.jobs import DeliverJob, FetchBatch, FetchResponse, fetch_from_job_id

AT = "2026-11-29T10:00:00.000Z"
COMMON = {"provider", "event_id", "received_at"}


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
    }


def test_a_fetch_job_is_known_by_its_id_alone() -> None:
    assert fetch_from_job_id("resp:sim@acme:r_1", received_at=AT) == (
        "fetch_response",
        {"provider": "sim@acme", "response_id": "r_1", "event_id": None, "received_at": AT},
    )
    assert fetch_from_job_id("batch:sim:b:1", received_at=AT) == (
        "fetch_batch",
        {"provider": "sim", "batch_id": "b:1", "event_id": None, "received_at": AT},
    )
    for other in ("deliver:jsonl:abc", "resp:sim", "resp:sim:", "nothing"):
        assert fetch_from_job_id(other, received_at=AT) is None
