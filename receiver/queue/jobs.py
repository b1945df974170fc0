"""The jobs' payloads: the one place their arq kwargs are built and read.

Queued jobs and dead letters outlive a deploy, so the function names, the keys and the job
ids never change:

- ``deliver`` (:class:`DeliverJob`): ``sink``, ``envelopes``, ``batch_state``, ``part``,
  ``settle``; ids ``deliver:<sink>:<uuid>``, a batch chunk's ``deliver:<sink>:<batch state
  key>:<part>``, a summary's ``deliver:<sink>:<batch state key>:summary``.
  :meth:`DeliverJob.from_kwargs` also reads the jobs queued before ``settle`` existed.
- ``fetch_response`` (:class:`FetchResponse`): ``provider``, ``event_id``, ``received_at``,
  ``tenant``, ``response_id``; id ``resp:<provider>:<response id>``.
- ``fetch_batch`` (:class:`FetchBatch`): the same with ``batch_id``, ``event_type`` and
  ``from_watch`` in place of ``response_id``; id ``batch:<provider>:<batch id>``.

A fetch job's id names the provider as :func:`~receiver.config.accounts.scoped` does
(``provider@tenant`` for another tenant). Its kwargs carry every key when a worker queues
it again (a retry, a dead letter); a callback's and a poll's leave out the keys they never
carried (see :meth:`FetchJob.callback` and :meth:`FetchJob.polled`), the reader's defaults
fill them in.

Every fetch job may also carry ``traceparent`` (the W3C trace context of the callback that
queued it, :mod:`receiver.tracing`): only while tracing is on, so a worker older than this
key never sees it unless tracing is turned on before it is upgraded.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from nopoll.envelope import DEFAULT_TENANT, Envelope, now_rfc3339
from nopoll.exceptions import SinkRowsRejected
from receiver.config.accounts import scoped
from receiver.queue._arq import JOB_KEY, RESULT_KEY, job_payload

__all__ = [
    "BATCHES_QUEUE",
    "DELIVER",
    "FETCH_BATCH",
    "FETCH_RESPONSE",
    "JOBS_QUEUE",
    "CallbackJob",
    "DeliverJob",
    "FetchBatch",
    "FetchJob",
    "FetchResponse",
    "QueuedJob",
    "batch_job_id",
    "fetch_from_job_id",
    "queue_for",
    "rejection_text",
    "response_job_id",
]

JOBS_QUEUE = "nopoll:jobs"
"""Short jobs: fetching single responses and re-delivering to sinks."""
BATCHES_QUEUE = "nopoll:batches"
"""Long jobs: streaming a batch's rows (their long timeout must not lock short jobs)."""

FETCH_RESPONSE = "fetch_response"
"""Job: fetch one finished response and fan it out."""
FETCH_BATCH = "fetch_batch"
"""Job: stream a finished batch's rows into the sinks."""
DELIVER = "deliver"
"""Job: write envelopes to one sink (a retry, a hand-off, a batch summary, a replay)."""
_QUEUE_OF = {FETCH_RESPONSE: JOBS_QUEUE, DELIVER: JOBS_QUEUE, FETCH_BATCH: BATCHES_QUEUE}


def queue_for(function: str) -> str:
    """The queue whose workers run ``function`` (a job on another queue would never run)."""
    try:
        return _QUEUE_OF[function]
    except KeyError:
        raise ValueError(f"unknown job function {function!r}") from None


@dataclass(frozen=True, slots=True)
class CallbackJob:
    """One verified callback that asks for a fetch."""

    provider: str
    """The dedupe scope: the provider, ``provider@tenant`` for other tenants."""
    webhook_id: str
    function: str
    job_id: str
    kwargs: dict[str, Any]
    queue: str = JOBS_QUEUE
    object_id: str = ""
    """The response or batch the callback is about (its journey's id)."""
    event_type: str = ""
    tenant: str = DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """A job to put on its function's queue, in arq's own format
    (:func:`receiver.queue._arq.job_payload`)."""

    function: str
    job_id: str
    kwargs: dict[str, Any]
    defer_s: float = 0.0
    job_try: int | None = None

    @property
    def queue(self) -> str:
        return queue_for(self.function)

    def keys(self) -> list[str]:
        """KEYS for :data:`PUT_JOB_LUA`'s ``put_job``: job key, result key, queue."""
        return [JOB_KEY + self.job_id, RESULT_KEY + self.job_id, self.queue]

    def args(self, expiry_ms: int) -> list[Any]:
        """ARGV for ``put_job``: payload, expiry, score, job id."""
        now_ms = int(time.time() * 1000)
        payload = job_payload(self.function, self.kwargs, self.job_try, now_ms)
        return [payload, expiry_ms, now_ms + int(self.defer_s * 1000), self.job_id]


def response_job_id(provider: str, response_id: str) -> str:
    """The arq job id of a single-response fetch: one pending fetch per response."""
    return f"resp:{provider}:{response_id}"


def batch_job_id(provider: str, batch_id: str) -> str:
    """The arq job id of a batch fetch: one pending fetch per batch."""
    return f"batch:{provider}:{batch_id}"


@dataclass(frozen=True, slots=True)
class DeliverJob:
    """Write ``envelopes`` to one sink. ``part`` is the chunk number S3 names its part file
    by (None: a plain write); ``batch_state`` and ``settle`` name the batch and the pending
    chunk this delivery settles when it succeeds."""

    sink: str
    envelopes: list[dict[str, Any]] = field(default_factory=list)
    batch_state: str | None = None
    part: int | None = None
    settle: int | None = None

    @classmethod
    def of(
        cls,
        sink: str,
        envelopes: Sequence[Envelope] | Sequence[dict[str, Any]],
        batch_state: str | None = None,
        part: int | None = None,
        settle: int | None = None,
    ) -> DeliverJob:
        dicts = [e.to_dict() if isinstance(e, Envelope) else e for e in envelopes]
        return cls(sink, dicts, batch_state, part, settle)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> DeliverJob:
        batch_state = kwargs.get("batch_state")
        part = kwargs.get("part")
        settle = kwargs.get("settle")
        if settle is None and batch_state is not None:
            settle = part  # a job queued before ``settle`` existed
        return cls(kwargs["sink"], list(kwargs.get("envelopes") or []), batch_state, part, settle)

    def to_kwargs(self) -> dict[str, Any]:
        return {
            "sink": self.sink,
            "envelopes": self.envelopes,
            "batch_state": self.batch_state,
            "part": self.part,
            "settle": self.settle,
        }

    def handoff(self, *, defer_s: float) -> QueuedJob:
        """This delivery as a job of its own; a batch chunk's has one id per (sink, chunk)."""
        job_id = (
            f"deliver:{self.sink}:{self.batch_state}:{self.part}"
            if self.batch_state is not None and self.part is not None
            else f"deliver:{self.sink}:{uuid.uuid4().hex}"
        )
        return QueuedJob(DELIVER, job_id, self.to_kwargs(), defer_s=defer_s, job_try=2)

    def summary(self, state_key: str) -> QueuedJob:
        """The job that writes a batch summary to this sink (one id per sink)."""
        kwargs = {k: v for k, v in self.to_kwargs().items() if k != "settle"}
        return QueuedJob(DELIVER, f"deliver:{self.sink}:{state_key}:summary", kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchJob:
    """What every fetch job is queued with: the callback (or poll) that caused it."""

    function: ClassVar[str]
    id_field: ClassVar[str]
    """The key the fetched object's id goes in."""
    _callback_leaves_out: ClassVar[tuple[str, ...]] = ()
    _poll_leaves_out: ClassVar[tuple[str, ...]] = ()

    provider: str
    event_id: str | None = None
    received_at: str
    tenant: str = DEFAULT_TENANT
    traceparent: str | None = None
    """The callback's W3C trace context; None (and left out of the kwargs): not traced."""

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> Self:
        """The job its kwargs describe, in any of the shapes it is queued in. A key it does
        not know is an error (the job is kept as a dead letter), as it always was."""
        return cls(**kwargs)

    def to_kwargs(self) -> dict[str, Any]:
        """The job's kwargs, every key set (what a retry queues and a dead letter replays);
        ``traceparent`` only when it has one."""
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.traceparent is None:
            del kwargs["traceparent"]
        return kwargs

    @property
    def object_id(self) -> str:
        """The id of the object this job fetches."""
        return str(getattr(self, self.id_field))

    @property
    def job_id(self) -> str:
        """One pending fetch per object (and tenant)."""
        raise NotImplementedError

    @classmethod
    def callback(
        cls,
        provider: str,
        object_id: str,
        webhook_id: str,
        *,
        tenant: str = DEFAULT_TENANT,
        event_type: str = "",
        traceparent: str | None = None,
        **more: Any,
    ) -> CallbackJob:
        """The job a verified callback about ``object_id`` queues, deduped by its
        ``webhook_id`` (the job's ``event_id``); ``event_type`` goes in its kwargs where
        the job has the field (a batch's) and on the id's journey; ``more``: its other
        fields. Its kwargs have no ``tenant`` for the default tenant, nor the keys of
        ``_callback_leaves_out``: callbacks never queued them."""
        if event_type and "event_type" in cls.__dataclass_fields__:
            more["event_type"] = event_type
        job = cls.from_kwargs(
            {
                "provider": provider,
                cls.id_field: object_id,
                "event_id": webhook_id,
                "received_at": now_rfc3339(),
                "tenant": tenant,
                "traceparent": traceparent,
                **more,
            }
        )
        leave_out = cls._callback_leaves_out
        if tenant == DEFAULT_TENANT:
            leave_out += ("tenant",)
        kwargs = job._kwargs(leave_out)
        scope = scoped(provider, tenant)
        return CallbackJob(
            scope,
            webhook_id,
            cls.function,
            job.job_id,
            kwargs,
            job.queue,
            object_id,
            event_type,
            tenant,
        )

    def polled(self) -> QueuedJob:
        """This job as the watch poller queues (or keeps in an expired watch's dead letter)
        it: without the keys of ``_poll_leaves_out``."""
        return QueuedJob(self.function, self.job_id, self._kwargs(self._poll_leaves_out))

    @property
    def queue(self) -> str:
        return queue_for(self.function)

    def _kwargs(self, leave_out: tuple[str, ...]) -> dict[str, Any]:
        return {k: v for k, v in self.to_kwargs().items() if k not in leave_out}


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchResponse(FetchJob):
    """The payload of a ``fetch_response`` job."""

    function: ClassVar[str] = FETCH_RESPONSE
    id_field: ClassVar[str] = "response_id"

    response_id: str

    @property
    def job_id(self) -> str:
        return response_job_id(scoped(self.provider, self.tenant), self.response_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchBatch(FetchJob):
    """The payload of a ``fetch_batch`` job."""

    function: ClassVar[str] = FETCH_BATCH
    id_field: ClassVar[str] = "batch_id"
    _callback_leaves_out: ClassVar[tuple[str, ...]] = ("from_watch",)
    _poll_leaves_out: ClassVar[tuple[str, ...]] = ("event_type",)

    batch_id: str
    event_type: str = "batch.completed"
    """Not read: the batch object's own status is what counts."""
    from_watch: bool = False
    """Queued by the watch poller (:mod:`receiver.worker.poller`) rather than by a callback."""

    @property
    def job_id(self) -> str:
        return batch_job_id(scoped(self.provider, self.tenant), self.batch_id)

    def runner_kwargs(self) -> dict[str, Any]:
        """What :meth:`receiver.batches.runner.BatchRunner.run` needs to know of the job."""
        return self._kwargs(("event_type", "from_watch", "traceparent"))


_BY_ID_PREFIX: dict[str, type[FetchJob]] = {"resp": FetchResponse, "batch": FetchBatch}
"""A fetch job id's prefix (``resp:<provider>:<id>``, ``batch:<provider>:<id>``)."""


def fetch_from_job_id(job_id: str, *, received_at: str) -> tuple[str, dict[str, Any]] | None:
    """The function and kwargs of a fetch job known by its id alone (its payload expired or
    cannot be read), as a dead letter keeps them: the provider as the id names it, no
    ``tenant``; None when ``job_id`` is no fetch job's."""
    prefix, _, rest = job_id.partition(":")
    provider, _, object_id = rest.partition(":")
    job_type = _BY_ID_PREFIX.get(prefix)
    if job_type is None or not object_id:
        return None
    job = job_type.from_kwargs(
        {"provider": provider, job_type.id_field: object_id, "received_at": received_at}
    )
    kept = ("provider", job_type.id_field, "event_id", "received_at")
    return job.function, {k: v for k, v in job.to_kwargs().items() if k in kept}


def rejection_text(error: SinkRowsRejected) -> str:
    """A dead letter's reason for rows a sink refused."""
    reasons = sorted(set(error.rejected.values()))
    return f"sink {error.sink!r} refused {len(error.rejected)} row(s): " + "; ".join(reasons)[:1500]
