"""sference's streams for the provider simulator: ``POST /v1/streams {name, window?}``
creates one (201), ``GET /v1/streams/{id}`` counts the responses created with its id in
``metadata.stream_id``, ``GET /v1/streams`` lists them, ``GET /v1/responses?stream_id=``
lists a stream's responses (see :mod:`receiver.demo.creates`, which keeps both).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from receiver.demo.batches import cost_micros, iso
from receiver.demo.ids import uuid7
from receiver.demo.responses import make_response

__all__ = ["SimStream", "StreamItem"]


@dataclass(frozen=True, slots=True)
class StreamItem:
    """A response created in a stream: its id, when it was created and when it ends."""

    response_id: str
    created_at: float
    completes_at: float


@dataclass(frozen=True, slots=True)
class SimStream:
    """A stream the simulator created."""

    stream_id: str
    name: str
    created_at: float
    window: str = "24h"

    def list_item(self) -> dict[str, Any]:
        """The stream as an item of ``GET /v1/streams`` (``StreamListItemResponse``)."""
        return {
            "id": self.stream_id,
            "name": self.name,
            "window": self.window,
            "status": "open",
            "created_at": iso(self.created_at),
            "updated_at": iso(self.created_at),
        }

    def detail(self, items: Iterable[StreamItem], now: float) -> dict[str, Any]:
        """``StreamDetailResponse`` at ``now``: each item pending in the first half of its
        wait, running in the second, then completed (with its tokens and cost)."""
        counts = {"pending": 0, "running": 0, "completed": 0}
        last: StreamItem | None = None
        for item in items:
            if now >= item.completes_at:
                counts["completed"] += 1
                if last is None or item.completes_at >= last.completes_at:
                    last = item
            else:
                midpoint = item.created_at + (item.completes_at - item.created_at) / 2
                counts["pending" if now < midpoint else "running"] += 1
        total = sum(counts.values())
        usage = make_response("usage")["usage"]
        prompt = usage["input_tokens"] * counts["completed"]
        completion = usage["output_tokens"] * counts["completed"]
        detail = self.list_item()
        detail.update(
            updated_at=iso(max(self.created_at, last.completes_at if last else 0)),
            cancelled_at=None,
            archived_at=None,
            total_items=total,
            pending_items=counts["pending"],
            running_items=counts["running"],
            completed_items=counts["completed"],
            failed_items=0,
            cancelled_items=0,
            completion_ratio=counts["completed"] / total if total else 0.0,
            total_prompt_tokens=prompt,
            total_completion_tokens=completion,
            total_tokens=prompt + completion,
            total_cost_micros=cost_micros(prompt, completion),
            last_completion_at=iso(last.completes_at) if last else None,
            latest_completion_id=uuid7(f"completion {last.response_id}") if last else None,
        )
        return detail
