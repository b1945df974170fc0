"""A small async client of nopoll's results API (``/v1``), over httpx.

::

    async with Results("https://nopoll.example.com", token) as results:
        env = await results.get("openai", "resp_123")              # None: not landed
        env = await results.wait("openai", "resp_123", timeout=30)  # None: not in 30 s
        async for env in results.stream(tenant="team-a"):
            handle(env)

:meth:`Results.stream` reconnects by itself with ``Last-Event-ID``; when entries it had
not seen were trimmed, iterating raises :class:`StreamReset`, and iterating again goes
on after the gap.

See docs/consumers.md (the Python client).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import httpx
import orjson
from httpx_sse import aconnect_sse

from nopoll.envelope import Envelope
from nopoll.exceptions import NopollError

__all__ = ["ResultStream", "Results", "ResultsError", "StreamReset"]


class ResultsError(NopollError):
    """The results API refused a request or could not be reached (``status`` is the HTTP
    status, None when there was no answer)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StreamReset(ResultsError):
    """Entries after the stream's ``last_event_id`` were trimmed before they were read:
    results may have been missed. ``resume_after`` is where the stream goes on."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(str(data.get("message") or "stream entries were trimmed"))
        self.reason: str = str(data.get("reason") or "trimmed")
        self.last_event_id: str | None = data.get("last_event_id")
        self.resume_after: str = str(data.get("resume_after") or "0-0")
        self.oldest_retained_id: str | None = data.get("oldest_retained_id")


def _failure(response: httpx.Response) -> ResultsError:
    try:
        message = str(orjson.loads(response.content).get("error"))
    except (orjson.JSONDecodeError, AttributeError):
        message = response.reason_phrase
    return ResultsError(f"{response.status_code}: {message}", status=response.status_code)


class Results:
    """The results API of one nopoll, with one consumer token."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_hold_s: float = 60.0,
    ) -> None:
        self.max_hold_s = max_hold_s
        """The longest ``?wait`` the server takes (its ``results.max_wait_s``)."""
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"authorization": f"Bearer {token}"},
            timeout=timeout_s,
            transport=transport,
        )
        self._timeout_s = timeout_s

    async def get(self, provider: str, key: str, *, tenant: str | None = None) -> Envelope | None:
        """The latest envelope of ``key``, or None when it has not landed."""
        return await self._get(provider, key, tenant, None)

    async def wait(
        self,
        provider: str,
        key: str,
        timeout: float = 30.0,  # noqa: ASYNC109 - the server holds the request this long
        *,
        tenant: str | None = None,
    ) -> Envelope | None:
        """The envelope of ``key`` once it lands, waiting up to ``timeout`` seconds; None if
        it did not. The server holds each request up to ``max_hold_s`` (its
        ``results.max_wait_s``, 60 by default); a longer ``timeout`` asks again."""
        deadline = time.monotonic() + max(timeout, 0.0)
        for _ in range(10_000):  # bounded: every round but the last holds max_hold_s
            remaining = deadline - time.monotonic()
            hold = min(remaining, self.max_hold_s)
            found = await self._get(
                provider, key, tenant, round(hold, 3) if hold >= 0.001 else None
            )
            if found is not None or remaining <= self.max_hold_s:
                return found
        return None

    async def _get(
        self, provider: str, key: str, tenant: str | None, wait_s: float | None
    ) -> Envelope | None:
        params: dict[str, str] = {}
        if tenant is not None:
            params["tenant"] = tenant
        timeout: float | httpx.Timeout = self._timeout_s
        if wait_s is not None:
            params["wait"] = f"{wait_s:g}"
            timeout = httpx.Timeout(self._timeout_s, read=wait_s + self._timeout_s)
        path = f"/v1/results/{quote(provider, safe='')}/{quote(key, safe='/')}"
        try:
            response = await self._client.get(path, params=params, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ResultsError(f"results API unreachable: {type(exc).__name__}") from exc
        if response.status_code == 200:
            return Envelope.from_dict(orjson.loads(response.content))
        if response.status_code == 404 and b"not landed" in response.content:
            return None
        raise _failure(response)

    def stream(
        self,
        *,
        tenant: str | None = None,
        provider: str | None = None,
        kind: str | None = None,
        status: str | None = None,
        last_event_id: str | None = None,
        max_retries: int = 8,
    ) -> ResultStream:
        """Envelopes as they land (see :class:`ResultStream`); without ``last_event_id``
        from the moment of the first connection on."""
        filters = {"tenant": tenant, "provider": provider, "kind": kind, "status": status}
        params = {k: v for k, v in filters.items() if v is not None}
        return ResultStream(self._client, params, last_event_id, max_retries)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class ResultStream:
    """``async for env in stream``: envelopes from ``GET /v1/results/stream``.

    ``last_event_id`` is the id of the last envelope yielded: it is sent as
    ``Last-Event-ID`` on every reconnection, and can be saved to resume after a restart
    (``Results.stream(last_event_id=...)``). A dropped connection is reconnected up to
    ``max_retries`` times in a row with backoff (1 s doubling up to 15 s), then
    :class:`ResultsError` is raised; a 4xx answer raises at once. Trimmed entries raise
    :class:`StreamReset` (see the module docs).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        params: dict[str, str],
        last_event_id: str | None,
        max_retries: int,
    ) -> None:
        self._client = client
        self._params = params
        self.last_event_id = last_event_id
        self._max_retries = max_retries

    def __aiter__(self) -> AsyncIterator[Envelope]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Envelope]:
        failures = 0
        while True:
            try:
                # closed here, in order, when the caller stops iterating (a ``break``): left
                # to the garbage collector, each nested generator would be closed on its
                # own, one while another still runs
                async with contextlib.aclosing(self._connection()) as events:
                    async for event, data in events:
                        failures = 0
                        if event == "reset":
                            gap = StreamReset(orjson.loads(data))
                            self.last_event_id = gap.resume_after
                            raise gap
                        if event == "error":
                            break  # the server lost Redis: reconnect
                        if event == "result-ref":  # a large envelope: read it whole
                            yield await self._fetch(orjson.loads(data))
                            continue
                        yield Envelope.from_dict(orjson.loads(data))
            except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
                if failures >= self._max_retries:
                    raise ResultsError(f"stream lost: {type(exc).__name__}") from exc
            except ResultsError as exc:
                if exc.status is None or exc.status < 500 or failures >= self._max_retries:
                    raise
            failures += 1
            if failures > self._max_retries:
                raise ResultsError(f"stream lost {failures} times in a row")
            await asyncio.sleep(random.uniform(0.5, 1.0) * min(15.0, 2.0 ** (failures - 1)))

    async def _fetch(self, ref: dict[str, Any]) -> Envelope:
        """The envelope a ``result-ref`` event names (the latest of its key); a
        :class:`ResultsError` when it is no longer kept (``last_event_id`` is past it)."""
        try:
            response = await self._client.get(str(ref["ref"]))
        except httpx.HTTPError as exc:
            raise ResultsError(f"results API unreachable: {type(exc).__name__}") from exc
        if response.status_code != 200:
            failure = _failure(response)
            raise ResultsError(
                f"large result {ref.get('provider')}/{ref.get('key')}: {failure}",
                status=failure.status,
            )
        return Envelope.from_dict(orjson.loads(response.content))

    async def _connection(self) -> AsyncGenerator[tuple[str, str]]:
        """(event type, data) of one connection's events; moves ``last_event_id``."""
        headers: dict[str, str] = {}
        if self.last_event_id:
            headers["last-event-id"] = self.last_event_id
        timeout = httpx.Timeout(10.0, read=60.0)  # the server pings every 15 s
        async with aconnect_sse(
            self._client,
            "GET",
            "/v1/results/stream",
            params=self._params,
            headers=headers,
            timeout=timeout,
        ) as source:
            response = source.response
            if response.status_code != 200:
                await response.aread()
                raise _failure(response)
            async with contextlib.aclosing(source.aiter_sse()) as events:  # as in _iterate
                async for sse in events:
                    if not sse.data:
                        continue  # a lone ``id:`` or ``retry:`` field: nothing to hand on
                    if sse.id:
                        self.last_event_id = sse.id
                    yield sse.event, sse.data
