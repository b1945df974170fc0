"""A flood of invalid signatures from one address against one API process, while a
provider's valid callbacks come from another address.

    python bench/flood.py                       # 20 s per case, about two minutes
    python bench/flood.py --seconds 10 --flood-connections 64
    python bench/flood.py --only consumers --seconds 10

Four cases on the same ``nopoll api`` config (Redis db 13, no worker), each its own
process, in one run:

1. ``alone``: only the valid callbacks (``--rate`` a second, from 127.0.0.3, each signed by
   the standardwebhooks package): the baseline latency.
2. ``flood, no limit``: the same, while ``--flood-procs`` processes send invalid-signature
   callbacks as fast as ``--flood-connections`` keep-alive connections allow, from
   127.0.0.2 (the API process is saturated).
3. ``flood, client_rps``: the same with ``api.client_rps`` set (``--client-rps``): the flood
   is answered 429 before its body is read and its connection closed.
4. ``consumers at cap``: ``api.limit_concurrency`` ``--consumer-limit`` (60) and two
   consumer tokens, each of which first holds as many ``GET /v1/results/stream`` and
   ``?wait=60`` requests as the API lets it (until it answers 429); then the valid
   callbacks come at ``--consumer-rate`` (100) a second.

Per case: valid callbacks sent / accepted, their p50/p99 latency, the flood's answers by
status, 5xx answers (target 0), the API's CPU. **Targets (case 3): every valid callback
accepted, p99 < 250 ms, the flood answered only 401/429; (case 4): every valid callback
accepted (0 non-2xx).** Exit status 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    BIN_DIR,
    PROVIDER,
    SECRET_ENV,
    WEBHOOK_PATH,
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

VALID_FROM = "127.0.0.3"
FLOOD_FROM = "127.0.0.2"
CONSUMER_FROM = "127.0.0.4"
CONSUMER_TOKENS = ("bench-consumer-all-0123456789", "bench-consumer-team-0123456789")


async def _request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes
) -> tuple[int, bool]:
    """One request on a keep-alive connection: (status, whether the server closes it)."""
    writer.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    return await read_answer(reader)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """One answer on a keep-alive connection: (status, whether the server closes it)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("closed")
    status = int(status_line.split()[1])
    length, close = 0, False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.lower() == "content-length":
            length = int(value)
        elif name.lower() == "connection" and "close" in value.lower():
            close = True
    await reader.readexactly(length)
    return status, close


def _flood(port: int, seconds: float, connections: int, out: multiprocessing.Queue) -> None:
    """One flooding process: invalid signatures, as fast as it can, from FLOOD_FROM."""
    body = b'{"id":"evt_x","type":"response.completed","data":{"id":"resp_flood"}}'
    head = (
        f"POST {WEBHOOK_PATH} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"webhook-id: msg_flood\r\nwebhook-timestamp: {int(time.time())}\r\n"
        "webhook-signature: v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\r\n"
    ).encode()
    statuses: Counter[int] = Counter()

    async def one() -> None:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(FLOOD_FROM, 0)
                )
            except OSError:
                statuses[-1] += 1
                await asyncio.sleep(0.01)
                continue
            try:
                for _ in range(1_000_000):
                    if time.monotonic() >= stop:
                        break
                    status, close = await _request(reader, writer, head, body)
                    statuses[status] += 1
                    if close:
                        break
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                statuses[-1] += 1
            finally:
                writer.close()

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(connections)))

    asyncio.run(main())
    out.put(dict(statuses))


async def _valid(port: int, seconds: float, rate: float, secret: str) -> tuple[list, Counter]:
    from standardwebhooks.webhooks import Webhook

    signer = Webhook(secret)
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    conns: asyncio.Queue = asyncio.Queue()
    for _ in range(8):
        conns.put_nowait(None)

    async def send(i: int) -> None:
        conn = await conns.get()
        now = datetime.now(tz=UTC)
        msg_id = f"msg_valid_{i}_{time.time_ns()}"
        body = (
            f'{{"id":"evt_{i}","type":"response.completed","data":{{"id":"resp_valid_{i}"}}}}'
        ).encode()
        head = (
            f"POST {WEBHOOK_PATH} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"webhook-id: {msg_id}\r\nwebhook-timestamp: {int(now.timestamp())}\r\n"
            f"webhook-signature: {signer.sign(msg_id, now, body.decode())}\r\n"
        ).encode()
        started = time.perf_counter()
        try:
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", port, local_addr=(VALID_FROM, 0))
            status, close = await _request(*conn, head, body)
            if close:
                conn[1].close()
                conn = None
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            status, conn = -1, None
        latencies.append((time.perf_counter() - started) * 1000)
        statuses[status] += 1
        conns.put_nowait(conn)

    tasks = []
    t0 = time.monotonic()
    for i in range(int(seconds * rate)):
        due = t0 + i / rate
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(send(i)))
    await asyncio.gather(*tasks)
    return sorted(latencies), statuses


async def _hold_consumers(port: int, most: int) -> tuple[list[asyncio.StreamWriter], Counter]:
    """Each consumer token holds streams, then waits, until the API refuses one (or
    ``most`` in all); the held connections, and the refusals by status."""
    held: list[asyncio.StreamWriter] = []
    refused: Counter[int] = Counter()
    for token in CONSUMER_TOKENS:
        for path in ("/v1/results/stream", "/v1/results/bench/never?wait=60"):
            while len(held) < most:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(CONSUMER_FROM, 0)
                )
                head = f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n\r\n"
                writer.write(head.encode())
                try:  # a stream answers its headers at once; a held wait answers nothing
                    line = await asyncio.wait_for(reader.readline(), 0.5)
                except TimeoutError:
                    line = b"HTTP/1.1 000 held"
                status = int(line.split()[1]) if line else -1
                if status in (0, 200):
                    held.append(writer)
                    continue
                refused[status] += 1
                writer.close()
                break
    return held, refused


async def _valid_with_consumers(
    port: int, args: argparse.Namespace, secret: str
) -> tuple[list, Counter, int, Counter]:
    held, refused = await _hold_consumers(port, args.consumer_limit)
    try:
        latencies, statuses = await _valid(port, args.seconds, args.consumer_rate, secret)
    finally:
        for writer in held:
            writer.close()
    return latencies, statuses, len(held), refused


def run_case(
    name: str,
    args: argparse.Namespace,
    client_rps: int | None,
    flood: bool,
    consumers: bool = False,
) -> dict:
    flush_bench_db()
    tmp = Path(tempfile.mkdtemp(prefix="nopoll-bench-flood-"))
    secret = new_secret()
    config = nopoll_config(
        tmp / "nopoll.yaml",
        base_url="http://127.0.0.1:9/v1",
        data_dir=tmp / "data",
        sinks_yaml=f"  files: {{type: jsonl, dir: {tmp / 'out'}}}\n",
    )
    if client_rps:
        config.write_text(config.read_text() + f"api: {{client_rps: {client_rps}}}\n")
    if consumers:
        config.write_text(
            config.read_text()
            + f"api: {{limit_concurrency: {args.consumer_limit}}}\n"
            + f"tenants: {{team-a: {{}}}}\ntenant_keys: ['{'k' * 40}']\n"
            + f"consumer_tokens: [{{token: {CONSUMER_TOKENS[0]}}}, "
            + f"{{token: {CONSUMER_TOKENS[1]}, tenant: team-a}}]\n"
        )
    port = free_port()
    log = tmp / "api.log"
    proc = start_process(
        [str(BIN_DIR / "nopoll"), "api", "--config", str(config), "--port", str(port)],
        env={SECRET_ENV: secret},
        log_path=log,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc=proc, log_path=log)
        out: multiprocessing.Queue = multiprocessing.Queue()
        flooders = []
        if flood:
            flooders = [
                multiprocessing.Process(
                    target=_flood, args=(port, args.seconds + 2, args.flood_connections, out)
                )
                for _ in range(args.flood_procs)
            ]
            for f in flooders:
                f.start()
            time.sleep(1.5)  # the flood is at full strength before the valid callbacks start
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        held, refused = 0, Counter()
        if consumers:
            latencies, valid, held, refused = asyncio.run(_valid_with_consumers(port, args, secret))
        else:
            latencies, valid = asyncio.run(_valid(port, args.seconds, args.rate, secret))
        cpu = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
        flood_statuses: Counter[int] = Counter()
        for f in flooders:
            f.join(args.seconds + 30)
            flood_statuses.update(out.get(timeout=10))
    finally:
        stop_process(proc)
    return {
        "name": name,
        "sent": sum(valid.values()),
        "accepted": valid.get(202, 0),
        "valid": dict(valid),
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "flood": dict(flood_statuses),
        "flood_5xx": sum(n for s, n in flood_statuses.items() if s >= 500),
        "cpu": cpu,
        "held": held,
        "refused": dict(refused),
        "non_2xx": sum(n for s, n in valid.items() if not 200 <= s < 300),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=50.0, help="valid callbacks a second")
    parser.add_argument("--flood-procs", type=int, default=2)
    parser.add_argument("--flood-connections", type=int, default=64)
    parser.add_argument("--client-rps", type=int, default=100)
    parser.add_argument("--consumer-limit", type=int, default=60, help="api.limit_concurrency")
    parser.add_argument("--consumer-rate", type=float, default=100.0)
    parser.add_argument("--only", choices=["flood", "consumers"], default=None)
    args = parser.parse_args()
    cases = []
    if args.only != "consumers":
        cases += [
            run_case("alone", args, None, flood=False),
            run_case("flood, no limit", args, None, flood=True),
            run_case(f"flood, client_rps {args.client_rps}", args, args.client_rps, flood=True),
        ]
    if args.only != "flood":
        cases.append(run_case("consumers at cap", args, None, flood=False, consumers=True))
    print(
        f"\nprovider {PROVIDER}: {args.rate:g} valid callbacks/s from {VALID_FROM} "
        f"({args.consumer_rate:g}/s in the consumers' case); flood "
        f"from {FLOOD_FROM}: {args.flood_procs} processes x {args.flood_connections} "
        "connections, invalid signatures"
    )
    print(
        f"{'case':28} {'valid sent':>10} {'accepted':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'flood answers':>30} {'5xx':>5} {'API CPU':>8}"
    )
    for c in cases:
        flood = ", ".join(f"{n:,}x{s}" for s, n in sorted(c["flood"].items())) or "-"
        print(
            f"{c['name']:28} {c['sent']:10} {c['accepted']:9} {c['p50']:8.1f} {c['p99']:8.1f} "
            f"{flood:>30} {c['flood_5xx']:5} {c['cpu'] * 100:7.0f}%"
        )
    ok = all(c["flood_5xx"] == 0 for c in cases)
    print("(-1: a connection closed or reset by the client side's own timing)")
    limited = [c for c in cases if c["name"].startswith("flood, client_rps")]
    for c in limited:
        met = c["accepted"] == c["sent"] and c["p99"] < 250 and set(c["flood"]) <= {401, 429, -1}
        ok = ok and met
        print(
            "targets (limit on): all valid accepted, p99 < 250 ms, flood only 401/429, no 5xx: "
            + ("met" if met else "MISSED")
        )
    for c in cases:
        if c["name"] != "consumers at cap":
            continue
        met = c["non_2xx"] == 0 and c["held"] > 0
        ok = ok and met
        refusals = ", ".join(f"{n}x{s}" for s, n in sorted(c["refused"].items())) or "none"
        print(
            f"consumers at cap: api.limit_concurrency {args.consumer_limit}, consumers held "
            f"{c['held']} streams and waits (then refused: {refusals}); "
            f"{c['sent']} valid callbacks at {args.consumer_rate:g}/s: {c['non_2xx']} non-2xx, "
            f"p99 {c['p99']:.1f} ms (target 0 non-2xx: {'met' if met else 'MISSED'})"
        )
    print(load_note())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
