"""Signed callbacks while one team does its worst within its caps, next to a quiet run.

    python bench/hostile.py --pin             # 3 rounds of 3 runs of 20 s; --pin: below
    python bench/hostile.py --seconds 10 --rate 100 --parts hog,catchup

Two ``nopoll api`` processes and one ``nopoll worker`` (Redis db 13, the provider
simulator, the results API on, every cap at its default; tenant ``team-a`` with a
consumer token). The results stream holds ``--stream-entries`` results of other tenants
and the dead letters ``--letters`` of the operator's own. Then, for ``--seconds``, signed
callbacks come at ``--rate`` a second from 127.0.0.3 to the first API process: alone
(``quiet``); while team-a, from 127.0.0.4, works the same process (``hostile``); and
while it works the second one (``split``: providers and consumers on API processes of
their own, one Redis). The team, in a process of its own, at once:

1. keeps ``--hog`` keep-alive connections busy with a ``GET`` every 3 s, half anonymous
   on ``/healthz``, half with its token (connection slots);
2. makes 300 dead letters a second (its callbacks for unknown ids did) while its user
   pages through them (``GET /admin/v1/deadletters?tenant=team-a``) 20 times a second;
3. holds its token's 20 streams: 10 reconnecting from ``Last-Event-ID: 0-0`` every
   ``--catchup-every`` s, 10 stalled, while 6 MB envelopes of team-a are published.

``--pin`` puts the providers' API process, the sender and Redis on the last CPU, and the
team, the worker, the simulator and the consumers' API process on the others (as another
pod would be), so that the team's own CPU is not taken from the server.
Prints per run the answers by status, p50/p99, the API's CPU and peak RSS, the team's
counts; the runs alternate for ``--rounds``, and the targets compare median p99s.
**Target: hostile p99 within 1.5x of quiet, and no 503.** Exit 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as common
import e2e
from flood import _valid, read_answer

from nopoll.envelope import Envelope, now_rfc3339
from receiver.queue.deadletter import DeadLetters
from receiver.queue.jobs import FETCH_RESPONSE
from receiver.redis import RedisConnector
from sinks.results import RESULTS_SINK, ResultsSink, ResultsSinkConfig

TEAM_FROM = "127.0.0.4"
ADMIN = "bench-admin-token-0123456789"
TEAM_TOKEN = "bench-team-a-token-0123456789"
OPS_TOKEN = "bench-ops-token-0123456789"
TARGET_RATIO = 1.5
LETTERS_PER_S = 300


def _config(work: Path, base_url: str) -> Path:
    config = common.nopoll_config(
        work / "nopoll.yaml",
        base_url=base_url,
        data_dir=work / "data",
        sinks_yaml=f"  files: {{type: jsonl, dir: {work / 'out'}}}",
        extra_yaml=(
            f"tenants: {{team-a: {{}}}}\ntenant_keys: ['{'k' * 40}']\n"
            f"admin_tokens: ['{ADMIN}']\n"
            f"consumer_tokens: [{{token: {OPS_TOKEN}}}, {{token: {TEAM_TOKEN}, tenant: team-a}}]\n"
        ),
    )
    return config


def _envelope(key: str, tenant: str, size: int) -> Envelope:
    now = now_rfc3339()
    return Envelope(
        provider=common.PROVIDER,
        tenant=tenant,
        kind="response",
        key=key,
        status="completed",
        usable=True,
        output_text="x" * size,
        received_at=now,
        fetched_at=now,
        body={"id": key},
    )


def _results_sink() -> ResultsSink:
    connector = RedisConnector.from_url(common.REDIS_URL)
    config = ResultsSinkConfig(
        stream_max_entries=100_000, stream_retention_s=86_400, latest_ttl_s=3600
    )
    return ResultsSink(
        RESULTS_SINK, config, connect=lambda s: connector.client("results", at_most_s=s)
    )


async def prefill(entries: int, letters: int) -> None:
    """Other tenants' results in the stream, the operator's dead letters."""
    sink = _results_sink()
    async with sink:
        for start in range(0, entries, 500):
            part = range(start, min(entries, start + 500))
            await sink.write([_envelope(f"other_{i}", "default", 2000) for i in part])
    redis = RedisConnector.from_url(common.REDIS_URL).client("api")
    store = DeadLetters(redis)
    try:
        for i in range(letters):
            kwargs = {"provider": common.PROVIDER, "response_id": f"resp_old_{i}"}
            await store.keep(FETCH_RESPONSE, kwargs, attempts=8, error="404 not found " * 20)
    finally:
        await redis.aclose()


class Team:
    """team-a at its caps (see the module docs); its own counts."""

    def __init__(self, port: int, catchup_every_s: float = 2.0) -> None:
        self.port = port
        self.catchup_every_s = catchup_every_s
        self.stop = asyncio.Event()
        self.counts: Counter[str] = Counter()

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port, local_addr=(TEAM_FROM, 0))

    async def hog(self, n: int) -> None:
        async def one(i: int) -> None:
            path = "/healthz" if i % 2 else f"/v1/results/{common.PROVIDER}/nothing"
            auth = "" if i % 2 else f"authorization: Bearer {TEAM_TOKEN}\r\n"
            head = f"GET {path} HTTP/1.1\r\nhost: x\r\n{auth}\r\n".encode()
            conn = None
            for _ in range(10_000):
                if self.stop.is_set():
                    break
                try:
                    if conn is None:
                        conn = await self._open()
                    reader, writer = conn
                    writer.write(head)
                    status, close = await read_answer(reader)
                    self.counts[f"hog {status}"] += 1
                    if close:
                        writer.close()
                        conn = None
                except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                    self.counts["hog dropped"] += 1
                    conn = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 3)
            if conn is not None:
                conn[1].close()

        await asyncio.gather(*(one(i) for i in range(n)))

    async def letters(self) -> None:
        redis = RedisConnector.from_url(common.REDIS_URL).client("api")
        store = DeadLetters(redis)
        try:
            started = time.monotonic()
            for i in range(1_000_000):
                if self.stop.is_set():
                    return
                kwargs = {"provider": common.PROVIDER, "response_id": f"x{i}", "tenant": "team-a"}
                await store.keep(FETCH_RESPONSE, kwargs, attempts=8, error="404 not found")
                self.counts["letters made"] += 1
                # at the pace its callbacks made them (2,000 in 7 s), not Redis's
                await asyncio.sleep(max(0.0, started + (i + 1) / LETTERS_PER_S - time.monotonic()))
        finally:
            await redis.aclose()

    async def browse(self) -> None:
        head = (
            "GET /admin/v1/deadletters?tenant=team-a HTTP/1.1\r\nhost: x\r\n"
            f"authorization: Bearer {ADMIN}\r\n\r\n"
        ).encode()
        conn = None
        for _ in range(1_000_000):
            if self.stop.is_set():
                break
            try:
                conn = conn or await self._open()
                conn[1].write(head)
                status, close = await read_answer(conn[0])
                self.counts[f"letter pages {status}"] += 1
                if close:
                    conn[1].close()
                    conn = None
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                conn = None
            await asyncio.sleep(0.05)

    async def catch_up(self) -> None:
        head = (
            f"GET /v1/results/stream HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TEAM_TOKEN}"
            "\r\nlast-event-id: 0-0\r\n\r\n"
        ).encode()
        for _ in range(100_000):
            if self.stop.is_set():
                return
            try:
                reader, writer = await self._open()
                writer.write(head)
                with contextlib.suppress(TimeoutError):
                    got = await asyncio.wait_for(reader.read(1 << 16), 2)
                    self.counts["catch-ups"] += 1 if b" 200 " in got[:20] else 0
                    self.counts["catch-ups refused"] += 0 if b" 200 " in got[:20] else 1
                writer.close()
            except OSError:
                self.counts["catch-ups dropped"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.catchup_every_s)

    async def stalled(self, n: int) -> list[asyncio.StreamWriter]:
        """``n`` streams from the start that never read."""
        head = (
            f"GET /v1/results/stream HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TEAM_TOKEN}"
            "\r\nlast-event-id: 0-0\r\n\r\n"
        ).encode()
        writers = []
        for _ in range(n):
            _, writer = await asyncio.open_connection(  # it stops reading at 2 KiB
                "127.0.0.1", self.port, local_addr=(TEAM_FROM, 0), limit=1024
            )
            writer.write(head)
            writers.append(writer)
        return writers

    async def large(self) -> None:
        sink = _results_sink()
        async with sink:
            for i in range(1000):
                if self.stop.is_set():
                    return
                await sink.write([_envelope(f"big_{i}", "team-a", 6_000_000)])
                self.counts["6 MB envelopes"] += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 2)


PARTS = ("hog", "letters", "browse", "catchup", "stalled", "large")


def _team_process(
    port: int,
    hog: int,
    seconds: float,
    parts: set[str],
    cpus: set[int],
    catchup_every_s: float,
    out: multiprocessing.Queue,
) -> None:
    """team-a, in a process of its own (the sender's latencies are not its event loop's),
    doing ``parts`` for ``seconds``; its counts put on ``out``."""

    if cpus:
        os.sched_setaffinity(0, cpus)

    async def run() -> Counter[str]:
        team = Team(port, catchup_every_s)
        streams = 20  # results.max_held_per_token, the default
        stalled = await team.stalled(streams // 2) if "stalled" in parts else []
        work = {
            "hog": lambda: [team.hog(hog)],
            "letters": lambda: [team.letters()],
            "browse": lambda: [team.browse()],
            "large": lambda: [team.large()],
            "catchup": lambda: [team.catch_up() for _ in range(streams // 2)],
        }
        tasks = [asyncio.create_task(c) for p in parts if p in work for c in work[p]()]
        await asyncio.sleep(seconds)
        team.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in stalled:
            writer.close()
        return team.counts

    out.put(dict(asyncio.run(run())))


def hostile_run(port: int, team_port: int, args: argparse.Namespace, secret: str) -> tuple:
    out: multiprocessing.Queue = multiprocessing.Queue()
    team = multiprocessing.Process(
        target=_team_process,
        args=(
            team_port,
            args.hog,
            args.seconds + 4,
            set(args.parts),
            set(_TEAM_CPUS),
            args.catchup_every,
            out,
        ),
    )
    team.start()
    try:
        time.sleep(2)  # every part at full strength
        latencies, statuses = asyncio.run(_valid(port, args.seconds, args.rate, secret))
        counts = Counter(out.get(timeout=args.seconds + 60))
    finally:
        team.join(30)
        if team.is_alive():
            team.kill()
    return latencies, statuses, counts


def _pin(api: int, others: list[int]) -> str:
    """The API and the sender (this process: the quiet and the hostile run alike) on the
    last CPU; the worker, the simulator and the team (its process pins itself) on the
    others, so that the team's own CPU is taken from neither (Redis goes with the API for
    the run, see :func:`main`)."""
    cpus = sorted(os.sched_getaffinity(0))
    rest = set(cpus[:-1])
    for pid in (api, os.getpid()):
        e2e.pin(pid, {cpus[-1]})
    for pid in others:
        e2e.pin(pid, rest)
    _TEAM_CPUS.update(rest)
    return (
        f"API and sender pinned to CPU {cpus[-1]}; worker, simulator, team and the "
        f"consumers' API process to {sorted(rest)}"
    )


_TEAM_CPUS: set[int] = set()
"""Where the team's process runs (``--pin``); empty: anywhere."""


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=100.0, help="valid callbacks a second")
    parser.add_argument(
        "--hog", type=int, default=60, help="team-a's busy keep-alive connections (60)"
    )
    parser.add_argument(
        "--catchup-every", type=float, default=2.0, help="seconds between a reader's reconnects"
    )
    parser.add_argument("--stream-entries", type=int, default=20_000)
    parser.add_argument("--letters", type=int, default=9_000, help="the operator's own")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three runs (3)")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the API, the sender and Redis on the last CPU, the team, the worker and the "
        "simulator on the others: the team's own CPU is not the server's",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        type=lambda v: [p for p in v.split(",") if p],
        help=f"what team-a does (default all: {','.join(PARTS)})",
    )
    args = parser.parse_args()
    print(f"hostile team against one API process; {common.load_note()}", flush=True)
    common.flush_bench_db()
    asyncio.run(prefill(args.stream_entries, args.letters))
    secret = common.new_secret()
    results: dict[str, list[tuple]] = {}
    with tempfile.TemporaryDirectory(prefix="nopoll-hostile-") as tmp:
        work = Path(tmp)
        sim = api = second = worker = None
        redis_pid: int | None = None
        redis_cpus: set[int] = set()
        try:
            sim, _, base_url = e2e.start_simulator(work)
            config = _config(work, base_url)
            env = {common.SECRET_ENV: secret}
            health, port = common.free_port(), common.free_port()
            worker = common.start_process(
                [str(common.BIN_DIR / "nopoll"), "worker", "--config", str(config),
                 "--health-port", str(health)],
                env=env, log_path=work / "worker.log",
            )  # fmt: skip
            api = common.start_process(
                [str(common.BIN_DIR / "nopoll"), "api", "--config", str(config),
                 "--port", str(port)],
                env=env, log_path=work / "api.log",
            )  # fmt: skip
            common.wait_http(f"http://127.0.0.1:{port}/readyz", proc=api, timeout_s=60)
            team_port = common.free_port()
            # consumers and operators on an API process of their own (the split case)
            second = common.start_process(
                [str(common.BIN_DIR / "nopoll"), "api", "--config", str(config),
                 "--port", str(team_port)],
                env=env, log_path=work / "api-consumers.log",
            )  # fmt: skip
            common.wait_http(f"http://127.0.0.1:{team_port}/readyz", proc=second)
            if args.pin:
                print(_pin(api.pid, [worker.pid, sim.pid, second.pid]), flush=True)
                redis_pid = e2e.redis_pid().get("redis (shared)")
                if redis_pid is not None:  # given back at the end
                    redis_cpus = os.sched_getaffinity(redis_pid)
                    e2e.pin(redis_pid, os.sched_getaffinity(api.pid))
                    print(f"Redis (pid {redis_pid}) pinned with the API for the run", flush=True)
            for _round in range(args.rounds):
                for name in ("quiet", "hostile", "split"):
                    cpu0, t0 = common.cpu_seconds(api.pid), time.monotonic()
                    if name == "quiet":
                        latencies, statuses = asyncio.run(
                            _valid(port, args.seconds, args.rate, secret)
                        )
                        counts: Counter[str] = Counter()
                    else:  # the team on the providers' API process, then on its own
                        at = port if name == "hostile" else team_port
                        latencies, statuses, counts = hostile_run(port, at, args, secret)
                    cpu = (common.cpu_seconds(api.pid) - cpu0) / (time.monotonic() - t0)
                    run = (latencies, statuses, counts, cpu, _peak_rss_mb(api.pid))
                    results.setdefault(name, []).append(run)
        finally:
            for proc in (api, second, worker, sim):
                common.stop_process(proc)
            if redis_pid is not None:
                e2e.pin(redis_pid, redis_cpus)
    for name, runs in results.items():
        for n, (latencies, statuses, counts, cpu, rss) in enumerate(runs, 1):
            print(
                f"{name:>8} {n}: {sum(statuses.values())} callbacks, answers {dict(statuses)}; "
                f"p50 {common.percentile(latencies, 50):.1f} ms, "
                f"p99 {common.percentile(latencies, 99):.1f} ms; API CPU {cpu:.0%} of a core, "
                f"peak RSS {rss:.0f} MB"
            )
            if counts and n == 1:
                print(f"          team-a: {dict(sorted(counts.items()))}")

    def p99(name: str) -> float:
        return statistics.median(common.percentile(r[0], 99) for r in results[name])

    quiet = p99("quiet")
    met = []
    for name, where in (("hostile", "one API process"), ("split", "API processes split")):
        refused = sum(n for r in results[name] for s, n in r[1].items() if s == 503 or s < 0)
        ratio = p99(name) / quiet if quiet else float("nan")
        met.append(ratio <= TARGET_RATIO and refused == 0)
        print(
            f"target ({where}): median p99 {p99(name):.1f} ms within {TARGET_RATIO}x of "
            f"quiet's {quiet:.1f} ms, no 503: {ratio:.2f}x, {refused} refused "
            f"({'met' if met[-1] else 'MISSED'})"
        )
    print(common.load_note())
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
