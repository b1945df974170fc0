"""The ``openai`` dialect (and any OpenAI-compatible API).

Batch results: ``GET /batches/{id}``, then the ``output_file_id`` and ``error_file_id``
files via ``GET /files/{file_id}/content``, JSONL lines
``{"id","custom_id","response":{"status_code","request_id","body"},"error"}``. A line with
status code 200 and no error is ``completed``; any other is ``failed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from nopoll.envelope import BatchRow
from nopoll.exceptions import ProviderError
from nopoll.wire import safe_id
from receiver.providers.base import BatchFetch, Chunk, ResponsesDialect, chunk_rows

__all__ = ["OpenAIDialect", "parse_line"]


def parse_line(index: int, line: bytes) -> BatchRow:
    """One line of an OpenAI batch output or error file."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return BatchRow(index, None, "failed", error={"code": "bad_line", "message": "not JSON"})
    if not isinstance(data, dict):
        return BatchRow(
            index, None, "failed", error={"code": "bad_line", "message": "not an object"}
        )
    custom_id = data.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    raw_response = data.get("response")
    response: dict[str, Any] = raw_response if isinstance(raw_response, dict) else {}
    raw_body = response.get("body")
    body = raw_body if isinstance(raw_body, dict) else None
    code = response.get("status_code")
    error: Any = data.get("error")
    if error is None and code == 200:
        return BatchRow(index, custom_id, "completed", body=body)
    if not isinstance(error, dict):
        nested = body.get("error") if body else None
        error = (
            nested
            if isinstance(nested, dict)
            else {
                "code": str(code) if code is not None else "error",
                "message": f"request failed with status {code}",
            }
        )
    return BatchRow(index, custom_id, "failed", body=body, error=error)


class OpenAIDialect(ResponsesDialect):
    """OpenAI: output and error files of a batch."""

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        fetch.batch = await self.fetch_batch_object(fetch.batch_id)
        file_ids = []
        for name in ("output_file_id", "error_file_id"):
            value = fetch.batch.get(name)
            if value is None:
                continue
            if not safe_id(value):
                raise ProviderError(
                    f"unsafe {name}", provider=self.client.name, path=f"batches/{fetch.batch_id}"
                )
            file_ids.append(value)

        async def lines() -> AsyncIterator[bytes]:
            for file_id in file_ids:
                async for line in self.client.stream_lines(f"files/{file_id}/content"):
                    yield line

        async for chunk in chunk_rows(lines(), fetch, parse_line):
            yield chunk
