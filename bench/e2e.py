"""End-to-end latency: a signed callback in, a row in Postgres out.

Usage: ``python bench/e2e.py [--rate 200] [--seconds 20]``

Starts the provider simulator (``receiver.demo.simulator.ProviderSimulator``, a real HTTP
server on 127.0.0.1 in a thread) and ``nopoll serve`` (API + worker in one process) with
Redis database 13 and one sink, ``{type: sql, url: postgresql://...test, table:
bench_results}``; waits for ``/readyz``; then sends ``response.completed`` callbacks at a
steady rate with ``receiver.demo.simulator.send_callback`` (signed by ``standardwebhooks``),
one new response id each, recording when each was sent. A poller asks Postgres every
few milliseconds which of the outstanding keys have a row and records when each shows
up. Prints p50/p90/p99 of callback-to-row latency, rows landed / sent, and provider
requests per delivered result (the simulator's count of ``GET /v1/responses/...``).

Exits 1 when a row is missing or a callback was not answered 202. The latency includes
the poller's own granularity (``--poll-ms``, default 5 ms, plus the query's time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import socket
import sys
import tempfile
import time
import types
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BIN_DIR,
    PG_URL,
    PROVIDER,
    SECRET_ENV,
    cpu_seconds,
    flush_bench_db,
    free_port,
    load_note,
    new_secret,
    nopoll_config,
    percentile,
    start_process,
    stop_process,
    wait_http,
)

TABLE = "bench_results"
TARGET_P99_MS = 250.0
TARGET_P50_MS = 50.0
TARGET_REQUESTS_PER_RESULT = 1.0
MAX_KEYS_PER_POLL = 2000


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
    server_cpu_s: float = 0.0
    """CPU time nopoll serve used from the first callback to the last row."""
    stamps: dict[str, tuple[float, float]] = field(default_factory=dict)
    """key -> (received_at, fetched_at) as perf_counter values, read from the rows."""


async def prepare_postgres() -> None:
    """Drop the benchmark's table (and its schema-version row) before the run."""
    import asyncpg

    conn = await asyncpg.connect(PG_URL, timeout=10)
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


async def send_all(
    run: Run, url: str, secret: str, ids: list[str], rate: float, clients: int
) -> None:
    """Send one callback per id at a steady ``rate``, each in its own task.

    The callbacks are spread round-robin over several small httpx clients: httpcore's
    pool walks every connection (and every queued request) on each request, so one big
    pool costs the sender more CPU than the server it measures.
    """
    import httpx

    from receiver.demo.simulator import send_callback

    async def one(client: httpx.AsyncClient, rid: str) -> None:
        run.pending[rid] = None
        run.sent_at[rid] = time.perf_counter()
        try:
            resp = await send_callback(client, url, secret, rid)
        except httpx.HTTPError as exc:
            run.errors[rid] = type(exc).__name__
            return
        run.acked_at[rid] = time.perf_counter()
        run.status[rid] = resp.status_code

    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    async with contextlib.AsyncExitStack() as stack:
        pool = [
            await stack.enter_async_context(httpx.AsyncClient(timeout=10.0, limits=limits))
            for _ in range(clients)
        ]
        tasks: list[asyncio.Task[None]] = []
        run.send_started = start = time.perf_counter()
        for i, rid in enumerate(ids):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(pool[i % clients], rid)))
        run.send_finished = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
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
            rows = await conn.fetch(query, PROVIDER, keys)  # type: ignore[attr-defined]
            seen = time.perf_counter()
            took = seen - before
            run.poll_seconds.append(took)
            for row in rows:
                key = row["key"]
                if key in run.pending:
                    del run.pending[key]
                    run.landed_at[key] = seen
        await asyncio.sleep(max(poll_s, took))


async def measure(args: argparse.Namespace, url: str, secret: str, ids: list[str]) -> Run:
    import asyncpg

    run = Run(wall_offset=time.time() - time.perf_counter())
    conn = await asyncpg.connect(PG_URL, timeout=10)
    try:
        await wait_for_table(conn)
        max_s = args.seconds + args.drain + 90
        poller = asyncio.create_task(
            poll_rows(run, conn, args.poll_ms / 1000, args.drain, max_s), name="poller"
        )
        try:
            await send_all(run, url, secret, ids, args.rate, args.clients)
            await asyncio.wait_for(poller, timeout=max_s)
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        run.table_rows = int(
            await conn.fetchval(f"SELECT count(*) FROM {TABLE} WHERE provider = $1", PROVIDER)  # type: ignore[attr-defined]
        )
        rows = await conn.fetch(  # type: ignore[attr-defined]
            f"SELECT key, extract(epoch FROM received_at) AS r, "
            f"extract(epoch FROM fetched_at) AS f FROM {TABLE} WHERE provider = $1",
            PROVIDER,
        )
        for row in rows:
            run.stamps[row["key"]] = (
                float(row["r"]) - run.wall_offset,
                float(row["f"]) - run.wall_offset,
            )
    finally:
        await conn.close()
    return run


def scrape_metrics(port: int) -> dict[str, float]:
    """nopoll's own /metrics: ``name -> value`` summed over labels, and each labelled line."""
    totals: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return totals
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        with contextlib.suppress(ValueError):
            for key in {name, name.split("{", 1)[0]}:
                totals[key] = totals.get(key, 0.0) + float(value)
    return totals


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


def install_sniffio_shim() -> bool:
    """Give this process (the load generator, not nopoll) a ``sniffio`` when it is missing.

    httpcore calls ``current_async_library()``, which does ``import sniffio`` and falls
    back to "asyncio" on ImportError; a failed import is not cached, so every call
    searches sys.path again. The stand-in answers what the fallback answers, at once.
    """
    try:
        import sniffio  # noqa: F401
    except ImportError:
        shim = types.ModuleType("sniffio")
        shim.current_async_library = lambda: "asyncio"  # type: ignore[attr-defined]
        sys.modules["sniffio"] = shim
        return True
    return False


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="callbacks per second (200)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of sending (20)")
    parser.add_argument(
        "--drain", type=float, default=30.0, help="seconds to wait for late rows (30)"
    )
    parser.add_argument("--poll-ms", type=float, default=5.0, help="Postgres poll interval (5)")
    parser.add_argument(
        "--clients", type=int, default=8, help="httpx clients the sender spreads over (8)"
    )
    args = parser.parse_args(argv)
    if not (0 < args.rate <= 5000 and 0 < args.seconds <= 600 and 0 <= args.drain <= 600):
        parser.error("--rate 0..5000, --seconds 0..600, --drain 0..600")
    if not 1 <= args.poll_ms <= 1000:
        parser.error("--poll-ms 1..1000")
    if not 1 <= args.clients <= 64:
        parser.error("--clients 1..64")
    # The sender, the poller and the simulator's thread share this process's GIL: hand it
    # over faster than the default 5 ms so that none of them stalls the others that long.
    sys.setswitchinterval(0.0005)
    if install_sniffio_shim():
        print(
            "note: sniffio is not installed, so httpcore re-tries `import sniffio` several "
            "times per request (~90 us each); this sender uses a stand-in module"
        )

    from receiver.demo.simulator import ProviderSimulator

    total = max(1, math.floor(args.rate * args.seconds))
    nonce = uuid.uuid4().hex[:10]
    ids = [f"resp_e2e{nonce}_{i:06d}" for i in range(total)]
    secret = new_secret()
    api_key = "bench-key"

    asyncio.run(prepare_postgres())
    flush_bench_db()
    sim = ProviderSimulator(api_key=api_key)
    if fix_simulator_nodelay(sim):
        print(
            "note: the simulator's socket has proto 0, so asyncio leaves Nagle on and every "
            "keep-alive answer waits ~40 ms for a delayed ACK; this run re-creates it"
        )
    proc = None
    with tempfile.TemporaryDirectory(prefix="nopoll-e2e-") as tmp:
        work = Path(tmp)
        log_path = work / "nopoll.log"
        try:
            sim.start()
            for rid in ids:
                sim.add_response(rid)
            config = nopoll_config(
                work / "nopoll.yaml",
                base_url=sim.base_url,
                data_dir=work / "data",
                sinks_yaml=f"  results: {{type: sql, url: '{PG_URL}', table: {TABLE}}}",
            )
            port = free_port()
            proc = start_process(
                [
                    str(BIN_DIR / "nopoll"),
                    "serve",
                    "--config",
                    str(config),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                env={SECRET_ENV: secret},
                log_path=log_path,
            )
            wait_http(f"http://127.0.0.1:{port}/readyz", proc=proc, timeout_s=60, log_path=log_path)
            print(
                f"nopoll serve on 127.0.0.1:{port}, simulator on {sim.base_url}; sending "
                f"{total} callbacks at {args.rate:g}/s for {args.seconds:g}s; {load_note()}"
            )
            url = f"http://127.0.0.1:{port}/webhooks/{PROVIDER}"
            cpu_before = cpu_seconds(proc.pid)
            run = asyncio.run(measure(args, url, secret, ids))
            run.server_cpu_s = cpu_seconds(proc.pid) - cpu_before
            provider_requests = sim.request_count("/v1/responses/")
            run.server_metrics = scrape_metrics(port)
        finally:
            stop_process(proc)
            sim.stop()
        if proc is not None and proc.returncode not in (0, None):
            print(f"note: nopoll serve exited with {proc.returncode}")
        code = report(args, run, ids, provider_requests)
        if code or proc is None or proc.returncode not in (0, None):
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            print(f"\nlast lines of nopoll's log (log level warning):\n{log[-4000:]}")
    return code


def report(args: argparse.Namespace, run: Run, ids: list[str], provider_requests: int) -> int:
    total = len(ids)
    latencies = sorted(
        (run.landed_at[rid] - run.sent_at[rid]) * 1000 for rid in ids if rid in run.landed_at
    )
    acks = sorted(
        (run.acked_at[rid] - run.sent_at[rid]) * 1000 for rid in ids if rid in run.acked_at
    )
    landed = len(latencies)
    not_202 = {rid: s for rid, s in run.status.items() if s != 202}
    send_s = run.send_finished - run.send_started
    per_result = provider_requests / landed if landed else float("nan")
    p50, p90, p99 = (percentile(latencies, q) for q in (50, 90, 99))

    print()
    print(f"sent:            {total} callbacks in {send_s:.2f}s ({total / send_s:.1f}/s)")
    print(
        f"answers:         {len(run.status)} ({len(run.status) - len(not_202)} x 202), "
        f"{len(run.errors)} transport errors; 202 in p50 {percentile(acks, 50):.1f} ms, "
        f"p99 {percentile(acks, 99):.1f} ms"
    )
    print(
        f"rows landed:     {landed} / {total} ({landed / total:.4f}); "
        f"table holds {run.table_rows} rows"
    )
    polls = sorted(t * 1000 for t in run.poll_seconds)
    print(
        f"poller:          {len(polls)} queries, each p50 {percentile(polls, 50):.1f} ms, "
        f"p99 {percentile(polls, 99):.1f} ms (the resolution of the latencies below)"
    )
    if latencies:
        print(
            f"callback -> row: p50 {p50:.1f} ms  p90 {p90:.1f} ms  p99 {p99:.1f} ms  "
            f"max {latencies[-1]:.1f} ms"
        )
    stages = [
        (
            run.stamps[rid][0] - run.sent_at[rid],
            run.stamps[rid][1] - run.stamps[rid][0],
            run.landed_at[rid] - run.stamps[rid][1],
        )
        for rid in ids
        if rid in run.landed_at and rid in run.stamps
    ]
    if stages:
        names = ("send -> API received_at", "received_at -> fetched_at", "fetched_at -> row seen")
        for n, name in enumerate(names):
            part = sorted(s[n] * 1000 for s in stages)
            print(
                f"  {name:<26} p50 {percentile(part, 50):7.1f} ms  "
                f"p90 {percentile(part, 90):7.1f} ms  p99 {percentile(part, 99):7.1f} ms"
            )
        print("  (received_at and fetched_at are the row's own ms timestamps)")
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
    if landed:
        cpu_ms = run.server_cpu_s / landed * 1000
        print(
            f"  nopoll serve CPU per result (API + worker) {cpu_ms:.2f} ms "
            f"({run.server_cpu_s:.1f} s for {landed} rows)"
        )
    outcomes = ", ".join(
        f"{name.split('{', 1)[1].rstrip('}')}: {value:.0f}"
        for name, value in sorted(m.items())
        if name.startswith(("nopoll_jobs_total{", "nopoll_sink_writes_total{"))
        or (name.startswith("nopoll_dead_letters_total{") and value)
    )
    if outcomes:
        print(f"  worker outcomes: {outcomes}")
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
    failed = False
    if landed < total:
        missing = [rid for rid in ids if rid not in run.landed_at]
        print(f"MISSING ROWS: {len(missing)}, e.g. {', '.join(missing[:5])}")
        failed = True
    if not_202 or run.errors:
        sample = list(not_202.items())[:5] + list(run.errors.items())[:5]
        print(f"CALLBACKS NOT ANSWERED 202: {len(not_202) + len(run.errors)}, e.g. {sample}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
