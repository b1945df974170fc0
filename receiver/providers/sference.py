"""The ``sference`` dialect.

Batch results: ``GET /batches/{id}``, then ``GET /batches/{id}/results.jsonl``, one row per
line: ``custom_id`` (optional: the key is then ``{batch_id}/~{line index}``), ``status``,
``result_json`` (a chat completion, as an object or a JSON string) and ``error_json``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from nopoll.envelope import BatchRow
from nopoll.status import row_status, unknown_status
from receiver.providers.base import (
    BatchFetch,
    Chunk,
    ResponsesDialect,
    chunk_rows,
    line_object,
    loads_obj,
)
from receiver.providers.batch_input import BatchInput

__all__ = ["SferenceDialect", "parse_line"]


def parse_line(index: int, line: bytes) -> BatchRow:
    """One line of ``results.jsonl``."""
    parsed = line_object(index, line)
    if isinstance(parsed, BatchRow):
        return parsed
    data, custom_id = parsed
    body = loads_obj(data.get("result_json"))
    error = loads_obj(data.get("error_json"))
    raw = data.get("status")
    status = row_status(raw, "completed" if body and not error else "failed")
    error = error or unknown_status(raw)
    if error is None and body is None and not isinstance(raw, str):
        error = {"code": "no_result", "message": "the line has no result_json and no error_json"}
    return BatchRow(index, custom_id, status, body=body, error=error)


class SferenceDialect(ResponsesDialect):
    """sference: ``results.jsonl`` rows; created with ``POST /batches {"window": "24h",
    "requests": [{"custom_id", "body"}]}``."""

    request_part = "body"

    def _batch_head(self, batch: BatchInput, name: str, digest: str) -> bytes:
        return b'{"window":"24h","requests":['

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        fetch.batch = await self.fetch_batch_object(fetch.batch_id)
        lines = self.client.stream_lines(f"batches/{fetch.batch_id}/results.jsonl")
        async for chunk in chunk_rows(lines, fetch, parse_line):
            yield chunk
