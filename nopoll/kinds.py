"""The result kinds: the one table every kind-dependent set, choice, enum and parser reads.

A kind is what an envelope holds (``Envelope.kind``): a single background response, one
row of a batch, or a batch's summary. Adding a kind is adding a row to :data:`KINDS`.
See docs/envelope.md for what each kind's envelope carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEFAULT_KIND",
    "FETCHED_KINDS",
    "KINDS",
    "ROW_KINDS",
    "SINGLE_KINDS",
    "SUMMARY_KINDS",
    "WATCHABLE_KINDS",
    "Kind",
    "KindInfo",
    "WatchKind",
    "kind_names",
    "kind_of_event",
    "kind_of_job_id",
]

Kind = Literal["response", "batch_row", "batch"]
"""A kind's name as envelopes, sinks and the results API spell it."""

WatchKind = Literal["response", "batch"]
"""The name of a watchable kind (:data:`WATCHABLE_KINDS`), as watches and the admin API
spell it."""

DEFAULT_KIND: WatchKind = "response"
"""The kind of an id when nothing says otherwise."""


@dataclass(frozen=True, slots=True)
class KindInfo:
    """What nopoll knows about one kind of result."""

    name: Kind
    plural: str
    """The name of many of them, in words and paths (``responses/`` of the s3 sink)."""
    watchable: bool
    """An id of this kind can be registered as a watch (polled until it finishes)."""
    callback_events: frozenset[str] = frozenset()
    """The webhook event types (``type`` of a Standard Webhooks callback) about an object of
    this kind."""
    job: str | None = None
    """The arq function that fetches an object of this kind; None: it is never fetched on
    its own (a batch row comes with its batch)."""
    id_prefix: str | None = None
    """The first part of that fetch job's id (``<prefix>:<provider>:<object id>``)."""
    queue: str | None = None
    """The arq queue that job goes on."""
    id_field: str | None = None
    """The job's (and the envelope's) field holding the object's id."""
    summary: bool = False
    """Its envelope sums up rows of another kind (a batch's): final statuses are batch
    statuses, and the s3 sink writes it as the manifest of its rows' parts."""
    row_of: str | None = None
    """The kind this is one row of; its envelopes are written in numbered parts, never on
    their own."""

    @property
    def single(self) -> bool:
        """One whole result on its own: neither a summary nor a row."""
        return not self.summary and self.row_of is None


KINDS: dict[str, KindInfo] = {
    "response": KindInfo(
        "response",
        "responses",
        watchable=True,
        callback_events=frozenset(
            {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
        ),
        job="fetch_response",
        id_prefix="resp",
        queue="nopoll:jobs",
        id_field="response_id",
    ),
    "batch_row": KindInfo("batch_row", "batch rows", watchable=False, row_of="batch"),
    "batch": KindInfo(
        "batch",
        "batches",
        watchable=True,
        callback_events=frozenset(
            {"batch.completed", "batch.failed", "batch.cancelled", "batch.expired"}
        ),
        job="fetch_batch",
        id_prefix="batch",
        queue="nopoll:batches",
        id_field="batch_id",
        summary=True,
    ),
}
"""Every kind, by name, in the order they are listed to users."""

WATCHABLE_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.watchable)
FETCHED_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.job is not None)
SINGLE_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.single)
SUMMARY_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.summary)
ROW_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.row_of is not None)


def kind_names() -> tuple[str, ...]:
    """Every kind's name, for a CLI choice, a query filter or an OpenAPI enum."""
    return tuple(KINDS)


def kind_of_event(event_type: str) -> KindInfo | None:
    """The kind a webhook event type is about; None for an event nopoll does not take."""
    return next((k for k in KINDS.values() if event_type in k.callback_events), None)


def kind_of_job_id(job_id: str) -> KindInfo | None:
    """The kind whose fetch job has this id (``resp:...``, ``batch:...``); None otherwise."""
    prefix = job_id.partition(":")[0]
    return next((k for k in KINDS.values() if k.id_prefix == prefix), None)
