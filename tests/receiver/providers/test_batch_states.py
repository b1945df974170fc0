"""When is a batch finished, and what does its summary say: each dialect reads its own
provider's batch object (issue 31 item 1). Sail's and Valar's published references have no
batch ``status``: ``request_counts`` is one integer and ``request_status`` says how each
request went; Sail's older guide shape has a ``status`` and a counts object."""

from __future__ import annotations

from typing import Any

import pytest

from receiver.config.sections import HttpConfig
from receiver.config.settings import ProviderConfig
from receiver.providers import ProviderClient, dialect_for


def dialect(name: str) -> Any:
    config = ProviderConfig(dialect=name, base_url="http://127.0.0.1:9/v1")
    return dialect_for(name, ProviderClient("p", config, HttpConfig()))


def reference(*statuses: str, counts: int | None = None, label: str | None = None) -> dict:
    """A batch object as Sail's and Valar's references give it."""
    obj: dict[str, Any] = {
        "id": "batch_abc123",
        "request_counts": len(statuses) if counts is None else counts,
        "created_at": 1741564800,
        "request_status": {f"r-{i}": {"status": s} for i, s in enumerate(statuses)},
    }
    if label is not None:
        obj["label"] = label
    return obj


@pytest.mark.parametrize("name", ["sail", "valar"])
def test_a_reference_batch_is_finished_only_when_every_request_settled(name: str) -> None:
    d = dialect(name)
    assert d.batch_pending(reference("COMPLETED", "RUNNING", "FAILED")) == (
        "2 of 3 requests settled"
    )
    # an empty or partial map is never finished, whatever its entries say
    assert d.batch_pending(reference(counts=3)) == "0 of 3 requests settled"
    assert d.batch_pending(reference("COMPLETED", "COMPLETED", counts=3)) is not None
    assert d.batch_pending(reference("PENDING", counts=1)) == "0 of 1 requests settled"
    # without a request count nothing says it is over
    no_count = reference("COMPLETED")
    del no_count["request_counts"]
    assert d.batch_pending(no_count) == "no request count"
    # every request settled, some failed or were cancelled: finished
    assert d.batch_pending(reference("COMPLETED", "FAILED", "CANCELLED")) is None
    assert d.batch_pending(reference("completed", "Failed")) is None  # any case


@pytest.mark.parametrize("name", ["sail", "valar"])
def test_a_reference_batch_summary_counts_its_requests(name: str) -> None:
    d = dialect(name)
    facts = d.batch_facts(reference("COMPLETED", "FAILED", "COMPLETED", label="evals_01"))
    assert facts.status == "completed"
    assert facts.request_counts == {"total": 3, "completed": 2, "failed": 1}
    assert facts.metadata == {"label": "evals_01"}
    cancelled = d.batch_facts(reference("CANCELLED", "CANCELLED"))
    assert cancelled.status == "cancelled" and cancelled.request_counts == {
        "total": 2,
        "cancelled": 2,
    }


def test_sails_guide_shape_is_decided_by_its_status() -> None:
    d = dialect("sail")
    running = {
        "id": "b1",
        "status": "in_progress",
        "request_counts": {"total": 2, "completed": 2, "failed": 0},
        "request_status": {"a": {"status": "COMPLETED"}, "b": {"status": "COMPLETED"}},
        "results": None,
    }
    assert d.batch_pending(running) == "in_progress"  # a status, where one is given, decides
    done = {**running, "status": "completed"}
    assert d.batch_pending(done) is None
    facts = d.batch_facts(done)
    assert facts.status == "completed"
    assert facts.request_counts == {"total": 2, "completed": 2, "failed": 0}
    # inline results are there only once the batch is over
    assert d.batch_pending({"id": "b1", "results": []}) is None


def test_openai_and_sference_batches_keep_their_status() -> None:
    for name in ("openai", "sference"):
        d = dialect(name)
        assert d.batch_pending({"id": "b", "status": "in_progress"}) == "in_progress"
        assert d.batch_pending({"id": "b", "status": "completed"}) is None
        assert d.batch_pending({"id": "b"}) == "<none>"


def test_a_sference_batch_summary_carries_its_count_tokens_and_cost() -> None:
    d = dialect("sference")
    batch = {
        "id": "0199e0c4-7d3a-7b4e-9f10-5a2b3c4d5e6f",
        "status": "completed",
        "window": "24h",
        "request_count": 3,
        "created_at": "2026-12-01T10:00:00+00:00",
        "updated_at": "2026-12-01T10:05:00+00:00",
        "completed_at": "2026-12-01T10:05:00+00:00",
        "total_prompt_tokens": 120,
        "total_completion_tokens": 45,
        "total_tokens": 165,
        "total_cost_micros": 0,
    }
    assert d.batch_pending(batch) is None
    assert d.batch_pending({**batch, "status": "pending"}) == "pending"
    assert d.batch_pending({**batch, "status": "running"}) == "running"
    facts = d.batch_facts(batch)
    assert facts.status == "completed" and facts.request_counts == {"total": 3}
    assert (facts.input_tokens, facts.output_tokens) == (120, 45)
    assert facts.metadata == {"total_tokens": 165, "total_cost_micros": 0}
    assert d.batch_facts({**batch, "status": "cancelled"}).status == "cancelled"


def test_rows_of_a_cancelled_sference_batch_that_never_ran_are_cancelled() -> None:
    from receiver.providers.sference import parse_line

    never_ran = b'{"custom_id": "a", "status": "pending", "result_json": null, "error_json": null}'
    row = parse_line(0, never_ran, cancelled=True)
    assert (row.status, row.error) == ("cancelled", None)
    done = b'{"custom_id": "b", "status": "completed", "result_json": {"choices": []}}'
    assert parse_line(1, done, cancelled=True).status == "completed"
    said = b'{"custom_id": "c", "status": "cancelled", "result_json": null, "error_json": null}'
    assert parse_line(2, said).status == "cancelled"
    # outside a cancelled batch an unfinished row status is still a failed row, saying why
    odd = parse_line(3, never_ran)
    assert odd.status == "failed" and odd.error["code"] == "unknown_status"


def test_every_dialect_implements_the_whole_dialect_protocol() -> None:
    """A dialect is found by name at run time, so no type checker sees a missing method:
    every row of the table has every member of :class:`Dialect`."""
    from receiver.providers import DIALECTS, Dialect, dialect_type

    members = [
        name for name in vars(Dialect) if not name.startswith("_") and name not in ("client",)
    ] + [name for name in Dialect.__annotations__ if name != "client"]
    assert {"batch_pending", "batch_facts", "batch_chunks", "stable_chunks"} <= set(members)
    for name in DIALECTS:
        cls = dialect_type(name)
        missing = [m for m in members if not hasattr(cls, m)]
        assert not missing, f"{name}: {missing}"
