"""The ``valar`` dialect.

Batch results: the batch object's ``request_status`` map, then
``GET /batches/{id}/{custom_id}`` (a Responses object) for every ``COMPLETED`` row under
bounded concurrency; ``FAILED``/``CANCELLED`` rows are recorded with their status and no
body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from receiver.exceptions import ProviderError
from receiver.providers.base import BatchFetch, Chunk, ResponsesDialect, rows_by_custom_id

__all__ = ["ValarDialect"]


class ValarDialect(ResponsesDialect):
    """Valar: ``request_status`` walk with per-row GETs."""

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        fetch.batch = await self.fetch_batch_object(fetch.batch_id)
        request_status = fetch.batch.get("request_status")
        if request_status is None:
            request_status = {}
        if not isinstance(request_status, dict):
            raise ProviderError(
                "request_status is not an object",
                provider=self.client.name,
                path=f"batches/{fetch.batch_id}",
                status=200,
            )
        concurrency = self.client.config.max_concurrency
        async for chunk in rows_by_custom_id(self, fetch, request_status, concurrency):
            yield chunk
