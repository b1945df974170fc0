"""What every job of a worker process needs, typed and built once: :class:`WorkerState`.

:func:`build_state` makes it from the settings (provider clients, lazily opened sinks,
the dead-letter store, the batch runner, a Redis client of its own); the arq start-up hook
(:func:`startup`) builds one per process and shares it between the process's workers, and
``nopoll fetch-batch`` builds its own. Jobs read ``ctx["state"]``, nothing else of ctx but
arq's ``job_id`` and ``job_try`` and, in a batch job, its lease (``ctx["leases"]``). While
the workers' state is open, the cyclic GC is set for jobs (:func:`_tune_gc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from receiver.batches.runner import BatchRunner
from receiver.config.settings import ProviderConfig, Settings
from receiver.fanout.fanout import FanOut, ManagedSink
from receiver.fanout.publish import add_publication
from receiver.fanout.routing import Router
from receiver.liveness import Liveness
from receiver.metrics import Metrics
from receiver.providers import Dialect, ProviderClient, dialect_for
from receiver.queue._arq import arq_pool
from receiver.queue.deadletter import DeadLetters
from receiver.webhooks.tenants import DEFAULT_TENANT, tenant_providers

__all__ = ["Shared", "WorkerState", "build_state", "hand_back", "shutdown", "startup"]

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
    redis_url: str,
    metrics: Metrics,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> WorkerState:
    """A worker's resources; nothing is connected yet (sinks open on first use)."""

    def dialect(name: str, cfg: ProviderConfig) -> Dialect:
        on_request = metrics.observe_provider_request
        client = ProviderClient(
            name, cfg, settings.http, transport=transport, on_request=on_request
        )
        return dialect_for(cfg.dialect, client)

    dialects = {name: dialect(name, cfg) for name, cfg in settings.providers.items()}
    tenant_dialects = {key: dialect(key[1], cfg) for key, cfg in tenant_providers(settings).items()}
    sinks = {name: ManagedSink(name, cfg, metrics) for name, cfg in settings.sinks.items()}
    router = Router(settings.routes, list(sinks))
    # the results API's own sink (with consumer_tokens): every envelope, whatever the routes
    router = add_publication(sinks, router, settings, redis_url, metrics)
    fanout = FanOut(sinks, router, metrics)
    redis = arq_pool(redis_url, expires_ms=settings.job_expiry_s * 1000)
    dead_letters = DeadLetters(redis)
    runner = BatchRunner(
        settings, redis=redis, fanout=fanout, dead_letters=dead_letters, metrics=metrics
    )
    return WorkerState(
        settings, metrics, redis, dialects, fanout, dead_letters, runner, tenant_dialects
    )


@dataclass
class Shared:
    """The process's one :class:`WorkerState`, shared by its arq workers (``ctx["shared"]``)."""

    redis_url: str
    transport: httpx.AsyncBaseTransport | None = None
    state: WorkerState | None = None
    users: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    gc_threshold: tuple[int, int, int] | None = None
    """The cyclic GC's thresholds before the state was opened (see :func:`_tune_gc`)."""
    poller: asyncio.Task[None] | None = None
    """The process's watch poller (:mod:`receiver.worker.poller`), started with the state."""
    liveness: Liveness | None = None
    """The process's heartbeat (:mod:`receiver.liveness`), beating while the state is open."""
    publisher: asyncio.Task[None] | None = None
    """Publishes the accounts this process serves (:mod:`receiver.worker.served`)."""


_JOB_GC_THRESHOLD = (20_000, 20, 20)


def _tune_gc(shared: Shared) -> None:
    """Make the cyclic GC cheap for a worker, as long as its state is open.

    Everything that exists once the state is open (modules, settings, clients, sinks)
    lives as long as the state, so it is frozen out of the GC's sight: a full collection
    then walks only what jobs allocate. And a job's objects die by reference counting
    within milliseconds of their creation; with Python's default first threshold (700
    objects) every job in flight is scanned and promoted a few times before it ends
    (with both, the GC's share of a worker's CPU time at 1,000 results/s in
    ``bench/e2e.py`` fell from about a quarter to about a sixteenth). :func:`_restore_gc`
    undoes both."""
    shared.gc_threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*_JOB_GC_THRESHOLD)


def _restore_gc(shared: Shared) -> None:
    if shared.gc_threshold is not None:
        gc.unfreeze()
        gc.set_threshold(*shared.gc_threshold)
        shared.gc_threshold = None


async def startup(ctx: dict[str, Any]) -> None:
    """arq start-up hook: the process's state in ``ctx["state"]`` (built by the first
    worker to start, opened once)."""
    shared: Shared = ctx["shared"]
    first = shared.state is None
    if shared.state is None:  # no await before it is set: a second worker sees it
        shared.state = build_state(
            ctx["settings"], shared.redis_url, ctx["metrics"], transport=shared.transport
        )
    shared.users += 1
    ctx["state"] = shared.state
    ctx["fanout"] = shared.state.fanout  # for the heartbeat's sink health
    if first:
        if shared.liveness is not None:
            await shared.liveness.start()  # known as alive before its first claim
        from receiver.worker.served import publish_while_running

        state = shared.state
        shared.publisher = asyncio.create_task(
            publish_while_running(state.redis, state.settings), name="accounts publisher"
        )
        await shared.state.open()
        _tune_gc(shared)
        if shared.state.settings.providers:
            from receiver.worker.poller import WatchPoller

            owner = shared.liveness.worker_id if shared.liveness is not None else None
            poller = WatchPoller(shared.state, owner=owner)
            shared.poller = asyncio.create_task(poller.run(), name="watch poller")


async def hand_back(shared: Shared) -> None:
    """Stopping (SIGTERM): stop polling watches and make the ones this process took due
    now for the other workers, instead of after their lease."""
    await _stop_poller(shared)
    if shared.liveness is not None:
        try:
            n = await shared.liveness.hand_back_watches()
        except (RedisError, OSError) as exc:
            log.warning("could not hand back this worker's watches (%s)", type(exc).__name__)
        else:
            if n:
                log.info("handed back %d watch(es) being polled", n)


async def _stop_poller(shared: Shared) -> None:
    if shared.poller is not None:
        shared.poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await shared.poller
        shared.poller = None


async def shutdown(ctx: dict[str, Any]) -> None:
    """arq shutdown hook: close the state once the process's last worker stops."""
    shared: Shared = ctx["shared"]
    shared.users -= 1
    if shared.users <= 0 and shared.state is not None:
        state, shared.state = shared.state, None
        if shared.publisher is not None:
            shared.publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await shared.publisher
            shared.publisher = None
        await _stop_poller(shared)
        if shared.liveness is not None:
            await shared.liveness.stop()  # nothing of this process runs any more
        _restore_gc(shared)
        await state.aclose()
