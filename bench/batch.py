"""Batch benchmark: a 100,000-row, ~1 GiB batch into Postgres, memory, and per-row fetching.

    python bench/batch.py                       # the issue's sizes
    python bench/batch.py --rows 20000 --small-rows 2000 --valar-rows 5000   # quicker
    python bench/batch.py --parts 1 --trace-memory      # where the memory is, at its peak
    python bench/batch.py --parts 5 --chunk-bytes 1048576 --inflight-bytes 16777216

Prints, each measured in this run:
  1. rows/s of ``nopoll fetch-batch`` (sference results.jsonl → the sql sink on Postgres) as a
     ratio to a bare asyncpg COPY of the same rows (streamed from the same simulator, parsed,
     COPYed in 1,000-row chunks).                               target: ratio >= 0.9
  2. peak RSS of the nopoll process for that batch and for a 10x smaller one.
                                                                target: <= 150 MB, <= +10 %
  3. rows/s of Valar-style per-row fetching (request_status walk, one GET per row, 20 ms per
     request at the simulator, concurrency 32).                 target: >= 1,000 rows/s
  4. rows/s and peak RSS of an Anthropic Message Batch (``--anthropic-rows``, 20,000 by
     default: poll the batch object, stream its results_url JSONL) into the same sql sink,
     beside the same figures for a batch of as many rows in each other dialect (sference,
     openai, sail, valar).
  5. rows/s and peak RSS of ``--concurrent`` such batches at once (one per dialect) in one
     process: one worker state, one batch runner, as a worker running them together.
                                                                target: near 150 MB
Parts 1 and 2 run ``--rounds`` times. ``--chunk-bytes`` and ``--inflight-bytes`` set
``batch.chunk_bytes`` and ``batch.inflight_bytes``; ``--trace-memory [TOP]`` runs every
``fetch-batch`` under tracemalloc and prints the TOP allocation sites at its traced peak
(tracing slows it: its rates and RSS are not comparable with an untraced run).

Talks to 127.0.0.1 only: the simulator (a separate process), Postgres (database ``test``,
tables ``bench_batch_*`` dropped first) and the Redis database of
``NOPOLL_BENCH_REDIS_URL`` (13 by default; flushed first).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import httpx
import orjson
import redis

PG = os.environ.get("NOPOLL_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("NOPOLL_BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")


SIDE_BY_SIDE = {
    "sference": ("results.jsonl", "bench_side", ""),
    "openai": ("output file", "bench_side_openai", ""),
    "sail": ("inline results", "bench_side_sail", ",shape=guide"),
    "valar": ("per-row GETs", "bench_side_valar", ""),
}
"""The batches measured beside the Anthropic one, as many rows each: (where its rows come
from, its batch id, its simulator options). Valar's per-row GETs have no delay here (part 3
has the 20 ms one); Sail's inline results are its guide's shape."""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_sim(port: int, specs: list[str]) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "receiver.demo.simulator", "--port", str(port)]
    for spec in specs:
        args += ["--batch", spec]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/batches/none", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("simulator did not start")


BASELINE_LZ4 = False
"""``--baseline-lz4``: the bare COPY's ``body`` column compressed with lz4, as nopoll's is."""


async def baseline_copy(base_url: str, batch_id: str, table: str) -> tuple[int, float]:
    """Stream results.jsonl, parse each line, COPY (key, status, body) per 1,000 rows."""
    conn = await asyncpg.connect(PG)
    await conn.execute(f"DROP TABLE IF EXISTS {table}")
    await conn.execute(f"CREATE TABLE {table} (key text primary key, status text, body jsonb)")
    if BASELINE_LZ4:
        await conn.execute(f"ALTER TABLE {table} ALTER COLUMN body SET COMPRESSION lz4")
    await conn.set_type_codec(
        "jsonb",
        schema="pg_catalog",
        format="binary",
        encoder=lambda v: b"\x01" + orjson.dumps(v),
        decoder=lambda b: orjson.loads(b[1:]),
    )
    rows = 0
    started = time.perf_counter()
    records: list[tuple[str, str, object]] = []
    pending = b""
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("GET", f"{base_url}/batches/{batch_id}/results.jsonl") as response,
    ):
        async for chunk in response.aiter_bytes():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line:
                    continue
                row = orjson.loads(line)
                records.append(
                    (f"{batch_id}/{row.get('custom_id', rows)}", row["status"], row["result_json"])
                )
                rows += 1
                if len(records) == 1000:
                    await conn.copy_records_to_table(table, records=records)
                    records = []
    if records:
        await conn.copy_records_to_table(table, records=records)
    elapsed = time.perf_counter() - started
    await conn.close()
    return rows, elapsed


TRACE: int = 0
"""``--trace-memory``: allocation sites shown per fetch-batch process (0: no tracing)."""

_TRACE_PRELUDE = """
import atexit, sys, threading, time, tracemalloc
TOP = int(sys.argv.pop(1))
tracemalloc.start(6)
peak = [0, None]
def watch():
    while True:
        time.sleep(0.2)
        now, _ = tracemalloc.get_traced_memory()
        if now > peak[0] * 1.02:
            peak[1] = tracemalloc.take_snapshot()
            peak[0] = now
threading.Thread(target=watch, daemon=True).start()
def report():
    snapshot = peak[1]
    if snapshot is None:
        return
    snapshot = snapshot.filter_traces([
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
    ])
    print(f"tracemalloc at peak: {peak[0] / 2**20:.1f} MiB traced; top sites:")
    for stat in snapshot.statistics("lineno")[:TOP]:
        frame = stat.traceback[0]
        print(f"  {stat.size / 2**20:8.1f} MiB {stat.count:>8} blocks  "
              f"{frame.filename}:{frame.lineno}")
    print("largest by traceback:")
    for stat in snapshot.statistics("traceback")[:3]:
        print(f"  {stat.size / 2**20:8.1f} MiB")
        for line in stat.traceback.format()[-12:]:
            print("    " + line)
atexit.register(report)
"""

_CLI = """
import sys
from receiver.cli import main
sys.argv = ["nopoll", *sys.argv[1:]]
sys.exit(main())
"""


def _python(code: str | None) -> list[str]:
    """The interpreter's arguments that run ``code`` (None: ``python -m receiver``), under
    tracemalloc with ``--trace-memory``."""
    if not TRACE:
        return ["-m", "receiver"] if code is None else ["-c", code]
    return ["-c", _TRACE_PRELUDE + (code or _CLI), str(TRACE)]


def run_fetch_batch(config: Path, batch_id: str) -> tuple[int, float, float, str]:
    """``nopoll fetch-batch`` in a fresh process: (rows, rows/s, peak RSS MB, output). With
    ``--trace-memory`` the process runs under tracemalloc and prints, at its exit, the top
    allocation sites of the snapshot taken at its traced peak."""
    proc = subprocess.Popen(
        [
            sys.executable,
            *_python(None),
            "fetch-batch",
            "--config",
            str(config),
            "bench",
            batch_id,
            "--force",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "100"},
    )
    try:
        out, _ = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    # ru_maxrss of this child alone (KiB on Linux): RUSAGE_CHILDREN after each run would mix them
    rusage = resource_of(proc)
    text, m = _finished(
        proc, out, r"(\d+) rows delivered in [\d.]+ s \(([\d,]+) rows/s\)", "fetch-batch"
    )
    return int(m.group(1)), float(m.group(2).replace(",", "")), rusage, text


def _finished(
    proc: subprocess.Popen[bytes], out: bytes, pattern: str, what: str
) -> tuple[str, re.Match[str]]:
    """A bench child's output and the match of its closing line (printing its memory
    trace with ``--trace-memory``); exits when it failed or printed no such line."""
    text = out.decode(errors="replace")
    if TRACE:
        print(text[text.find("tracemalloc at peak") :].rstrip())
    m = re.search(pattern, text)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"{what} failed:\n{text[-3000:]}")
    return text, m


_RUSAGE: dict[int, float] = {}
CPU_S: dict[int, float] = {}
"""Each reaped child's own CPU seconds (user + sys), by PID."""


def resource_of(proc: subprocess.Popen[bytes]) -> float:
    return _RUSAGE.get(proc.pid, float("nan"))


def _patch_wait() -> None:
    """Record each child's own peak RSS and CPU time by reaping it with os.wait4."""
    original = subprocess.Popen._try_wait  # type: ignore[attr-defined]

    def try_wait(self, wait_flags):  # type: ignore[no-untyped-def]
        try:
            pid, status, usage = os.wait4(self.pid, wait_flags)
        except ChildProcessError:
            return original(self, wait_flags)
        if pid:
            _RUSAGE[pid] = usage.ru_maxrss / 1024
            CPU_S[pid] = usage.ru_utime + usage.ru_stime
        return pid, status

    subprocess.Popen._try_wait = try_wait  # type: ignore[attr-defined]


BATCH_SETTINGS: dict[str, int] = {}
"""``batch:`` settings every config gets (``--chunk-bytes``, ``--inflight-bytes``)."""


def write_config(tmp: Path, base_url: str, sinks: str) -> Path:
    path = tmp / f"nopoll-{abs(hash(sinks)) % 10000}.yaml"
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    batch = ", ".join(f"{k}: {v}" for k, v in BATCH_SETTINGS.items())
    path.write_text(
        f"redis_url: {REDIS}\n"
        f"data_dir: {tmp / 'data'}\n" + (f"batch: {{{batch}}}\n" if batch else "") + "providers:\n"
        "  bench:\n"
        "    dialect: sference\n"
        f"    base_url: {base_url}\n"
        f"    webhook_secrets: ['{secret}']\n"
        "    max_concurrency: 32\n"
        # the simulator has no request limit (valar's default budget would be 1/s)
        "    rate_limit_rps: null\n"
        f"sinks:\n{sinks}"
    )
    return path


_CONCURRENT = """
import asyncio, sys, time
from nopoll.envelope import now_rfc3339
from receiver.config.settings import load_settings
from receiver.metrics import Metrics
from receiver.runtime import redis_for
from receiver.worker.gc_policy import job_gc
from receiver.worker.state import build_state

def status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0

async def main(settings, redis, pairs, one_after_another):
    state = build_state(settings, redis, Metrics())

    def run(provider, batch_id):
        return state.batch_runner.run(
            state.dialect(provider, "default"), provider=provider, batch_id=batch_id,
            event_id=None, received_at=now_rfc3339(), force=True,
        )

    try:
        started = time.monotonic()
        if one_after_another:  # as one worker takes them: each batch's own high-water mark
            outcomes = []
            for provider, batch_id in pairs:
                outcomes.append(await run(provider, batch_id))
                print(
                    f"after {provider}: {outcomes[-1].rows} rows, peak RSS so far "
                    f"{status_mb('VmHWM'):.0f} MB, RSS now {status_mb('VmRSS'):.0f} MB",
                    flush=True,
                )
        else:
            outcomes = await asyncio.gather(*(run(p, b) for p, b in pairs))
        elapsed = time.monotonic() - started
    finally:
        await state.aclose()
    rows = sum(o.rows for o in outcomes)
    print(f"{rows} rows in {elapsed:.1f} s")

settings = load_settings(sys.argv[1])
one_after_another = "--one-after-another" in sys.argv
pairs = [tuple(a.split("=", 1)) for a in sys.argv[2:] if not a.startswith("--")]
with redis_for(settings) as redis, job_gc():
    asyncio.run(main(settings, redis, pairs, one_after_another))
"""


def run_concurrent(
    config: Path, pairs: list[tuple[str, str]], one_after_another: bool = False
) -> tuple[int, float, float]:
    """Several batches at once in one fresh process, the way one worker runs them (one
    state, one batch runner): (rows, seconds, peak RSS MB). ``one_after_another``: each
    after the previous one, printing the peak RSS after each."""
    args = [f"{provider}={batch_id}" for provider, batch_id in pairs]
    if one_after_another:
        args.append("--one-after-another")
    proc = subprocess.Popen(
        [sys.executable, *_python(_CONCURRENT), str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = proc.communicate(timeout=1800)
    text, m = _finished(proc, out, r"(\d+) rows in ([\d.]+) s", "concurrent batches")
    for line in text.splitlines():
        if line.startswith("after "):
            print(f"  {line}")
    return int(m.group(1)), float(m.group(2)), resource_of(proc)


def concurrent_config(pg_config: Path, base: str, port: int) -> Path:
    """One provider per dialect of :data:`SIDE_BY_SIDE` (and Anthropic), all into the sql
    sink of ``pg_config``."""
    text = pg_config.read_text()
    head, rest = text.split("providers:\n", 1)
    provider, sinks = rest.split("sinks:\n", 1)
    blocks = []
    for dialect in [*SIDE_BY_SIDE, "anthropic"]:
        block = provider.replace("  bench:", f"  bench_{dialect}:").replace(
            "dialect: sference", f"dialect: {dialect}"
        )
        if dialect == "anthropic":  # the API host, as in the SDK; no webhook secrets
            block = block.replace(base, f"http://127.0.0.1:{port}")
            block = "".join(
                line for line in block.splitlines(True) if "webhook_secrets" not in line
            )
        blocks.append(block)
    path = pg_config.with_name("nopoll-concurrent.yaml")
    path.write_text(head + "providers:\n" + "".join(blocks) + "sinks:\n" + sinks)
    return path


def main() -> int:
    global TRACE, BASELINE_LZ4
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--body-bytes", type=int, default=10_000)
    parser.add_argument("--small-rows", type=int, default=10_000)
    parser.add_argument("--valar-rows", type=int, default=20_000)
    parser.add_argument("--valar-delay", type=float, default=0.02)
    parser.add_argument("--anthropic-rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=1, help="repeat parts 1 and 2")
    parser.add_argument("--chunk-bytes", type=int, help="batch.chunk_bytes (default: nopoll's)")
    parser.add_argument(
        "--inflight-bytes", type=int, help="batch.inflight_bytes (default: nopoll's)"
    )
    parser.add_argument(
        "--trace-memory",
        type=int,
        nargs="?",
        const=15,
        default=0,
        metavar="TOP",
        help="run fetch-batch under tracemalloc; print the TOP allocation sites at its peak",
    )
    parser.add_argument(
        "--concurrent",
        type=int,
        default=4,
        metavar="N",
        help="part 5: N batches of --anthropic-rows rows at once in one process "
        "(sference, openai, sail, valar, anthropic; 0: skip)",
    )
    parser.add_argument(
        "--dialects",
        help="part 5: which dialects' batches, comma-separated (default: the first N)",
    )
    parser.add_argument(
        "--one-after-another",
        action="store_true",
        help="part 5 runs its batches one after another in one process, as one worker "
        "takes them, and prints the peak RSS after each",
    )
    parser.add_argument(
        "--parts",
        default="1,2,3,4,5",
        help="which parts to run (1 and 2 go together; default all)",
    )
    parser.add_argument(
        "--baseline-lz4",
        action="store_true",
        help="the bare COPY's body column with lz4 compression too (default: the server's)",
    )
    args = parser.parse_args()
    TRACE = args.trace_memory
    BASELINE_LZ4 = args.baseline_lz4
    if args.chunk_bytes is not None:
        BATCH_SETTINGS["chunk_bytes"] = args.chunk_bytes
    if args.inflight_bytes is not None:
        BATCH_SETTINGS["inflight_bytes"] = args.inflight_bytes
    parts = {int(p) for p in args.parts.split(",") if p.strip()}
    _patch_wait()
    redis.Redis.from_url(REDIS).flushdb()
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    body = f"body_bytes={args.body_bytes}"
    sim = start_sim(
        port,
        [
            f"sference:bench_big:{args.rows}:{body},failed_every=50",
            f"sference:bench_small:{args.small_rows}:{body},failed_every=50",
            f"valar:bench_valar:{args.valar_rows}:row_delay_s={args.valar_delay},failed_every=50",
            f"anthropic:msgbatch_bench:{args.anthropic_rows}:{body},errored_every=50",
            *(
                f"{dialect}:{batch_id}:{args.anthropic_rows}:{body},failed_every=50{options}"
                for dialect, (_, batch_id, options) in SIDE_BY_SIDE.items()
            ),
        ],
    )
    try:
        with tempfile.TemporaryDirectory(prefix="nopoll-bench-") as tmp_name:
            tmp = Path(tmp_name)
            settings = ", ".join(f"{k}={v:,}" for k, v in BATCH_SETTINGS.items())
            print(f"batch settings: {settings or 'defaults'}")
            pg_config = write_config(
                tmp, base, f"  db: {{type: sql, url: '{PG}', table: bench_batch_rows}}\n"
            )
            if parts & {1, 2}:
                for round_no in range(1, args.rounds + 1):
                    if args.rounds > 1:
                        print(f"round {round_no} of {args.rounds}")
                    _copy_and_memory(args, base, pg_config)
            if 3 in parts:
                _valar(args, tmp, base)
            if 4 in parts:
                _side_by_side(args, tmp, base, port, pg_config)
            if 5 in parts and args.concurrent > 0:
                config = concurrent_config(pg_config, base, port)
                ids = {
                    **{d: b for d, (_, b, _) in SIDE_BY_SIDE.items()},
                    "anthropic": "msgbatch_bench",
                }
                chosen = args.dialects.split(",") if args.dialects else list(ids)
                pairs = [(f"bench_{d}", ids[d]) for d in chosen[: args.concurrent]]
                asyncio.run(_drop("bench_batch_rows"))
                names = ", ".join(p.removeprefix("bench_") for p, _ in pairs)
                if args.one_after_another:
                    print(f"{len(pairs)} batches one after another in one process ({names}):")
                rows, seconds, rss = run_concurrent(config, pairs, args.one_after_another)
                how = "one after another" if args.one_after_another else "at once"
                print(
                    f"{len(pairs)} batches {how} in one process ({names}): {rows:,} rows in "
                    f"{seconds:.1f} s ({rows / seconds:,.0f} rows/s), peak RSS {rss:.0f} MB"
                    "   (target near 150 MB)"
                )
    finally:
        sim.send_signal(signal.SIGTERM)
        try:
            sim.wait(10)
        except subprocess.TimeoutExpired:
            sim.kill()
        asyncio.run(_drop("bench_batch_baseline"))
    return 0


def _copy_and_memory(args: argparse.Namespace, base: str, pg_config: Path) -> None:
    """Parts 1 and 2: the big batch against a bare COPY, and its peak RSS beside a small one's."""
    with httpx.stream("GET", f"{base}/batches/bench_small/results.jsonl", timeout=60) as r:
        size = sum(len(c) for c in r.iter_bytes())
    gib = size * args.rows / args.small_rows / 2**30
    print(f"batch: {args.rows:,} rows, about {gib:.2f} GiB of results.jsonl")
    rows, seconds = asyncio.run(baseline_copy(base, "bench_big", "bench_batch_baseline"))
    base_rate = rows / seconds
    what = "lz4 body" if BASELINE_LZ4 else "server default compression"
    print(f"  bare asyncpg COPY        {base_rate:>10,.0f} rows/s", end="")
    print(f"  ({what})", end="")
    print(f"  ({rows:,} rows, {seconds:.1f} s)")
    asyncio.run(_drop("bench_batch_rows"))
    n, rate, rss_big, _ = run_fetch_batch(pg_config, "bench_big")
    assert n == args.rows, n
    print(
        f"  nopoll fetch-batch → sql {rate:>10,.0f} rows/s  ratio {rate / base_rate:.2f}"
        "   (target >= 0.90)"
    )
    _, _, rss_small, _ = run_fetch_batch(pg_config, "bench_small")
    print(
        f"peak RSS: {rss_big:.0f} MB for {args.rows:,} rows, {rss_small:.0f} MB for "
        f"{args.small_rows:,} rows: {(rss_big / rss_small - 1) * 100:+.1f} %"
        "   (target <= 150 MB and <= +10 %)"
    )


def _valar(args: argparse.Namespace, tmp: Path, base: str) -> None:
    files_config = write_config(tmp, base, f"  files: {{type: jsonl, dir: '{tmp / 'out'}'}}\n")
    files_config.write_text(files_config.read_text().replace("dialect: sference", "dialect: valar"))
    n, rate, _, _ = run_fetch_batch(files_config, "bench_valar")
    print(
        f"valar per-row fetch: {rate:,.0f} rows/s for {n:,} rows at concurrency 32, "
        f"{args.valar_delay * 1000:.0f} ms per request   (target >= 1,000 rows/s)"
    )


def _side_by_side(
    args: argparse.Namespace, tmp: Path, base: str, port: int, pg_config: Path
) -> None:
    anthropic_config = tmp / "nopoll-anthropic.yaml"
    anthropic_config.write_text(
        pg_config.read_text()
        .replace("dialect: sference", "dialect: anthropic")
        .replace(base, f"http://127.0.0.1:{port}")  # the API host, as in the SDK
        .split("    webhook_secrets:")[0]
        + "    max_concurrency: 32\n"
        + pg_config.read_text().split("max_concurrency: 32\n", 1)[1]
    )
    n, rate, rss, _ = run_fetch_batch(anthropic_config, "msgbatch_bench")
    assert n == args.anthropic_rows, n
    lines = [f"  {'anthropic':<9} {'(results_url JSONL)':<20} {rate:>8,.0f} rows/s"]
    lines[0] += f"  peak RSS {rss:.0f} MB"
    for dialect, (source, batch_id, _) in SIDE_BY_SIDE.items():
        side_config = tmp / f"nopoll-side-{dialect}.yaml"
        side_config.write_text(
            pg_config.read_text().replace("dialect: sference", f"dialect: {dialect}")
        )
        n, side_rate, side_rss, _ = run_fetch_batch(side_config, batch_id)
        assert n == args.anthropic_rows, (dialect, n)
        lines.append(
            f"  {dialect:<9} {f'({source})':<20} {side_rate:>8,.0f} rows/s"
            f"  peak RSS {side_rss:.0f} MB"
        )
    print(f"{args.anthropic_rows:,}-row batch → sql, every dialect beside the others:")
    print("\n".join(lines))


async def _drop(table: str) -> None:
    conn = await asyncpg.connect(PG)
    try:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
    finally:
        await conn.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import load_note

    print(f"machine before: {load_note()}", flush=True)
    code = main()
    print(f"machine after: {load_note()}")
    sys.exit(code)
