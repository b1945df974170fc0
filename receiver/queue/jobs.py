"""The jobs: the one :data:`JOBS` table, and each job's payload, the one place its arq
kwargs are built and read.

A :class:`JobSpec` row (arq's ``func(name, timeout, max_tries)``, and more) holds a job's
name, payload class, queue, id format and parser, deadline, retry rule and dead-letter
target; the fetch jobs take their name, queue, id prefix and id field from
:data:`nopoll.kinds.KINDS`. Queued jobs and dead letters outlive a deploy, so names, keys
and ids never change; every payload carries its version ``v`` (:data:`PAYLOAD_VERSION`).

See docs/architecture.md (jobs) for each job's kwargs and id, docs/reliability.md
(payload versions).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, Self

from nopoll.envelope import DEFAULT_TENANT, Envelope, now_rfc3339
from nopoll.exceptions import SinkRowsRejected
from nopoll.kinds import KINDS, Kind
from nopoll.status import unfinished_status
from receiver.config.accounts import scoped
from receiver.config.sections import RetryConfig
from receiver.config.settings import Settings
from receiver.journey.store import envelope_ids
from receiver.providers import Dialect
from receiver.queue._arq import JOB_KEY, RESULT_KEY, job_payload

__all__ = [
    "BATCHES_QUEUE",
    "DELIVER",
    "FETCH_BATCH",
    "FETCH_RESPONSE",
    "JOBS",
    "JOBS_QUEUE",
    "JOB_GRACE_S",
    "PAYLOAD_VERSION",
    "PUSHED_VERSION",
    "READS",
    "STATE_VERSION",
    "CallbackJob",
    "DeliverJob",
    "FetchBatch",
    "FetchJob",
    "FetchResponse",
    "JobId",
    "JobPayload",
    "JobRules",
    "JobSpec",
    "LetterTarget",
    "PayloadVersionError",
    "Poll",
    "QueuedJob",
    "batch_job_id",
    "check_state_version",
    "fetch_from_job_id",
    "fetch_payload",
    "job_spec",
    "journeys_of",
    "letter_target",
    "parse_job_id",
    "poll_job",
    "queue_for",
    "rejection_text",
    "response_job_id",
]


class _Fetch(NamedTuple):
    job: str
    queue: str
    id_prefix: str
    id_field: str


def _fetch_of(kind: Kind) -> _Fetch:
    """What :data:`~nopoll.kinds.KINDS` says of the job that fetches ``kind``."""
    info = KINDS[kind]
    if info.job is None or info.queue is None or info.id_prefix is None or info.id_field is None:
        raise ValueError(f"kind {kind!r} has no fetch job")
    return _Fetch(info.job, info.queue, info.id_prefix, info.id_field)


_RESPONSE, _BATCH = _fetch_of("response"), _fetch_of("batch")
JOBS_QUEUE = _RESPONSE.queue
"""Short jobs: fetching single responses and re-delivering to sinks."""
BATCHES_QUEUE = _BATCH.queue
"""Long jobs: streaming a batch's rows (their long timeout must not lock short jobs)."""
FETCH_RESPONSE = _RESPONSE.job
"""Job: fetch one finished response and fan it out."""
FETCH_BATCH = _BATCH.job
"""Job: stream a finished batch's rows into the sinks."""
DELIVER = "deliver"
"""Job: write envelopes to one sink (a retry, a hand-off, a batch summary, a replay)."""

PAYLOAD_VERSION = 1
"""The version of the payloads this code writes (their kwargs' ``v``); a payload without
``v`` (queued by an older version) is version 1."""
PUSHED_VERSION = 2
"""A ``fetch_response`` payload that carries a trusted completion webhook's object
(``pushed``): a worker that reads only version 1 keeps it as a dead letter naming the
version, never lands it without the object."""
_READS_VERSIONS = frozenset({PAYLOAD_VERSION, PUSHED_VERSION})
STATE_VERSION = 1
"""The version of the batch progress this code writes (its hash's ``v``; none: 1)."""
_READS_STATE_VERSIONS = frozenset({STATE_VERSION})
READS = frozenset(
    {f"job:{v}" for v in _READS_VERSIONS} | {f"state:{v}" for v in _READS_STATE_VERSIONS}
)
"""What this code reads, as the marks a worker publishes (:attr:`PayloadVersionError.mark`):
a worker that cannot read a job hands it to a live one that can."""


class PayloadVersionError(ValueError):
    """A job's payload (or its batch's progress, ``what="state"``) is of a version this
    worker cannot read, written by a newer nopoll: the job is handed to a live worker that
    reads it, else kept as a dead letter naming the version (docs/reliability.md)."""

    def __init__(self, function: str, version: object, what: str = "job") -> None:
        reads = _READS_VERSIONS if what == "job" else _READS_STATE_VERSIONS
        noun = "payload" if what == "job" else "batch progress"
        super().__init__(
            f"{function} {noun} version {version!r} is not one this worker reads "
            f"(it reads {', '.join(map(str, sorted(reads)))}): written by a newer "
            "nopoll? replay the dead letter once every worker is upgraded"
        )
        self.function = function
        self.version = version
        self.mark = f"{what}:{version}"
        """The :data:`READS` mark a worker that reads it publishes."""


def check_state_version(function: str, stored: str | None) -> None:
    """Raise :class:`PayloadVersionError` when a batch's stored progress version (None:
    1) is not one this code reads."""
    version: object = 1 if stored is None else (int(stored) if stored.isdigit() else stored)
    if version not in _READS_STATE_VERSIONS:
        raise PayloadVersionError(function, version, "state")


def _unversioned(function: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` without their version, once it is one this code reads (none: 1)."""
    version = kwargs.get("v", 1)
    if isinstance(version, bool) or version not in _READS_VERSIONS:
        raise PayloadVersionError(function, version)
    return {k: v for k, v in kwargs.items() if k != "v"}


JOB_GRACE_S = 5.0
"""arq's timeout for a job sits this far above the job's own deadline, so nopoll's
deadline always fires first and the job is retried or dead-lettered, never dropped."""


class LetterTarget(NamedTuple):
    """What a job's dead letter is filed under."""

    sink: str
    """The sink that failed, or ``fetch`` for a fetch."""
    provider: str
    keys: list[str]


@dataclass(frozen=True, slots=True)
class JobRules:
    """How long one job function may run and how it is retried."""

    function: str
    deadline_s: float
    retry: RetryConfig

    @property
    def arq_timeout_s(self) -> float:
        return self.deadline_s + JOB_GRACE_S


@dataclass(frozen=True, slots=True)
class Poll:
    """How the watch poller polls an object its fetch job fetches: one GET through the
    dialect, what the object says while it is not finished, its final status."""

    get: Callable[[Dialect, str, float], Awaitable[dict[str, Any]]]
    """One GET of the object (id, the wait for the account's slot), through the rate limit."""
    pending: Callable[[Dialect, dict[str, Any]], str | None]
    """Its status while not finished (at most 64 characters); None once it is."""
    final: Callable[[Dialect, dict[str, Any]], str]
    """A finished object's final status."""
    lands_polled: bool = False
    """The poller lands the object it polled (a response: no second GET); False: it queues
    the fetch job, ``from_watch`` (a batch's rows take a long job)."""


class JobPayload(Protocol):
    """A job's kwargs as one typed object (one dataclass per job function)."""

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> Self: ...

    def to_kwargs(self) -> dict[str, Any]: ...

    def letter_target(self) -> LetterTarget: ...

    def journeys(self) -> list[tuple[str, str, str]]: ...


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job function: everything about it but its code (see the module docs)."""

    name: str
    """The arq function's name (what queued jobs and dead letters carry)."""
    payload: type[JobPayload]
    queue: str
    """The queue whose workers run it (a job on another queue would never run)."""
    id_prefix: str
    """The first part of its job ids, ``<prefix>:<named>:<rest>``."""
    id_names: Literal["account", "sink"]
    """What the second part of its ids names: a provider account or a sink."""
    deadline_s: Callable[[Settings], float]
    """Its own deadline under the settings (arq's timeout is :data:`JOB_GRACE_S` above)."""
    retry: Callable[[Settings], RetryConfig]
    """Its retry rule under the settings."""
    letter_sink: str | None = None
    """The sink its dead letters are filed under; None: the sink its payload names."""
    kind: Kind | None = None
    """The result kind it fetches (None: not a fetch)."""
    id_field: str | None = None
    """The kwarg holding the id of the object it fetches."""
    poll: Poll | None = None
    """How a watch of its kind is polled; None: its kind cannot be watched."""

    def rules(self, settings: Settings) -> JobRules:
        """Its deadline and retry rule under ``settings``."""
        return JobRules(self.name, self.deadline_s(settings), self.retry(settings))

    def job_id(self, named: str, rest: str) -> str:
        """Its job id for ``named`` (the account or sink) and the rest."""
        return f"{self.id_prefix}:{named}:{rest}"

    def read(self, kwargs: Mapping[str, Any]) -> JobPayload | None:
        """Its payload from these kwargs; None when they cannot be read (a key or a version
        it does not know, a field an older or shorter letter lacks)."""
        try:
            return self.payload.from_kwargs(kwargs)
        except (TypeError, KeyError, ValueError):
            return None

    def letter_target(self, kwargs: Mapping[str, Any]) -> LetterTarget:
        """What a dead letter of a job with these kwargs is filed under: as its payload
        says, or, when it cannot be read, by the sink, provider and id the kwargs name."""
        if (payload := self.read(kwargs)) is not None:
            return payload.letter_target()
        sink = self.letter_sink if self.letter_sink is not None else kwargs.get("sink")
        keys = [str(kwargs.get(self.id_field) or "")] if self.id_field is not None else []
        return LetterTarget(str(sink or ""), str(kwargs.get("provider", "")), keys)

    def journeys(self, kwargs: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        """The journeys a job with these kwargs belongs to: as its payload says, or, when
        it cannot be read, the provider, tenant and id the kwargs name; none when they name
        no object."""
        if (payload := self.read(kwargs)) is not None:
            return payload.journeys()
        object_id = kwargs.get(self.id_field) if self.id_field is not None else None
        provider = kwargs.get("provider")
        if not (isinstance(object_id, str) and object_id and isinstance(provider, str)):
            return []
        return [(provider, str(kwargs.get("tenant") or DEFAULT_TENANT), object_id)]


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


@dataclass(frozen=True, slots=True)
class DeliverJob:
    """Write ``envelopes`` to one sink. ``part`` is the chunk number S3 names its part file
    by (None: a plain write); ``batch_state`` and ``settle`` name the batch and the pending
    chunk this delivery settles when it succeeds; ``fp`` is the sink's config fingerprint
    where it was queued (:meth:`~sinks.base.SinkConfig.fingerprint`; None: any)."""

    sink: str
    envelopes: list[dict[str, Any]] = field(default_factory=list)
    batch_state: str | None = None
    part: int | None = None
    settle: int | None = None
    fp: str | None = None

    @classmethod
    def of(
        cls,
        sink: str,
        envelopes: Sequence[Envelope] | Sequence[dict[str, Any]],
        batch_state: str | None = None,
        part: int | None = None,
        settle: int | None = None,
        *,
        fp: str | None = None,
    ) -> DeliverJob:
        dicts = [e.to_dict() if isinstance(e, Envelope) else e for e in envelopes]
        return cls(sink, dicts, batch_state, part, settle, fp)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> DeliverJob:
        """The delivery its kwargs describe; :class:`PayloadVersionError` for a version this
        code does not read."""
        kwargs = _unversioned(DELIVER, kwargs)
        batch_state = kwargs.get("batch_state")
        part = kwargs.get("part")
        settle = kwargs.get("settle")
        if settle is None and batch_state is not None:
            settle = part  # a job queued before ``settle`` existed
        envelopes = list(kwargs.get("envelopes") or [])
        fp = kwargs.get("fp")
        return cls(kwargs["sink"], envelopes, batch_state, part, settle, fp)

    def to_kwargs(self) -> dict[str, Any]:
        kwargs = {
            "sink": self.sink,
            "envelopes": self.envelopes,
            "batch_state": self.batch_state,
            "part": self.part,
            "settle": self.settle,
            "v": PAYLOAD_VERSION,
        }
        if self.fp is not None:  # an older worker reads the rest and ignores it
            kwargs["fp"] = self.fp
        return kwargs

    def handoff(self, *, defer_s: float) -> QueuedJob:
        """This delivery as a job of its own; a batch chunk's has one id per (sink, chunk)."""
        spec = JOBS[DELIVER]
        job_id = (
            spec.job_id(self.sink, f"{self.batch_state}:{self.part}")
            if self.batch_state is not None and self.part is not None
            else spec.job_id(self.sink, uuid.uuid4().hex)
        )
        return QueuedJob(DELIVER, job_id, self.to_kwargs(), defer_s=defer_s, job_try=2)

    def summary(self, state_key: str) -> QueuedJob:
        """The job that writes a batch summary to this sink (one id per sink)."""
        kwargs = {k: v for k, v in self.to_kwargs().items() if k != "settle"}
        return QueuedJob(DELIVER, JOBS[DELIVER].job_id(self.sink, f"{state_key}:summary"), kwargs)

    def letter_target(self) -> LetterTarget:
        """Filed under its sink, the provider of its first envelope and their keys."""
        envelopes = [e for e in self.envelopes if isinstance(e, dict)]
        provider = str(envelopes[0].get("provider", "")) if envelopes else ""
        return LetterTarget(self.sink, provider, [str(e.get("key")) for e in envelopes])

    def journeys(self) -> list[tuple[str, str, str]]:
        """``(provider, tenant, id)`` of its envelopes' journeys (a row's is its batch's)."""
        return envelope_ids(e for e in self.envelopes if isinstance(e, dict))


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchJob:
    """What every fetch job is queued with: the callback (or poll) that caused it."""

    kind: ClassVar[Kind]
    """The result kind it fetches."""
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
        not know is an error (the job is kept as a dead letter), as it always was, and so is
        a version it does not read (:class:`PayloadVersionError`)."""
        return cls(**_unversioned(cls.function, kwargs))

    def to_kwargs(self) -> dict[str, Any]:
        """The job's kwargs, every key set (what a retry queues and a dead letter replays);
        ``traceparent`` only when it has one."""
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.traceparent is None:
            del kwargs["traceparent"]
        kwargs["v"] = PAYLOAD_VERSION
        return kwargs

    def letter_target(self) -> LetterTarget:
        """Filed under ``fetch``, its provider and the object's id."""
        return LetterTarget("fetch", self.provider, [self.object_id])

    def journeys(self) -> list[tuple[str, str, str]]:
        """``(provider, tenant, id)`` of the journey of the object it fetches."""
        return [(self.provider, self.tenant, self.object_id)]

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

    @classmethod
    def of_watch(
        cls, provider: str, object_id: str, *, received_at: str, tenant: str, from_watch: bool
    ) -> QueuedJob:
        """The job that lands a watched object, as :meth:`polled`: queued by a poll that
        claimed the landing (``from_watch``, where the job has the field), or kept in an
        expired watch's dead letter, whose replay lands it as a callback's job would."""
        more = {"from_watch": from_watch} if "from_watch" in cls.__dataclass_fields__ else {}
        kwargs = {"provider": provider, cls.id_field: object_id, "received_at": received_at}
        return cls.from_kwargs({**kwargs, "tenant": tenant, **more}).polled()

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

    kind: ClassVar[Kind] = "response"
    function: ClassVar[str] = FETCH_RESPONSE
    id_field: ClassVar[str] = _RESPONSE.id_field

    response_id: str
    pushed: dict[str, Any] | None = None
    """A trusted completion webhook's Response object (``completion_webhook.trust_body``):
    landed as it came, no GET; None (and left out of the kwargs): fetched by id."""

    def to_kwargs(self) -> dict[str, Any]:
        kwargs = FetchJob.to_kwargs(self)
        if self.pushed is None:
            del kwargs["pushed"]
        else:
            kwargs["v"] = PUSHED_VERSION
        return kwargs

    @property
    def job_id(self) -> str:
        return response_job_id(scoped(self.provider, self.tenant), self.response_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchBatch(FetchJob):
    """The payload of a ``fetch_batch`` job."""

    kind: ClassVar[Kind] = "batch"
    function: ClassVar[str] = FETCH_BATCH
    id_field: ClassVar[str] = _BATCH.id_field
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
        return self._kwargs(("event_type", "from_watch", "traceparent", "v"))


def _fetch_spec(
    payload: type[FetchJob],
    deadline_s: Callable[[Settings], float],
    retry: Callable[[Settings], RetryConfig],
    poll: Poll | None = None,
) -> JobSpec:
    """The row of the job that fetches ``payload.kind``: name, queue, id prefix and id
    field as :data:`~nopoll.kinds.KINDS` has them."""
    fetch = _fetch_of(payload.kind)
    if (
        poll is not None
        and not poll.lands_polled
        and "from_watch" not in payload.__dataclass_fields__
    ):
        # the job a poll queues must know the poll claimed the landing, or it skips it
        raise ValueError(f"{fetch.job}: a poll that queues it needs a from_watch field")
    return JobSpec(
        fetch.job,
        payload,
        fetch.queue,
        fetch.id_prefix,
        "account",
        deadline_s,
        retry,
        letter_sink="fetch",
        kind=payload.kind,
        id_field=fetch.id_field,
        poll=poll,
    )


async def _get_response(dialect: Dialect, response_id: str, wait_s: float) -> dict[str, Any]:
    return await dialect.fetch_response(response_id, wait_s=wait_s)


async def _get_batch(dialect: Dialect, batch_id: str, wait_s: float) -> dict[str, Any]:
    # one try: every request a watch makes goes through the rate limit
    return await dialect.fetch_batch_object(batch_id, attempts=1, wait_s=wait_s)


_POLL_RESPONSE = Poll(
    _get_response,
    lambda dialect, obj: unfinished_status(obj),
    lambda dialect, obj: str(dialect.object_status(obj)),
    lands_polled=True,
)
_POLL_BATCH = Poll(
    _get_batch,
    lambda dialect, obj: dialect.batch_pending(obj),
    lambda dialect, obj: dialect.batch_facts(obj).status,
)


JOBS: dict[str, JobSpec] = {
    spec.name: spec
    for spec in (
        _fetch_spec(
            FetchResponse,
            lambda s: s.worker.response_job_timeout_s,
            lambda s: s.fetch_retry,
            _POLL_RESPONSE,
        ),
        _fetch_spec(
            FetchBatch, lambda s: s.batch.job_timeout_s, lambda s: s.fetch_retry, _POLL_BATCH
        ),
        JobSpec(
            DELIVER,
            DeliverJob,
            JOBS_QUEUE,
            DELIVER,
            "sink",
            lambda s: s.worker.response_job_timeout_s,
            lambda s: s.sink_retry,
        ),
    )
}
"""Every job function, by name: what the worker registers and everything else reads."""

_BY_ID_PREFIX = {spec.id_prefix: spec for spec in JOBS.values()}


def job_spec(function: str) -> JobSpec:
    """The row of ``function``; ValueError for a function nothing runs."""
    try:
        return JOBS[function]
    except KeyError:
        raise ValueError(f"unknown job function {function!r}") from None


def fetch_payload(kind: str) -> type[FetchJob]:
    """The payload class of the job that fetches ``kind``; ValueError for a kind no job
    fetches (a batch row comes with its batch)."""
    info = KINDS.get(kind)
    spec = JOBS.get(info.job) if info is not None and info.job is not None else None
    payload = spec.payload if spec is not None else None
    if payload is None or not issubclass(payload, FetchJob):
        raise ValueError(f"no job fetches a {kind!r}")
    return payload


def poll_job(kind: str) -> JobSpec | None:
    """The fetch job whose :class:`Poll` polls a watch of ``kind``; None when nothing can
    poll it (a kind that is not watchable, or has no fetch job that says how)."""
    info = KINDS.get(kind)
    if info is None or not info.watchable or info.job is None:
        return None
    spec = JOBS.get(info.job)
    return spec if spec is not None and spec.poll is not None else None


def queue_for(function: str) -> str:
    """The queue whose workers run ``function`` (a job on another queue would never run)."""
    return job_spec(function).queue


def response_job_id(provider: str, response_id: str) -> str:
    """The arq job id of a single-response fetch: one pending fetch per response."""
    return JOBS[FETCH_RESPONSE].job_id(provider, response_id)


def batch_job_id(provider: str, batch_id: str) -> str:
    """The arq job id of a batch fetch: one pending fetch per batch."""
    return JOBS[FETCH_BATCH].job_id(provider, batch_id)


class JobId(NamedTuple):
    """A job id, parsed: ``<prefix>:<named>:<rest>``."""

    spec: JobSpec
    named: str
    """The account (a fetch's) or the sink (a delivery's) the id names."""
    rest: str


def parse_job_id(job_id: str) -> JobId | None:
    """The job an id belongs to and what it names; None for an id of no job in
    :data:`JOBS` (a replay's ``replay:<letter>``) or one that names nothing."""
    prefix, _, rest = job_id.partition(":")
    named, _, rest = rest.partition(":")
    spec = _BY_ID_PREFIX.get(prefix)
    if spec is None or not named:
        return None
    return JobId(spec, named, rest)


def letter_target(function: str, kwargs: Mapping[str, Any]) -> LetterTarget:
    """What a dead letter of this job is filed under (a function nothing runs: nothing,
    the letter is kept all the same)."""
    spec = JOBS.get(function)
    if spec is None:
        return LetterTarget("", "", [])
    return spec.letter_target(kwargs)


def journeys_of(function: str, kwargs: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The journeys a job's work belongs to, ``(provider, tenant, id)``: none for a
    function nothing runs or a payload that cannot be read."""
    spec = JOBS.get(function)
    return [] if spec is None else spec.journeys(kwargs)


def fetch_from_job_id(job_id: str, *, received_at: str) -> tuple[str, dict[str, Any]] | None:
    """The function and kwargs of a fetch job known by its id alone (its payload expired or
    cannot be read), as a dead letter keeps them: the provider as the id names it, no
    ``tenant``; None when ``job_id`` is no fetch job's."""
    parsed = parse_job_id(job_id)
    if parsed is None or parsed.spec.id_field is None or not parsed.rest:
        return None
    spec, id_field = parsed.spec, parsed.spec.id_field
    job = spec.payload.from_kwargs(
        {"provider": parsed.named, id_field: parsed.rest, "received_at": received_at}
    )
    kept = ("provider", id_field, "event_id", "received_at", "v")
    return spec.name, {k: v for k, v in job.to_kwargs().items() if k in kept}


def rejection_text(error: SinkRowsRejected) -> str:
    """A dead letter's reason for rows a sink refused."""
    reasons = sorted(set(error.rejected.values()))
    return f"sink {error.sink!r} refused {len(error.rejected)} row(s): " + "; ".join(reasons)[:1500]
