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
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Any

import orjson
from redis.asyncio import Redis

from nopoll.envelope import DEFAULT_TENANT
from nopoll.kinds import DEFAULT_KIND, KINDS, WATCHABLE_KINDS
from receiver.activity import last_hour, processes, tokens_by_hour
from receiver.batches.progress import BATCH_INDEX_KEY
from receiver.config.accounts import scoped, tenant_providers
from receiver.config.settings import Settings
from receiver.fanout.health import queue_depths, sink_states
from receiver.feeds.store import FeedStore
from receiver.journey.store import JourneyStore
from receiver.queue.deadletter import DeadLetter, DeadLetters
from receiver.watches.store import WatchStore, due_key, read_member
from sinks.results import latest_key

__all__ = ["MAX_OFFSET", "Console"]

BATCHES_SHOWN = 100
"""Batches read per listing (newest first)."""
MAX_OFFSET = 10**12
"""The furthest a page of dead letters may start (Redis ranges are 64-bit)."""
_TENANT_READ = 1000
"""A tenant's listing (batches, next polls) reads this many entries at most, newest (or
soonest) first, to find its own among every tenant's."""


class Console:
    """The operator's view of one nopoll deployment (every pod shares the Redis)."""

    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.journeys = JourneyStore(redis, ttl_s=settings.journey_ttl_s)
        self.letters = DeadLetters(redis, journey=self.journeys)
        self.watches = WatchStore(redis, ended_ttl_s=settings.dedupe_ttl_s)

    def tenants(self) -> list[str]:
        """Every configured tenant: ``default`` first, then the ``tenants`` of the config."""
        return [DEFAULT_TENANT, *(t for t in self.settings.tenants if t != DEFAULT_TENANT)]

    async def overview(self, tenant: str | None = None) -> dict[str, Any]:
        """Activity of the last hour, queues, processes, sinks, dead letters, watches, and
        the counts of each tenant, the tokens landed per hour and model over the last day
        (``tenant`` given: that tenant's dead letters, watches and counts only, and no
        tokens, which are counted per model for every tenant together; activity, queues,
        processes and sinks are the deployment's)."""
        now = time.time()
        by_tenant = await self.tenant_counts()
        if tenant is not None:
            by_tenant = {tenant: by_tenant.get(tenant, _no_counts())}
        return {
            "at": now,
            "activity": await last_hour(self.redis, now),
            "queues": await queue_depths(self.redis),
            "processes": await processes(self.redis, now),
            "sinks": await self.sinks(),
            "dead_letters": await self.letters.count()
            if tenant is None
            else by_tenant[tenant]["dead_letters"],
            "watches": await self.watch_counts(tenant),
            "tenants": by_tenant,
            "tokens": await tokens_by_hour(self.redis, now)
            if tenant is None
            else {"hours": [], "models": {}},
            "feeds": await self.feeds(tenant),
        }

    async def feeds(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Each followed completion feed's holder, cursors, lag and count landed (``tenant``
        given: that tenant's accounts only)."""
        accounts = [
            (name, DEFAULT_TENANT)
            for name, cfg in self.settings.providers.items()
            if cfg.follows_feed
        ]
        accounts += [
            (provider, team)
            for (team, provider), cfg in tenant_providers(self.settings).items()
            if cfg.follows_feed
        ]
        store, now = FeedStore(self.redis), time.time()
        shown = []
        for provider, team in accounts:
            if tenant is not None and team != tenant:
                continue
            state = await store.state(scoped(provider, team))
            shown.append({"provider": provider, "tenant": team, **state.to_dict(now)})
        return shown

    async def tenant_counts(self) -> dict[str, dict[str, int]]:
        """Per tenant (every configured one, and any other that has something kept):
        batches running and finished (of the latest listed), pending watches, dead
        letters."""
        counts = {t: _no_counts() for t in self.tenants()}
        listed = await self.batches()
        for state in ("running", "finished"):
            for batch in listed[state]:
                counts.setdefault(batch["tenant"], _no_counts())[f"batches_{state}"] += 1
        for provider in self.settings.providers:
            async for tenant, _, _, _ in self._due(provider):
                counts.setdefault(tenant, _no_counts())["watches_pending"] += 1
        for tenant, n in (await self.letters.by_tenant()).items():
            counts.setdefault(tenant, _no_counts())["dead_letters"] = n
        return counts

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

    async def watch_counts(self, tenant: str | None = None) -> dict[str, dict[str, int | None]]:
        """Watches by provider: pending, landed, expired. For one ``tenant``: its pending
        ones (landed and expired are counted per provider only: None)."""
        if tenant is None:
            return {p: {**await self.watches.counts(p)} for p in self.settings.providers}
        out: dict[str, dict[str, int | None]] = {}
        for provider in self.settings.providers:
            pending = 0
            async for of, _, _, _ in self._due(provider):
                pending += of == tenant
            out[provider] = {"pending": pending, "landed": None, "expired": None}
        return out

    async def next_polls(self, limit: int = 20, tenant: str | None = None) -> list[dict[str, Any]]:
        """The soonest-due pending watches over every provider (and every tenant, or
        ``tenant``'s among the soonest 1,000 of each provider)."""
        found: list[dict[str, Any]] = []
        for provider in self.settings.providers:
            mine = 0
            async for of, kind, object_id, due_at in self._due(provider, _TENANT_READ):
                if tenant is not None and of != tenant:
                    continue
                found.append(
                    {
                        "provider": provider,
                        "tenant": of,
                        "kind": kind,
                        "id": object_id,
                        "due_at": due_at,
                    }
                )
                mine += 1
                if mine >= limit:
                    break
        return sorted(found, key=lambda w: w["due_at"])[:limit]

    async def _due(
        self, provider: str, most: int | None = None
    ) -> AsyncIterator[tuple[str, str, str, float]]:
        """``(tenant, kind, id, due at)`` of ``provider``'s pending watches, soonest first,
        read in slices (at most ``most``)."""
        start, step = 0, 1000
        while most is None or start < most:
            entries = await self.redis.zrange(
                due_key(provider), start, start + step - 1, withscores=True
            )
            for member, score in entries:
                tenant, kind, object_id = read_member(member.decode())
                yield tenant, kind, object_id, score / 1000
            if len(entries) < step:
                return
            start += step

    async def batches(
        self, limit: int = BATCHES_SHOWN, tenant: str | None = None
    ) -> dict[str, list[dict[str, Any]]]:
        """Batches in progress and finished ones (newest first), with rows done per sink,
        rate and ETA (``tenant`` given: its own among the newest 1,000). Entries whose
        state expired are dropped from the index."""
        keys: list[str] = [
            k.decode()
            for k in await self.redis.zrevrange(
                BATCH_INDEX_KEY, 0, (limit if tenant is None else _TENANT_READ) - 1
            )
        ]
        if tenant is not None:
            keys = [k for k in keys if _key_scope(k)[1] == tenant][:limit]
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
        self,
        *,
        offset: int = 0,
        limit: int = 50,
        sink: str | None = None,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """A page of dead letters (of one sink's, one tenant's), newest first, and how
        many there are."""
        letters, total = await self.letters.page(
            offset=offset, limit=limit, sink=sink, tenant=tenant
        )
        return {"total": total, "offset": offset, "letters": [_letter(d) for d in letters]}

    async def replay(
        self, *, ids: list[str] | None = None, sink: str | None = None, tenant: str | None = None
    ) -> dict[str, int]:
        """Queue dead letters again: the given ids, or every letter of ``sink`` (or all of
        them with neither); only ``tenant``'s when given. ``kept``: letters whose work
        cannot be redone (still listed)."""
        if ids is None:
            letters = await self.letters.find(sink=sink, tenant=tenant)
        else:
            letters = [
                d for d in await self.letters.get(ids) if tenant is None or d.tenant == tenant
            ]
        replayed = await self.letters.replay(letters)
        return {"replayed": replayed, "kept": len(letters) - replayed}

    async def journey(
        self, provider: str, q: str, tenant: str = DEFAULT_TENANT
    ) -> dict[str, Any] | None:
        """What happened to ``q`` of ``tenant`` at ``provider``: a response id, a batch id,
        a batch row's ``{batch_id}/{custom_id}`` key (its batch's journey, and the row's
        stored envelope) or a callback's webhook-id. Its events (oldest first), its watch,
        its dead letters and the results API's link to it; None when nothing is known."""
        object_id, row, webhook_id = q, None, None
        events = await self.journeys.events(provider, q, tenant)
        if not events and "/" in q:
            batch_id = q.partition("/")[0]
            if batch_events := await self.journeys.events(provider, batch_id, tenant):
                object_id, row, events = batch_id, q, batch_events
        if not events and (found := await self.journeys.by_webhook(provider, q, tenant)):
            object_id, webhook_id = found, q
            events = await self.journeys.events(provider, found, tenant)
        watch = None
        for kind in WATCHABLE_KINDS:
            if watch is None:
                watch = await self.watches.get(provider, kind, object_id, tenant)
        letters = await self.letters.of_journey(provider, object_id, tenant)
        key = row or object_id
        stored = await self.redis.get(latest_key(tenant, provider, key))
        if not (events or watch or letters or stored):
            return None
        result = None
        if stored is not None:
            result = f"/v1/results/{provider}/{key}"
            if tenant != DEFAULT_TENANT:
                result += f"?tenant={tenant}"
        return {
            "provider": provider,
            "tenant": tenant,
            "id": object_id,
            "asked": q,
            "kind": _kind(row, watch.kind if watch else None, events),
            "row": row,
            "webhook_id": webhook_id,
            "events": events,
            "watch": watch.to_dict() if watch else None,
            "dead_letters": [_letter(d) for d in letters],
            "result": result,
            "envelope": orjson.loads(stored) if row is not None and stored else None,
        }

    async def find_journey(self, q: str, tenant: str | None = None) -> dict[str, Any] | None:
        """:meth:`journey` of ``q`` at the first configured provider (and tenant, unless
        given) that knows it: the default tenant's first, then each tenant's."""
        tenants = [tenant] if tenant else [DEFAULT_TENANT, *self.settings.tenants]
        for who in tenants:
            for provider in self.settings.providers:
                if who != DEFAULT_TENANT and provider not in self.settings.tenants[who].providers:
                    continue
                found = await self.journey(provider, q, who)
                if found is not None:
                    return found
        return None

    def sink_names(self) -> list[str]:
        """What a dead letter's ``sink`` can be: the sinks, ``fetch`` and ``watch``."""
        return [*self.settings.sinks, "fetch", "watch"]


def _no_counts() -> dict[str, int]:
    return {"batches_running": 0, "batches_finished": 0, "watches_pending": 0, "dead_letters": 0}


_ROWS_OF: str = next(info.row_of for info in KINDS.values() if info.row_of is not None)
"""The kind a row asked about belongs to: a row's key is ``{id}/{custom_id}`` of one."""


def _kind(row: str | None, watched: str | None, events: list[dict[str, Any]]) -> str:
    """A watchable kind, from whatever says it (``unknown`` when nothing does)."""
    if row is not None:
        return _ROWS_OF
    if watched is not None:
        return watched
    for event in events:
        if event.get("kind") in WATCHABLE_KINDS:
            return str(event["kind"])
        if isinstance(event.get("event"), str):
            return _kind_of_event_name(event["event"])
    return "unknown"


def _kind_of_event_name(event_type: str) -> str:
    """The watchable kind an event type starts with (``batch.``), else the default kind."""
    named, dot, _ = event_type.partition(".")
    return named if dot and named in WATCHABLE_KINDS else DEFAULT_KIND


_LISTED = tuple(f.name for f in fields(DeadLetter) if f.name != "kwargs")
"""A letter's fields in a listing: all but its work (envelopes, large, and copied whole by
``asdict`` before being dropped)."""


def _letter(d: DeadLetter) -> dict[str, Any]:
    data = {name: getattr(d, name) for name in _LISTED}
    data["keys"] = list(d.keys)
    data["tenant"] = d.tenant
    return data


def _key_scope(key: str) -> tuple[str, str]:
    """(provider, tenant) of a batch state key ``nopoll:batch:<provider[@tenant]>:<id>``."""
    scope = key.removeprefix("nopoll:batch:").partition(":")[0]
    provider, at, tenant = scope.partition("@")
    return provider, tenant if at else DEFAULT_TENANT


def _batch(key: str, raw: dict[bytes, bytes], sinks: list[str], now: float) -> dict[str, Any]:
    state = {k.decode(): v.decode() for k, v in raw.items()}
    _, _, rest = key.partition("nopoll:batch:")
    batch_id = rest.partition(":")[2]
    provider, tenant = _key_scope(key)
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
        "tenant": tenant,
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
