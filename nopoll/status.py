"""Provider statuses in nopoll's words: the one table every dialect, the envelope and the
pollers read.

A result's ``status`` is one of :data:`STATUSES`; :data:`FINAL` maps every spelling the
providers document (``COMPLETED``, ``canceled``, ``succeeded``, ...), case-insensitively.
Anything else, in :data:`UNFINISHED` or unknown, is not final: fetched again later, never
stored. A batch row with an unknown status is ``failed`` (``unknown_status``), since its
batch is over.

See docs/envelope.md (statuses).
"""

from __future__ import annotations

from typing import Any

from nopoll.kinds import DEFAULT_KIND, SUMMARY_KINDS, WatchKind

__all__ = [
    "FINAL",
    "STATUSES",
    "UNFINISHED",
    "final_status",
    "pending_status",
    "row_status",
    "unfinished_status",
    "unknown_status",
]

STATUSES = ("completed", "incomplete", "failed", "cancelled", "expired")
"""A result's status in every envelope: what the results stream can filter on."""

FINAL: dict[str, str] = {
    "completed": "completed",
    "succeeded": "completed",
    "success": "completed",
    "incomplete": "incomplete",
    "failed": "failed",
    "error": "failed",
    "errored": "failed",
    "cancelled": "cancelled",
    "canceled": "cancelled",
    "expired": "expired",
}
"""Every final spelling the providers' documents use (lower-cased) → nopoll's status."""

BATCH_FINAL: dict[str, str] = {**FINAL, "ended": "completed"}
"""A batch object is also over when it has ``ended`` (Anthropic's ``processing_status``);
its rows say how each request went."""

UNFINISHED = frozenset(
    {
        "queued",
        "pending",
        "validating",
        "in_progress",
        "running",
        "processing",
        "finalizing",
        "cancelling",
        "canceling",
    }
)
"""Statuses of an object that is not finished yet, as the providers spell them."""


def final_status(value: Any, kind: WatchKind = DEFAULT_KIND) -> str | None:
    """nopoll's status for a provider's final status (any case); None when ``value`` is
    not a final status nopoll knows."""
    if not isinstance(value, str):
        return None
    return (BATCH_FINAL if kind in SUMMARY_KINDS else FINAL).get(value.lower())


def unfinished_status(obj: dict[str, Any], kind: WatchKind = DEFAULT_KIND) -> str | None:
    """:func:`pending_status` of the object's ``status`` (where a Responses object, and most
    batch objects, keep it; a dialect that keeps it elsewhere reads it itself)."""
    return pending_status(obj.get("status"), kind)


def pending_status(status: Any, kind: WatchKind = DEFAULT_KIND) -> str | None:
    """An object's status when it is not finished (``"<none>"`` when it has none, at most
    64 characters); None when it is final."""
    if not isinstance(status, str):
        return "<none>"
    if final_status(status, kind) is not None:
        return None
    return status[:64]


def row_status(value: Any, default: str = "failed") -> str:
    """A batch row's status in nopoll's words; a status nopoll does not know is ``failed``
    (:func:`unknown_status` says why), no status at all is ``default``."""
    if not isinstance(value, str):
        return default
    return FINAL.get(value.lower(), "failed")


def unknown_status(value: Any) -> dict[str, str] | None:
    """The error of a row whose status is text but no final status nopoll knows."""
    if isinstance(value, str) and value.lower() not in FINAL:
        return {
            "code": "unknown_status",
            "message": f"row status {value[:64]!r} is not a final status nopoll knows",
        }
    return None
