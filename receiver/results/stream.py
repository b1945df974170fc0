"""``GET /v1/results/stream``: Server-Sent Events of every landed envelope, resumable.

One reader per API process (:class:`StreamHub`) reads :data:`sinks.results.STREAM` with
``XREAD BLOCK`` while anyone is subscribed and hands each entry, encoded once, to the
subscribers whose filter matches. A subscriber more than :data:`MAILBOX_LIMIT` events or
:data:`MAILBOX_BYTES` behind catches up from Redis; one that stops reading is
disconnected after ``send_timeout``. Resuming after ``Last-Event-ID`` has no gap and no
duplicate, and starts with ``event: reset`` when entries after it were trimmed
(:func:`resume_point`).

See docs/consumers.md (every result as it lands).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sse_starlette import EventSourceResponse
from starlette.types import Message, Receive, Scope, Send

from receiver.backoff import Backoff
from receiver.redis.link import RedisLink
from sinks.results import LAST_ID, STREAM, TENANT_SUFFIX

__all__ = [
    "ALL",
    "MAILBOX_BYTES",
    "MAILBOX_LIMIT",
    "WRITE_BYTES",
    "EventStream",
    "Filter",
    "SendStuck",
    "Source",
    "StreamHub",
    "Subscriber",
    "events",
    "last_id",
    "parse_id",
    "reset_event",
    "resume_point",
    "whole",
]

log = logging.getLogger("nopoll.results")

StreamId = tuple[int, int]
T = TypeVar("T")
MAILBOX_LIMIT = 5_000
"""Events a subscriber may be behind the live stream before it catches up from Redis."""
MAILBOX_BYTES = 1 << 20
"""... and bytes of events (events are shared by the subscribers they go to)."""
WRITE_BYTES = 128 << 10
"""About the most one write to a client carries, and one catch-up page read from Redis
(an envelope larger than this goes alone)."""
_FIRST_PAGE = 4
"""Entries of the first catch-up page; the next ones are sized to WRITE_BYTES."""
_READ_COUNT = 1000
_BLOCK_MS = 1000
_PAGE = 500
_ATTACH_S = 10.0
_SEND_GAP_S = 0.01
"""At most one write per subscriber in this long: a burst is batched, not sent event by
event (a write costs the server far more than its bytes)."""
_ID = re.compile(r"(\d{1,20})(?:-(\d{1,20}))?")
_ZERO: StreamId = (0, 0)


def whole(command: Awaitable[T]) -> Awaitable[T]:
    """``command``, run to its end even when the caller is cancelled (its client went
    away): a Redis command cut off halfway can leave its pooled connection out of step,
    and the next user of the connection reads a stale reply."""
    task = asyncio.ensure_future(command)
    task.add_done_callback(_retrieved)
    return asyncio.shield(task)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # nobody may wait for it any more: no "never retrieved" warning


def parse_id(text: str | bytes) -> StreamId | None:
    """A stream entry id (``1700000000000-3``, or ``1700000000000`` for ``-0``), or None."""
    raw = text.decode() if isinstance(text, bytes) else text
    m = _ID.fullmatch(raw.strip())
    if m is None:
        return None
    ms, seq = int(m.group(1)), int(m.group(2) or 0)
    return (ms, seq) if ms < 2**64 and seq < 2**64 else None


def _text(sid: StreamId) -> str:
    return f"{sid[0]}-{sid[1]}"


@dataclass(frozen=True, slots=True)
class Filter:
    """Which entries a subscriber gets: each field's allowed values, or None for any."""

    tenant: frozenset[bytes] | None = None
    provider: frozenset[bytes] | None = None
    kind: frozenset[bytes] | None = None
    status: frozenset[bytes] | None = None

    def matches(self, fields: dict[bytes, bytes]) -> bool:
        return (
            (self.tenant is None or fields.get(b"tenant") in self.tenant)
            and (self.provider is None or fields.get(b"provider") in self.provider)
            and (self.kind is None or fields.get(b"kind") in self.kind)
            and (self.status is None or fields.get(b"status") in self.status)
        )


@dataclass(frozen=True, slots=True)
class Source:
    """The Redis stream a subscriber catches up from, and the key of its newest id."""

    stream: str = STREAM
    last: str = LAST_ID

    @classmethod
    def of(cls, filter_: Filter) -> Source:
        """A filter on one tenant but ``default`` reads that tenant's own stream (the same
        entries under the same ids, none of the others'); any other reads them all."""
        tenants = filter_.tenant
        if tenants is None or len(tenants) != 1:
            return ALL
        [tenant] = tenants
        if tenant == b"default":
            return ALL
        name = TENANT_SUFFIX + tenant.decode()
        return cls(STREAM + name, LAST_ID + name)


ALL = Source()
"""Every tenant's entries (:data:`sinks.results.STREAM`)."""


def _event(raw_id: bytes, fields: dict[bytes, bytes]) -> bytes:
    """The SSE event of a stream entry: ``result`` with the envelope, or ``result-ref``
    with where to read a large one (:func:`sinks.results.reference`)."""
    ref = fields.get(b"ref")
    if ref is not None:
        return b"id: %s\nevent: result-ref\ndata: %s\n\n" % (raw_id, ref)
    return b"id: %s\nevent: result\ndata: %s\n\n" % (raw_id, fields.get(b"envelope", b"null"))


class Subscriber:
    """One stream client: its filter, the last entry it was sent (or skipped), its
    mailbox, and whether it fell behind."""

    __slots__ = ("filter", "lagging", "mailbox", "mailbox_bytes", "position", "wake")

    def __init__(self, filter_: Filter, position: StreamId) -> None:
        self.filter = filter_
        self.position = position
        self.mailbox: list[tuple[StreamId, bytes]] = []
        self.mailbox_bytes = 0
        self.lagging = False
        self.wake = asyncio.Event()

    def post(self, sid: StreamId, event: bytes) -> None:
        self.mailbox.append((sid, event))
        self.mailbox_bytes += len(event)

    def clear(self) -> None:
        self.mailbox.clear()
        self.mailbox_bytes = 0

    def take(self) -> list[tuple[StreamId, bytes]]:
        """The oldest events of the mailbox, about :data:`WRITE_BYTES` of them (at least
        one); the rest stay, and ``wake`` stays set for them."""
        size, taken = 0, 0
        for _sid, event in self.mailbox:
            taken += 1
            size += len(event)
            if size >= WRITE_BYTES:
                break
        batch = self.mailbox[:taken]
        del self.mailbox[:taken]
        self.mailbox_bytes -= size
        if self.mailbox:
            self.wake.set()
        return batch


class StreamHub:
    """The process's one reader of the stream, fanning entries out to subscribers."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._groups: dict[Filter, set[Subscriber]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._link = RedisLink("results API (stream)")

    @property
    def subscribers(self) -> int:
        return sum(len(g) for g in self._groups.values())

    async def attach(self, sub: Subscriber) -> None:
        """Start delivering live entries to ``sub`` (the reader starts if needed); returns
        once the reader knows where it reads from, so that a catch-up after this point
        leaves no gap."""
        self._groups.setdefault(sub.filter, set()).add(sub)
        if self._task is None:
            self._ready = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="results API: stream reader")
        await self._ready.wait()

    def detach(self, sub: Subscriber) -> None:
        group = self._groups.get(sub.filter)
        if group is not None:
            group.discard(sub)
            if not group:
                del self._groups[sub.filter]
        # the reader stops by itself after its current read (at most _BLOCK_MS): cancelled
        # halfway, a command can leave its pooled connection out of step

    async def _run(self) -> None:
        backoff, attempt = Backoff(0.1, 5.0), 0
        position: bytes | None = None
        while True:
            if not self._groups:  # nobody left: stop (attach starts a new reader)
                self._task = None
                return
            try:
                if position is None:
                    position = (await last_id(self._redis)).encode()
                    self._ready.set()
                reply = await self._redis.xread(
                    {STREAM: position}, count=_READ_COUNT, block=_BLOCK_MS
                )
            except (RedisError, OSError) as exc:
                if not self._groups:  # nobody waits for it (the client may be closing)
                    continue
                self._link.lost(exc)
                attempt += 1
                await asyncio.sleep(backoff.delay(attempt))
                continue
            attempt = 0
            self._link.back()
            for _stream, entries in reply or ():
                if entries:
                    self._dispatch(entries)
                    position = entries[-1][0]

    def _dispatch(self, entries: Iterable[tuple[bytes, dict[bytes, bytes]]]) -> None:
        touched: set[Subscriber] = set()
        for raw_id, fields in entries:
            sid = parse_id(raw_id)
            if sid is None:  # pragma: no cover - Redis makes the ids
                continue
            event: bytes | None = None
            for filter_, group in self._groups.items():
                if not filter_.matches(fields):
                    continue
                event = event or _event(raw_id, fields)
                for sub in group:
                    if not sub.lagging:
                        sub.post(sid, event)
                        touched.add(sub)
        for sub in touched:
            if len(sub.mailbox) > MAILBOX_LIMIT or sub.mailbox_bytes > MAILBOX_BYTES:
                sub.lagging = True  # it catches up from Redis instead
                sub.clear()
            sub.wake.set()


async def last_id(redis: Redis, source: Source = ALL) -> str:
    """The id of the newest entry ever added to ``source`` (``0-0`` when there was none)."""
    value = await whole(redis.get(source.last))
    if value is not None:
        return str(value.decode())
    newest = await whole(redis.xrevrange(source.stream, "+", "-", count=1))
    return str(newest[0][0].decode()) if newest else "0-0"


async def resume_point(
    redis: Redis, after: StreamId, source: Source = ALL
) -> tuple[StreamId, dict[str, Any] | None]:
    """Where a reader of ``source`` that has seen everything up to ``after`` goes on from,
    and, when entries it has not seen were trimmed (or ``after`` is newer than anything
    the stream ever had: Redis lost its data), the ``reset`` event's data.

    The newest trimmed entry is the oldest retained one's ``prev`` field, or the source's
    last id when trimming emptied it; it is newer than ``after`` exactly when something
    after ``after`` is gone. Ids are shared by every source, so ``after`` is unknown only
    when it is newer than the whole stream's newest."""
    newest = parse_id(await last_id(redis)) or _ZERO
    # read before the oldest entry, as the whole stream's: an entry added in between is
    # then in the range read, never taken for a trimmed one
    own = newest if source == ALL else parse_id(await last_id(redis, source)) or _ZERO
    oldest = await whole(redis.xrange(source.stream, "-", "+", count=1))
    oldest_id = parse_id(oldest[0][0]) if oldest else None
    if after > newest:
        gone = _ZERO  # go on from the oldest retained entry
        reason = "unknown_id"
    else:
        if oldest_id is None:
            trimmed = own
        else:
            trimmed = parse_id(oldest[0][1].get(b"prev", b"")) or _ZERO
            trimmed = min(trimmed, oldest_id)
        if trimmed <= after:
            return after, None
        gone, reason = trimmed, "trimmed"
    data = {
        "reason": reason,
        "last_event_id": _text(after),
        "resume_after": _text(gone),
        "oldest_retained_id": _text(oldest_id) if oldest_id is not None else None,
        "message": (
            "entries after last_event_id are no longer kept (results.stream_max_entries, "
            "results.stream_retention_s); the stream goes on after resume_after"
            if reason == "trimmed"
            else "last_event_id is newer than any entry this stream has; it goes on from "
            "its oldest retained entry"
        ),
    }
    return gone, data


class SendStuck(Exception):
    """A client took no data for ``send_timeout_s``: its connection is dropped."""


class EventStream(EventSourceResponse):
    """sse-starlette's response with a cheaper guard against clients that stop reading.

    Instead of a timeout around every send (``send_timeout``: a cancel scope per write, a
    large share of the server's CPU at thousands of writes a second), one watchdog per
    connection looks every few seconds whether a send has been waiting longer than
    ``send_timeout_s``, and if so fails the response, which closes the connection."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        send_timeout_s: float,
        on_close: Callable[[], None] | None = None,
        **kw: Any,
    ):
        super().__init__(content, **kw)
        self._stuck_after_s = send_timeout_s
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        sending_since: list[float] = []

        async def guarded_send(message: Message) -> None:
            sending_since.append(loop.time())
            try:
                await send(message)
            finally:
                sending_since.pop()

        async def watchdog() -> None:
            while True:
                await anyio.sleep(min(5.0, self._stuck_after_s / 2))
                if sending_since and loop.time() - sending_since[0] > self._stuck_after_s:
                    raise SendStuck(f"a send waited over {self._stuck_after_s:g} s")

        self.data_sender_callable = watchdog
        try:
            await super().__call__(scope, receive, guarded_send)
        except* SendStuck:
            client = scope.get("client")
            log.warning(
                "results stream: dropped %s, which took no data for %g s",
                client[0] if client else "a client",
                self._stuck_after_s,
            )
        finally:
            if self._on_close is not None:
                self._on_close()


def reset_event(data: dict[str, Any]) -> bytes:
    return b"event: reset\ndata: " + orjson.dumps(data) + b"\n\n"


async def _catch_up(redis: Redis, sub: Subscriber) -> AsyncIterator[bytes]:
    """Every matching entry after ``sub.position`` up to the stream's end, a page of about
    :data:`WRITE_BYTES` at a time (the reset event first if some of them were trimmed),
    moving the position; read from the subscriber's tenant's own stream when it has one
    (:class:`Source`)."""
    source = Source.of(sub.filter)
    sub.position, reset = await resume_point(redis, sub.position, source)
    if reset is not None:
        yield reset_event(reset)
    count = _FIRST_PAGE
    while True:
        after = f"({_text(sub.position)}"
        page = await whole(redis.xrange(source.stream, after, "+", count=count))
        if not page:
            return
        chunk = b"".join(_event(raw, f) for raw, f in page if sub.filter.matches(f))
        sub.position = parse_id(page[-1][0]) or sub.position
        last = len(page) < count
        size = sum(len(f.get(b"envelope") or f.get(b"ref") or b"") for _, f in page) or 1
        count = max(1, min(_PAGE, WRITE_BYTES * len(page) // size))
        del page  # not held while the client takes the chunk
        if chunk:
            yield chunk
        if last:
            return


async def events(hub: StreamHub, redis: Redis, sub: Subscriber) -> AsyncIterator[bytes]:
    """The SSE body of one subscriber: attach it to ``hub``, send the entries after its
    position from Redis, then live ones (several events per chunk when they come fast),
    each only if newer than the last one sent; detach it when the body ends."""
    loop = asyncio.get_running_loop()
    sent_at = 0.0
    try:
        async with asyncio.timeout(_ATTACH_S):
            await hub.attach(sub)
        catch_up = True
        while True:
            if catch_up or sub.lagging:
                sub.lagging = False
                sub.clear()  # what it held is read again from Redis
                async for chunk in _catch_up(redis, sub):
                    yield chunk
                catch_up = False
            await sub.wake.wait()
            # A burst goes out in one write per _SEND_GAP_S; a lone event at once.
            gap = sent_at + _SEND_GAP_S - loop.time()
            if gap > 0:
                await asyncio.sleep(gap)
            sub.wake.clear()
            if sub.lagging:
                continue
            batch = sub.take()
            fresh = [event for sid, event in batch if sid > sub.position]
            if batch:
                sub.position = max(sub.position, batch[-1][0])
            if fresh:
                sent_at = loop.time()
                yield b"".join(fresh)
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("results stream: Redis failed (%s)", type(exc).__name__)
        error = {"error": "Redis unreachable; reconnect with Last-Event-ID"}
        yield b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"
    finally:
        hub.detach(sub)
