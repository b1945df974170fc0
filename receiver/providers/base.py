"""The dialect contract: fetch one response; fetch a batch object; list a batch's rows as an
async stream.

A dialect turns one provider family's API into :class:`~nopoll.envelope.BatchRow`
chunks, numbered and deterministic for a given batch, so a batch job that dies skips the
chunks every sink committed. A dialect whose rows come in no stable order says so
(``stable_chunks = False``), and its resumed batches start from the first row.

See docs/batches.md (streaming, chunks and resumption) and docs/providers.md.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import orjson

from nopoll.envelope import BatchFacts, BatchRow, BodyFields, Envelope, body_fields
from nopoll.exceptions import ProviderError
from nopoll.kinds import KindInfo, kind_of_event
from nopoll.status import FINAL, pending_status, row_status, unknown_status
from nopoll.wire import safe_id
from receiver.providers.batch_input import BatchInput, CreateCall, check_lines
from receiver.providers.client import ProviderClient

__all__ = [
    "PER_ROW_BYTES",
    "BadCallback",
    "BatchFetch",
    "Callback",
    "ChunkCut",
    "CompletionFeed",
    "Dialect",
    "FeedEvent",
    "FeedPage",
    "IdempotentCreates",
    "RequestStatusDialect",
    "ResponsesDialect",
    "batch_label",
    "chunk_rows",
    "count_or_none",
    "id_chunks",
    "line_object",
    "loads_obj",
    "rows_by_custom_id",
]

Chunk = tuple[int, list[BatchRow]]


@dataclass
class BatchFetch:
    """What a dialect learns while streaming: the batch object (complete at the end)."""

    batch_id: str
    chunk_size: int = 1000
    chunk_bytes: int = 0
    """A chunk also ends once its rows' raw bytes reach this (0: by rows only); see
    :class:`ChunkCut`."""
    skip_before: int = 0
    """Chunks below this index were committed by every sink: do not fetch or parse them."""
    batch: dict[str, Any] = field(default_factory=dict)
    last_chunk_bytes: int = 0
    """The raw bytes of the chunk yielded last (0 when the dialect cannot tell: per-row
    GETs)."""


class ChunkCut:
    """Where a batch's chunks end: after ``chunk_size`` rows or once the rows' raw bytes
    reach ``chunk_bytes``, whichever comes first. Only the rows' sizes decide, never their
    contents parsed, so a resumed run cuts exactly where the first one did while it reads
    past the skipped rows; and the stream gives the same rows in the same bytes every time
    (a results file; Sail's inline array, where a row's size is counted from its parse
    events)."""

    __slots__ = ("bytes", "max_bytes", "max_rows", "number", "rows")

    def __init__(self, fetch: BatchFetch) -> None:
        self.max_rows = fetch.chunk_size
        self.max_bytes = fetch.chunk_bytes
        self.number = 0
        """The chunk the next row belongs to."""
        self.rows = 0
        self.bytes = 0

    def add(self, size: int) -> bool:
        """Count one row of ``size`` raw bytes into the current chunk; True when the chunk
        ends with it (call :meth:`next` once it is handed on)."""
        self.rows += 1
        self.bytes += size
        return self.rows >= self.max_rows or 0 < self.max_bytes <= self.bytes

    def next(self) -> None:
        self.number += 1
        self.rows = self.bytes = 0


@dataclass(frozen=True, slots=True)
class Callback:
    """What a verified callback asks for: fetch the object ``object_id`` of ``kind``."""

    event_type: str
    kind: KindInfo
    object_id: str


class FeedEvent(Protocol):
    """One completion a feed names (:class:`CompletionFeed`)."""

    @property
    def completion_id(self) -> str:
        """The feed's cursor up to and with this event."""
        ...

    @property
    def response_id(self) -> str | None:
        """The response it finished; None for a completion that is no single response."""
        ...

    @property
    def status(self) -> str | None:
        """nopoll's final status; None for one it does not know as final."""
        ...

    @property
    def completed_at(self) -> float | None:
        """When it finished (Unix time), if the event says."""
        ...

    @property
    def whole(self) -> bool:
        """It carries the whole result: :meth:`envelope` lands it with no GET."""
        ...

    def envelope(self, provider: str, *, tenant: str, received_at: str) -> Envelope:
        """The ``response`` envelope of a :attr:`whole` event."""
        ...


@dataclass(frozen=True, slots=True)
class FeedPage:
    """One answer of a completion feed: its events in completion order (the last one's id
    is the next cursor), and whether more wait."""

    events: list[FeedEvent]
    has_more: bool
    skipped: int = 0
    """Items that were no usable event (no id to be a cursor)."""


@runtime_checkable
class CompletionFeed(Protocol):
    """A dialect whose API has an account-wide completion feed (its row's
    ``completion_feed``): :mod:`receiver.worker.feed` follows it."""

    async def feed_page(
        self,
        *,
        stream_id: str | None,
        after: str | None,
        limit: int,
        wait_ms: int,
        wait_s: float | None = None,
        before: str | None = None,
    ) -> FeedPage:
        """The completions after the cursor ``after`` (None: the newest, or those before
        ``before``, paging back), of the stream ``stream_id`` (None: the account's requests
        outside streams), waiting up to ``wait_ms`` for one; ``wait_s``: the wait for the
        account's slot."""
        ...


class BadCallback(ValueError):
    """A callback body its dialect cannot read; the message says why (the sender's 400)."""


class Dialect(Protocol):
    """How one provider family hands out finished results."""

    client: ProviderClient

    def __init__(self, client: ProviderClient) -> None: ...

    async def fetch_response(
        self, response_id: str, *, wait_s: float | None = None
    ) -> dict[str, Any]:
        """The finished Responses object for ``response_id``; the GET waits at most
        ``wait_s`` for its slot of the account's budget (:mod:`receiver.providers.budget`)."""
        ...

    async def fetch_batch_object(
        self, batch_id: str, *, attempts: int | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        """The batch object for ``batch_id`` (after checking the id is safe), tried up to
        ``attempts`` times (default ``http.attempts``), each waiting at most ``wait_s`` for
        its slot: what a watch polls."""
        ...

    def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        """Every row of the batch, in numbered chunks; fills ``fetch.batch``. A batch that
        is not finished yet yields no rows (the runner then retries the job later)."""
        ...

    def batch_pending(self, batch: dict[str, Any]) -> str | None:
        """What the batch object says of a batch that is not finished yet (its status, or
        how far it got; at most 64 characters), None when it is finished: what a watch and
        the batch runner decide by."""
        ...

    def batch_facts(self, batch: dict[str, Any]) -> BatchFacts:
        """A finished batch object's facts for its ``batch`` summary."""
        ...

    @classmethod
    def parse_callback(cls, event: dict[str, Any]) -> Callback | None:
        """A verified callback's JSON object as the fetch it asks for; None for an event
        nopoll does not take. Raises :class:`BadCallback` when the body is not one."""
        ...

    @classmethod
    def normalize(cls, body: dict[str, Any] | None) -> BodyFields:
        """A row's result body (as the provider gives it) read into what its envelope
        takes: text, tokens, model, incomplete reason."""
        ...

    def object_status(self, obj: dict[str, Any]) -> Any:
        """A provider object's own status, as the provider spells it (a key of
        :data:`~nopoll.status.FINAL` or :data:`~nopoll.status.UNFINISHED`, or anything
        else): where the object keeps it."""
        ...

    stable_chunks: ClassVar[bool]
    """Each numbered chunk holds the same rows on every run of a batch, so a resumed run
    skips the chunks every sink committed; False when the provider gives the rows in no
    stable order (a chunk number then names other rows next time): a resumed run rewrites
    the batch from its first row."""

    whole_file_record: ClassVar[str | None]
    """The record of the call that creates a ``submit --batch`` file's last batch, when
    one call does (a rerun that finds it recorded sends nothing and reads nothing); None
    when only reading the file tells how many batches it makes."""

    idempotent_creates: ClassVar[bool]
    """The provider documents that a create sent again with the same ``Idempotency-Key``
    is not done twice. False: a create whose answer was lost may have happened, and
    ``nopoll submit`` looks for it (:meth:`submit_group`, :meth:`group_ids`,
    :meth:`batches_like`) before it sends the create again."""

    async def submit_group(self, name: str) -> str | None:
        """A group at the provider that one submit's single creates are made in (so that a
        create whose answer was lost can be found: :meth:`group_ids`); None: none."""
        ...

    def in_group(self, body: dict[str, Any], group: str) -> dict[str, Any]:
        """A create body made in ``group``."""
        ...

    async def group_ids(self, group: str) -> set[str] | None:
        """Every id created in ``group``; None when the provider cannot say."""
        ...

    async def group_progress(self, group: str) -> str | None:
        """How the provider says ``group``'s requests stand, in words (its own counters);
        None when it keeps none."""
        ...

    async def batches_like(self, rows: int, since: float) -> list[str] | None:
        """The ids of the account's batches of ``rows`` requests created since ``since``
        (Unix time): where a batch create whose answer was lost would be; None when the
        provider cannot list them."""
        ...

    @classmethod
    def batch_input(cls, lines: Iterable[tuple[int, bytes]], dialect: str) -> BatchInput:
        """A ``submit --batch`` file's lines checked (``dialect``: the configured name, for
        messages) and kept in the shape the create calls send."""
        ...

    def create_calls(
        self, batch: BatchInput, name: str, digest: str, created: Mapping[str, str]
    ) -> Iterator[CreateCall]:
        """The POSTs that create the file's batches, in order; ``name`` is the file's,
        ``digest`` its hash; ``created`` holds the ids of the calls before (by record)."""
        ...


async def chunk_rows(
    lines: AsyncIterator[bytes], fetch: BatchFetch, parse: Any
) -> AsyncIterator[Chunk]:
    """Group JSONL lines into chunks (:class:`ChunkCut`); lines of skipped chunks are
    counted, not parsed."""
    cut = ChunkCut(fetch)
    index = 0
    chunk: list[BatchRow] = []
    async for line in lines:
        if cut.number >= fetch.skip_before:
            chunk.append(parse(index, line))
        index += 1
        if cut.add(len(line)):
            if chunk:
                fetch.last_chunk_bytes = cut.bytes
                yield cut.number, chunk
            chunk = []
            cut.next()
    if chunk:
        fetch.last_chunk_bytes = cut.bytes
        yield cut.number, chunk


PER_ROW_BYTES = 8 * 1024
"""What each row of a per-row dialect counts for against ``chunk_bytes`` (its size is known
only once fetched): a chunk holds at most ``chunk_bytes // PER_ROW_BYTES`` rows. A resumed
batch's chunks are cut by it again, so it is part of the stored bounds' meaning: never
change it."""


def id_chunks(ids: Iterable[str], fetch: BatchFetch) -> list[tuple[int, list[tuple[int, str]]]]:
    """Sorted custom_ids in numbered chunks of (row index, custom_id), skipped ones left out:
    ``chunk_size`` rows each, fewer when ``chunk_bytes`` is set (:data:`PER_ROW_BYTES`)."""
    ordered = sorted(ids)
    size = fetch.chunk_size
    if fetch.chunk_bytes > 0:
        size = max(1, min(size, fetch.chunk_bytes // PER_ROW_BYTES))
    out = []
    for start in range(fetch.skip_before * size, len(ordered), size):
        part = ordered[start : start + size]
        out.append((start // size, [(start + i, cid) for i, cid in enumerate(part)]))
    return out


def line_object(
    index: int,
    line: bytes,
    not_json: str = "not a JSON object",
    not_object: str = "not a JSON object",
) -> tuple[dict[str, Any], str | None] | BatchRow:
    """A results line as its JSON object and its ``custom_id`` (None unless a string); or,
    when the line is no JSON object, the failed row it is (``bad_line``, with the message
    the dialect gives)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return BatchRow(index, None, "failed", error={"code": "bad_line", "message": not_json})
    if not isinstance(data, dict):
        return BatchRow(index, None, "failed", error={"code": "bad_line", "message": not_object})
    custom_id = data.get("custom_id")
    return data, custom_id if isinstance(custom_id, str) else None


def loads_obj(value: Any) -> dict[str, Any] | None:
    """A JSON object given as an object or as a JSON string; None otherwise."""
    if isinstance(value, (str, bytes)):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def count_or_none(value: Any) -> int | None:
    """A token count as the body has it: an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def standard_callback(event: dict[str, Any]) -> Callback | None:
    """A Standard Webhooks callback of an OpenAI-style API: ``{"type": <event>, "data":
    {"id": ...}}``, the event one of a kind's ``callback_events``."""
    event_type = event.get("type")
    if not isinstance(event_type, str):
        raise BadCallback("body must be a JSON object with a string 'type'")
    kind = kind_of_event(event_type)
    if kind is None:
        return None
    data = event.get("data")
    object_id = data.get("id") if isinstance(data, dict) else None
    if not safe_id(object_id):
        raise BadCallback("data.id must match [A-Za-z0-9_.:-]{1,256}")
    assert isinstance(object_id, str)
    return Callback(event_type, kind, object_id)


class IdempotentCreates:
    """A provider whose create is sent again under the same ``Idempotency-Key`` when its
    answer was lost (Sail and Valar document that it then replays the first answer):
    nothing to look up."""

    idempotent_creates: ClassVar[bool] = True

    async def submit_group(self, name: str) -> str | None:
        return None

    def in_group(self, body: dict[str, Any], group: str) -> dict[str, Any]:
        return body

    async def group_ids(self, group: str) -> set[str] | None:
        return None

    async def group_progress(self, group: str) -> str | None:
        return None

    async def batches_like(self, rows: int, since: float) -> list[str] | None:
        return None


class ResponsesDialect(IdempotentCreates):
    """Single responses: ``GET {base_url}/responses/{id}``, the same for every dialect; and
    ``POST {base_url}/batches`` with the requests inline, as Sail and Valar take it (``{"endpoint",
    "label", "requests": [{"custom_id", "params": body}]}``)."""

    row_limit: ClassVar[int] = 100_000
    """Rows per batch the provider documents (or accepts)."""
    request_part: ClassVar[str] = "params"
    """Where a request's body goes in an item of ``requests``."""
    whole_file_record: ClassVar[str | None] = "batch"
    stable_chunks: ClassVar[bool] = True

    def __init__(self, client: ProviderClient) -> None:
        self.client = client

    async def fetch_response(
        self, response_id: str, *, wait_s: float | None = None
    ) -> dict[str, Any]:
        if not safe_id(response_id):
            raise ProviderError("unsafe response id", provider=self.client.name, path="responses/?")
        # One request per job try: the fetch job's own retries are this request's retries
        # (retrying here too would multiply them; docs/reliability.md has the bound).
        data = await self.client.get_json(f"responses/{response_id}", attempts=1, wait_s=wait_s)
        if data.get("id") != response_id:
            raise ProviderError(
                "answer is for another response id",
                provider=self.client.name,
                path=f"responses/{response_id}",
                status=200,
            )
        return data

    async def fetch_batch_object(
        self, batch_id: str, *, attempts: int | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        """``GET {base_url}/batches/{id}`` (after checking the id is safe), tried up to
        ``attempts`` times (default ``http.attempts``), each waiting at most ``wait_s`` for
        its slot of the account's budget."""
        if not safe_id(batch_id):
            raise ProviderError("unsafe batch id", provider=self.client.name, path="batches/?")
        return await self.client.get_json(f"batches/{batch_id}", attempts=attempts, wait_s=wait_s)

    def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        raise NotImplementedError

    @classmethod
    def parse_callback(cls, event: dict[str, Any]) -> Callback | None:
        return standard_callback(event)

    @classmethod
    def normalize(cls, body: dict[str, Any] | None) -> BodyFields:
        """A Responses object, or a chat completion (:func:`~nopoll.envelope.body_fields`)."""
        return body_fields(body)

    def object_status(self, obj: dict[str, Any]) -> Any:
        """Its ``status``."""
        return obj.get("status")

    def batch_pending(self, batch: dict[str, Any]) -> str | None:
        """By the object's own ``status`` (OpenAI's and sference's batch objects have one)."""
        return pending_status(self.object_status(batch), "batch")

    def batch_facts(self, batch: dict[str, Any]) -> BatchFacts:
        return BatchFacts.of(batch)

    @classmethod
    def batch_input(cls, lines: Iterable[tuple[int, bytes]], dialect: str) -> BatchInput:
        return check_lines(lines, dialect, cls.row_limit, cls._add_row, cls.row_rule)

    @classmethod
    def row_rule(cls, row: dict[str, Any]) -> str | None:
        """Why the provider would refuse this ``submit --batch`` line (the common checks
        passed), or None: none beyond them here."""
        return None

    @classmethod
    def _add_row(cls, batch: BatchInput, row: dict[str, Any]) -> None:
        item = orjson.dumps({"custom_id": row["custom_id"], cls.request_part: row["body"]})
        batch.requests += (b"," if batch.rows > 1 else b"") + item

    def _batch_head(self, batch: BatchInput, name: str, digest: str) -> bytes:
        """The create body up to the ``requests`` array's items: its ``endpoint`` and a
        ``label`` naming the file (:func:`batch_label`)."""
        label = orjson.dumps(batch_label(name, digest))
        endpoint = orjson.dumps(batch.endpoint)
        return b'{"endpoint":' + endpoint + b',"label":' + label + b',"requests":['

    def create_calls(
        self, batch: BatchInput, name: str, digest: str, created: Mapping[str, str]
    ) -> Iterator[CreateCall]:
        content = self._batch_head(batch, name, digest) + bytes(batch.requests) + b"]}"
        yield CreateCall("batch", "batches", content)


class RequestStatusDialect(ResponsesDialect):
    """Batches whose object tracks each request in ``request_status`` (``{custom_id:
    {"status": "COMPLETED" | "FAILED" | "CANCELLED" | "RUNNING" | ...}}``) beside
    ``request_counts``, as Sail's and Valar's published references have them: an integer,
    the number of requests, and no batch ``status`` at all. (Sail's requests-at-scale guide
    shows an older shape with a ``status`` and a counts object; both are read.)

    A batch is finished when it has a final ``status``, or, without one, when the entries of
    ``request_status`` that settled (completed, failed or cancelled) number its requests:
    an empty or partial map is never finished."""

    @classmethod
    def row_rule(cls, row: dict[str, Any]) -> str | None:
        return request_status_rule(row)

    def batch_pending(self, batch: dict[str, Any]) -> str | None:
        if isinstance(batch.get("status"), str):
            return pending_status(batch["status"], "batch")
        total, settled = settled_requests(batch)
        done = sum(settled.values())
        if total is None:
            return "no request count"
        if total < 1 or done < total:
            return f"{done} of {total} requests settled"
        return None

    def batch_facts(self, batch: dict[str, Any]) -> BatchFacts:
        total, settled = settled_requests(batch)
        if isinstance(batch.get("status"), str):
            facts = BatchFacts.of(batch)
            if facts.request_counts or total is None:
                return facts
            return BatchFacts(status=facts.status, request_counts={"total": total, **settled})
        # Every request settled: the batch ran to its end, even with failed rows; a batch all
        # of whose requests were cancelled was cancelled.
        cancelled = bool(settled) and set(settled) == {"cancelled"}
        counts = {"total": total, **settled} if total is not None else dict(settled)
        label = batch.get("label")
        return BatchFacts(
            status="cancelled" if cancelled else "completed",
            request_counts=counts,
            metadata={"label": label} if isinstance(label, str) else {},
        )


LABEL = re.compile(r"[a-zA-Z0-9_-]{1,128}")
"""A batch ``label`` as Sail and Valar take it."""
_NOT_LABEL = re.compile(r"[^a-zA-Z0-9_-]+")


def batch_label(name: str, digest: str) -> str:
    """``nopoll-<file name>-<12 hex of its hash>``, the name's other characters as ``_``
    and cut so that the whole fits :data:`LABEL`."""
    stem = _NOT_LABEL.sub("_", name).strip("_")[:100] or "batch"
    return f"nopoll-{stem}-{digest[:12]}"


BATCH_CUSTOM_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
"""A batch request's ``custom_id`` as Sail and Valar take it: lower-case letters, digits,
``_`` and ``-``, starting with a letter or digit, 1 to 64 characters."""
_RESPONSES = "/v1/responses"
_NOT_IN_BATCHES = ("asap", "priority")


def request_status_rule(row: dict[str, Any]) -> str | None:
    """Sail's and Valar's refusals of a batch request (their ``CreateBatchRequest``):
    the ``custom_id`` pattern, the one endpoint, ``metadata`` values that are strings, and
    no ``asap``/``priority`` completion window in a batch."""
    custom_id = row["custom_id"]
    if not BATCH_CUSTOM_ID.fullmatch(custom_id):
        return (
            f"custom_id: {custom_id[:80]!r} does not match ^[a-z0-9][a-z0-9_-]*$ "
            "(1 to 64 lower-case letters, digits, _ or -, starting with a letter or digit)"
        )
    if row["url"] != _RESPONSES:
        return f"url: {row['url'][:80]}, but batches here take {_RESPONSES} only"
    metadata = row["body"].get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            return "body.metadata: must be an object of strings"
        for key, value in metadata.items():
            if not isinstance(value, str):
                return f"body.metadata.{str(key)[:40]}: must be a string"
        if metadata.get("completion_window") in _NOT_IN_BATCHES:
            window = metadata["completion_window"]
            return f"body.metadata.completion_window: {window} is not available for batches"
    return None


def settled_requests(batch: dict[str, Any]) -> tuple[int | None, Counter[str]]:
    """The batch's request count (``request_counts`` as an integer, or its ``total``) and
    the entries of ``request_status`` that settled, by nopoll's status."""
    counts = batch.get("request_counts")
    total = counts.get("total") if isinstance(counts, dict) else counts
    if not isinstance(total, int) or isinstance(total, bool):
        total = None
    settled: Counter[str] = Counter()
    entries = batch.get("request_status")
    if isinstance(entries, dict):
        for info in entries.values():
            raw = info.get("status") if isinstance(info, dict) else info
            status = FINAL.get(raw.lower()) if isinstance(raw, str) else None
            if status is not None:
                settled[status] += 1
    return total, settled


def _row_status(info: Any) -> tuple[str, dict[str, str] | None]:
    raw = info.get("status") if isinstance(info, dict) else info
    return row_status(raw), unknown_status(raw)


async def rows_by_custom_id(dialect: ResponsesDialect, fetch: BatchFetch) -> AsyncIterator[Chunk]:
    """Walk the batch object's ``request_status``: ``GET /batches/{id}/{custom_id}`` for every
    completed row under bounded concurrency (two chunks in flight, at most
    ``max_concurrency`` GETs, fewer when the account's budget lets fewer through in a few
    seconds), the rest recorded with their status. Each GET waits for its slot of the
    account's budget: a 1,000-row Valar batch at its 60 a minute takes some 18 minutes.
    Chunks are cut by row count (:func:`id_chunks`): a row's size is known once it is
    fetched, and a resumed run fetches no skipped row."""
    client = dialect.client
    request_status = fetch.batch.get("request_status") or {}
    if not isinstance(request_status, dict):
        raise ProviderError(
            "request_status is not an object",
            provider=client.name,
            path=f"batches/{fetch.batch_id}",
            status=200,
        )
    concurrency = client.useful_concurrency(client.config.max_concurrency)
    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int, custom_id: str) -> BatchRow:
        status, error = _row_status(request_status[custom_id])
        if status != "completed":
            return BatchRow(index, custom_id, status, error=error)
        if not safe_id(custom_id):
            return BatchRow(
                index,
                custom_id,
                "failed",
                error={"code": "unsafe_custom_id", "message": "not fetched: unsafe id"},
            )
        async with semaphore:
            body = await client.get_json(f"batches/{fetch.batch_id}/{custom_id}")
        return BatchRow(index, custom_id, "completed", body=body)

    async def gather(rows: list[tuple[int, str]]) -> list[BatchRow]:
        return list(await asyncio.gather(*(one(i, cid) for i, cid in rows)))

    pending: deque[tuple[int, asyncio.Task[list[BatchRow]]]] = deque()
    try:
        for number, rows in id_chunks(request_status, fetch):
            pending.append((number, asyncio.create_task(gather(rows))))
            if len(pending) >= 2:
                number_done, task = pending.popleft()
                fetch.last_chunk_bytes = 0  # not known: the rows came one GET each
                yield number_done, await task
        while pending:
            number_done, task = pending.popleft()
            fetch.last_chunk_bytes = 0
            yield number_done, await task
    finally:
        for _, task in pending:
            task.cancel()
        await asyncio.gather(*(t for _, t in pending), return_exceptions=True)
