"""The ``sail`` dialect.

Sail's API reference has a batch object without ``status`` or inline results: its rows
are per-row ``GET /batches/{id}/{custom_id}`` for every completed row, and it is finished
once every request settled (:class:`~receiver.providers.base.RequestStatusDialect`). The
older shape of its requests-at-scale guide is read too: a ``status`` and inline
``results``, parsed incrementally (ijson); a watch's poll stops reading where they begin.

See docs/providers.md (Sail) and docs/batches.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import ijson

from nopoll.envelope import BatchRow
from nopoll.exceptions import ProviderError
from nopoll.wire import safe_id
from receiver.providers.base import (
    BatchFetch,
    Chunk,
    ChunkCut,
    RequestStatusDialect,
    rows_by_custom_id,
)

__all__ = ["SailDialect", "row_from_item"]

_PUSH = 1024 * 1024
_ITEM_START = ("start_map", "start_array", "string", "number", "null", "boolean")
_ITEM_OPEN = ("start_map", "start_array", "map_key")


async def _events(
    chunks: AsyncIterator[bytes],
) -> AsyncGenerator[tuple[int, list[tuple[str, str, Any]]], None]:
    """ijson parse events of a streamed document, pushed about 1 MiB at a time in this task:
    for every push, its size and the events it completed. (yajl scans a token cut at the end
    of a push again from its start with the next one: large pushes keep a long string
    linear; 64 KiB pushes made a 64 MiB string take ten seconds.)"""
    found = ijson.sendable_list()
    parser = ijson.parse_coro(found, use_float=True)
    pending: list[bytes] = []
    size = 0
    async for chunk in chunks:
        pending.append(chunk)
        size += len(chunk)
        if size >= _PUSH:
            parser.send(b"".join(pending))
            yield size, list(found)
            del found[:]
            pending, size = [], 0
    if pending:
        parser.send(b"".join(pending))
    parser.close()
    yield size, list(found)


def row_from_item(index: int, item: Any) -> BatchRow:
    """One entry of Sail's inline ``results``."""
    if not isinstance(item, dict):
        return BatchRow(
            index, None, "failed", error={"code": "bad_item", "message": "not an object"}
        )
    custom_id = item.get("custom_id") if isinstance(item.get("custom_id"), str) else None
    response = item.get("response")
    body = response.get("body") if isinstance(response, dict) else None
    error = item.get("error")
    if isinstance(body, dict) and not error:
        return BatchRow(index, custom_id, "completed", body=body)
    if not isinstance(error, dict):
        error = {"code": "error", "message": str(error) if error else "no response body"}
    return BatchRow(
        index, custom_id, "failed", body=body if isinstance(body, dict) else None, error=error
    )


class _ItemTooLong(Exception):
    """A whole ``results`` item measured over ``http.max_line_bytes``."""


class _Inline:
    """One pass over a Sail batch object: the object around ``results`` is built whole,
    the items of ``results`` become rows (those of skipped chunks are counted, not built)."""

    def __init__(self, fetch: BatchFetch, line_cap: int) -> None:
        self.line_cap = line_cap
        self.top = ijson.ObjectBuilder()
        self.item: ijson.ObjectBuilder | None = None
        self.inline = False
        """The object had a ``results`` array (else rows come from ``request_status``)."""
        self.in_results = False
        self.index = 0
        self.chunk: list[BatchRow] = []
        self.cut = ChunkCut(fetch)
        self.skip_before = fetch.skip_before
        self.item_bytes = 0
        """The current item's size, counted from its events (a stand-in for its raw bytes:
        the same document gives the same count on every run)."""
        self.sizes: dict[int, int] = {}
        self.keys: dict[str, str] = {}
        """The short keys seen so far, shared by every item (see :meth:`_key`)."""
        """The size of each completed chunk not yet handed on, by number."""

    def feed(self, events: list[tuple[str, str, Any]]) -> tuple[bool, list[Chunk]]:
        """Take one push's events: (whether a results item or the array ended in it, the
        chunks it completed)."""
        ended = False
        full: list[Chunk] = []
        for prefix, event, value in events:
            if prefix == "" and event == "map_key" and value == "results":
                continue
            if prefix != "results" and not prefix.startswith("results."):
                self.top.event(event, value)
                continue
            if prefix == "results" and event in ("start_array", "end_array"):
                self.in_results = event == "start_array"
                self.inline = ended = True
            if not prefix.startswith("results.item"):
                continue
            if prefix == "results.item" and event in _ITEM_START:
                building = self.cut.number >= self.skip_before
                self.item = ijson.ObjectBuilder() if building else None
                self.item_bytes = 0
            if isinstance(value, str):
                self.item_bytes += len(value) + 2
                if event == "map_key":
                    value = self._key(value)
            else:
                self.item_bytes += 4
            if self.item is not None:
                self.item.event(event, value)
            if prefix == "results.item" and event not in _ITEM_OPEN:
                if self.item_bytes > self.line_cap:
                    raise _ItemTooLong
                ended = True
                full += self._item_done()
        return ended, full

    def _key(self, key: str) -> str:
        """One string object for every occurrence of a short key (ijson makes a new one
        each time, where orjson shares them): a row's dozens of keys then cost nothing."""
        found = self.keys.get(key)
        if found is not None:
            return found
        if len(key) <= 64 and len(self.keys) < 4096:  # a hostile document's fresh keys
            self.keys[key] = key
        return key

    def _item_done(self) -> list[Chunk]:
        if self.item is not None:
            self.chunk.append(row_from_item(self.index, self.item.value))
        self.index += 1
        self.item = None
        if not self.cut.add(self.item_bytes):
            return []
        done, self.chunk = self.chunk, []
        number = self.cut.number
        if done:
            self.sizes[number] = self.cut.bytes
        self.cut.next()
        return [(number, done)] if done else []

    def last(self) -> list[Chunk]:
        """The last, partial chunk, if any."""
        self.sizes[self.cut.number] = self.cut.bytes
        return [(self.cut.number, self.chunk)] if self.chunk else []

    @property
    def batch(self) -> dict[str, Any]:
        return self.top.value if isinstance(self.top.value, dict) else {}


class SailDialect(RequestStatusDialect):
    """Sail: per-custom_id results, or inline ones (the guide's older shape)."""

    def _not_json(self, path: str, exc: Exception) -> ProviderError:
        return ProviderError(
            f"batch object is not valid JSON ({type(exc).__name__})",
            provider=self.client.name,
            path=path,
            status=200,
        )

    def batch_pending(self, batch: dict[str, Any]) -> str | None:
        if not isinstance(batch.get("status"), str) and isinstance(batch.get("results"), list):
            return None  # inline results: Sail inlines them once the batch is over
        return super().batch_pending(batch)

    async def fetch_batch_object(
        self, batch_id: str, *, attempts: int | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        """The batch object, streamed: everything but inline ``results`` is built (within
        ``http.max_response_bytes``); when an inline ``results`` array begins, reading stops
        there and the object has ``results: []`` in its place (the batch is over)."""
        if not safe_id(batch_id):
            raise ProviderError("unsafe batch id", provider=self.client.name, path="batches/?")
        path = f"batches/{batch_id}"
        cap = self.client.http.max_response_bytes
        top = ijson.ObjectBuilder()
        read = 0
        try:
            async with (
                contextlib.aclosing(
                    self.client.stream_bytes(path, attempts=attempts, wait_s=wait_s)
                ) as stream,
                contextlib.aclosing(_events(stream)) as pushes,
            ):
                async for size, events in pushes:
                    read += size
                    for prefix, event, value in events:
                        if prefix == "" and event == "map_key" and value == "results":
                            continue
                        if prefix == "results" and event == "start_array":
                            batch = top.value if isinstance(top.value, dict) else {}
                            batch["results"] = []
                            return batch
                        if prefix == "results" or prefix.startswith("results."):
                            continue
                        top.event(event, value)
                    if read > cap:
                        raise self.client.too_large(path, "batch object", "max_response_bytes")
        except ijson.JSONError as exc:
            raise self._not_json(path, exc) from None
        if not isinstance(top.value, dict):
            raise ProviderError(
                "answer is not a JSON object", provider=self.client.name, path=path, status=200
            )
        return top.value

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        if not safe_id(fetch.batch_id):
            raise ProviderError("unsafe batch id", provider=self.client.name, path="batches/?")
        path = f"batches/{fetch.batch_id}"
        caps = self.client.http
        parse = _Inline(fetch, caps.max_line_bytes)
        # One item may be max_line_bytes (the whole document may be ~1 GiB); the batch object
        # around it, max_response_bytes. An item is measured whole once it ends; one still
        # open, by the reads since the one in which the item before it ended (a lower bound:
        # an endless item is stopped about two reads past the cap).
        open_bytes = outside_bytes = 0
        try:
            async with (
                contextlib.aclosing(self.client.stream_bytes(path)) as stream,
                contextlib.aclosing(_events(stream)) as pushes,
            ):
                async for size, events in pushes:
                    ended, full = parse.feed(events)
                    for chunk in full:
                        fetch.last_chunk_bytes = parse.sizes.pop(chunk[0], 0)
                        yield chunk
                    if parse.in_results:
                        open_bytes = 0 if ended else open_bytes + size
                        if open_bytes > caps.max_line_bytes:
                            raise _ItemTooLong
                    else:
                        outside_bytes += size
                        if outside_bytes > caps.max_response_bytes:
                            raise self.client.too_large(path, "batch object", "max_response_bytes")
        except ijson.JSONError as exc:
            raise self._not_json(path, exc) from None
        except _ItemTooLong:
            what = f"results item {parse.index}"
            raise self.client.too_large(path, what, "max_line_bytes") from None
        for chunk in parse.last():
            fetch.last_chunk_bytes = parse.sizes.pop(chunk[0], 0)
            yield chunk
        fetch.batch = parse.batch
        if parse.inline:
            fetch.batch.setdefault("results", [])  # a stand-in: the rows were read above
            return
        if self.batch_pending(fetch.batch) is not None:
            return  # not finished: no row is fetched; the runner retries the job later
        async for part in rows_by_custom_id(self, fetch):
            yield part
