"""The hot path's incoming wire: the webhook request (the Redis round trip going out is
:mod:`receiver.queue.trips`).

Read here, within bounds: the Standard Webhooks headers (repeated ones included), a body
that must arrive whole within a deadline, and an early answer (413, 404, ...) that stays
readable, the rest of the body drained before the connection closes. :func:`read_body`
reads every body: a callback's, and every other route's through :class:`BoundedBodies`.

See docs/security.md (hostile bodies and slow senders) and docs/http.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "BoundedBodies",
    "ReadDeadlines",
    "Reply",
    "Then",
    "answer_and_close",
    "callback_headers",
    "drain_body",
    "read_body",
]

_CONTENT_TYPE = (b"content-type", b"application/json")
_CLOSE = (b"connection", b"close")
_SIGNATURE = "webhook-signature"
_WANTED = {
    b"webhook-id": "webhook-id",
    b"webhook-timestamp": "webhook-timestamp",
    b"webhook-signature": _SIGNATURE,
}
# After an early answer, at most this much of the rest of the body is read and dropped,
# for at most this long; then the connection is closed, under the client if need be.
_DRAIN_BYTES = 32 * 1024 * 1024
_DRAIN_SECONDS = 2.0


class Then(enum.Enum):
    """What happens to the connection after an answer."""

    KEEP_ALIVE = enum.auto()
    """The whole request was read: the connection can serve the next one."""
    DRAIN_AND_CLOSE = enum.auto()
    """The client may still be sending: answer, drop the rest of the body (bounded), close."""
    CLOSE = enum.auto()
    """Answer and close at once (a sender too slow to wait for)."""


class Reply(Exception):
    """Ends a request early with a status and a JSON body."""

    def __init__(
        self,
        status: int,
        payload: dict[str, Any],
        outcome: str | None = None,
        then: Then = Then.KEEP_ALIVE,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.status, self.payload, self.outcome = status, payload, outcome or str(status)
        self.then = then
        self.headers = headers or []


class ReadDeadlines:
    """Cancels a body read that outlives its deadline, with one timer for all reads.

    Every read gets the same time, so the oldest read has the earliest deadline: reads are
    kept in start order and one timer, set for the oldest, walks them. A timer per request
    (``asyncio.timeout``) would cost about a third of the route's own CPU time.
    """

    __slots__ = ("_expired", "_reads", "_timer", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._reads: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def start(self, task: asyncio.Task[Any]) -> None:
        loop = task.get_loop()
        deadline = loop.time() + self.timeout_s
        self._reads[task] = deadline
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire, loop)

    def stop(self, task: asyncio.Task[Any]) -> None:
        self._reads.pop(task, None)

    def expired(self, task: asyncio.Task[Any]) -> bool:
        """True when ``task`` was cancelled for its deadline (and by nobody else)."""
        if task not in self._expired:
            return False
        self._expired.discard(task)
        return task.uncancel() == 0

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time() + 0.001  # a timer may fire a little early
        while self._reads:
            task = next(iter(self._reads))
            deadline = self._reads[task]
            if deadline > now:
                self._timer = loop.call_at(deadline, self._expire, loop)
                return
            del self._reads[task]
            self._expired.add(task)
            task.cancel()


def callback_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[dict[str, str], bytes | None]:
    """The Standard Webhooks headers and the declared content-length.

    Every ``webhook-signature`` copy is a candidate (joined by spaces, so the verifier's
    MAX_SIGNATURES counts them all); a ``webhook-id`` or ``webhook-timestamp`` repeated
    with another value is a 400: which one was signed cannot be known.
    """
    headers: dict[str, str] = {}
    signatures: list[str] | None = None
    declared: bytes | None = None
    for name, value in raw:
        key = _WANTED.get(name)
        if key is None:
            if name == b"content-length":
                declared = value
            continue
        text = value.decode("latin-1")
        seen = headers.get(key)
        if seen is None:
            headers[key] = text
        elif key == _SIGNATURE:
            if signatures is None:
                signatures = [seen]
            signatures.append(text)
        elif text != seen:
            error = f"repeated {key} headers have different values"
            raise Reply(400, {"error": error}, then=Then.DRAIN_AND_CLOSE)
    if signatures is not None:
        headers[_SIGNATURE] = " ".join(signatures)
    return headers, declared


async def answer_and_close(reply: Reply, receive: Receive, send: Send) -> None:
    """Answer, then (for DRAIN_AND_CLOSE) read and drop the rest of the body before closing.

    A client that writes its whole body before reading (aiohttp) would otherwise get a
    connection reset instead of the answer: closing a socket with unread data resets it.
    The answer goes out first, complete (content-length), for clients that read early
    (curl, httpx); the response ends, and the connection closes, once the body is in or
    the drain bound is reached.
    """
    body = orjson.dumps(reply.payload)
    headers = [_CONTENT_TYPE, (b"content-length", b"%d" % len(body)), _CLOSE, *reply.headers]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    if reply.then is Then.CLOSE:
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await drain_body(receive)
    await send({"type": "http.response.body", "body": b""})


async def drain_body(receive: Receive) -> None:
    """Read and drop the rest of a request body, at most 32 MiB or 2 s."""
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_DRAIN_SECONDS):
            while dropped <= _DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
                dropped += len(message.get("body", b""))


async def read_body(
    receive: Receive, declared: bytes | None, limit: int, too_large: str, deadlines: ReadDeadlines
) -> bytes:
    """The whole request body, or the :class:`Reply` that ends the request: 413
    (``too_large``) for a declared Content-Length over ``limit`` before anything is read,
    or for the count passing it as the body arrives; 408 once it has not arrived whole
    within ``deadlines.timeout_s``; 400 when the client leaves first. Every body nopoll
    reads is read here: a callback's, and every other route's through :class:`BoundedBodies`.
    """
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Reply(413, {"error": too_large}, then=Then.DRAIN_AND_CLOSE)
    chunks: list[bytes] = []
    size = 0
    task = asyncio.current_task()
    assert task is not None
    deadlines.start(task)
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                reason = "client disconnected before sending the whole body"
                raise Reply(400, {"error": reason})
            chunk: bytes = message.get("body", b"")
            more: bool = message.get("more_body", False)
            size += len(chunk)
            if size > limit:
                then = Then.DRAIN_AND_CLOSE if more else Then.KEEP_ALIVE
                raise Reply(413, {"error": too_large}, then=then)
            if not more:
                if not chunks:
                    return chunk
                chunks.append(chunk)
                return b"".join(chunks)
            chunks.append(chunk)
    except asyncio.CancelledError:
        if not deadlines.expired(task):
            raise
        reason = f"body did not arrive whole within {deadlines.timeout_s:g} s"
        raise Reply(408, {"error": reason}, then=Then.CLOSE) from None
    finally:
        deadlines.stop(task)


class _Untimed(ReadDeadlines):
    """No deadline: for a read made outside the request's own task (a GET's watcher that
    waits for the client to go away)."""

    __slots__ = ()

    def start(self, task: asyncio.Task[Any]) -> None:
        pass

    def expired(self, task: asyncio.Task[Any]) -> bool:
        return False


_UNTIMED = _Untimed(0.0)


class BoundedBodies:
    """ASGI middleware for every route but the webhooks': the request body, read by
    :func:`read_body` as a callback's is, within the same bounds.

    - At the app's first read, the whole body is read and handed to the app as one
      message: a declared ``Content-Length`` over the path's cap is 413 at once, and so is
      the count passing the cap, Content-Length or not.
    - Due whole within ``deadlines.timeout_s`` of the app's first read, else 408 and the
      connection closes.
    - An answer the app gives before reading the body (a 404, 405 or 401, say) is held
      open while the rest is read and dropped (bounded), so the client reads it instead
      of a connection reset.

    The bounds apply only once the app reads: a route that answers first (a wrong token)
    never makes a client's body be read, and a GET that waits for the client to go away
    is not timed. A refusal is raised from ``receive`` and ends the app's request; what
    the app (or Starlette's error handler) sends after it is dropped. A client that leaves
    mid-body is passed on to the app as the disconnect it is.
    """

    def __init__(
        self, app: ASGIApp, cap_for: Callable[[str], int], deadlines: ReadDeadlines
    ) -> None:
        self.app, self._cap_for, self._deadlines = app, cap_for, deadlines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self._cap_for(scope["path"])
        task = asyncio.current_task()
        assert task is not None
        deadlines = self._deadlines
        reading = read_all = answered = False
        refusal: Reply | None = None

        async def bounded() -> Message:
            nonlocal reading, read_all, refusal
            if reading:  # the body is in: what follows is the client going away
                return await receive()
            reading = True
            timed = deadlines if asyncio.current_task() is task else _UNTIMED
            declared = _declared(scope["headers"])
            try:
                body = await read_body(receive, declared, cap, _too_large(cap), timed)
            except Reply as reply:
                if reply.status == 400:  # the client left: the app sees it leave
                    return {"type": "http.disconnect"}
                if reply.then is Then.KEEP_ALIVE:  # the app's request ends here, and so
                    reply.then = Then.CLOSE  # does the connection
                refusal = reply
                raise
            read_all = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def holding(message: Message) -> None:
            nonlocal answered
            if refusal is not None:
                return  # the app's (or Starlette's 500) answer to a refused body: ours goes
            if message["type"] == "http.response.start":
                answered = True
                deadlines.stop(task)
            ends = message["type"] == "http.response.body" and not message.get("more_body")
            if ends and not read_all:
                await send({**message, "more_body": True})
                await drain_body(receive)
                await send({"type": "http.response.body", "body": b""})
                return
            await send(message)

        try:
            await self.app(scope, bounded, holding)
        except Reply as raised:
            if raised is not refusal:
                raise
        except asyncio.CancelledError:
            if not deadlines.expired(task):
                raise
            reason = f"body did not arrive whole within {deadlines.timeout_s:g} s"
            refusal = Reply(408, {"error": reason}, then=Then.CLOSE)
        finally:
            deadlines.stop(task)
        if refusal is not None and not answered:
            await answer_and_close(refusal, receive, send)


def _declared(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The declared Content-Length, if any (uvicorn refuses a malformed one)."""
    for name, value in headers:
        if name == b"content-length":
            return value
    return None


def _too_large(cap: int) -> str:
    return f"body: larger than {cap} bytes"
