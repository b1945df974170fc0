"""What every job of a worker process needs, typed and built once: :class:`WorkerState`.

:func:`build_state` makes it from the settings (provider clients, lazily opened sinks,
the dead-letter store, the batch runner, a Redis client of its own); the arq start-up hook
(:func:`receiver.worker.process.startup`) builds one per process and shares it between the
process's workers, and ``nopoll fetch-batch`` builds its own. Jobs read ``ctx["state"]``,
nothing else of ctx but arq's ``job_id`` and ``job_try`` and, in a batch job, its lease
(``ctx["leases"]``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from receiver.batches.runner import BatchRunner
from receiver.config.accounts import DEFAULT_TENANT, tenant_providers
from receiver.config.settings import ProviderConfig, Settings
from receiver.fanout.fanout import FanOut, ManagedSink
from receiver.fanout.publish import add_publication
from receiver.fanout.routing import Router
from receiver.journey.store import JourneyStore
from receiver.metrics import Metrics
from receiver.providers import Dialect, ProviderClient, dialect_for
from receiver.providers.budget import account_budget
from receiver.queue._arq import arq_pool
from receiver.queue.deadletter import DeadLetters
from receiver.queue.trips import UNBOUNDED, SharedTrips
from receiver.redis.connector import RedisConnector
from receiver.watches.store import WatchStore
from receiver.worker.liveness import DEAD_AFTER_S

__all__ = ["WorkerState", "build_state"]

log = logging.getLogger("nopoll.worker")


@dataclass(frozen=True, slots=True)
class WorkerState:
    """The resources of one worker process (see the module docs)."""

    settings: Settings
    metrics: Metrics
    redis: Redis
    """nopoll's own client: dead letters, batch progress, hand-offs (arq has its own)."""
    dialects: Mapping[str, Dialect]
    fanout: FanOut
    dead_letters: DeadLetters
    batch_runner: BatchRunner
    tenant_dialects: Mapping[tuple[str, str], Dialect] = field(default_factory=dict)
    """Each ``(tenant, provider)`` account of the other tenants, with its own api_key."""
    journey: JourneyStore | None = None
    """Where the jobs note each id's fetch tries and sink writes (None: nowhere)."""
    trips: SharedTrips | None = None
    """Round trips the jobs share: their watch transitions and trail events ride together."""
    watches: WatchStore | None = None
    """The watches, through :attr:`trips`."""

    async def trail(
        self, provider: str, object_id: str, step: str, tenant: str = DEFAULT_TENANT, **fields: Any
    ) -> None:
        """One event on the id's journey (best-effort: see :mod:`receiver.journey.store`)."""
        if self.journey is None:
            return
        if self.trips is None:
            await self.journey.record(provider, object_id, step, tenant, **fields)
            return
        await self.send_trail(self.journey.commands(provider, object_id, step, tenant, **fields))

    async def send_trail(
        self, commands: list[tuple[Any, ...]], *also: tuple[Any, ...]
    ) -> list[Any]:
        """Trail events' commands and ``also`` (others of the job's) in one shared trip; the
        replies of ``also``. A trail event Redis cannot take is logged and dropped (the
        work goes on); a failed trip raises only when ``also`` was sent."""
        assert self.trips is not None
        if not commands and not also:
            return []
        try:
            replies = await self.trips.run([*commands, *also])
        except (RedisError, OSError) as exc:
            if also:
                raise
            log.debug("journey events dropped: %s", exc)
            return []
        return replies[len(commands) :]

    def dialect(self, provider: str, tenant: str = DEFAULT_TENANT) -> Dialect | None:
        """The dialect that fetches ``tenant``'s results at ``provider`` (with the tenant's
        key); None when the provider, or the tenant's account there, is not configured."""
        if tenant == DEFAULT_TENANT:
            return self.dialects.get(provider)
        return self.tenant_dialects.get((tenant, provider))

    async def open(self) -> None:
        """Open every sink now, so that start-up problems show at once; a sink that is down
        is only logged: its results wait and are retried."""
        for name, sink in self.fanout.sinks.items():
            try:
                await sink.write([])
            except Exception as exc:
                log.warning(
                    "sink %s cannot open yet (%s): its results wait and are retried; check "
                    "sinks.%s",
                    *(name, exc, name),
                )

    async def aclose(self) -> None:
        for dialect in (*self.dialects.values(), *self.tenant_dialects.values()):
            await dialect.client.aclose()
        await self.fanout.aclose()
        await self.redis.aclose()


def build_state(
    settings: Settings,
    redis_connector: RedisConnector,
    metrics: Metrics,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> WorkerState:
    """A worker's resources; nothing is connected yet (sinks open on first use). Each
    provider account (a provider's own, each tenant's there) gets its client with its own
    request budget (:mod:`receiver.providers.budget`), on the state's Redis."""
    redis = arq_pool(redis_connector, expires_ms=settings.job_expiry_s * 1000)

    def dialect(name: str, tenant: str, cfg: ProviderConfig) -> Dialect:
        client = ProviderClient(
            name,
            cfg,
            settings.http,
            transport=transport,
            on_request=metrics.observe_provider_request,
            budget=account_budget(redis, name, tenant, cfg, metrics),
        )
        return dialect_for(cfg.dialect, client)

    dialects = {
        name: dialect(name, DEFAULT_TENANT, cfg) for name, cfg in settings.providers.items()
    }
    tenant_dialects = {
        key: dialect(key[1], key[0], cfg) for key, cfg in tenant_providers(settings).items()
    }
    sinks = {name: ManagedSink(name, cfg, metrics) for name, cfg in settings.sinks.items()}
    router = Router(settings.routes, list(sinks))
    # the results API's own sink (with consumer_tokens): every envelope, whatever the routes
    router = add_publication(sinks, router, settings, redis_connector, metrics)
    fanout = FanOut(sinks, router, metrics)
    journey = JourneyStore(redis, ttl_s=settings.journey_ttl_s)
    # one trip out at a time: whatever the jobs ask meanwhile leaves together in the next;
    # no bound on who waits: the callers are this process's own jobs (worker.max_jobs)
    trips = SharedTrips(redis, max_in_flight=1, max_pending=UNBOUNDED)
    watches = WatchStore(redis, ended_ttl_s=settings.dedupe_ttl_s, trips=trips)
    dead_letters = DeadLetters(
        redis, journey=journey, limits=settings.dead_letters, on_dropped=metrics.letters_dropped
    )
    runner = BatchRunner(
        settings,
        redis=redis,
        fanout=fanout,
        dead_letters=dead_letters,
        metrics=metrics,
        dead_after_s=DEAD_AFTER_S,
        journey=journey,
    )
    return WorkerState(
        settings,
        metrics,
        redis,
        dialects,
        fanout,
        dead_letters,
        runner,
        tenant_dialects,
        journey,
        trips,
        watches,
    )
