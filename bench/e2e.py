"""End-to-end: signed callbacks in at a steady rate, a row in Postgres out.

Usage: ``python bench/e2e.py [--rate 200] [--seconds 20] [--serve] [--log-level info]``

Starts the provider simulator (``receiver.demo.simulator.ProviderSimulator``, a real HTTP
server on 127.0.0.1, in a process of its own: ``e2e.py --simulator PORT``) and nopoll
with Redis database 13 and one sink, ``{type: sql, url: postgresql://...test, table:
bench_results}``: ``nopoll api`` and ``nopoll worker`` as two processes, so that each
one's CPU time is its own (``--serve``: both in one ``nopoll serve``). Then it sends
``response.completed`` callbacks (signed by ``standardwebhooks``) at a steady rate over
a few keep-alive connections, one new response id each, recording when each was due. A
poller asks Postgres every few milliseconds which of the outstanding keys have a row and
records when each shows up.

Prints p50/p90/p99 of callback-to-row latency, rows landed / sent, delivered results per
second, provider requests per delivered result (the simulator's count of
``GET /v1/responses/...``), and the CPU time (from ``/proc``) of the worker per delivered
result and of the API per callback.

Exits 1 when a row is missing or a callback was not answered 202. The latency includes
the poller's own granularity (``--poll-ms``, default 5 ms, plus the query's time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common

TABLE = os.environ.get("NOPOLL_BENCH_E2E_TABLE", "bench_results")
"""The sink's table; ``NOPOLL_BENCH_E2E_TABLE`` gives each run on a shared machine its own."""
TARGET_P99_MS = 250.0
TARGET_P50_MS = 50.0
TARGET_EVENT_P99_MS = 50.0
"""Callback -> results-stream event at the default rate (``--stream``)."""
TARGET_REQUESTS_PER_RESULT = 1.0
TARGET_WORKER_CPU_MS = {"debug": 1.5, "info": 0.5, "warning": 0.35, "error": 0.35}
"""Worker CPU per delivered result, by log level (``info`` logs a line per result)."""
TARGET_BELL_P50_MS, TARGET_BELL_P99_MS = 10.0, 40.0
"""Callback -> row with the bell (``--wake both``, at the default 200/s)."""
TARGET_BELL_REDIS_CPU = 1.1
"""Redis CPU per callback, bell over poll (``--wake both``)."""
MAX_KEYS_PER_POLL = 2000
API_KEY = "bench-key"


@dataclass
class Run:
    """What happened to every callback, keyed by response id."""

    sent_at: dict[str, float] = field(default_factory=dict)
    acked_at: dict[str, float] = field(default_factory=dict)
    status: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    landed_at: dict[str, float] = field(default_factory=dict)
    pending: dict[str, None] = field(default_factory=dict)
    """Sent, no row seen yet; oldest first."""
    poll_seconds: list[float] = field(default_factory=list)
    sending_done: bool = False
    send_started: float = 0.0
    send_finished: float = 0.0
    table_rows: int = -1
    wall_offset: float = 0.0
    """time.time() - time.perf_counter(), to place the rows' timestamps on our clock."""
    server_metrics: dict[str, float] = field(default_factory=dict)
    stamps: dict[str, tuple[float, float]] = field(default_factory=dict)
    """key -> (received_at, fetched_at) as perf_counter values, read from the rows."""
    other_cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU time of the simulator, this process and Redis over the same span."""
    event_at: dict[str, float] = field(default_factory=dict)
    """When each result's event reached a results-stream subscriber (``--stream``)."""
    redis_command_s: float = 0.0
    """Time Redis spent running commands over the run (``INFO commandstats``)."""
    redis_reads: int = 0
    """Reads Redis made off its clients' sockets over the run (``total_reads_processed``):
    about one per round trip a client makes, whatever the trip carries."""
    machine_busy: float = float("nan")
    """How busy the whole machine was over that span (1.0: every core, all the time)."""


@dataclass
class Server:
    """One nopoll process of the run: its role, its /metrics, its CPU time."""

    role: str
    """``serve``, ``api`` or ``worker``."""
    proc: subprocess.Popen[bytes]
    metrics_url: str
    log_path: Path
    cpu_s: float = 0.0
    """CPU time used from the first callback to the last row (or the end of the drain)."""
    system_s: float = 0.0
    """The part of :attr:`cpu_s` spent in the kernel (socket writes and reads, wakeups)."""


async def prepare_postgres() -> None:
    """Drop the benchmark's table (and its schema-version row) before the run."""
    import asyncpg

    conn = await asyncpg.connect(common.PG_URL, timeout=10)
    try:
        await conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        if await conn.fetchval("SELECT to_regclass('nopoll_schema') IS NOT NULL"):
            await conn.execute("DELETE FROM nopoll_schema WHERE table_name = $1", TABLE)
    finally:
        await conn.close()


async def wait_for_table(conn: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.1) + 1):
        if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", TABLE):  # type: ignore[attr-defined]
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the sql sink did not create table {TABLE} within {timeout_s:.0f}s")


class _Callbacks:
    """Signed ``response.completed`` callbacks as raw HTTP/1.1 requests, signed by
    ``standardwebhooks`` just before each is sent (so its timestamp is "now")."""

    def __init__(self, secret: str, port: int) -> None:
        from standardwebhooks.webhooks import Webhook

        self._webhook = Webhook(secret)
        self._head = f"POST /webhooks/{common.PROVIDER} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"

    def request(self, response_id: str) -> bytes:
        ts = int(time.time())
        uid = uuid.uuid4().hex
        body = (
            f'{{"id":"evt_{uid}","type":"response.completed","created_at":{ts},'
            f'"data":{{"id":"{response_id}"}}}}'
        )
        signature = self._webhook.sign(f"msg_{uid}", datetime.fromtimestamp(ts, UTC), body)
        return (
            f"{self._head}webhook-id: msg_{uid}\r\nwebhook-timestamp: {ts}\r\n"
            f"webhook-signature: {signature}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n{body}"
        ).encode()


async def _connection(run: Run, port: int, queue: asyncio.Queue[tuple[str, bytes] | None]) -> None:
    """One keep-alive connection: send the queued requests one after another."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        for _ in range(10_000_000):
            item = await queue.get()
            if item is None:
                return
            rid, request = item
            try:
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                run.errors[rid] = type(exc).__name__
                return
            run.acked_at[rid] = time.perf_counter()
            run.status[rid] = int(head.split(b" ", 2)[1])
    finally:
        writer.close()


async def send_all(
    run: Run, port: int, secret: str, ids: list[str], rate: float, conns: int
) -> None:
    """Send one callback per id at a steady ``rate`` over ``conns`` keep-alive connections.

    A lean HTTP/1.1 client (one request in flight per connection), so that the sender
    costs little next to the server it measures. A callback waits in a queue when every
    connection is busy; its latency counts from when it was due. A callback still
    unanswered 60 s after the last was due is counted as a transport error.
    """
    callbacks = _Callbacks(secret, port)
    queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
    workers = [asyncio.create_task(_connection(run, port, queue)) for _ in range(conns)]
    run.send_started = start = time.perf_counter()
    for i, rid in enumerate(ids):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        run.pending[rid] = None
        run.sent_at[rid] = time.perf_counter()
        queue.put_nowait((rid, callbacks.request(rid)))
    run.send_finished = time.perf_counter()
    for _ in workers:
        queue.put_nowait(None)
    _, late = await asyncio.wait(workers, timeout=60)
    for task in late:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    for rid in ids:
        if rid not in run.status:
            run.errors.setdefault(rid, "unanswered")
    run.sending_done = True


async def poll_rows(run: Run, conn: object, poll_s: float, drain_s: float, max_s: float) -> None:
    """Record when each outstanding key's row becomes visible; bounded in time and count.

    One indexed query per round for (at most ``MAX_KEYS_PER_POLL`` of the oldest) keys
    not seen yet, then a pause of ``poll_s``, or as long as the query took if that is
    longer, so that a backlog does not turn the poller into Postgres's main load.
    """
    query = f"SELECT key FROM {TABLE} WHERE provider = $1 AND key = ANY($2::text[])"
    started = time.perf_counter()
    drain_deadline: float | None = None
    for _ in range(int(max_s / poll_s) + 1):
        now = time.perf_counter()
        if now - started > max_s:
            break
        if run.sending_done:
            if not run.pending:
                break
            if drain_deadline is None:
                drain_deadline = now + drain_s
            elif now > drain_deadline:
                break
        took = 0.0
        if run.pending:
            keys = list(itertools.islice(run.pending, MAX_KEYS_PER_POLL))
            before = time.perf_counter()
            rows = await conn.fetch(query, common.PROVIDER, keys)  # type: ignore[attr-defined]
            seen = time.perf_counter()
            took = seen - before
            run.poll_seconds.append(took)
            for row in rows:
                key = row["key"]
                if key in run.pending:
                    del run.pending[key]
                    run.landed_at[key] = seen
        await asyncio.sleep(max(poll_s, took))


async def read_rows(run: Run, conn: object) -> None:
    """The table's row count and every row's own ``received_at``/``fetched_at`` stamps."""
    run.table_rows = int(
        await conn.fetchval(f"SELECT count(*) FROM {TABLE} WHERE provider = $1", common.PROVIDER)  # type: ignore[attr-defined]
    )
    rows = await conn.fetch(  # type: ignore[attr-defined]
        f"SELECT key, extract(epoch FROM received_at) AS r, "
        f"extract(epoch FROM fetched_at) AS f FROM {TABLE} WHERE provider = $1",
        common.PROVIDER,
    )
    for row in rows:
        run.stamps[row["key"]] = (
            float(row["r"]) - run.wall_offset,
            float(row["f"]) - run.wall_offset,
        )


async def measure(
    args: argparse.Namespace,
    port: int,
    ids: list[str],
    servers: list[Server],
    others: dict[str, int],
) -> Run:
    """Send, watch the rows land, and take the CPU time of each server, of the ``others``
    (name -> pid) and of the whole machine over that span."""
    import asyncpg

    run = Run(wall_offset=time.time() - time.perf_counter())
    others_before = {name: common.cpu_seconds(pid) for name, pid in others.items()}
    commands_before = redis_command_seconds()
    reads_before = redis_reads()
    stream = await subscribe_stream(port, args, set(ids)) if args.stream else None
    postgres_before = postgres_cpu_seconds()
    machine_before = common.machine_cpu()
    conn = await asyncpg.connect(common.PG_URL, timeout=10)
    try:
        await wait_for_table(conn)
        max_s = args.seconds + args.drain + 90
        poller = asyncio.create_task(
            poll_rows(run, conn, args.poll_ms / 1000, args.drain, max_s), name="poller"
        )
        cpu_before = [common.cpu_seconds(s.proc.pid) for s in servers]
        system_before = [system_seconds(s.proc.pid) for s in servers]
        try:
            await send_all(run, port, args.secret, ids, args.rate, args.connections)
            await asyncio.wait_for(poller, timeout=max_s)
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        for server, before, system in zip(servers, cpu_before, system_before, strict=True):
            server.cpu_s = common.cpu_seconds(server.proc.pid) - before
            server.system_s = system_seconds(server.proc.pid) - system
        for name, pid in others.items():
            run.other_cpu_s[name] = common.cpu_seconds(pid) - others_before[name]
        if postgres_before is not None:
            run.other_cpu_s["postgres (shared)"] = postgres_cpu_seconds() - postgres_before
        run.redis_command_s = redis_command_seconds() - commands_before
        run.redis_reads = redis_reads() - reads_before
        if stream is not None:
            await stream_drained(stream, len(ids), args.drain)
            transport, client = stream
            transport.close()
            for key, at_ms in zip(client.seen, client.arrived_ms, strict=True):
                run.event_at.setdefault(key.decode(), at_ms / 1000 - run.wall_offset)
        (busy, whole), (busy0, whole0) = common.machine_cpu(), machine_before
        busy, whole = busy - busy0, whole - whole0
        run.machine_busy = busy / whole if whole else float("nan")
        await read_rows(run, conn)
    finally:
        await conn.close()
    return run


def scrape_metrics(url: str, totals: dict[str, float]) -> None:
    """Add a process's /metrics to ``totals``: ``name -> value`` summed over labels, and
    each labelled line."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        with contextlib.suppress(ValueError):
            for key in {name, name.split("{", 1)[0]}:
                totals[key] = totals.get(key, 0.0) + float(value)


def fix_simulator_nodelay(sim: object) -> bool:
    """Re-create the simulator's listening socket with ``proto=IPPROTO_TCP`` if needed.

    asyncio turns on TCP_NODELAY only for sockets whose ``proto`` is IPPROTO_TCP; a socket
    made by ``socket.socket(AF_INET, SOCK_STREAM)`` has proto 0, and so have the
    connections it accepts. Then Nagle's algorithm holds the response body (written after
    the headers) until the client's delayed ACK: about 40 ms on every keep-alive request,
    which would be counted as nopoll's latency. Returns True when it had to fix it.
    """
    old = getattr(sim, "_sock", None)
    if not isinstance(old, socket.socket) or old.proto == socket.IPPROTO_TCP:
        return False
    port = old.getsockname()[1]
    old.close()
    new = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    new.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    new.bind(("127.0.0.1", port))
    sim._sock = new  # type: ignore[attr-defined]
    return True


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="callbacks per second (200)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of sending (20)")
    parser.add_argument(
        "--drain", type=float, default=30.0, help="seconds to wait for late rows (30)"
    )
    parser.add_argument("--poll-ms", type=float, default=5.0, help="Postgres poll interval (5)")
    parser.add_argument(
        "--connections", type=int, default=32, help="the sender's keep-alive connections (32)"
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="run API and worker in one `nopoll serve` (default: `nopoll api` + `nopoll worker`)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="nopoll's log level (info, the default of a config, logs a line per result)",
    )
    parser.add_argument(
        "--profile",
        metavar="SVG",
        type=Path,
        help="record the worker with py-spy (on PATH or in NOPOLL_PY_SPY) while callbacks "
        "are sent, and write its flamegraph to SVG (collapsed stacks when it ends in .txt)",
    )
    parser.add_argument(
        "--profile-gil",
        action="store_true",
        help="with --profile: only the samples that hold the GIL (py-spy --gil), so the "
        "worker's waits for Redis, Postgres and the CPU drop out and Python's own work stays",
    )
    parser.add_argument(
        "--wake",
        choices=("bell", "poll", "both"),
        default="bell",
        help="how the worker learns of new jobs: its queue's bell (default), polling every "
        "poll_delay_s (worker.idle_wait_s: null), or both, poll then bell, compared",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="also subscribe to GET /v1/results/stream (a consumer token: the worker adds "
        "its _results sink) and print callback -> stream event",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each --wake mode (1; medians compared)"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the worker to the last CPU and everything else (API, simulator, sender, "
        "poller) to the others, as `taskset` would; needs two or more CPUs and no --serve",
    )
    args = parser.parse_args(argv)
    if args.pin and (args.serve or len(os.sched_getaffinity(0)) < 2):
        parser.error("--pin needs two or more CPUs and separate API and worker (no --serve)")
    if args.profile and args.serve:
        parser.error("--profile records the worker process: drop --serve")
    if not (0 < args.rate <= 5000 and 0 < args.seconds <= 600 and 0 <= args.drain <= 600):
        parser.error("--rate 0..5000, --seconds 0..600, --drain 0..600")
    if not 1 <= args.poll_ms <= 1000:
        parser.error("--poll-ms 1..1000")
    if not 1 <= args.connections <= 256:
        parser.error("--connections 1..256")
    return args


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads started later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(task.name), cpus)


def pin_all(servers: list[Server], others: dict[str, int]) -> str:
    """The worker alone on the last CPU, the rest (this process included) on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    worker_cpu, rest = {cpus[-1]}, set(cpus[:-1])
    for server in servers:
        pin(server.proc.pid, worker_cpu if server.role == "worker" else rest)
    for name, pid in others.items():
        if not name.startswith("redis"):
            pin(pid, rest)
    return f"worker pinned to CPU {cpus[-1]}, the rest to CPU {','.join(map(str, rest))}"


def start_profiler(
    svg: Path, pid: int, seconds: float, *, gil: bool = False
) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` (Python frames only, without pausing it) for ``seconds``;
    with ``gil``, only the samples taken while it holds the GIL."""
    exe = os.environ.get("NOPOLL_PY_SPY") or shutil.which("py-spy")
    if not exe:
        raise SystemExit("--profile: py-spy is not on PATH (pip install py-spy) nor NOPOLL_PY_SPY")
    svg.parent.mkdir(parents=True, exist_ok=True)
    form = "raw" if svg.suffix == ".txt" else "flamegraph"
    command = [exe, "record", "--nonblocking", "--rate", "200", "--format", form]
    command += ["--duration", str(max(1, int(seconds))), "--pid", str(pid), "--output", str(svg)]
    if gil:
        command.append("--gil")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_servers(args: argparse.Namespace, config: Path, work: Path) -> tuple[list[Server], int]:
    """nopoll's processes, ready: ``[serve]`` or ``[worker, api]``; and the API's port."""
    servers: list[Server] = []
    port = common.free_port()
    api = ["--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    env = {common.SECRET_ENV: args.secret, "NOPOLL_BENCH_TOKEN": args.token}
    try:
        if not args.serve:
            health = common.free_port()
            log_path = work / "worker.log"
            worker = ["worker", "--config", str(config), "--health-port", str(health)]
            proc = common.start_process(
                [str(common.BIN_DIR / "nopoll"), *worker], env=env, log_path=log_path
            )
            metrics = f"http://127.0.0.1:{health}/metrics"
            servers.append(Server("worker", proc, metrics, log_path))
            common.wait_http(f"http://127.0.0.1:{health}/healthz", proc=proc, timeout_s=60)
        role = "serve" if args.serve else "api"
        log_path = work / f"{role}.log"
        proc = common.start_process(
            [str(common.BIN_DIR / "nopoll"), role, *api], env=env, log_path=log_path
        )
        servers.append(Server(role, proc, f"http://127.0.0.1:{port}/metrics", log_path))
        common.wait_http(
            f"http://127.0.0.1:{port}/readyz", proc=proc, timeout_s=60, log_path=log_path
        )
    except BaseException:
        for server in servers:
            common.stop_process(server.proc)
        raise
    return servers, port


def start_simulator(work: Path) -> tuple[subprocess.Popen[bytes], Path, str]:
    """The provider simulator in a process of its own (``--simulator``), answering every
    ``GET /v1/responses/resp_...`` with a completed response; and its base URL."""
    port = common.free_port()
    log_path = work / "simulator.log"
    args = [sys.executable, __file__, "--simulator", str(port)]
    proc = common.start_process(args, log_path=log_path)
    # a path that needs the API key: answered 401, and not counted as a response fetch
    common.wait_http(
        f"http://127.0.0.1:{port}/v1/batches/probe", proc=proc, want=401, log_path=log_path
    )
    return proc, log_path, f"http://127.0.0.1:{port}/v1"


def serve_simulator(port: int) -> int:
    """Run the simulator until SIGTERM, then print how many responses it served."""
    from receiver.demo.simulator import ProviderSimulator

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sim = ProviderSimulator(api_key=API_KEY, port=port, auto_respond=True)
    if fix_simulator_nodelay(sim):
        print(
            "note: the simulator's socket has proto 0, so asyncio leaves Nagle on and every "
            "keep-alive answer waits ~40 ms for a delayed ACK; this run re-creates it"
        )
    with sim:
        for _ in range(24 * 3600 * 2):
            if stop.wait(0.5):
                break
        print(f"requests {sim.request_count('/v1/responses/')}", flush=True)
    return 0


def system_seconds(pid: int) -> float:
    """System (kernel) CPU seconds a local process has used so far (0.0 if unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def postgres_cpu_seconds() -> float | None:
    """CPU seconds of every ``postgres`` process on this machine, with the backends that
    have exited (their parent's ``cutime``/``cstime``); None when there is none here."""
    tick = os.sysconf("SC_CLK_TCK")
    total, found = 0.0, False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, _, rest = stat.read_text().rpartition(")")
        except OSError:
            continue
        if not head.partition("(")[2].startswith("postgres"):
            continue
        fields = rest.split()
        total += sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
        found = True
    return total if found else None


async def subscribe_stream(port: int, args: argparse.Namespace, want: set[str]) -> Any:
    """One ``GET /v1/results/stream`` subscriber (a raw-socket SSE client), connected."""
    from _consumers import _SseClient

    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    ready: asyncio.Future[None] = loop.create_future()
    transport, client = await loop.create_connection(
        lambda: _SseClient(want, done, ready), "127.0.0.1", port
    )
    transport.write(
        f"GET /v1/results/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {args.token}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    await asyncio.wait_for(ready, 30)
    return transport, client


async def stream_drained(stream: Any, total: int, limit_s: float) -> None:
    """Until the subscriber saw ``total`` events, or ``limit_s``."""
    _, client = stream
    deadline = time.monotonic() + limit_s
    for _ in range(int(limit_s / 0.05) + 1):
        if len(client.seen) >= total or time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.05)


def redis_command_seconds() -> float:
    """The time Redis has spent running commands so far (``INFO commandstats``, every
    database): its process's CPU time less what waking up, reading and writing costs."""
    client = common.redis_db13()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(float(v.get("usec", 0)) for v in stats.values() if isinstance(v, dict)) / 1e6


def redis_reads() -> int:
    """The reads Redis has made off client sockets so far (``INFO stats``)."""
    client = common.redis_db13()
    try:
        return int(client.info("stats").get("total_reads_processed") or 0)
    finally:
        client.close()


def redis_pid() -> dict[str, int]:
    """``{"redis": pid}`` when Redis runs on this machine (its ``INFO server``)."""
    client = common.redis_db13()
    try:
        pid = int(client.info("server").get("process_id") or 0)
    finally:
        client.close()
    return {"redis (shared)": pid} if pid and Path(f"/proc/{pid}").exists() else {}


def simulator_requests(log_path: Path) -> int:
    """The simulator's count of ``GET /v1/responses/...``, printed as it stopped."""
    found = re.search(r"^requests (\d+)$", log_path.read_text(errors="replace"), re.M)
    return int(found[1]) if found else -1


WAKE_YAML = {"bell": "", "poll": "worker: {idle_wait_s: null}\n"}
"""How a worker learns of a new job: the queue's bell (the default), or polling every
``worker.poll_delay_s`` (``idle_wait_s: null``, nopoll's way before the bell)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--simulator"]:
        return serve_simulator(int(argv[1]))
    args = parse_args(argv)
    modes = ["poll", "bell"] * args.rounds if args.wake == "both" else [args.wake] * args.rounds
    code, summaries = 0, []
    for n, mode in enumerate(modes):
        if len(modes) > 1:
            print(f"\n=== run {n + 1}/{len(modes)}: wake by {mode} ===")
        run_code, summary = run_once(args, mode)
        code = max(code, run_code)
        summaries.append((mode, summary))
    if args.wake == "both":
        compare(summaries)
    return code


def run_once(args: argparse.Namespace, wake: str) -> tuple[int, dict[str, float]]:
    """One run (a fresh table, Redis db and processes): its exit code and figures."""
    total = max(1, math.floor(args.rate * args.seconds))
    nonce = uuid.uuid4().hex[:10]
    ids = [f"resp_e2e{nonce}_{i:06d}" for i in range(total)]
    args.secret = common.new_secret()
    args.token = uuid.uuid4().hex

    asyncio.run(prepare_postgres())
    common.flush_bench_db()
    servers: list[Server] = []
    sim: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="nopoll-e2e-") as tmp:
        work = Path(tmp)
        try:
            sim, sim_log, base_url = start_simulator(work)
            config = common.nopoll_config(
                work / "nopoll.yaml",
                base_url=base_url,
                data_dir=work / "data",
                sinks_yaml=f"  results: {{type: sql, url: '{common.PG_URL}', table: {TABLE}}}",
                log_level=args.log_level,
                extra_yaml=WAKE_YAML[wake]
                + ('consumer_tokens: [{token: "${NOPOLL_BENCH_TOKEN}"}]\n' if args.stream else ""),
            )
            servers, port = start_servers(args, config, work)
            print(
                f"nopoll {' + '.join(f'{s.role} (pid {s.proc.pid})' for s in servers)}, "
                f"simulator (pid {sim.pid}) on {base_url}; sending {total} callbacks at "
                f"{args.rate:g}/s for {args.seconds:g}s; wake by {wake}; log level "
                f"{args.log_level}; {common.load_note()}"
            )
            others = {"simulator": sim.pid, "sender + poller": os.getpid()}
            if args.pin:
                print(pin_all(servers, others))
            others.update(redis_pid())
            profiler = None
            if args.profile:
                worker = next(s for s in servers if s.role == "worker")
                profiler = start_profiler(
                    args.profile, worker.proc.pid, args.seconds, gil=args.profile_gil
                )
            run = asyncio.run(measure(args, port, ids, servers, others))
            if profiler is not None:
                _, err = profiler.communicate(timeout=60)
                status = "written" if profiler.returncode == 0 else f"FAILED: {err.decode()[-300:]}"
                print(f"worker flamegraph ({args.seconds:g}s of sending): {args.profile} {status}")
            for server in servers:
                scrape_metrics(server.metrics_url, run.server_metrics)
        finally:
            for server in servers:
                common.stop_process(server.proc)
            common.stop_process(sim)
        code = finish(run, ids, simulator_requests(sim_log), servers, args.log_level)
        return code, summarize(run, ids, servers)


def summarize(run: Run, ids: list[str], servers: list[Server]) -> dict[str, float]:
    """A run's figures for :func:`compare`."""
    latencies = sorted(
        (run.landed_at[rid] - run.sent_at[rid]) * 1000 for rid in ids if rid in run.landed_at
    )
    landed = max(1, len(latencies))
    cpu = {s.role: s.cpu_s for s in servers}
    return {
        "callback -> row p50 (ms)": common.percentile(latencies, 50),
        "callback -> row p99 (ms)": common.percentile(latencies, 99),
        "callback -> event p99 (ms)": common.percentile(
            sorted((run.event_at[k] - run.sent_at[k]) * 1000 for k in ids if k in run.event_at),
            99,
        )
        if run.event_at
        else float("nan"),
        "worker CPU per result (ms)": cpu.get("worker", cpu.get("serve", 0.0)) / landed * 1000,
        "API CPU per callback (ms)": cpu.get("api", 0.0) / max(1, len(ids)) * 1000,
        "Redis CPU per callback (ms)": run.other_cpu_s.get("redis (shared)", 0.0)
        / max(1, len(ids))
        * 1000,
        "Redis command time/callback (ms)": run.redis_command_s / max(1, len(ids)) * 1000,
        "Redis round trips per callback": run.redis_reads / max(1, len(ids)),
        "simulator CPU per callback (ms)": run.other_cpu_s.get("simulator", 0.0)
        / max(1, len(ids))
        * 1000,
    }


def compare(summaries: list[tuple[str, dict[str, float]]]) -> None:
    """The bell against polling, run by run and as a ratio of their medians; then the
    bell's targets."""
    print("\nwake by bell against wake by poll (worker.idle_wait_s: null), medians of the runs:")
    names = list(summaries[0][1])
    poll, bell = (
        {n: statistics.median(s[n] for mode, s in summaries if mode == m) for n in names}
        for m in ("poll", "bell")
    )
    print(f"  {'':<30} {'poll':>9} {'bell':>9} {'bell/poll':>10}")
    for name in names:
        ratio = bell[name] / poll[name] if poll[name] else float("nan")
        print(f"  {name:<30} {poll[name]:9.3f} {bell[name]:9.3f} {ratio:10.2f}")
    for pct, target in (("p50", TARGET_BELL_P50_MS), ("p99", TARGET_BELL_P99_MS)):
        ms = bell[f"callback -> row {pct} (ms)"]
        print(f"target: bell {pct} <= {target:g} ms: {ms:.1f} ms ({verdict(ms <= target)})")
    cpu = "Redis CPU per callback (ms)"
    redis = bell[cpu] / poll[cpu] if poll[cpu] else float("nan")
    print(
        f"target: Redis CPU per callback, bell/poll <= {TARGET_BELL_REDIS_CPU:g}: {redis:.2f} "
        f"({verdict(redis <= TARGET_BELL_REDIS_CPU)})"
    )


def finish(
    run: Run, ids: list[str], provider_requests: int, servers: list[Server], log_level: str
) -> int:
    """Print the report; on a failure, or a server that exited badly, its log's last lines."""
    code = report(run, ids, provider_requests, servers, log_level)
    for server in servers:
        bad = server.proc.returncode not in (0, None)
        if bad:
            print(f"note: nopoll {server.role} exited with {server.proc.returncode}")
        if code or bad:
            log = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
            print(f"\nlast lines of nopoll {server.role}'s log:\n{log[-4000:]}")
            code = 1
    return code


def report(
    run: Run, ids: list[str], provider_requests: int, servers: list[Server], log_level: str
) -> int:
    latencies = sorted(
        (run.landed_at[rid] - run.sent_at[rid]) * 1000 for rid in ids if rid in run.landed_at
    )
    landed = len(latencies)
    per_result = provider_requests / landed if landed else float("nan")
    p50, p99 = common.percentile(latencies, 50), common.percentile(latencies, 99)
    report_traffic(run, ids, latencies)
    report_stages(run, ids)
    report_server(run, servers, landed)
    print(
        f"provider requests per result: {per_result:.3f} "
        f"({provider_requests} GET /v1/responses/ for {landed} rows)"
    )
    print()
    print(f"target: p99 < {TARGET_P99_MS:g} ms: {p99:.1f} ms ({verdict(p99 < TARGET_P99_MS)})")
    print(f"target: p50 < {TARGET_P50_MS:g} ms: {p50:.1f} ms ({verdict(p50 < TARGET_P50_MS)})")
    print(
        f"target: requests per result {TARGET_REQUESTS_PER_RESULT:.1f}: {per_result:.3f} "
        f"({verdict(abs(per_result - TARGET_REQUESTS_PER_RESULT) < 1e-9)})"
    )
    worker_ms = next((s.cpu_s / landed * 1000 for s in servers if s.role == "worker"), None)
    if worker_ms is not None and landed:
        target = TARGET_WORKER_CPU_MS[log_level]
        print(
            f"target: worker CPU per result at {log_level} <= {target:g} ms: {worker_ms:.2f} ms "
            f"({verdict(worker_ms <= target)})"
        )
    return report_failures(run, ids, landed)


def report_traffic(run: Run, ids: list[str], latencies: list[float]) -> None:
    """Sent, answered, landed, delivered per second, and the callback-to-row latency."""
    total, landed = len(ids), len(latencies)
    acks = sorted(
        (run.acked_at[rid] - run.sent_at[rid]) * 1000 for rid in ids if rid in run.acked_at
    )
    accepted = sum(1 for s in run.status.values() if s == 202)
    send_s = run.send_finished - run.send_started
    print()
    print(f"sent:            {total} callbacks in {send_s:.2f}s ({total / send_s:.1f}/s)")
    print(
        f"answers:         {len(run.status)} ({accepted} x 202), {len(run.errors)} transport "
        f"errors; 202 in p50 {common.percentile(acks, 50):.1f} ms, "
        f"p99 {common.percentile(acks, 99):.1f} ms"
    )
    print(
        f"rows landed:     {landed} / {total} ({landed / total:.4f}); "
        f"table holds {run.table_rows} rows"
    )
    if run.landed_at:
        during = sum(1 for t in run.landed_at.values() if t <= run.send_finished)
        span = max(run.landed_at.values()) - run.send_started
        print(
            f"delivered:       {during / send_s:.0f} results/s while sending; "
            f"{landed / span:.0f}/s from the first callback to the last row"
        )
    polls = sorted(t * 1000 for t in run.poll_seconds)
    print(
        f"poller:          {len(polls)} queries, each p50 {common.percentile(polls, 50):.1f} ms, "
        f"p99 {common.percentile(polls, 99):.1f} ms (the resolution of the latencies below)"
    )
    if latencies:
        p50, p90, p99 = (common.percentile(latencies, q) for q in (50, 90, 99))
        print(
            f"callback -> row: p50 {p50:.1f} ms  p90 {p90:.1f} ms  p99 {p99:.1f} ms  "
            f"max {latencies[-1]:.1f} ms"
        )
    events = sorted((run.event_at[k] - run.sent_at[k]) * 1000 for k in ids if k in run.event_at)
    if events:
        p50, p90, p99 = (common.percentile(events, q) for q in (50, 90, 99))
        print(
            f"callback -> stream event: p50 {p50:.1f} ms  p90 {p90:.1f} ms  p99 {p99:.1f} ms  "
            f"max {events[-1]:.1f} ms ({len(events)} of {len(ids)} events; target p99 <= "
            f"{TARGET_EVENT_P99_MS:g} ms: {verdict(p99 <= TARGET_EVENT_P99_MS)})"
        )


def report_stages(run: Run, ids: list[str]) -> None:
    """Where the time went, from the rows' own ``received_at``/``fetched_at`` stamps."""
    stages = [
        (
            run.stamps[rid][0] - run.sent_at[rid],
            run.stamps[rid][1] - run.stamps[rid][0],
            run.landed_at[rid] - run.stamps[rid][1],
        )
        for rid in ids
        if rid in run.landed_at and rid in run.stamps
    ]
    if not stages:
        return
    names = ("send -> API received_at", "received_at -> fetched_at", "fetched_at -> row seen")
    for n, name in enumerate(names):
        part = sorted(s[n] * 1000 for s in stages)
        print(
            f"  {name:<26} p50 {common.percentile(part, 50):7.1f} ms  "
            f"p90 {common.percentile(part, 90):7.1f} ms  "
            f"p99 {common.percentile(part, 99):7.1f} ms"
        )
    print("  (received_at and fetched_at are the row's own ms timestamps)")


def report_server(run: Run, servers: list[Server], landed: int) -> None:
    """nopoll's own timings and job outcomes (/metrics) and each process's CPU time."""
    m = run.server_metrics
    for label, metric in (
        ("provider GET (worker's view)", "nopoll_provider_request_seconds"),
        ("sink write (worker's view)", "nopoll_sink_write_seconds"),
        ("enqueue (API's view)", "nopoll_enqueue_seconds"),
    ):
        count = m.get(f"{metric}_count", 0.0)
        if count:
            mean_ms = m.get(f"{metric}_sum", 0.0) / count * 1000
            print(f"  {label:<30} mean {mean_ms:6.2f} ms over {count:.0f}")
    per = {"serve": "result (API + worker)", "worker": "delivered result", "api": "callback"}
    for server in servers:
        count = len(run.status) if server.role == "api" else landed
        if count:
            print(
                f"  nopoll {server.role} CPU per {per[server.role]}: "
                f"{server.cpu_s / count * 1000:.3f} ms ({server.cpu_s:.2f} s for {count}, "
                f"{server.system_s / count * 1000:.3f} ms of it in the kernel)"
            )
    others = ", ".join(f"{name} {cpu:.1f} s" for name, cpu in run.other_cpu_s.items())
    print(f"  CPU time of the others: {others}; machine {run.machine_busy:.0%} busy")
    if run.status:
        print(
            f"  Redis command time per callback: {run.redis_command_s / len(run.status) * 1e3:.3f}"
            f" ms ({run.redis_command_s:.2f} s, INFO commandstats; the rest of Redis's CPU is "
            "waking up, reading and writing)"
        )
        print(
            f"  Redis round trips per callback: {run.redis_reads / len(run.status):.2f} "
            f"({run.redis_reads} reads off client sockets, INFO stats)"
        )
    outcomes = ", ".join(
        f"{name.split('{', 1)[1].rstrip('}')}: {value:.0f}"
        for name, value in sorted(m.items())
        if name.startswith(("nopoll_jobs_total{", "nopoll_sink_writes_total{"))
        or (name.startswith("nopoll_dead_letters_total{") and value)
    )
    if outcomes:
        print(f"  worker outcomes: {outcomes}")


def report_failures(run: Run, ids: list[str], landed: int) -> int:
    """1 (and what went wrong) when a row is missing or a callback was not answered 202."""
    failed = False
    if landed < len(ids):
        missing = [rid for rid in ids if rid not in run.landed_at]
        print(f"MISSING ROWS: {len(missing)}, e.g. {', '.join(missing[:5])}")
        failed = True
    not_202 = {rid: s for rid, s in run.status.items() if s != 202}
    if not_202 or run.errors:
        sample = list(not_202.items())[:5] + list(run.errors.items())[:5]
        print(f"CALLBACKS NOT ANSWERED 202: {len(not_202) + len(run.errors)}, e.g. {sample}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
