"""The results API under load: SSE fan-out to many subscribers, and many held ``?wait``s.

Usage: ``python bench/consumers.py [--subscribers 100] [--rate 1000] [--seconds 20]
[--receivers 4] [--waits 1000] [--idle-seconds 10] [--stalled 100] [--skip-stream]
[--skip-waits] [--skip-stalled]``

1. **Stream**: one ``nopoll api`` process; ``--subscribers`` SSE clients of
   ``GET /v1/results/stream`` (spread over ``--receivers`` processes, all with
   ``Last-Event-ID: 0-0`` so none misses the start), with filters: every tenth none
   (every envelope), every tenth ``provider=p1`` (half), the others ``tenant=tN`` (a
   tenth). A publisher process writes ``--rate`` envelopes a second for ``--seconds``
   through the real ``_results`` sink code (:class:`sinks.results.ResultsSink`, one
   write per envelope, as the worker does for single responses: no callbacks, provider
   or worker involved). Each subscriber checks it got exactly the envelopes its filter
   matches (none missing, none twice, none else); the delay of each is its receipt time
   minus the time in its stream entry id (Redis's clock when the sink added it).
   Targets: nothing missing, doubled or foreign; p99 delay < 100 ms.
2. **Waits**: a fresh ``nopoll api``; its RSS and CPU while idle, then with ``--waits``
   requests ``GET /v1/results/{provider}/{key}?wait=60`` held open (one client process,
   raw sockets), then the results land and every request must answer 200. Targets:
   RSS over the idle baseline < 50 MB, CPU while they are held < 5 % of a core.
3. **Stalled readers**: ``--stalled`` SSE clients that read nothing (a 4 KiB receive
   buffer), over envelopes of about 20 KB: 8 MB of them already in the stream (the
   readers ask for it all with ``Last-Event-ID: 0-0``) and 8 MB more published while they
   are connected. Two fresh ``nopoll api`` processes, warmed up by one reader that takes
   the whole history: the baseline gets the same envelopes with no stalled reader; the
   other the stalled readers. Printed: each one's RSS before and at its peak, and the
   stalled run's peak over the baseline's. Target: the stalled readers add less than
   1 MB each.

The client processes (publisher with 8 concurrent writers, SSE subscribers on raw sockets,
held requests) are in ``bench/_consumers.py``. Redis database 13 only (flushed first),
127.0.0.1 only, every process stopped by its PID. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common
from _consumers import child, land_waits, publish_big

TOKEN_ENV = "NOPOLL_BENCH_TOKEN"
TARGET_P99_MS = 100.0
TARGET_RSS_MB = 50.0
TARGET_IDLE_CORE = 0.05
TARGET_STALLED_MB = 1.0


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def api_config(path: Path, data_dir: Path) -> Path:
    path.write_text(
        f"""\
redis_url: {common.REDIS_URL}
data_dir: {data_dir}
log_level: warning
api: {{limit_concurrency: 4000}}
results: {{max_held_per_token: 2000}}
consumer_tokens: [{{token: "${{{TOKEN_ENV}}}"}}]
sinks:
  files: {{type: jsonl, dir: {data_dir / "results"}}}
""",
        encoding="utf-8",
    )
    return path


def start_api(work: Path, token: str, name: str):  # type: ignore[no-untyped-def]
    port = common.free_port()
    config = api_config(work / f"{name}.yaml", work / "data")
    cmd = [str(common.BIN_DIR / "nopoll"), "api", "--config", str(config)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    log_path = work / f"{name}.log"
    proc = common.start_process(cmd, env={TOKEN_ENV: token}, log_path=log_path)
    common.wait_http(f"http://127.0.0.1:{port}/readyz", proc=proc, log_path=log_path)
    return proc, port


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def redis_cpu_s() -> float:
    client = common.redis_db13()
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# --- the two parts -------------------------------------------------------------------------


def _self(*args: object) -> list[str]:
    return [sys.executable, __file__, *(str(a) for a in args)]


def part_stream(args: argparse.Namespace, work: Path, token: str) -> bool:
    total = int(args.rate * args.seconds)
    print(
        f"== 1. stream: {args.subscribers} SSE subscribers over {args.receivers} processes, "
        f"{total} envelopes at {args.rate:g}/s through the _results sink"
    )
    common.flush_bench_db()
    api, port = start_api(work, token, "api-stream")
    receivers = []
    try:
        for r in range(args.receivers):
            numbers = ",".join(str(n) for n in range(r, args.subscribers, args.receivers))
            out = work / f"receiver{r}.json"
            cmd = _self("--subscribe", port, numbers, total, out)
            receivers.append(
                (
                    common.start_process(
                        cmd, env={TOKEN_ENV: token}, log_path=work / f"receiver{r}.log"
                    ),
                    out,
                )
            )
        for _ in range(1200):  # bounded: every subscriber has its answer's headers
            if all(out.with_suffix(".ready").exists() for _, out in receivers):
                break
            time.sleep(0.05)
        time.sleep(1.0)  # and is attached (Last-Event-ID 0-0: nothing would be missed)
        cpu0, redis0, t0 = common.cpu_seconds(api.pid), redis_cpu_s(), time.monotonic()
        published = work / "published.json"
        pub = common.start_process(
            _self("--publish", args.rate, total, published), log_path=work / "publisher.log"
        )
        pub.wait(args.seconds * 3 + 60)
        cpu1, redis1, t1 = common.cpu_seconds(api.pid), redis_cpu_s(), time.monotonic()
        for proc, _ in receivers:
            proc.wait(180)
    finally:
        for proc, _ in receivers:
            common.stop_process(proc)
        common.stop_process(api)
    sent = json.loads(published.read_text())
    subs, errors, timed_out, receivers_cpu = [], [], 0, 0.0
    for r, (_, out) in enumerate(receivers):
        if not out.exists():
            errors.append(
                f"receiver {r} wrote nothing: "
                + (work / f"receiver{r}.log").read_text(errors="replace")[-500:]
            )
            continue
        data = json.loads(out.read_text())
        subs += data["subscribers"]
        errors += data["errors"]
        timed_out += data["timed_out"]
        receivers_cpu += data["cpu_s"]
    delays = sorted(d for s in subs for d in s["delays"])
    wrong = [s for s in subs if s["missing"] or s["duplicates"] or s["foreign"]]
    delivered = sum(s["received"] for s in subs)
    rate = sent["published"] / sent["seconds"]
    print(
        f"published {sent['published']} in {sent['seconds']:.1f} s ({rate:.0f}/s, "
        f"{rate / args.rate:.2f} of the asked rate); delivered {delivered} events to "
        f"{len(subs)} subscribers ({delivered / (t1 - t0):.0f}/s)"
    )
    print(
        f"delay publish -> receipt: p50 {common.percentile(delays, 50):.1f} ms, p99 "
        f"{common.percentile(delays, 99):.1f} ms, max {delays[-1] if delays else float('nan'):.1f}"
        f" ms; API process {(cpu1 - cpu0) / (t1 - t0):.0%} of a core, Redis "
        f"{(redis1 - redis0) / (t1 - t0):.0%}; publisher {sent['cpu_s'] / (t1 - t0):.0%}, "
        f"subscribers' processes {receivers_cpu / (t1 - t0):.0%} (with their start-up)"
    )
    for s in wrong[:5]:
        print(
            f"  subscriber {s['n']} {s['filter']}: expected {s['expected']}, got "
            f"{s['received']}, missing {s['missing']}, twice {s['duplicates']}, "
            f"foreign {s['foreign']}"
        )
    for e in errors[:5]:
        print(f"  error: {e}")
    complete = len(subs) == args.subscribers and not wrong and not errors and not timed_out
    p99 = common.percentile(delays, 99)
    ok = complete and p99 < TARGET_P99_MS and rate >= 0.95 * args.rate
    print(
        f"target: every subscriber gets exactly its envelopes: {len(subs) - len(wrong)}/"
        f"{args.subscribers} ({verdict(complete)}); p99 delay < {TARGET_P99_MS:g} ms: "
        f"{p99:.1f} ms, {p99 / TARGET_P99_MS:.2f} of the target ({verdict(ok)})"
    )
    return ok


def part_waits(args: argparse.Namespace, work: Path, token: str) -> bool:
    print(f"\n== 2. waits: {args.waits} requests ?wait=60 held open on one API process")
    common.flush_bench_db()
    api, port = start_api(work, token, "api-waits")
    holder = None
    try:
        time.sleep(3.0)  # imports and start-up are not the idle cost
        base_rss = rss_mb(api.pid)
        c0, t0 = common.cpu_seconds(api.pid), time.monotonic()
        time.sleep(args.idle_seconds)
        idle_core = (common.cpu_seconds(api.pid) - c0) / (time.monotonic() - t0)
        ready, out = work / "waits-ready.json", work / "waits.json"
        holder = common.start_process(
            _self("--waits", port, args.waits, ready, out),
            env={TOKEN_ENV: token},
            log_path=work / "waits.log",
        )
        for _ in range(600):
            if ready.exists() or holder.poll() is not None:
                break
            time.sleep(0.05)
        early = json.loads(ready.read_text())["answered_early"] if ready.exists() else -1
        time.sleep(2.0)
        held_rss = rss_mb(api.pid)
        c0, t0 = common.cpu_seconds(api.pid), time.monotonic()
        time.sleep(args.idle_seconds)
        held_core = (common.cpu_seconds(api.pid) - c0) / (time.monotonic() - t0)
        landed_at = time.time()
        asyncio.run(land_waits(args.waits))
        holder.wait(120)
    finally:
        common.stop_process(holder)
        common.stop_process(api)
    result = json.loads(out.read_text()) if out.exists() else {"statuses": [], "answered": []}
    ok_answers = sum(1 for s in result["statuses"] if s == 200)
    after = sorted((t - landed_at) * 1000 for t in result["answered"])
    extra = held_rss - base_rss
    print(f"idle: RSS {base_rss:.1f} MB, CPU {idle_core:.2%} of a core")
    print(
        f"{args.waits} held ({early} answered before landing): RSS {held_rss:.1f} MB "
        f"(+{extra:.1f} MB, {extra / args.waits * 1024:.1f} KiB each), CPU "
        f"{held_core:.2%} of a core"
    )
    print(
        f"then all landed in one write: {ok_answers}/{args.waits} answered 200, the last "
        f"{after[-1] if after else float('nan'):.0f} ms after the write began"
    )
    for e in result.get("errors", []):
        print(f"  error: {e}")
    answers_ok = ok_answers == args.waits and early == 0
    ok = answers_ok and extra < TARGET_RSS_MB and held_core < TARGET_IDLE_CORE
    print(
        f"target: extra RSS < {TARGET_RSS_MB:g} MB: {extra:.1f} MB ({extra / TARGET_RSS_MB:.2f} "
        f"of it); CPU while held < {TARGET_IDLE_CORE:.0%}: {held_core:.2%} "
        f"({held_core / TARGET_IDLE_CORE:.2f} of it); every wait answered 200 "
        f"({verdict(answers_ok)}) ({verdict(ok)})"
    )
    return ok


def _stalled_run(work: Path, token: str, name: str, readers: int) -> tuple[float, float]:
    """A fresh API with 8 MB of ~20 KB envelopes in the stream, warmed up by one reader of
    all of it; then ``readers`` stalled readers and 8 MB more: RSS before and at its peak."""
    import socket

    import httpx

    common.flush_bench_db()
    asyncio.run(publish_big("old", 400))
    api, port = start_api(work, token, name)
    sockets: list[socket.socket] = []
    try:
        headers = {"authorization": f"Bearer {token}", "last-event-id": "0-0"}
        with httpx.stream(
            "GET", f"http://127.0.0.1:{port}/v1/results/stream", headers=headers, timeout=60
        ) as r:
            got = 0
            for chunk in r.iter_bytes():
                got += chunk.count(b"event: result")
                if got >= 400:
                    break
        time.sleep(1.0)
        before = peak = rss_mb(api.pid)
        for _ in range(readers):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(
                f"GET /v1/results/stream HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}"
                "\r\nlast-event-id: 0-0\r\n\r\n".encode()
            )
            sockets.append(sock)
        asyncio.run(publish_big("new", 400))
        deadline = time.monotonic() + 8  # within the 30 s after which stalled ones are dropped
        while time.monotonic() < deadline:
            peak = max(peak, rss_mb(api.pid))
            time.sleep(0.1)
    finally:
        for sock in sockets:
            sock.close()
        common.stop_process(api)
    return before, peak


def part_stalled(args: argparse.Namespace, work: Path, token: str) -> bool:
    print(
        f"\n== 3. stalled readers: {args.stalled} SSE clients that read nothing, ~20 KB envelopes"
    )
    base_before, base_peak = _stalled_run(work, token, "api-baseline", 0)
    before, peak = _stalled_run(work, token, "api-stalled", args.stalled)
    extra = (peak - before) - (base_peak - base_before)
    each = extra / max(args.stalled, 1)
    print(f"baseline (no stalled reader): RSS {base_before:.1f} MB before, {base_peak:.1f} MB peak")
    print(
        f"{args.stalled} stalled readers: RSS {before:.1f} MB before, {peak:.1f} MB peak; "
        f"peak {peak / base_peak:.2f}x the baseline's, +{extra:.1f} MB over its growth "
        f"({each * 1024:.0f} KiB per stalled reader)"
    )
    ok = each < TARGET_STALLED_MB
    print(
        f"target: < {TARGET_STALLED_MB:g} MB per stalled reader: {each:.2f} MB "
        f"({each / TARGET_STALLED_MB:.2f} of it) ({verdict(ok)})"
    )
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subscribers", type=int, default=100)
    p.add_argument("--receivers", type=int, default=4, help="client processes")
    p.add_argument("--rate", type=float, default=1000.0, help="envelopes a second")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--waits", type=int, default=1000)
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--skip-stream", action="store_true")
    p.add_argument("--skip-waits", action="store_true")
    p.add_argument("--stalled", type=int, default=100, help="SSE readers that read nothing")
    p.add_argument("--skip-stalled", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    token = os.environ.get(TOKEN_ENV, "")
    if argv[:1] in (["--publish"], ["--subscribe"], ["--waits"]):
        return child(argv, token)
    args = parse_args(argv)
    print(common.load_note())
    token = "bench-consumer-" + os.urandom(16).hex()
    ok = True
    with tempfile.TemporaryDirectory(prefix="nopoll-bench-consumers-") as tmp:
        if not args.skip_stream:
            ok = part_stream(args, Path(tmp), token) and ok
        if not args.skip_waits:
            ok = part_waits(args, Path(tmp), token) and ok
        if not args.skip_stalled:
            ok = part_stalled(args, Path(tmp), token) and ok
    print(f"\n{'all targets met' if ok else 'a target was missed'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
