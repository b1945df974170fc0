"""What every process did, per minute, and which processes are alive: shared through Redis.

Each process runs one :class:`ActivityRecorder`: every few seconds it adds what its own
Prometheus counters gained into ``nopoll:activity:<unix minute>``, the tokens by model
into ``nopoll:activity:tokens:<unix hour>``, and stamps itself in ``nopoll:processes``.
``/ui`` and ``GET /admin/v1/overview`` read them with :func:`last_hour`,
:func:`processes` and :func:`tokens_by_hour`. A flush that finds Redis down keeps its
deltas for the next one.

See docs/ui.md (what it shows); the keys are in docs/capacity.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterable
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from receiver.metrics import Metrics

__all__ = ["ActivityRecorder", "last_hour", "processes", "tokens_by_hour"]

log = logging.getLogger("nopoll.activity")

_PREFIX = "nopoll:activity:"
PROCESSES_KEY = "nopoll:processes"
_TTL_S = 2 * 3600
_GONE_S = 120.0
"""A process not heard from for this long is dropped from the list."""
FIELDS = ("callbacks", "accepted", "results", "dead_letters")


def _total(counter: Any, *, where: dict[str, str] | None = None) -> float:
    """The sum of a labelled counter's ``_total`` samples (optionally matching labels)."""
    total = 0.0
    for family in counter.collect():
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if where and any(sample.labels.get(k) != v for k, v in where.items()):
                continue
            total += sample.value
    return total


class ActivityRecorder:
    """Adds this process's counter increments to the shared per-minute hashes."""

    def __init__(self, redis: Redis, metrics: Metrics, roles: Iterable[str]) -> None:
        self._redis = redis
        self._metrics = metrics
        self._roles = sorted(roles)
        self._sent: dict[str, float] = dict.fromkeys(FIELDS, 0.0)
        self._tokens_sent: dict[str, float] = {}
        self._id = f"{socket.gethostname()}:{os.getpid()}"
        self._started = time.time()

    def _totals(self) -> dict[str, float]:
        m = self._metrics
        return {
            "callbacks": _total(m.callbacks),
            "accepted": _total(m.callbacks, where={"outcome": "accepted"}),
            "results": _total(m.results),
            "dead_letters": _total(m.dead_letters),
        }

    async def flush(self, now: float | None = None) -> None:
        """Send what the counters gained since the last successful flush."""
        now = time.time() if now is None else now
        totals = self._totals()
        deltas = {k: int(totals[k] - self._sent[k]) for k in FIELDS}
        key = f"{_PREFIX}{int(now // 60)}"
        beat = orjson.dumps({"roles": self._roles, "at": now, "started": self._started}).decode()
        tokens = _tokens_by_model(self._metrics)
        token_deltas = {m: int(n - self._tokens_sent.get(m, 0.0)) for m, n in tokens.items()}
        async with self._redis.pipeline(transaction=True) as pipe:
            for field, n in deltas.items():
                if n:
                    pipe.hincrby(key, field, n)
            pipe.expire(key, _TTL_S)
            pipe.hset(PROCESSES_KEY, self._id, beat)
            _add_tokens(pipe, token_deltas, now)
            await pipe.execute()
        for field, n in deltas.items():
            self._sent[field] += n
        for model, n in token_deltas.items():
            self._tokens_sent[model] = self._tokens_sent.get(model, 0.0) + n

    async def run(self, stopping: asyncio.Event, interval_s: float = 5.0) -> None:
        """Flush every ``interval_s`` until ``stopping`` is set, then once more."""
        while not stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval_s)
            try:
                await self.flush()
            except (RedisError, OSError) as exc:
                log.debug("activity not recorded this time: %s", type(exc).__name__)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.hdel(PROCESSES_KEY, self._id)  # type: ignore[misc]


async def last_hour(redis: Redis, now: float | None = None) -> list[dict[str, Any]]:
    """The last 60 minutes, oldest first: ``{"minute": unix seconds, <field>: int}``."""
    now = time.time() if now is None else now
    current = int(now // 60)
    minutes = list(range(current - 59, current + 1))
    async with redis.pipeline(transaction=False) as pipe:
        for minute in minutes:
            pipe.hgetall(f"{_PREFIX}{minute}")
        raw = await pipe.execute()
    out = []
    for minute, values in zip(minutes, raw, strict=True):
        row: dict[str, Any] = {"minute": minute * 60}
        for field in FIELDS:
            row[field] = int(values.get(field.encode(), 0))
        out.append(row)
    return out


async def processes(redis: Redis, now: float | None = None) -> list[dict[str, Any]]:
    """The nopoll processes heard from in the last two minutes, with their last heartbeat
    age; older entries (a process killed without a goodbye) are removed."""
    now = time.time() if now is None else now
    raw = await redis.hgetall(PROCESSES_KEY)  # type: ignore[misc]
    alive, gone = [], []
    for name, value in raw.items():
        try:
            data = orjson.loads(value)
            at = float(data["at"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            gone.append(name)
            continue
        age = now - at
        if age > _GONE_S:
            gone.append(name)
            continue
        alive.append(
            {
                "process": name.decode(),
                "roles": list(data.get("roles", [])),
                "age_s": round(max(age, 0.0), 1),
                "up_s": round(max(now - float(data.get("started", at)), 0.0)),
            }
        )
    if gone:
        await redis.hdel(PROCESSES_KEY, *gone)  # type: ignore[misc]
    return sorted(alive, key=lambda p: p["process"])


_TOKENS_PREFIX = "nopoll:activity:tokens:"
_TOKENS_TTL_S = 26 * 3600


def _tokens_by_model(metrics: Metrics) -> dict[str, float]:
    """``nopoll_tokens`` of this process so far, input and output, by model."""
    totals: dict[str, float] = {}
    for family in metrics.tokens.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                model = sample.labels["model"]
                totals[model] = totals.get(model, 0.0) + sample.value
    return totals


def _add_tokens(pipe: Any, deltas: dict[str, int], now: float) -> None:
    """Queue the tokens gained since the last flush into the current hour's hash."""
    if not any(deltas.values()):
        return
    key = f"{_TOKENS_PREFIX}{int(now // 3600)}"
    for model, n in deltas.items():
        if n:
            pipe.hincrby(key, model, n)
    pipe.expire(key, _TOKENS_TTL_S)


async def tokens_by_hour(redis: Redis, now: float | None = None, hours: int = 24) -> dict[str, Any]:
    """Tokens of the results landed per hour and model over the last ``hours`` hours,
    summed over every process: ``{"hours": [unix seconds, oldest first], "models":
    {model: [tokens per hour]}}``, the busiest model first."""
    now = time.time() if now is None else now
    current = int(now // 3600)
    hour_numbers = list(range(current - hours + 1, current + 1))
    async with redis.pipeline(transaction=False) as pipe:
        for hour in hour_numbers:
            pipe.hgetall(f"{_TOKENS_PREFIX}{hour}")
        raw = await pipe.execute()
    models: dict[str, list[int]] = {}
    for i, values in enumerate(raw):
        for model, n in values.items():
            models.setdefault(model.decode(), [0] * hours)[i] = int(n)
    busiest = sorted(models.items(), key=lambda item: (-sum(item[1]), item[0]))
    return {"hours": [h * 3600 for h in hour_numbers], "models": dict(busiest)}
