"""The ``valar`` dialect.

Batch results: the batch object's ``request_status`` map, then
``GET /batches/{id}/{custom_id}`` (a Responses object) for every ``COMPLETED`` row under
bounded concurrency; ``FAILED``/``CANCELLED`` rows are recorded with their status and no
body. Valar's batch object has no ``status``: it is finished when every request settled
(:class:`~receiver.providers.base.RequestStatusDialect`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from receiver.providers.base import BatchFetch, Chunk, RequestStatusDialect, rows_by_custom_id

__all__ = ["ValarDialect"]


class ValarDialect(RequestStatusDialect):
    """Valar: ``request_status`` walk with per-row GETs."""

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        fetch.batch = await self.fetch_batch_object(fetch.batch_id)
        if self.batch_pending(fetch.batch) is not None:
            return  # not finished: no row is fetched; the runner retries the job later
        async for chunk in rows_by_custom_id(self, fetch):
            yield chunk
