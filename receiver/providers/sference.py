"""The ``sference`` dialect.

Batch results are ``GET /batches/{id}`` (a ``BatchResponse``), then
``GET /batches/{id}/results.jsonl``, one row per line (a row without ``custom_id`` is
keyed ``{batch_id}/~{line index}``; one a cancelled batch never ran is ``cancelled``).
sference documents no idempotency (:attr:`idempotent_creates` is False): single creates
each get a stream of their own (``metadata.stream_id``) so that their ids can be listed
when an answer was lost, and a lost batch create is looked for in ``GET /batches``.

See docs/providers.md (sference) and docs/submit.md.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import orjson

from nopoll.envelope import BatchFacts, BatchRow
from nopoll.exceptions import ProviderError
from nopoll.status import UNFINISHED, final_status, row_status, unknown_status
from nopoll.wire import safe_id
from receiver.providers.base import (
    BatchFetch,
    Chunk,
    ResponsesDialect,
    chunk_rows,
    line_object,
    loads_obj,
)
from receiver.providers.batch_input import BatchInput
from receiver.providers.client import error_reason

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
    idempotent_creates = False

    async def submit_group(self, name: str) -> str:
        """A stream for one submit (``POST /streams``): a second stream of the same name,
        made when an answer was lost, costs nothing (it stays empty), so this is tried again
        freely."""
        body = orjson.dumps({"name": name[:200], "window": "24h"})
        key = "nopoll-" + hashlib.sha256(name.encode()).hexdigest()[:48]
        error = "no answer"
        for _ in range(3):
            status, content, _retry = await self.client.post_once(
                "streams", body, content_type="application/json", idempotency_key=key
            )
            if status in (200, 201):
                data = orjson.loads(content) if content.strip() else None
                stream_id = data.get("id") if isinstance(data, dict) else None
                if isinstance(stream_id, str) and safe_id(stream_id):
                    return stream_id
                error = "the answer holds no usable stream id"
                break
            error = error_reason(content) or f"HTTP {status}"
            if status < 500 and status != 429:
                break
        raise ProviderError(
            f"could not create a stream for this submit: {error}",
            provider=self.client.name,
            path="streams",
        )

    def in_group(self, body: dict[str, Any], group: str) -> dict[str, Any]:
        """The create body with ``metadata.stream_id`` (and the ``completion_window`` a
        background response needs, 24h, unless it names one)."""
        metadata = dict(body.get("metadata") or {})
        metadata["stream_id"] = group
        if body.get("background"):
            metadata.setdefault("completion_window", "24h")
        return {**body, "metadata": metadata}

    async def group_ids(self, group: str) -> set[str] | None:
        """Every response id created in the stream ``group``: ``GET /streams/{id}`` says how
        many, ``GET /responses?stream_id=`` lists them; None when the list is not whole."""
        if not safe_id(group):
            return None
        stream = await self.client.get_json(f"streams/{group}")
        total = stream.get("total_items")
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            return None
        listed = await self.client.get_json(f"responses?stream_id={group}&limit={total + 100}")
        data = listed.get("data")
        if not isinstance(data, list) or listed.get("has_more"):
            return None
        ids = {
            item["id"]
            for item in data
            if isinstance(item, dict) and isinstance(item.get("id"), str)
        }
        return ids if len(ids) >= total else None

    async def batches_like(self, rows: int, since: float) -> list[str] | None:
        """``GET /batches`` (``{"items": [...]}``, every batch of the account): those with
        ``request_count`` ``rows`` created at ``since`` or later (a minute's leeway for
        clocks)."""
        listed = await self.client.get_json("batches")
        items = listed.get("items")
        if not isinstance(items, list):
            return None
        found = []
        for item in items:
            if not isinstance(item, dict) or item.get("request_count") != rows:
                continue
            created = _unix(item.get("created_at"))
            batch_id = item.get("id")
            if created is not None and created >= since - 60 and isinstance(batch_id, str):
                found.append(batch_id)
        return found

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


def _unix(value: Any) -> float | None:
    """An ISO 8601 time (sference's batch timestamps) as Unix time."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
