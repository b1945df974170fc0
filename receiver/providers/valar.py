"""The ``valar`` dialect.

Batch results: the batch object's ``request_status`` map, then
``GET /batches/{id}/{custom_id}`` (a Responses object) for every ``COMPLETED`` row under
bounded concurrency; ``FAILED``/``CANCELLED`` rows are recorded with their status and no
body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from receiver.providers.base import BatchFetch, Chunk, ResponsesDialect, rows_by_custom_id

__all__ = ["ValarDialect"]


class ValarDialect(ResponsesDialect):
    """Valar: ``request_status`` walk with per-row GETs."""

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        fetch.batch = await self.fetch_batch_object(fetch.batch_id)
        async for chunk in rows_by_custom_id(self, fetch):
            yield chunk
