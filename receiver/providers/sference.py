"""The ``sference`` dialect.

Batch results: ``GET /batches/{id}``, then ``GET /batches/{id}/results.jsonl`` (a row
without ``custom_id`` is keyed ``{batch_id}/~{line index}``). sference documents no
idempotency: single creates go in a stream of their own so that a lost answer can be
looked up, and a lost batch create is looked for in ``GET /batches``. Its completion feed
is :meth:`SferenceDialect.feed_page`; :class:`CompletionEvent` reads one event.

See docs/providers.md (sference), docs/watches.md and docs/submit.md.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import orjson

from nopoll.envelope import BatchFacts, BatchRow, Envelope, body_fields, now_rfc3339
from nopoll.exceptions import ProviderError
from nopoll.status import UNFINISHED, final_status, row_status, unknown_status
from nopoll.wire import safe_id
from receiver.providers.base import (
    BatchFetch,
    Chunk,
    FeedEvent,
    FeedPage,
    ResponsesDialect,
    chunk_rows,
    line_object,
    loads_obj,
)
from receiver.providers.batch_input import BatchInput
from receiver.providers.client import error_reason

__all__ = ["CompletionEvent", "SferenceDialect", "parse_line"]


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


@dataclass(frozen=True, slots=True)
class CompletionEvent:
    """One event of the completion feed (``StreamInferenceCompletionEvent``)."""

    completion_id: str
    response_id: str | None
    """None for a completion that is no single response (a batch's row)."""
    custom_id: str | None
    status: str | None
    """nopoll's final status, None for a status it does not know as final."""
    raw: dict[str, Any]

    @classmethod
    def read(cls, obj: Any) -> CompletionEvent | None:
        """The event, or None when it has no usable ``completion_id`` (it cannot be a
        cursor, so it is skipped)."""
        if not isinstance(obj, dict) or not safe_id(obj.get("completion_id")):
            return None
        rid, cid = obj.get("response_id"), obj.get("custom_id")
        return cls(
            obj["completion_id"],
            rid if safe_id(rid) else None,
            cid if isinstance(cid, str) and cid else None,
            final_status(obj.get("status")),
            obj,
        )

    @property
    def completed_at(self) -> float | None:
        return _unix(self.raw.get("completed_at"))

    @property
    def whole(self) -> bool:
        """It carries the whole result: final, a response's, and its ``result`` an object
        with the output (a chat completion's ``choices``, a Responses ``output``), or it
        failed with an ``error``."""
        if self.status is None or self.response_id is None:
            return False
        result, error = self.raw.get("result"), self.raw.get("error")
        if self.status == "completed":
            return isinstance(result, dict) and ("choices" in result or "output" in result)
        return isinstance(error, dict) or isinstance(result, dict)

    def envelope(self, provider: str, *, tenant: str, received_at: str) -> Envelope:
        """The ``response`` envelope of a :attr:`whole` event (``body``: the event)."""
        assert self.response_id is not None and self.status is not None
        result = self.raw.get("result")
        fields = body_fields(result if isinstance(result, dict) else None)
        error = self.raw.get("error")
        metadata: dict[str, Any] = {"completion_id": self.completion_id}
        if self.custom_id is not None:
            metadata["custom_id"] = self.custom_id
        if _count(self.raw.get("cost_micros")) is not None:
            metadata["cost_micros"] = self.raw["cost_micros"]
        text = fields.output_text
        return Envelope(
            provider=provider,
            tenant=tenant,
            kind="response",
            key=self.response_id,
            response_id=self.response_id,
            custom_id=self.custom_id,
            status=self.status,
            usable=self.status == "completed"
            or (self.status == "incomplete" and fields.incomplete_reason == "max_output_tokens"),
            incomplete_reason=fields.incomplete_reason,
            model=fields.model,
            output_text=text,
            input_tokens=_first_count(self.raw.get("prompt_tokens"), fields.input_tokens),
            output_tokens=_first_count(self.raw.get("completion_tokens"), fields.output_tokens),
            error=_error_of(error) if self.status != "completed" else None,
            metadata=metadata,
            event_id=f"feed:{self.completion_id}",
            received_at=received_at,
            fetched_at=now_rfc3339(),
            body=self.raw,
        )


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

    async def group_progress(self, group: str) -> str | None:
        """The stream's counters (``GET /streams/{id}``): completed, failed, cancelled,
        running and pending of its items."""
        if not safe_id(group):
            return None
        stream = await self.client.get_json(f"streams/{group}", attempts=1)
        total = _count(stream.get("total_items"))
        if total is None:
            return None
        names = ("completed", "failed", "cancelled", "running", "pending")
        parts = [f"{n} {name}" for name in names if (n := _count(stream.get(f"{name}_items")))]
        return f"{', '.join(parts) or 'none yet'} of {total}"

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

    async def feed_page(
        self,
        *,
        stream_id: str | None,
        after: str | None,
        limit: int,
        wait_ms: int,
        wait_s: float | None = None,
        before: str | None = None,
    ) -> FeedPage:
        """``GET /responses/events``: the completions after the cursor ``after`` (a
        ``completion_id``), of the stream ``stream_id`` (None: of the account's requests
        outside streams), waiting up to ``wait_ms`` for one. After a cursor the events are
        in the feed's own order, oldest first, and the next cursor is the last one's id;
        without one (the newest completions, or with ``before`` those before it,
        ``ending_before``, in an order the contract leaves open) they are put in completion
        order, and the next cursor is the newest. ``wait_s``: the wait for the account's
        slot."""
        query: dict[str, str | int] = {"limit": limit, "wait_ms": wait_ms}
        if after is not None:
            query["starting_after"] = after
        elif before is not None:
            query["ending_before"] = before
        if stream_id is not None:
            query["stream_id"] = stream_id
        answer = await self.client.get_json(
            f"responses/events?{urlencode(query)}", attempts=1, wait_s=wait_s
        )
        data = answer.get("data")
        items = data if isinstance(data, list) else []
        events = [e for e in map(CompletionEvent.read, items) if e is not None]
        if after is None:
            events.sort(key=lambda e: (e.completed_at or 0.0, e.completion_id))
        found: list[FeedEvent] = list(events)
        return FeedPage(found, answer.get("has_more") is True, len(items) - len(events))

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


def _first_count(*values: Any) -> int | None:
    return next((v for v in map(_count, values) if v is not None), None)


def _error_of(error: Any) -> dict[str, Any] | None:
    """An event's ``error`` as the envelope's ``{code, message}``."""
    if not isinstance(error, dict):
        return None
    code, message = error.get("code") or error.get("type"), error.get("message")
    return {"code": str(code) if code is not None else None, "message": message}
