"""Which provider objects are finished: only a terminal object is ever stored as a result.

A response or batch whose status is not terminal yet (``queued``, ``in_progress``,
``validating``, ``finalizing``, ``cancelling``, or any status nopoll does not know) is a
transient failure of the fetch: retried with backoff, then kept as a dead letter that
names the status. An unknown status is treated as unfinished on purpose: a dead letter
can be replayed, a wrong final row cannot be taken back.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TERMINAL_BATCH", "TERMINAL_RESPONSE", "unfinished_status"]

TERMINAL_RESPONSE = frozenset(
    {"completed", "incomplete", "failed", "cancelled", "canceled", "expired"}
)
"""Final states of a Responses object."""
TERMINAL_BATCH = frozenset({"completed", "failed", "cancelled", "canceled", "expired", "ended"})
"""Final states of a batch object in the four dialects."""


def unfinished_status(obj: dict[str, Any], terminal: frozenset[str]) -> str | None:
    """The object's status when it is not terminal (``"<none>"`` when it has none); None
    when it is finished."""
    status = obj.get("status")
    if not isinstance(status, str):
        return "<none>"
    if status.lower() in terminal:
        return None
    return status[:64]
