"""The result envelope (``nopoll.result/v1``) and how provider objects become envelopes.

Every sink receives the same record; DESIGN.md's table is the contract. The functions
here are pure: they take the provider's JSON and return envelopes, nothing else.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = [
    "SCHEMA",
    "Envelope",
    "chat_output_text",
    "envelope_from_response",
    "now_rfc3339",
    "response_output_text",
]

SCHEMA = "nopoll.result/v1"
Kind = Literal["response", "batch_row", "batch"]
_TERMINAL = {"completed", "incomplete", "failed", "cancelled", "expired"}


def now_rfc3339() -> str:
    """The current UTC time as RFC 3339 with milliseconds."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclasses.dataclass(slots=True, kw_only=True)
class Envelope:
    """One result as every sink sees it."""

    provider: str
    tenant: str = "default"
    kind: Kind
    key: str
    response_id: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    status: str
    usable: bool
    incomplete_reason: str | None = None
    model: str | None = None
    output_text: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: dict[str, Any] | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    event_id: str | None = None
    received_at: str
    fetched_at: str
    body: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The envelope as a JSON-ready dict, fields in contract order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Envelope:
        """Rebuild an envelope from :meth:`to_dict` output (e.g. a queued delivery)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


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


def envelope_from_response(
    response: dict[str, Any],
    *,
    provider: str,
    received_at: str,
    event_id: str | None = None,
    tenant: str = "default",
) -> Envelope:
    """Normalize a Responses API object into a ``response`` envelope."""
    status = response.get("status")
    if status not in _TERMINAL:
        status = str(status) if status is not None else "failed"
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
