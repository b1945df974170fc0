"""Ingest throughput of nopoll's callback endpoint, as a ratio to a no-op baseline.

Usage: ``python bench/ingest.py [--duration 10] [--connections 64] [--threads 2]``

Four single-process uvicorn servers (1 worker, uvloop, httptools, no access log, log
level warning), one at a time, each on a free 127.0.0.1 port, are loaded by ``wrk``:

a. ``baseline``: a no-op Starlette app that reads the body and answers 200;
b. ``verify``: the same plus ``receiver.webhooks.verify.Verifier``, answering 202;
c. ``arq``: verify + arq's standard ``ArqRedis.enqueue_job`` per request;
d. ``nopoll``: the real API, ``nopoll api --config <generated> --host --port``.

Every request is a distinct callback (unique ``webhook-id`` and ``data.id``) signed by
the ``standardwebhooks`` package with a timestamp of "now". The requests are generated
before each case into one file per wrk thread (the exact bytes ``wrk.format`` would
build, NUL-separated); a generated Lua script loads its thread's file in ``init`` and
``request()`` walks through it. The pool is sized from the baseline's rate so it does not
run out; if a thread does run out (it would repeat requests), the case is run again
with a pool twice as large.

After the nopoll case the Redis queue ``nopoll:jobs`` must hold exactly one job per 202
that the server sent (its own ``nopoll_callbacks_total{outcome="accepted"}``), and wrk
must have seen no non-2xx answer. Redis database 13 is flushed before every case.
Figures are ratios to the baseline measured in the same run (the machine is noisy); the
server's busy share (its CPU time over the wall time, from ``/proc``) says whether it
waited instead of working.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.servers

from _common import (
    BENCH_DIR,
    BIN_DIR,
    REDIS_URL,
    SECRET_ENV,
    WRK_LUA,
    WrkResult,
    cpu_seconds,
    flush_bench_db,
    free_port,
    load_note,
    machine_cpu,
    new_secret,
    nopoll_config,
    redis_db13,
    run_wrk,
    start_process,
    stop_process,
    wait_http,
    write_pool,
)

TARGET_RATIO = 0.6
TARGET_BUSY = 0.9
CASES = {
    "baseline": "no-op Starlette, 200",
    "verify": "Verifier only, 202",
    "arq": "verify + arq enqueue_job",
    "nopoll": "nopoll api (real)",
    "replica0": "nopoll, primary + 1 replica",
    "replica1": "same, min_replicas_acked 1",
}
REPLICA_CASES = {"replica0": 0, "replica1": 1}
"""Cases on a primary with one replica of their own (valkey processes), without and with
``WAIT 1`` ending every enqueue trip: what acknowledging only replicated callbacks costs."""


@dataclass
class CaseResult:
    case: str
    wrk: WrkResult
    pool_per_thread: int
    notes: list[str] = field(default_factory=list)
    ok: bool = True
    machine_busy: float = float("nan")

    @property
    def busy(self) -> float:
        """The server's CPU time over the wall time: 1.0 means it never waited."""
        return self.wrk.server_cpu_s / self.wrk.seconds if self.wrk.seconds else float("nan")


def server_command(case: str, port: int, config: Path) -> list[str]:
    if case == "nopoll" or case in REPLICA_CASES:
        return [
            str(BIN_DIR / "nopoll"),
            "api",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    factory = {"baseline": "baseline", "verify": "verify_only", "arq": "stock_arq"}[case]
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "--app-dir",
        str(BENCH_DIR),
        f"_apps:{factory}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--no-access-log",
        "--log-level",
        "warning",
        "--lifespan",
        "on",
    ]


def redis_pid() -> int | None:
    """The PID of the Redis server on 127.0.0.1:6379, when it runs on this machine."""
    r = redis_db13()
    try:
        pid = int(r.info("server").get("process_id", 0))
    finally:
        r.close()
    return pid if pid > 0 and Path(f"/proc/{pid}").exists() else None


def accepted_counter(port: int) -> int | None:
    """The nopoll API's own count of callbacks it answered 202 ``accepted``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("nopoll_callbacks_total{") and 'outcome="accepted"' in line:
            return round(float(line.rsplit(" ", 1)[1]))
    return None


def _measure(
    case: str, proc: subprocess.Popen[bytes], pool: Path, args: argparse.Namespace, **wrk: Any
) -> CaseResult:
    """One timed wrk run, with the CPU time of the server, Redis and the whole machine."""
    rpid = redis_pid()
    cpu0, rcpu0, (busy0, total0) = cpu_seconds(proc.pid), cpu_seconds(rpid), machine_cpu()
    result = run_wrk(pool=pool, seconds=args.duration, **wrk)
    busy1, total1 = machine_cpu()
    result.server_cpu_s = cpu_seconds(proc.pid) - cpu0
    result.redis_cpu_s = cpu_seconds(rpid) - rcpu0
    res = CaseResult(case, result, 0)
    res.machine_busy = (busy1 - busy0) / (total1 - total0) if total1 > total0 else math.nan
    if result.non_2xx:  # replica1: a 503 when WAIT times out under saturation is its promise
        res.ok = res.ok and REPLICA_CASES.get(case, 0) > 0
        res.notes.append(f"{result.non_2xx} non-2xx answers")
    if result.socket_errors != "none":
        res.notes.append(f"socket errors: {result.socket_errors}")
    return res


def _check_queue(
    res: CaseResult, port: int, before: int | None, connections: int, url: str | None = None
) -> None:
    """The nopoll cases: one job in the queue per 202 the server counted, and per wrk 2xx."""
    import redis as redis_sync

    time.sleep(0.5)  # let requests that were in flight when wrk stopped finish
    r = redis_db13() if url is None else redis_sync.Redis.from_url(url)
    try:
        queued = int(r.zcard("nopoll:jobs"))
    finally:
        r.close()
    after = accepted_counter(port)
    accepted = None if after is None or before is None else after - before
    w = res.wrk
    res.notes.append(
        f"queue nopoll:jobs holds {queued} jobs; server answered {accepted} x 202; "
        f"wrk counted {w.requests} answers, {w.non_2xx} non-2xx"
    )
    # a 503 of min_replicas_acked comes after the enqueue: its job is queued all the same
    # (the provider's retry is then a duplicate), so it may add to the queue
    waited = w.non_2xx if url is not None else 0
    if accepted is None or not accepted <= queued <= accepted + waited:
        res.ok = False
        res.notes.append("MISMATCH: jobs in the queue != 202 answers")
    if not w.requests - w.non_2xx <= queued <= w.requests + connections:
        res.ok = False
        res.notes.append("MISMATCH: jobs in the queue do not match wrk's 2xx count")


def run_case(
    case: str, *, args: argparse.Namespace, work: Path, secret: str, per_thread: int, config: Path
) -> CaseResult:
    port = free_port()
    warm, pool = work / f"warm-{case}", work / f"pool-{case}"
    if args.warmup > 0:
        write_pool(warm, threads=args.threads, per_thread=3000, secret=secret, port=port, tag="w")
    write_pool(pool, threads=args.threads, per_thread=per_thread, secret=secret, port=port, tag="m")
    log_path = work / f"server-{case}.log"
    flush_bench_db()
    servers: list[Any] = []
    own_url: str | None = None
    if case in REPLICA_CASES:  # a primary and a replica of its own, this case only
        from tests.servers import ValkeyProcess

        primary = ValkeyProcess(appendonly=True).start()
        servers.append(primary)
        replica = ValkeyProcess(extra=("--replicaof", "127.0.0.1", str(primary.port)))
        servers.append(replica.start())
        own_url = primary.url
        text = config.read_text().replace(f"redis_url: {REDIS_URL}", f"redis_url: {own_url}")
        text += f"redis: {{min_replicas_acked: {REPLICA_CASES[case]}, wait_timeout_ms: 1000}}\n"
        config = work / f"nopoll-{case}.yaml"
        config.write_text(text)
    proc = start_process(
        server_command(case, port, config),
        env={SECRET_ENV: secret, "BENCH_REDIS_URL": REDIS_URL},
        log_path=log_path,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc, log_path=log_path)
        wrk: dict[str, Any] = {
            "port": port,
            "script": work / "pool.lua",
            "threads": args.threads,
            "connections": args.connections,
        }
        if args.warmup > 0:
            run_wrk(pool=warm, seconds=args.warmup, **wrk)
            time.sleep(0.2)
            flush_bench_db()
            if own_url is not None:  # the case's own primary (its replica follows)
                import redis as redis_sync

                own = redis_sync.Redis.from_url(own_url)
                own.flushdb()
                own.close()
        # No line yet (no callback counted so far) means 0.
        real = case == "nopoll" or case in REPLICA_CASES
        before = (accepted_counter(port) or 0) if real else None
        res = _measure(case, proc, pool, args, **wrk)
        res.pool_per_thread = per_thread
        if real:
            _check_queue(res, port, before, args.connections, own_url)
        return res
    finally:
        stop_process(proc)
        for server in servers:
            server.stop()
        if proc.returncode not in (0, None, -15):
            print(f"  note: {case} server exited with {proc.returncode} (log {log_path})")
        for t in range(args.threads):
            Path(f"{pool}.{t}").unlink(missing_ok=True)
            Path(f"{warm}.{t}").unlink(missing_ok=True)


def _run_sized(case: str, base_rps: float, **kwargs: Any) -> CaseResult:
    """Baseline: requests may repeat (it does nothing with them). Others: enough distinct
    requests for 1.3x the baseline's rate, doubled once if that runs out."""
    args = kwargs["args"]
    if case == "baseline":
        per_thread = 20_000
    else:
        expected = max(base_rps, 2000.0) * args.duration * 1.3
        per_thread = math.ceil(expected / args.threads) + 1000
    for attempt in range(2):
        res = run_case(case, per_thread=per_thread, **kwargs)
        if case == "baseline" or res.wrk.wrapped == 0:
            break
        res.notes.append(f"pool of {per_thread}/thread ran out (attempt {attempt})")
        per_thread *= 2
    if case != "baseline" and res.wrk.wrapped:
        res.ok = False
        res.notes.append("requests repeated: the figure is not valid")
    return res


def _print_round(rnd: int, res: CaseResult) -> None:
    w = res.wrk
    print(
        f"  round {rnd + 1} {res.case:<9} {w.rps:>10,.0f} req/s  "
        f"p50 {w.p50_ms:6.2f} ms  p99 {w.p99_ms:7.2f} ms  "
        f"server {res.busy:4.0%} busy, "
        f"{w.cpu_us_per_request(w.server_cpu_s):4.0f} us CPU/req, "
        f"redis {w.cpu_us_per_request(w.redis_cpu_s):3.0f} us/req, "
        f"machine {res.machine_busy:4.0%} busy  non-2xx {w.non_2xx}  "
        f"({w.requests} answers in {w.seconds:.2f}s, "
        f"pool {res.pool_per_thread}/thread, used {'+'.join(map(str, w.used))})"
    )
    for note in res.notes:
        print(f"      {note}")


def run_rounds(
    args: argparse.Namespace, wanted: list[str], secret: str, work: Path, config: Path
) -> dict[str, list[tuple[CaseResult, float, float]]]:
    """Every case, every round: (result, ratio to the round's baseline, CPU ratio)."""
    runs: dict[str, list[tuple[CaseResult, float, float]]] = {c: [] for c in wanted}
    for rnd in range(args.rounds):
        base_rps, base_cpu = 0.0, math.nan
        for case in wanted:
            res = _run_sized(case, base_rps, args=args, work=work, secret=secret, config=config)
            w = res.wrk
            cpu = w.cpu_us_per_request(w.server_cpu_s)
            if case == "baseline":
                base_rps, base_cpu = w.rps, cpu
            ratio = w.rps / base_rps if base_rps else math.nan
            runs[case].append((res, ratio, base_cpu / cpu))
            _print_round(rnd, res)
    return runs


def summarize(runs: dict[str, list[tuple[CaseResult, float, float]]], strict: bool) -> int:
    """The median table over rounds, the target verdict; the exit status."""
    header = (
        f"{'case':<10} {'what':<26} {'req/s':>10} {'ratio':>7} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'us CPU/req':>11} {'CPU ratio':>10} {'busy':>6}"
    )
    print(header)
    print("-" * len(header))
    failed = False
    for case, rows in runs.items():
        res = [r for r, _, _ in rows]

        def med(values: Any) -> float:
            return float(statistics.median(values))

        cpu = med(r.wrk.cpu_us_per_request(r.wrk.server_cpu_s) for r in res)
        flag = "" if all(r.ok for r in res) else "  (check failed)"
        failed |= bool(flag)
        print(
            f"{case:<10} {CASES[case]:<26} {med(r.wrk.rps for r in res):>10,.0f} "
            f"{med(x for _, x, _ in rows):>7.3f} {med(r.wrk.p50_ms for r in res):>8.2f} "
            f"{med(r.wrk.p99_ms for r in res):>8.2f} {cpu:>11.0f} "
            f"{med(c for _, _, c in rows):>10.3f} {med(r.busy for r in res):>6.0%}{flag}"
        )
    print(
        "ratio: req/s over the baseline's in the same round; CPU ratio: the baseline's "
        "server CPU time per request over this case's (steadier on a busy machine); busy: "
        "the server's CPU time over the wall time"
    )
    print()
    exit_code = 1 if failed else 0
    if "nopoll" in runs:
        ratio = statistics.median(x for _, x, _ in runs["nopoll"])
        busy = statistics.median(r.busy for r, _, _ in runs["nopoll"])
        met = ratio >= TARGET_RATIO and busy >= TARGET_BUSY
        print(
            f"target: nopoll ratio >= {TARGET_RATIO} with the server >= {TARGET_BUSY:.0%} busy: "
            f"{ratio:.3f}, {busy:.0%} ({'met' if met else 'MISSED'})"
        )
        non2 = sum(r.wrk.non_2xx for r, _, _ in runs["nopoll"])
        print(f"nopoll non-2xx answers: {non2} (must be 0)")
        if not met and strict:
            exit_code = exit_code or 1
    if failed:
        print("a correctness check failed: see the notes above")
    return exit_code


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per case (10)")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections (64)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per case (2)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every case N times (1)")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated subset of {','.join(CASES)} (baseline is always run)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when the nopoll target is missed"
    )
    args = parser.parse_args(argv)
    wanted = ["baseline", *[c for c in args.cases.split(",") if c and c != "baseline"]]
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s): {', '.join(unknown)}")
    if not (1 <= args.rounds <= 20 and 1 <= args.duration <= 600 and args.connections >= 1):
        parser.error("--rounds 1..20, --duration 1..600, --connections >= 1")
    return args, wanted


def main(argv: list[str] | None = None) -> int:
    args, wanted = _parse(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed: apt-get install wrk", file=sys.stderr)
        return 2
    secret = new_secret()
    with tempfile.TemporaryDirectory(prefix="nopoll-bench-") as tmp:
        work = Path(tmp)
        (work / "pool.lua").write_text(WRK_LUA, encoding="utf-8")
        config = nopoll_config(
            work / "nopoll.yaml",
            base_url="http://127.0.0.1:9/v1",
            data_dir=work / "data",
            sinks_yaml=f"  files: {{type: jsonl, dir: {work / 'results'}}}",
        )
        print(
            f"wrk -t{args.threads} -c{args.connections}, {args.duration:g}s per case "
            f"(+{args.warmup:g}s warm-up), {args.rounds} round(s), Redis db 13; "
            f"{load_note()}"
        )
        runs = run_rounds(args, wanted, secret, work, config)
    print(f"after the run: {load_note()}")
    print()
    return summarize(runs, args.strict)


if __name__ == "__main__":
    sys.exit(main())
