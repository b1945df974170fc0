"""The result envelope (``nopoll.result/v1``) and how provider objects become envelopes.

Every sink receives the same record (docs/envelope.md). The functions
here are pure: they take the provider's JSON and return envelopes, nothing else.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from typing import Any, Literal

import orjson

from nopoll.kinds import Kind
from nopoll.status import final_status

__all__ = [
    "COLUMNS",
    "DEFAULT_TENANT",
    "FIELDS",
    "PRIMARY_KEY",
    "SCHEMA",
    "BatchFacts",
    "BatchRow",
    "BodyFields",
    "Column",
    "ColumnType",
    "Envelope",
    "batch_summary_envelope",
    "body_fields",
    "chat_output_text",
    "envelope_from_response",
    "envelope_from_row",
    "now_rfc3339",
    "redact_push",
    "response_output_text",
    "row_key",
]

DEFAULT_TENANT = "default"
"""The tenant of ``/webhooks/{provider}`` and of every envelope that names none: the
providers' own keys and secrets."""

SCHEMA = "nopoll.result/v1"


def now_rfc3339() -> str:
    """The current UTC time as RFC 3339 with milliseconds (``2026-11-29T14:17:42.825Z``)."""
    now = time.time()
    seconds = int(now)
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        + f".{int((now - seconds) * 1000):03d}Z"
    )


ColumnType = Literal["text", "integer", "boolean", "json", "timestamp"]
"""How a field is stored in a table (the ``sql`` sink): ``timestamp`` fields are RFC 3339
text in the envelope; ``json`` ones are objects (JSONB on Postgres)."""

_TEXT: dict[str, ColumnType] = {"column": "text"}
_INT: dict[str, ColumnType] = {"column": "integer"}
_BOOL: dict[str, ColumnType] = {"column": "boolean"}
_JSON: dict[str, ColumnType] = {"column": "json"}
_TIME: dict[str, ColumnType] = {"column": "timestamp"}


@dataclasses.dataclass(slots=True, kw_only=True)
class Envelope:
    """One result as every sink sees it. The fields, in this order, are the contract's
    (docs/envelope.md) and, through :data:`COLUMNS`, the ``sql`` sink's columns."""

    provider: str = dataclasses.field(metadata=_TEXT)
    tenant: str = dataclasses.field(default=DEFAULT_TENANT, metadata=_TEXT)
    kind: Kind = dataclasses.field(metadata=_TEXT)
    key: str = dataclasses.field(metadata=_TEXT)
    response_id: str | None = dataclasses.field(default=None, metadata=_TEXT)
    batch_id: str | None = dataclasses.field(default=None, metadata=_TEXT)
    custom_id: str | None = dataclasses.field(default=None, metadata=_TEXT)
    status: str = dataclasses.field(metadata=_TEXT)
    usable: bool = dataclasses.field(metadata=_BOOL)
    incomplete_reason: str | None = dataclasses.field(default=None, metadata=_TEXT)
    model: str | None = dataclasses.field(default=None, metadata=_TEXT)
    output_text: str | None = dataclasses.field(default=None, metadata=_TEXT)
    input_tokens: int | None = dataclasses.field(default=None, metadata=_INT)
    output_tokens: int | None = dataclasses.field(default=None, metadata=_INT)
    error: dict[str, Any] | None = dataclasses.field(default=None, metadata=_JSON)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict, metadata=_JSON)
    event_id: str | None = dataclasses.field(default=None, metadata=_TEXT)
    received_at: str = dataclasses.field(metadata=_TIME)
    fetched_at: str = dataclasses.field(metadata=_TIME)
    body: dict[str, Any] | None = dataclasses.field(default=None, metadata=_JSON)

    def to_dict(self) -> dict[str, Any]:
        """The envelope as a JSON-ready dict, fields in contract order."""
        return dict(zip(FIELDS, _values(self), strict=True))

    def to_json(self) -> bytes:
        """:meth:`to_dict` as JSON (orjson's bytes), what the s3 and kafka sinks write.
        Encoded on each call, not kept: a fan-out's sinks are chunks apart, and keeping the
        bytes of every row until its last sink had them cost far more memory (a part's
        worth per chunk between them) than encoding twice costs CPU. Raises
        ``orjson.JSONEncodeError`` (a ``TypeError``) on a value JSON cannot hold."""
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Envelope:
        """Rebuild an envelope from :meth:`to_dict` output (e.g. a queued delivery)."""
        return cls(**{k: v for k, v in data.items() if k in _FIELD_SET})


@dataclasses.dataclass(frozen=True, slots=True)
class Column:
    """One envelope field as a table column."""

    name: str
    type: ColumnType
    nullable: bool
    """Fields with no value (None) and JSON fields; the others are NOT NULL."""
    default: str | None = None
    """The value a row written without this field gets (``tenant``: ``default``)."""


def _column(f: dataclasses.Field[Any]) -> Column:
    kind: ColumnType = f.metadata["column"]
    default = f.default if isinstance(f.default, str) else None
    return Column(f.name, kind, nullable=f.default is None or kind == "json", default=default)


COLUMNS: tuple[Column, ...] = tuple(_column(f) for f in dataclasses.fields(Envelope))
"""Every envelope field as a column, in contract order: the one place a table's columns
come from."""
FIELDS: tuple[str, ...] = tuple(c.name for c in COLUMNS)
"""The envelope's field names, in contract order."""
PRIMARY_KEY = ("provider", "key", "tenant")
"""What identifies a result: ``key`` is unique within a provider's account, and each
tenant has its own account (two tenants' results with the same id are two results)."""
_FIELD_SET = frozenset(FIELDS)
_values = operator.attrgetter(*FIELDS)


def response_output_text(response: dict[str, Any]) -> str | None:
    """``output_text`` as the OpenAI SDK computes it: every ``output_text`` part of every
    ``message`` item, concatenated with no separator; reasoning is not output."""
    parts: list[str] = []
    found = False
    for item in response.get("output") or ():
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        for part in item.get("content") or ():
            if isinstance(part, dict) and part.get("type") == "output_text":
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                    found = True
    return "".join(parts) if found else None


def chat_output_text(completion: dict[str, Any]) -> str | None:
    """``choices[0].message.content`` of a chat completion, or None."""
    choices = completion.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _error(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    return {"code": value.get("code"), "message": value.get("message")}


PUSH_KEYS = frozenset({"completion_webhook", "webhook_token"})
"""The create metadata that asks a provider for a completion webhook (Sail, Valar): the
token is a secret and the URL may be a tenant's endpoint address, so neither is kept."""
REDACTED = "[redacted]"


def redact_push(response: dict[str, Any]) -> dict[str, Any]:
    """``response`` with the values of its metadata's :data:`PUSH_KEYS` replaced by
    :data:`REDACTED` (the object itself when it has none: the common case costs a lookup)."""
    metadata = response.get("metadata")
    if not isinstance(metadata, dict) or PUSH_KEYS.isdisjoint(metadata):
        return response
    kept = {k: REDACTED if k in PUSH_KEYS else v for k, v in metadata.items()}
    return {**response, "metadata": kept}


def envelope_from_response(
    response: dict[str, Any],
    *,
    provider: str,
    received_at: str,
    event_id: str | None = None,
    tenant: str = DEFAULT_TENANT,
) -> Envelope:
    """Normalize a Responses API object into a ``response`` envelope (completion-webhook
    metadata redacted: :func:`redact_push`)."""
    response = redact_push(response)
    status = final_status(response.get("status")) or "failed"
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    text = response_output_text(response)
    usable = status == "completed" or (
        status == "incomplete" and reason == "max_output_tokens" and bool(text)
    )
    raw_usage = response.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    metadata = response.get("metadata")
    model = response.get("model")
    return Envelope(
        provider=provider,
        tenant=tenant,
        kind="response",
        key=str(response["id"]),
        response_id=str(response["id"]),
        status=status,
        usable=usable,
        incomplete_reason=reason if isinstance(reason, str) else None,
        model=model if isinstance(model, str) else None,
        output_text=text,
        input_tokens=_int_or_none(usage.get("input_tokens")),
        output_tokens=_int_or_none(usage.get("output_tokens")),
        error=_error(response.get("error")),
        metadata=metadata if isinstance(metadata, dict) else {},
        event_id=event_id,
        received_at=received_at,
        fetched_at=now_rfc3339(),
        body=response,
    )


@dataclasses.dataclass(slots=True)
class BatchRow:
    """One row of a batch as a dialect found it, before it becomes an envelope."""

    index: int
    """0-based position in the provider's listing (the key, as ``~{index}``, when there is
    no custom_id)."""
    custom_id: str | None
    status: str
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class BodyFields:
    """What a row's envelope takes from its result body, in nopoll's words: each dialect
    reads its own body shape into these (its ``normalize``); :func:`body_fields` is the
    reading of the OpenAI-style shapes."""

    output_text: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    model: str | None = None
    incomplete_reason: str | None = None
    """``max_output_tokens`` for output cut at the token limit, whatever the provider calls it
    (so that one usable rule holds)."""
    status: str | None = None
    """The body's own final status (nopoll's word), when it has one."""


def body_fields(body: dict[str, Any] | None) -> BodyFields:
    """Text, tokens, model, incomplete reason and status of an OpenAI-style result body: a
    Responses object, or a chat completion (a batch of ``/v1/chat/completions``)."""
    if not body:
        return BodyFields()
    raw_usage = body.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    model = body.get("model")
    if "choices" in body:  # a chat completion: no status, no incomplete reason
        return BodyFields(
            output_text=chat_output_text(body),
            input_tokens=_int_or_none(usage.get("prompt_tokens")),
            output_tokens=_int_or_none(usage.get("completion_tokens")),
            model=model if isinstance(model, str) else None,
        )
    details = body.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    return BodyFields(
        output_text=response_output_text(body),
        input_tokens=_int_or_none(usage.get("input_tokens")),
        output_tokens=_int_or_none(usage.get("output_tokens")),
        model=model if isinstance(model, str) else None,
        incomplete_reason=reason if isinstance(reason, str) else None,
        status=final_status(body.get("status")),
    )


def row_key(batch_id: str, custom_id: str | None, index: int) -> str:
    """The key of a batch row, one-to-one with (custom_id, index): ``{batch_id}/{custom_id}``;
    ``{batch_id}/~{index}`` for a row without custom_id; a custom_id that starts with ``~``
    gets one more ``~`` (``"~3"`` → ``~~3``), so it never meets an index key (``"3"`` → ``3``,
    index 3 → ``~3``)."""
    if custom_id is None:
        return f"{batch_id}/~{index}"
    if custom_id.startswith("~"):
        return f"{batch_id}/~{custom_id}"
    return f"{batch_id}/{custom_id}"


def envelope_from_row(
    row: BatchRow,
    *,
    provider: str,
    batch_id: str,
    received_at: str,
    event_id: str | None,
    tenant: str = DEFAULT_TENANT,
    fetched_at: str | None = None,
    fields: BodyFields | None = None,
) -> Envelope:
    """Normalize one batch row into a ``batch_row`` envelope keyed by :func:`row_key`;
    ``fields`` are its body's, as its dialect reads them (by default an OpenAI-style
    body's: :func:`body_fields`)."""
    if fields is None:
        fields = body_fields(row.body)
    status = row.status
    if status == "completed" and fields.status == "incomplete":
        status = "incomplete"  # a body that ran out of tokens
    text = fields.output_text
    reason = fields.incomplete_reason
    usable = status == "completed" or (
        status == "incomplete" and reason == "max_output_tokens" and bool(text)
    )
    body_error = row.body.get("error") if row.body else None
    metadata = row.body.get("metadata") if row.body else None
    return Envelope(
        provider=provider,
        tenant=tenant,
        kind="batch_row",
        key=row_key(batch_id, row.custom_id, row.index),
        response_id=_str_or_none(row.body.get("id")) if row.body else None,
        batch_id=batch_id,
        custom_id=row.custom_id,
        status=status,
        usable=usable,
        incomplete_reason=reason,
        model=fields.model,
        output_text=text,
        input_tokens=fields.input_tokens,
        output_tokens=fields.output_tokens,
        error=_error(row.error) or _error(body_error),
        metadata=metadata if isinstance(metadata, dict) else {},
        event_id=event_id,
        received_at=received_at,
        fetched_at=fetched_at or now_rfc3339(),
        body=row.body,
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True, slots=True)
class BatchFacts:
    """What a finished batch object says about the whole batch, in nopoll's words: what its
    ``batch`` summary envelope carries. Each provider dialect reads its own object's shape
    (a ``status``, or only a ``request_status`` map; counts as an object or one integer;
    token totals); :meth:`of` is the reading of an OpenAI-style batch object."""

    status: str
    """The batch's status in nopoll's words (:data:`~nopoll.status.STATUSES`)."""
    request_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """Requests by state, with ``total`` where the provider says how many there are."""
    input_tokens: int | None = None
    output_tokens: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further facts for the summary's ``metadata`` (a cost total, a label)."""

    @classmethod
    def of(cls, batch: dict[str, Any]) -> BatchFacts:
        """An OpenAI-style batch object's facts: its ``status`` (a batch without one that is
        over, e.g. an ended Message Batch, is ``completed``) and its ``request_counts``
        object."""
        status = final_status(batch.get("status") or "completed", "batch") or "failed"
        counts = batch.get("request_counts")
        request_counts = (
            {k: v for k, v in counts.items() if _int_or_none(v) is not None}
            if isinstance(counts, dict)
            else {}
        )
        return cls(status=status, request_counts=request_counts)


def batch_summary_envelope(
    batch: dict[str, Any],
    *,
    provider: str,
    batch_id: str,
    received_at: str,
    event_id: str | None,
    counts: dict[str, int],
    tenant: str = DEFAULT_TENANT,
    facts: BatchFacts | None = None,
) -> Envelope:
    """The ``batch`` envelope written after every row: the batch's facts (its dialect's
    reading of the object; by default :meth:`BatchFacts.of`), nopoll's own row counts and
    the batch object (without its inline rows)."""
    facts = facts or BatchFacts.of(batch)
    body = {k: v for k, v in batch.items() if k not in ("results", "request_status")}
    metadata = batch.get("metadata") if isinstance(batch.get("metadata"), dict) else {}
    return Envelope(
        provider=provider,
        tenant=tenant,
        kind="batch",
        key=batch_id,
        batch_id=batch_id,
        status=facts.status,
        usable=facts.status == "completed",
        model=_str_or_none(batch.get("model")),
        input_tokens=facts.input_tokens,
        output_tokens=facts.output_tokens,
        error=_error(batch.get("error")),
        metadata={
            **(metadata or {}),
            **facts.metadata,
            "request_counts": dict(facts.request_counts),
            "rows_by_status": counts,
        },
        event_id=event_id,
        received_at=received_at,
        fetched_at=now_rfc3339(),
        body=body,
    )
