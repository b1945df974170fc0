"""Dead letters: work that failed every retry, kept in Redis until replayed.

A dead letter holds everything needed to redo the work: the arq function and its
arguments (a fetch, or a sink delivery with its envelopes), the keys it concerns, how
many attempts it took and the last error. ``nopoll dlq list`` shows them,
``nopoll dlq replay`` queues them again (and forgets them once queued).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from arq.connections import ArqRedis

from receiver.queue import JOBS_QUEUE

__all__ = ["DeadLetter", "DeadLetters"]

_DATA = "nopoll:dlq"
_INDEX = "nopoll:dlq:index"


@dataclass(slots=True)
class DeadLetter:
    """One piece of failed work."""

    id: str
    sink: str
    """The sink that failed, or ``fetch`` when the provider fetch itself failed."""
    provider: str
    keys: list[str]
    attempts: int
    error: str
    function: str
    kwargs: dict[str, Any]
    created_at: float = field(default_factory=time.time)


class DeadLetters:
    """The dead-letter store on the shared Redis."""

    def __init__(self, redis: ArqRedis) -> None:
        self._redis = redis

    async def add(
        self,
        *,
        sink: str,
        provider: str,
        keys: list[str],
        attempts: int,
        error: str,
        function: str,
        kwargs: dict[str, Any],
    ) -> DeadLetter:
        """Keep failed work; returns the stored dead letter."""
        letter = DeadLetter(
            id=uuid.uuid4().hex,
            sink=sink,
            provider=provider,
            keys=keys,
            attempts=attempts,
            error=error[:2000],
            function=function,
            kwargs=kwargs,
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(_DATA, letter.id, orjson.dumps(asdict(letter)).decode())
            pipe.zadd(_INDEX, {letter.id: letter.created_at})
            await pipe.execute()
        return letter

    async def find(self, *, sink: str | None = None, key: str | None = None) -> list[DeadLetter]:
        """Dead letters, oldest first, optionally only one sink's or one key's."""
        ids = await self._redis.zrange(_INDEX, 0, -1)
        if not ids:
            return []
        raw: list[bytes | None] = await self._redis.hmget(_DATA, ids)  # type: ignore[misc]
        letters = [DeadLetter(**orjson.loads(r)) for r in raw if r is not None]
        return [
            d
            for d in letters
            if (sink is None or d.sink == sink) and (key is None or key in d.keys)
        ]

    async def replay(self, letters: list[DeadLetter]) -> int:
        """Queue each dead letter's work again (from try 1) and forget it; returns how many."""
        done = 0
        for letter in letters:
            await self._redis.enqueue_job(
                letter.function,
                _job_id=f"replay:{letter.id}",
                _queue_name=JOBS_QUEUE,
                **letter.kwargs,
            )
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hdel(_DATA, letter.id)
                pipe.zrem(_INDEX, letter.id)
                await pipe.execute()
            done += 1
        return done

    async def count(self) -> int:
        """How many dead letters are kept."""
        return int(await self._redis.zcard(_INDEX))
