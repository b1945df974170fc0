"""What an operator looks at: one read model over Redis for ``/admin/v1`` and ``/ui``.

The status page and the admin API call the same methods of :class:`Console`, so they can
never disagree: activity per minute (:mod:`receiver.activity`), queue depths and sink
health (:mod:`receiver.fanout.health`), batches (:mod:`receiver.batches.progress`'s index), watches
(:mod:`receiver.watches.store`) and dead letters (:mod:`receiver.queue.deadletter`). Every method is
bounded: it reads a page, never a whole keyspace.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict
from typing import Any

import orjson
from redis.asyncio import Redis

from receiver.activity import last_hour, processes, tokens_by_hour
from receiver.batches.progress import BATCH_INDEX_KEY
from receiver.config.settings import Settings
from receiver.fanout.health import queue_depths, sink_states
from receiver.queue.deadletter import DeadLetter, DeadLetters
from receiver.watches.store import WatchStore, due_key, read_member

__all__ = ["MAX_OFFSET", "Console"]

BATCHES_SHOWN = 100
MAX_OFFSET = 10**12
"""The furthest a page of dead letters may start (Redis ranges are 64-bit)."""
"""Batches read per listing (newest first)."""


class Console:
    """The operator's view of one nopoll deployment (every pod shares the Redis)."""

    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.letters = DeadLetters(redis)
        self.watches = WatchStore(redis, ended_ttl_s=settings.dedupe_ttl_s)

    async def overview(self) -> dict[str, Any]:
        """Activity of the last hour, queues, processes, sinks, dead letters, watches, and
        the tokens landed per hour and model over the last day."""
        now = time.time()
        return {
            "at": now,
            "activity": await last_hour(self.redis, now),
            "queues": await queue_depths(self.redis),
            "processes": await processes(self.redis, now),
            "sinks": await self.sinks(),
            "dead_letters": await self.letters.count(),
            "watches": await self.watch_counts(),
            "tokens": await tokens_by_hour(self.redis, now),
        }

    async def sinks(self) -> list[dict[str, Any]]:
        """Every configured sink with its last published state (``unknown`` when no worker
        reported it lately)."""
        seen = await sink_states(self.redis)
        out = []
        for name, config in self.settings.sinks.items():
            data = seen.get(name, {})
            out.append(
                {
                    "name": name,
                    "type": config.type,
                    "state": data.get("state", "unknown"),
                    "error": data.get("error"),
                    "since": data.get("since"),
                    "worker": data.get("worker"),
                }
            )
        return out

    async def watch_counts(self) -> dict[str, dict[str, int]]:
        return {p: await self.watches.counts(p) for p in self.settings.providers}

    async def next_polls(self, limit: int = 20) -> list[dict[str, Any]]:
        """The soonest-due pending watches over every provider and tenant."""
        found: list[dict[str, Any]] = []
        for provider in self.settings.providers:
            entries = await self.redis.zrange(due_key(provider), 0, limit - 1, withscores=True)
            for member, score in entries:
                tenant, kind, object_id = read_member(member.decode())
                found.append(
                    {
                        "provider": provider,
                        "tenant": tenant,
                        "kind": kind,
                        "id": object_id,
                        "due_at": score / 1000,
                    }
                )
        return sorted(found, key=lambda w: w["due_at"])[:limit]

    async def batches(self, limit: int = BATCHES_SHOWN) -> dict[str, list[dict[str, Any]]]:
        """Batches in progress and finished ones (newest first), with rows done per sink,
        rate and ETA. Entries whose state expired are dropped from the index."""
        keys: list[str] = [
            k.decode() for k in await self.redis.zrevrange(BATCH_INDEX_KEY, 0, limit - 1)
        ]
        if not keys:
            return {"running": [], "finished": []}
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            states = await pipe.execute()
        gone = [k for k, s in zip(keys, states, strict=True) if not s]
        if gone:
            await self.redis.zrem(BATCH_INDEX_KEY, *gone)
        now = time.time()
        running: list[dict[str, Any]] = []
        finished: list[dict[str, Any]] = []
        for key, raw in zip(keys, states, strict=True):
            if raw:
                batch = _batch(key, raw, list(self.settings.sinks), now)
                (finished if batch["done"] else running).append(batch)
        return {"running": running, "finished": finished}

    async def dead_letters(
        self, *, offset: int = 0, limit: int = 50, sink: str | None = None
    ) -> dict[str, Any]:
        """A page of dead letters, newest first, and how many there are."""
        letters, total = await self.letters.page(offset=offset, limit=limit, sink=sink)
        return {"total": total, "offset": offset, "letters": [_letter(d) for d in letters]}

    async def replay(
        self, *, ids: list[str] | None = None, sink: str | None = None
    ) -> dict[str, int]:
        """Queue dead letters again: the given ids, or every letter of ``sink`` (or all of
        them with neither). ``kept``: letters whose work cannot be redone (still listed)."""
        letters = await self.letters.find(sink=sink) if ids is None else await self.letters.get(ids)
        replayed = await self.letters.replay(letters)
        return {"replayed": replayed, "kept": len(letters) - replayed}

    def sink_names(self) -> list[str]:
        """What a dead letter's ``sink`` can be: the sinks, ``fetch`` and ``watch``."""
        return [*self.settings.sinks, "fetch", "watch"]


def _letter(d: DeadLetter) -> dict[str, Any]:
    data = asdict(d)
    del data["kwargs"]  # the work itself: envelopes, large and not for a listing
    return data


def _batch(key: str, raw: dict[bytes, bytes], sinks: list[str], now: float) -> dict[str, Any]:
    state = {k.decode(): v.decode() for k, v in raw.items()}
    _, _, rest = key.partition("nopoll:batch:")
    provider, _, batch_id = rest.partition(":")
    chunks: dict[int, int] = {}
    by_status: Counter[str] = Counter()
    for name, value in state.items():
        if name.startswith("k:"):
            counts = orjson.loads(value)
            chunks[int(name[2:])] = sum(counts.values())
            by_status.update(counts)
    total = int(state["rows"]) if state.get("rows", "").isdigit() else None
    started = float(state.get("t0") or now)
    ended = float(state["t1"]) if state.get("t1") else None
    per_sink = {}
    for sink in sinks:
        last = int(state.get(f"c:{sink}", -1))
        per_sink[sink] = sum(n for number, n in chunks.items() if number <= last)
    done_rows = min(per_sink.values(), default=0)
    elapsed = max((ended or now) - started, 1e-3)
    rate = done_rows / elapsed
    eta = None
    if total is not None and not state.get("done") and rate > 0:
        eta = max(total - done_rows, 0) / rate
    return {
        "provider": provider,
        "batch_id": batch_id,
        "done": bool(state.get("done")),
        "rows": total,
        "fetched": sum(chunks.values()),
        "by_sink": per_sink,
        "by_status": dict(by_status),
        "started_at": started,
        "ended_at": ended,
        "rows_per_s": round(rate, 1),
        "eta_s": None if eta is None else round(eta, 1),
    }
