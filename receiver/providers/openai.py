"""The ``openai`` dialect (and any OpenAI-compatible API).

Batch results: ``GET /batches/{id}``, then the ``output_file_id`` and ``error_file_id``
files via ``GET /files/{file_id}/content``, JSONL lines
``{"id","custom_id","response":{"status_code","request_id","body"},"error"}``. A line with
status code 200 and no error is ``completed``; any other is ``failed``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import orjson

from nopoll.envelope import BatchRow
from nopoll.exceptions import ProviderError
from nopoll.wire import safe_id
from receiver.providers.base import (
    BatchFetch,
    Chunk,
    ResponsesDialect,
    chunk_rows,
    line_object,
)
from receiver.providers.batch_input import BatchInput, CreateCall

__all__ = ["OpenAIDialect", "parse_line"]


def parse_line(index: int, line: bytes) -> BatchRow:
    """One line of an OpenAI batch output or error file."""
    parsed = line_object(index, line, "not JSON", "not an object")
    if isinstance(parsed, BatchRow):
        return parsed
    data, custom_id = parsed
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
    """OpenAI: output and error files of a batch; created from an uploaded file,
    ``POST /files`` (multipart, ``purpose=batch``, the lines re-serialized) then ``POST
    /batches {"input_file_id", "endpoint", "completion_window": "24h"}``."""

    row_limit = 50_000

    @classmethod
    def _add_row(cls, batch: BatchInput, row: dict[str, Any]) -> None:
        batch.file += orjson.dumps(row) + b"\n"

    def create_calls(
        self, batch: BatchInput, name: str, digest: str, created: Mapping[str, str]
    ) -> Iterator[CreateCall]:
        boundary = "nopoll" + os.urandom(12).hex()
        content = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                f"--{boundary}\r\nContent-Disposition: form-data; "
                f'name="file"; filename="{_file_name(name)}"\r\n'
                "Content-Type: application/jsonl\r\n\r\n"
            ).encode()
            + bytes(batch.file)
            + f"\r\n--{boundary}--\r\n".encode()
        )
        content_type = f"multipart/form-data; boundary={boundary}"
        yield CreateCall("file", "files", content, content_type, batch=False)
        body = {
            "input_file_id": created["file"],
            "endpoint": batch.endpoint,
            "completion_window": "24h",
        }
        yield CreateCall("batch", "batches", orjson.dumps(body))

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        fetch.batch = await self.fetch_batch_object(fetch.batch_id)
        if self.batch_pending(fetch.batch) is not None:
            return  # not finished: its files are not read; the runner retries later
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


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:100] or "batch.jsonl"
