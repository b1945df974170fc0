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

from receiver.envelope import BatchRow
from receiver.exceptions import ProviderError
from receiver.providers.base import BatchFetch, Chunk, ResponsesDialect, rows_by_custom_id
from receiver.providers.client import safe_id

__all__ = ["SailDialect", "row_from_item"]


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, str, Any]]:
    """ijson parse events of a streamed document, pushed chunk by chunk in this task."""
    found = ijson.sendable_list()
    parser = ijson.parse_coro(found, use_float=True)
    async for chunk in chunks:
        parser.send(chunk)
        for event in found:
            yield event
        del found[:]
    parser.close()
    for event in found:
        yield event


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
        top = ijson.ObjectBuilder()
        item: ijson.ObjectBuilder | None = None
        inline = False
        index = 0
        chunk: list[BatchRow] = []
        skip_rows = fetch.skip_before * fetch.chunk_size
        stream = self.client.stream_bytes(f"batches/{fetch.batch_id}")
        async for prefix, event, value in _events(stream):
            if prefix == "results" or prefix.startswith("results."):
                if prefix == "results" and event == "start_array":
                    inline = True
                if not prefix.startswith("results.item"):
                    continue
                if prefix == "results.item" and event in (
                    "start_map",
                    "start_array",
                    "string",
                    "number",
                    "null",
                    "boolean",
                ):
                    item = ijson.ObjectBuilder() if index >= skip_rows else None
                if item is not None:
                    item.event(event, value)
                if prefix == "results.item" and event not in (
                    "start_map",
                    "start_array",
                    "map_key",
                ):
                    if item is not None:
                        chunk.append(row_from_item(index, item.value))
                    index += 1
                    item = None
                    if index % fetch.chunk_size == 0:
                        if chunk:
                            yield index // fetch.chunk_size - 1, chunk
                        chunk = []
                continue
            if prefix == "" and event == "map_key" and value == "results":
                continue
            top.event(event, value)
        if chunk:
            yield index // fetch.chunk_size, chunk
        batch = top.value if isinstance(top.value, dict) else {}
        fetch.batch = batch
        if inline:
            return
        async for part in rows_by_custom_id(self, fetch):
            yield part
