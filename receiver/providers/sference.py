"""The ``sference`` dialect.

Batch results: ``GET /batches/{id}`` (a ``BatchResponse``: ``status`` ``pending`` |
``running`` | ``completed`` | ``failed`` | ``cancelled``, ``request_count``, token totals,
``total_cost_micros``), then ``GET /batches/{id}/results.jsonl``, one row per line:
``custom_id`` (optional: the key is then ``{batch_id}/~{line index}``), ``status``,
``result_json`` (a chat completion, as an object or a JSON string) and ``error_json``.
A row of a cancelled batch that never ran (its status still ``pending`` or ``running``) is
``cancelled``.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from nopoll.envelope import BatchFacts, BatchRow
from nopoll.status import UNFINISHED, final_status, row_status, unknown_status
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


def parse_line(index: int, line: bytes, *, cancelled: bool = False) -> BatchRow:
    """One line of ``results.jsonl`` (``cancelled``: of a cancelled batch, whose rows that
    never ran are cancelled, not failed)."""
    parsed = line_object(index, line)
    if isinstance(parsed, BatchRow):
        return parsed
    data, custom_id = parsed
    body = loads_obj(data.get("result_json"))
    error = loads_obj(data.get("error_json"))
    raw = data.get("status")
    if cancelled and isinstance(raw, str) and raw.lower() in UNFINISHED and body is None:
        return BatchRow(index, custom_id, "cancelled", error=error)
    status = row_status(raw, "completed" if body and not error else "failed")
    error = error or unknown_status(raw)
    if error is None and body is None and not isinstance(raw, str):
        error = {"code": "no_result", "message": "the line has no result_json and no error_json"}
    return BatchRow(index, custom_id, status, body=body, error=error)


class SferenceDialect(ResponsesDialect):
    """sference: ``results.jsonl`` rows; created with ``POST /batches {"window": "24h",
    "requests": [{"custom_id", "body"}]}``."""

    request_part = "body"

    @classmethod
    def row_rule(cls, row: dict[str, Any]) -> str | None:
        """sference's create-time refusals of a batch row: a body with a non-empty
        ``messages`` list or a Responses ``input``, and no ``background``."""
        body = row["body"]
        messages, given = body.get("messages"), body.get("input")
        if not (isinstance(messages, list) and messages) and given in (None, "", []):
            return "body: needs a non-empty messages list or a Responses input"
        if "messages" in body and not (isinstance(messages, list) and messages):
            return "body.messages: must be a non-empty list"
        if "background" in body:
            return "body.background: not supported in sference batch rows"
        return None

    def _batch_head(self, batch: BatchInput, name: str, digest: str) -> bytes:
        return b'{"window":"24h","requests":['

    def batch_facts(self, batch: dict[str, Any]) -> BatchFacts:
        """The status, ``request_count`` as ``request_counts.total``, the prompt and
        completion token totals as the summary's tokens, and ``total_tokens`` and
        ``total_cost_micros`` (micro-dollars) in its metadata."""
        status = final_status(batch.get("status"), "batch") or "failed"
        counts = BatchFacts.of(batch).request_counts  # an OpenAI-style object, if any
        if _count(batch.get("request_count")) is not None:
            counts["total"] = batch["request_count"]
        extra = {
            k: batch[k]
            for k in ("total_tokens", "total_cost_micros")
            if _count(batch.get(k)) is not None
        }
        return BatchFacts(
            status=status,
            request_counts=counts,
            input_tokens=_count(batch.get("total_prompt_tokens")),
            output_tokens=_count(batch.get("total_completion_tokens")),
            metadata=extra,
        )

    async def batch_chunks(self, fetch: BatchFetch) -> AsyncIterator[Chunk]:
        fetch.batch = await self.fetch_batch_object(fetch.batch_id)
        if self.batch_pending(fetch.batch) is not None:
            return  # not finished: its results are not read; the runner retries later
        cancelled = final_status(fetch.batch.get("status"), "batch") == "cancelled"
        parse = functools.partial(parse_line, cancelled=cancelled)
        lines = self.client.stream_lines(f"batches/{fetch.batch_id}/results.jsonl")
        async for chunk in chunk_rows(lines, fetch, parse):
            yield chunk


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
