"""Running nopoll: the API, the worker, or both in one process, with clean shutdown.

On SIGTERM or SIGINT the API stops accepting and finishes in-flight requests, the
worker stops picking jobs, waits up to ``worker.shutdown_wait_s`` for running ones and
cancels the rest (arq runs a cancelled job again later), then everything is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from arq.worker import Worker

from receiver.app import create_app
from receiver.config import Settings
from receiver.embedded import EmbeddedRedis
from receiver.metrics import Metrics
from receiver.queue import redis_client
from receiver.worker import HEALTH_CHECK_KEY, build_workers

__all__ = ["redis_url_for", "run"]

log = logging.getLogger("nopoll")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (we stop the worker too)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def redis_url_for(settings: Settings) -> Iterator[str]:
    """The Redis URL to use, starting the embedded server for as long as needed."""
    if not settings.embedded_redis:
        yield settings.redis_url.get_secret_value()
        return
    server = EmbeddedRedis(settings.data_dir)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


async def _run(
    settings: Settings,
    redis_url: str,
    *,
    api: bool,
    worker: bool,
    host: str,
    port: int,
    extra_ctx: dict[str, Any] | None,
) -> None:
    metrics = Metrics()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    tasks: list[asyncio.Task[Any]] = []
    server: _Server | None = None
    arq_workers: list[Worker] = []
    redis = redis_client(redis_url)

    if worker:
        arq_workers = build_workers(
            settings, redis_url, metrics, handle_signals=False, extra_ctx=extra_ctx
        )
        for w in arq_workers:
            tasks.append(asyncio.create_task(w.async_run(), name=f"worker {w.queue_name}"))
    if api:
        if not settings.providers:
            log.warning("no providers configured: every callback will answer 404")

        @contextlib.asynccontextmanager
        async def lifespan(_app: Any) -> AsyncIterator[None]:
            yield
            await redis.aclose()

        app = create_app(
            settings,
            redis=redis,
            metrics=metrics,
            worker_heartbeat_key=HEALTH_CHECK_KEY if worker else None,
            lifespan=lifespan,
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=10,
        )
        server = _Server(config)
        tasks.append(asyncio.create_task(server.serve(), name="api"))

    stop_waiter = asyncio.create_task(stopping.wait())
    done, _ = await asyncio.wait([stop_waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    failed = [t for t in done if t is not stop_waiter and t.exception() is not None]
    log.info("shutting down")
    if server is not None:
        server.should_exit = True
    for w in arq_workers:
        w.handle_sig_wait_for_completion(signal.SIGTERM)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    stop_waiter.cancel()
    for w in arq_workers:
        with contextlib.suppress(Exception):
            await w.close()
    if not api:
        await redis.aclose()
    for task in failed:
        raise task.exception()  # type: ignore[misc]
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, asyncio.CancelledError):
            raise result


def run(
    settings: Settings,
    *,
    api: bool = True,
    worker: bool = True,
    host: str = "127.0.0.1",
    port: int = 8000,
    extra_ctx: dict[str, Any] | None = None,
) -> None:
    """Run the API and/or the worker until SIGTERM/SIGINT."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        runner = asyncio.run
    with redis_url_for(settings) as url:
        runner(
            _run(settings, url, api=api, worker=worker, host=host, port=port, extra_ctx=extra_ctx)
        )
