"""The ``sail`` dialect.

Batch results: the terminal batch object's inline ``results`` array (``custom_id``,
``response.body`` = a Responses object, ``error``), parsed incrementally (ijson) because
it can be about 1 GiB. When ``results`` is null (too large for Sail to inline), every
completed row comes from ``request_status`` via ``GET /batches/{id}/{custom_id}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ijson

from nopoll.envelope import BatchRow
from nopoll.exceptions import ProviderError
from nopoll.wire import safe_id
from receiver.providers.base import BatchFetch, Chunk, ResponsesDialect, rows_by_custom_id

__all__ = ["SailDialect", "row_from_item"]

_PUSH = 1024 * 1024
_ITEM_START = ("start_map", "start_array", "string", "number", "null", "boolean")
_ITEM_OPEN = ("start_map", "start_array", "map_key")


async def _events(
    chunks: AsyncIterator[bytes],
) -> AsyncIterator[tuple[int, list[tuple[str, str, Any]]]]:
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


class SailDialect(ResponsesDialect):
    """Sail: inline results, or per-custom_id results when they are too large."""

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        if not safe_id(fetch.batch_id):
            raise ProviderError("unsafe batch id", provider=self.client.name, path="batches/?")
        path = f"batches/{fetch.batch_id}"
        caps = self.client.http
        top = ijson.ObjectBuilder()
        item: ijson.ObjectBuilder | None = None
        inline = in_results = False
        index = 0
        chunk: list[BatchRow] = []
        skip_rows = fetch.skip_before * fetch.chunk_size
        # Bytes read since the last results item ended: one item may be max_line_bytes (the
        # whole document may be ~1 GiB); the batch object around it, max_response_bytes.
        open_bytes = outside_bytes = 0
        try:
            async for size, events in _events(self.client.stream_bytes(path)):
                ended = False
                for prefix, event, value in events:
                    if prefix == "" and event == "map_key" and value == "results":
                        continue
                    if prefix != "results" and not prefix.startswith("results."):
                        top.event(event, value)
                        continue
                    if prefix == "results" and event in ("start_array", "end_array"):
                        in_results = event == "start_array"
                        inline = ended = True
                    if not prefix.startswith("results.item"):
                        continue
                    if prefix == "results.item" and event in _ITEM_START:
                        item = ijson.ObjectBuilder() if index >= skip_rows else None
                    if item is not None:
                        item.event(event, value)
                    if prefix == "results.item" and event not in _ITEM_OPEN:
                        if item is not None:
                            chunk.append(row_from_item(index, item.value))
                        index += 1
                        item = None
                        ended = True
                        if index % fetch.chunk_size == 0:
                            if chunk:
                                yield index // fetch.chunk_size - 1, chunk
                            chunk = []
                if in_results:
                    open_bytes = 0 if ended else open_bytes + size
                    if open_bytes > caps.max_line_bytes:
                        raise self.client.too_large(path, f"results item {index}", "max_line_bytes")
                else:
                    outside_bytes += size
                    if outside_bytes > caps.max_response_bytes:
                        raise self.client.too_large(path, "batch object", "max_response_bytes")
        except ijson.JSONError as exc:
            raise ProviderError(
                f"batch object is not valid JSON ({type(exc).__name__})",
                provider=self.client.name,
                path=path,
                status=200,
            ) from None
        if chunk:
            yield index // fetch.chunk_size, chunk
        batch = top.value if isinstance(top.value, dict) else {}
        fetch.batch = batch
        if inline:
            return
        async for part in rows_by_custom_id(self, fetch):
            yield part
