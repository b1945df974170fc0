"""Running nopoll: the API, the worker, or both in one process, with clean shutdown.

On SIGTERM or SIGINT the API finishes in-flight requests, and the worker hands back what
it holds but is not running, cancels its batch jobs (they resume elsewhere), waits up to
``worker.shutdown_wait_s`` for the rest, then leaves the live workers
(:mod:`receiver.worker.liveness`). Redis going away ends nothing. Once Redis first
answers, a ``maxmemory-policy`` that may evict jobs exits with status 2 (unless
``redis_policy_check: warn``); no persistence is a warning.

See docs/reliability.md (what nopoll expects of Redis, worker liveness) and
docs/deployment.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from nopoll.exceptions import ConfigError, NopollError
from receiver.activity import ActivityRecorder
from receiver.aio import settle_cancelled, where
from receiver.app import create_app, operator_app
from receiver.config.describe import describe
from receiver.config.settings import Settings
from receiver.embedded import EmbeddedRedis
from receiver.metrics import CONTENT_TYPE_LATEST, Metrics
from receiver.queue._arq import stop_workers, wait_stopped
from receiver.queue.enqueue import HEALTH_CHECK_KEY
from receiver.redis import RedisConnector, RedisLink, redis_settings_problems
from receiver.responses import json_answer
from receiver.tracing import configure as configure_tracing
from receiver.tracing import shutdown as shutdown_tracing
from receiver.webhooks.slots import ConnectionSlots
from receiver.worker.liveness import claim_identity, worker_identity
from receiver.worker.process import NopollWorker, Shared, build_workers, hand_back

__all__ = ["api_server_config", "redis_for", "run"]

log = logging.getLogger("nopoll")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (we stop the worker too)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def redis_for(settings: Settings) -> Iterator[RedisConnector]:
    """The process's one Redis connector, starting the embedded server (no ``redis.url``)
    for as long as needed; its pools are closed when the block ends."""
    if not settings.embedded_redis:
        yield RedisConnector(settings.redis)
        return
    server = EmbeddedRedis(settings.data_dir)
    url = server.start()
    try:
        yield RedisConnector(settings.redis, url=url)
    finally:
        server.stop()


@dataclass(frozen=True, slots=True)
class _Roles:
    """What one process runs: the API on ``host:port``, the workers, a worker health port."""

    api: bool
    worker: bool
    host: str
    port: int
    extra_ctx: dict[str, Any] | None
    health: tuple[str, int] | None
    config: str | None = None
    worker_id: str | None = None


def _api_server(settings: Settings, redis: Any, metrics: Metrics, roles: _Roles) -> _Server:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        await redis.aclose()

    app = create_app(
        settings,
        redis=redis,
        metrics=metrics,
        worker_heartbeat_key=HEALTH_CHECK_KEY if roles.worker else None,
        lifespan=lifespan,
    )
    config = api_server_config(app, settings, host=roles.host, port=roles.port, metrics=metrics)
    return _Server(config)


def _count_refusal(metrics: Metrics) -> Callable[[str], None]:
    def count(reason: str) -> None:
        metrics.connection_refusals.labels(reason).inc()

    return count


_IDLE_S = 5.0
"""A connection silent this long is closed: after a response (uvicorn's keep-alive
timeout) or before its first request (:class:`~receiver.webhooks.slots.ConnectionSlots`)."""


def api_server_config(
    app: Any,
    settings: Settings,
    *,
    host: str,
    port: int,
    lifespan: Literal["on", "off"] = "on",
    metrics: Metrics | None = None,
) -> uvicorn.Config:
    """uvicorn's settings for the API (the tests' servers use them too): its connections
    counted by :class:`~receiver.webhooks.slots.ConnectionSlots`, which answers 503
    beyond ``api.limit_concurrency`` (the provider retries later) and keeps
    ``api.reserved_for_webhooks`` of them for callbacks."""
    api = settings.api
    slots = ConnectionSlots(
        limit=api.limit_concurrency,
        reserve=api.reserved_for_webhooks,
        per_client=api.max_connections_per_client or api.limit_concurrency,
        trusted=api.trusted_proxies,
        idle_s=_IDLE_S,
        on_refused=None if metrics is None else _count_refusal(metrics),
    )
    return uvicorn.Config(
        slots.guard(app),
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan=lifespan,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=int(_IDLE_S),
        http=slots.protocol(),
        limit_concurrency=None,
        # X-Forwarded-For names the client only when it comes from a configured proxy
        proxy_headers=bool(settings.api.trusted_proxies),
        forwarded_allow_ips=list(settings.api.trusted_proxies),
    )


def _operator_server(settings: Settings, redis: Any, metrics: Metrics, roles: _Roles) -> _Server:
    """``api.operator_port``: /metrics and the detailed /readyz, beside the API."""
    app = operator_app(
        settings,
        redis=redis,
        metrics=metrics,
        worker_heartbeat_key=HEALTH_CHECK_KEY if roles.worker else None,
    )
    port = settings.api.operator_port
    assert port is not None
    return _Server(
        uvicorn.Config(
            app, host=roles.host, port=port, log_config=None, access_log=False, lifespan="off"
        )
    )


def _health_server(
    settings: Settings, workers: list[NopollWorker], metrics: Metrics, address: tuple[str, int]
) -> _Server:
    app = worker_health_app(workers, metrics, settings.worker.health_check_interval_s)
    host, port = address
    return _Server(
        uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")
    )


async def _run(settings: Settings, connector: RedisConnector, roles: _Roles) -> None:
    metrics = Metrics()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    redis = connector.client("api")
    api = (roles.host, roles.port) if roles.api else None
    for line in describe(settings, connector, api=api, worker=roles.worker, config=roles.config):
        log.info("%s", line)
    otel = settings.otel
    configure_tracing(  # opt-in: the otel block or OTEL_TRACES_EXPORTER
        enabled=otel.enabled,
        service_name=otel.service_name,
        exporter=otel.exporter,
        endpoint=otel.endpoint,
        role="+".join(r for r in ("api", "worker") if getattr(roles, r)),
    )

    workers: list[NopollWorker] = []
    if roles.worker:
        worker_id = await _identity(settings, connector, roles.worker_id)
        workers = build_workers(
            settings,
            connector,
            metrics,
            handle_signals=False,
            extra_ctx=roles.extra_ctx,
            worker_id=worker_id,
        )
    tasks = [asyncio.create_task(w.async_run(), name=f"worker {w.queue_name}") for w in workers]
    servers: dict[str, _Server] = {}
    if roles.api:
        servers["api"] = _api_server(settings, redis, metrics, roles)
        if settings.api.operator_port is not None:
            servers["operator"] = _operator_server(settings, redis, metrics, roles)
    if roles.health is not None and workers:
        servers["worker health"] = _health_server(settings, workers, metrics, roles.health)
    tasks += [asyncio.create_task(server.serve(), name=name) for name, server in servers.items()]

    refused: list[str] = []
    checker = asyncio.create_task(_check_redis(redis, settings, refused, stopping))
    recorder_redis = connector.client("api")
    recorded = asyncio.Event()
    recorder = ActivityRecorder(
        recorder_redis, metrics, [r for r in ("api", "worker") if getattr(roles, r)]
    )
    activity = asyncio.create_task(recorder.run(recorded), name="activity")
    stop_waiter = asyncio.create_task(stopping.wait())
    done, _ = await asyncio.wait([stop_waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    checker.cancel()
    failed = [t for t in done if t is not stop_waiter and t.exception() is not None]
    # refused at start-up: nothing ran that needs a graceful end, so nothing is waited for
    results = await _shut_down(
        settings, list(servers.values()), workers, tasks, graceful=not refused
    )
    stop_waiter.cancel()
    recorded.set()  # one last flush of what the shut-down work counted
    with contextlib.suppress(Exception):
        await asyncio.wait_for(activity, 5)
    with contextlib.suppress(Exception):
        await recorder_redis.aclose()
    shutdown_tracing()  # the spans still buffered go out
    if not roles.api:
        await redis.aclose()
    with contextlib.suppress(Exception):
        await connector.aclose()
    if refused:
        raise ConfigError("; ".join(refused))
    for task in failed:
        raise task.exception()  # type: ignore[misc]
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
            raise result


async def _shut_down(
    settings: Settings,
    servers: list[_Server],
    workers: list[NopollWorker],
    tasks: list[asyncio.Task[Any]],
    *,
    graceful: bool = True,
) -> list[Any]:
    """Stop serving and picking jobs, let running jobs finish (up to
    ``worker.shutdown_wait_s``; not ``graceful``: cancel them at once), close the workers;
    the tasks' results."""
    log.info("shutting down")
    for server in servers:
        server.should_exit = True
    # batch jobs are cancelled at once: they resume elsewhere
    stop_workers(workers, wait=graceful)
    await _hand_back(workers)
    limit_s = settings.worker.shutdown_wait_s + 30 if graceful else 10.0
    results = await wait_stopped(tasks, workers, limit_s, force=not graceful)
    for w in workers:
        with contextlib.suppress(Exception):
            await w.close()
    return results


async def _hand_back(workers: list[NopollWorker]) -> None:
    """What the workers hold but have not started goes to the other workers at once: the
    watches being polled, the jobs claimed but not started (see receiver.worker.liveness)."""
    for worker in workers:
        with contextlib.suppress(Exception):
            if n := await worker.hand_back():
                log.info("handed back %d claimed job(s) of %s", n, worker.queue_name)
    shared = workers[0].ctx.get("shared") if workers else None
    if isinstance(shared, Shared):
        await hand_back(shared)


async def _identity(settings: Settings, connector: RedisConnector, given: str | None) -> str | None:
    """The worker's stable id, its previous life's holdings taken back
    (:func:`~receiver.worker.liveness.claim_identity`); None (a random id) when Redis
    cannot be asked in a few seconds: a worker starts whether Redis is up or not."""
    wanted = worker_identity(settings.data_dir, given)
    redis = connector.client("health", at_most_s=5)
    try:
        async with asyncio.timeout(10):
            return await claim_identity(redis, wanted)
    except (RedisError, OSError, TimeoutError) as exc:
        log.info(
            "worker id %s not claimed (%s): running under a new id", wanted, type(exc).__name__
        )
        return None
    finally:
        with contextlib.suppress(RedisError, OSError):
            await redis.aclose()


async def _check_redis(
    redis: Any, settings: Settings, refused: list[str], stopping: asyncio.Event
) -> None:
    """Once Redis answers, check the settings the guarantees rest on (see module docs)."""
    await RedisLink("start-up check").wait(redis)
    refusals, warnings = await redis_settings_problems(redis)
    for warning in warnings:
        log.warning("%s", warning)
    if refusals and settings.redis_policy_check == "refuse":
        for refusal in refusals:
            log.error("%s", refusal)
        refused.extend(refusals)
        stopping.set()
    else:
        for refusal in refusals:
            log.warning("%s", refusal)


def worker_health_app(
    workers: list[NopollWorker], metrics: Metrics, interval_s: float
) -> Starlette:
    """``GET /healthz`` (this process's workers are turning their poll loops) and
    ``GET /metrics`` for a worker-only process (``nopoll worker --health-port``)."""
    limit = 2 * interval_s + 5

    async def healthz(request: Request) -> Response:
        now = time.monotonic()
        ages = {
            w.queue_name: now - b if (b := getattr(w, "last_beat", None)) else None for w in workers
        }
        ok = all(age is not None and age < limit for age in ages.values())
        body = {
            "ok": ok,
            "poll_loop_age_s": {q: round(a, 3) if a is not None else None for q, a in ages.items()},
        }
        return json_answer(200 if ok else 503, body)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
        ]
    )


def _check_listen(host: str, port: int, option: str) -> None:
    """A NopollError naming the address and what to do when ``host:port`` cannot be
    listened on (bound as uvicorn binds it, then let go)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise NopollError(
                    f"cannot listen on {host}:{port}: {host}:{port} is already in use (another "
                    f"nopoll or another program): stop it, or choose another {option}"
                ) from None
            raise NopollError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc} (check {option} and --host)"
            ) from None


def run(
    settings: Settings,
    *,
    api: bool = True,
    worker: bool = True,
    host: str = "127.0.0.1",
    port: int = 8000,
    extra_ctx: dict[str, Any] | None = None,
    health: tuple[str, int] | None = None,
    config: str | None = None,
    worker_id: str | None = None,
) -> None:
    """Run the API and/or the worker until SIGTERM/SIGINT; ``config`` is the config file's
    path, for the start-up summary; ``worker_id`` the worker's stable id (default: the host
    and the data_dir, :func:`~receiver.worker.liveness.worker_identity`)."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        runner = asyncio.run
    roles = _Roles(api, worker, host, port, extra_ctx, health, config, worker_id)
    # a port in use is one clear line, before anything starts (uvicorn would exit mid-run)
    if api:
        _check_listen(host, port, "--port")
    if health is not None and worker:
        _check_listen(*health, "--health-port")
    with redis_for(settings) as connector:
        runner(_run_and_settle(settings, connector, roles))


async def _run_and_settle(settings: Settings, connector: RedisConnector, roles: _Roles) -> None:
    """:func:`_run`, then every task left over cancelled and waited for here, its cancel sent
    again if Python 3.11 lost it: the loop's own final cancel is sent once and waited for
    without a bound, so one lost cancel kept a stopping process alive (seen in CI: a worker
    refusing an evicting Redis said "shutting down" and never exited). A task that still
    runs after 10 s is logged with where it stands, and the process exits without it."""
    try:
        await _run(settings, connector, roles)
    finally:
        current = asyncio.current_task()
        leftover = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        await settle_cancelled(leftover, 10.0)
        stuck = [t for t in leftover if not t.done()]
        for task in stuck:
            log.error("task %s did not end when cancelled (at %s)", task.get_name(), where(task))
        if stuck:  # the loop would wait for them for ever
            logging.shutdown()
            os._exit(1)
