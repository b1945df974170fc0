"""sference's completion feed for the provider simulator: ``GET /v1/responses/events``.

Each response made by ``POST /v1/responses`` becomes an event once complete, in its
stream's feed (``metadata.stream_id``) or the account's own. A ``completion_id`` is a
UUIDv7 of the completion's millisecond, shown once that millisecond has passed, so ids
sort in completion order. ``starting_after`` pages oldest first, no cursor and
``ending_before`` newest first; ``wait_ms`` (at most 30 s) holds an empty answer.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from dataclasses import dataclass
from typing import Any

from receiver.demo.batches import cost_micros, iso
from receiver.demo.ids import uuid7_at

__all__ = ["MAX_WAIT_MS", "FeedEvents"]

MAX_WAIT_MS = 30_000
"""sference caps a long poll at 30 s (its CLI's help says so)."""
_LOOK_S = 0.02
"""How often a waiting request looks for new events."""


@dataclass(frozen=True, slots=True)
class _Completion:
    completion_id: str
    response_id: str
    custom_id: str | None
    done_ms: int
    model: str
    text: str


class FeedEvents:
    """Every completion, kept sorted per feed (the stream id, or None for the account's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str | None, list[str]] = {}
        self._items: dict[str, _Completion] = {}

    def add(
        self,
        response_id: str,
        *,
        stream_id: str | None,
        custom_id: str | None,
        completes_at: float,
        model: str,
        text: str,
    ) -> None:
        """A created response, completing at ``completes_at``."""
        done_ms = int(completes_at * 1000)
        cid = uuid7_at(done_ms, response_id)
        item = _Completion(cid, response_id, custom_id, done_ms, model, text)
        with self._lock:
            self._items[cid] = item
            bisect.insort(self._ids.setdefault(stream_id, []), cid)

    def page(
        self,
        stream_id: str | None,
        *,
        limit: int,
        starting_after: str | None,
        ending_before: str | None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """One page of events as the feed answers it, and ``has_more``."""
        shown_ms = int(time.time() * 1000)  # an event's millisecond must have passed
        with self._lock:
            ids = self._ids.get(stream_id, [])
            end = _visible_end(ids, self._items, shown_ms)
            if starting_after is not None:
                start = bisect.bisect_right(ids, starting_after)
                chosen = ids[start : min(end, start + limit)]
                more = start + limit < end
            else:
                stop = end
                if ending_before is not None:
                    stop = min(end, bisect.bisect_left(ids, ending_before))
                chosen = list(reversed(ids[max(0, stop - limit) : stop]))
                more = stop - limit > 0
            items = [self._items[c] for c in chosen]
        return [_event(i) for i in items], more

    async def wait_page(
        self,
        stream_id: str | None,
        *,
        limit: int,
        starting_after: str | None,
        ending_before: str | None,
        wait_ms: int,
    ) -> tuple[list[dict[str, Any]], bool]:
        """:meth:`page`, held up to ``wait_ms`` while it is empty."""
        deadline = time.monotonic() + min(wait_ms, MAX_WAIT_MS) / 1000
        while True:
            found = self.page(
                stream_id, limit=limit, starting_after=starting_after, ending_before=ending_before
            )
            if found[0] or time.monotonic() >= deadline:
                return found
            await asyncio.sleep(_LOOK_S)


def _visible_end(ids: list[str], items: dict[str, _Completion], shown_ms: int) -> int:
    """The end of the ids whose millisecond has passed (they sort by their millisecond)."""
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high) // 2
        if items[ids[mid]].done_ms < shown_ms:
            low = mid + 1
        else:
            high = mid
    return low


def _event(item: _Completion) -> dict[str, Any]:
    """A ``StreamInferenceCompletionEvent``: the result as a chat completion."""
    prompt, completion = 12, max(1, len(item.text.split()))
    return {
        "completion_id": item.completion_id,
        "response_id": item.response_id,
        "custom_id": item.custom_id,
        "status": "completed",
        "result": {
            "id": f"chatcmpl-{item.response_id}",
            "object": "chat.completion",
            "model": item.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": item.text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        },
        "error": None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cost_micros": cost_micros(prompt, completion),
        "completed_at": iso(item.done_ms / 1000),
    }
