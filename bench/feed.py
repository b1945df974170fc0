"""sference's completion feed: provider requests per landed result, and ready → row.

Usage: ``python bench/feed.py [--n 10000] [--spread-s 60] [--baseline-n 2000]
[--skip-baseline]``

``nopoll submit`` creates ``--n`` background responses at the provider simulator (sference,
in a process of its own on 127.0.0.1); once all are made and pending, they finish at random
times over ``--spread-s`` seconds; one ``nopoll worker`` lands them in Postgres (table
``bench_feed``). Counted at the simulator: every request but the creates (and the submit's
one stream): the feed's long polls, any GET of a response, any poll. Per result: those
requests over the results landed; and the delay from the moment a response was finished
at the provider (ready) to its row showing in Postgres (looked for every 50 ms).

Then the baseline, in the same run: the same with the feed off (``feed.enabled: false``),
``--baseline-n`` ids polled one by one with the default watch schedule, as nopoll did before.

Targets: requests per result <= 0.02 with the feed; ready → row p99 <= 2 s. Exits 1 when
one is missed or a result never lands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common

TABLE = "bench_feed"
TARGET_PER_RESULT = 0.02
TARGET_P99_S = 2.0
CREATE_S = 30.0
"""The first response finishes this long after the simulator starts: every id is made and
pending by then, as in a user's backlog (the creates are not what is measured)."""


def serve_simulator(port: int, spread_s: float, seed: int, start: float, out: Path) -> int:
    """``--simulator PORT SPREAD SEED START OUT``: the sference simulator in a process of its
    own, each created response finishing at ``START`` (Unix time) plus ``U(0, SPREAD)`` s
    (at once if that has passed); on SIGTERM it writes ``{"ready": {id: unix time},
    "requests": {kind: count}}`` to ``OUT``."""
    import signal
    import threading

    from receiver.demo.simulator import ProviderSimulator

    rnd = random.Random(seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    delays: dict[str, float] = {}

    def complete_after(rid: str) -> float:
        return delays.setdefault(rid, max(0.0, start - time.time()) + rnd.uniform(0.0, spread_s))

    with ProviderSimulator(
        api_key="bench-key", port=port, dialect="sference", complete_after=complete_after
    ) as sim:
        for _ in range(4 * 3600 * 2):  # bounded: at most four hours
            if stop.wait(0.5):
                break
        made = sim.creates.responses()
        with sim.state.lock:
            paths = dict(sim.state.requests)
        _write(out, made, paths)  # before the server's stop waits for its long polls
    return 0


def _write(out: Path, made: list[tuple[str, Any]], paths: dict[str, int]) -> None:
    counts = {"events": 0, "gets": 0, "streams": 0, "other": 0}
    for path, n in paths.items():
        if path == "/v1/responses/events":
            counts["events"] += n
        elif path.startswith("/v1/responses/"):
            counts["gets"] += n
        elif path.startswith("/v1/streams/"):
            counts["streams"] += n
        elif path not in ("/v1/responses", "/v1/streams"):  # the creates are not counted
            counts["other"] += n
    ready = {rid: m.completes_at for rid, m in made}
    out.write_text(json.dumps({"ready": ready, "requests": counts}))


def config(path: Path, base_url: str, data_dir: Path, *, feed: bool) -> Path:
    path.write_text(
        f"""\
redis_url: {common.REDIS_URL}
data_dir: {data_dir}
log_level: warning
providers:
  sim:
    dialect: sference
    base_url: {base_url}
    api_key: bench-key
    feed: {{enabled: {"true" if feed else "false"}}}
sinks:
  warehouse: {{type: sql, url: "{common.PG_URL}", table: {TABLE}}}
""",
        encoding="utf-8",
    )
    return path


async def row_times(n: int, deadline: float) -> dict[str, float]:
    """When each row first shows up in Postgres (looked for every 50 ms, bounded)."""
    import asyncpg

    seen: dict[str, float] = {}
    conn = None
    for _ in range(int((deadline - time.time()) / 0.05) + 2):
        if len(seen) >= n or time.time() > deadline:
            break
        try:
            conn = conn or await asyncpg.connect(common.PG_URL)
            rows = await conn.fetch(f"SELECT key FROM {TABLE}")
        except Exception:  # the table is made by the first write
            rows = []
        now = time.time()
        for row in rows:
            seen.setdefault(row["key"], now)
        await asyncio.sleep(0.05)
    if conn is not None:
        await conn.close()
    return seen


def run_case(
    name: str, n: int, spread_s: float, seed: int, work: Path, *, feed: bool
) -> dict[str, float]:
    print(
        f"\n== {name}: {n} responses finishing over {spread_s:g} s, feed {'on' if feed else 'off'}"
    )
    common.flush_bench_db()
    asyncio.run(common.drop_table(TABLE))
    out = work / f"{name}-sim.json"
    port = common.free_port()
    start = time.time() + CREATE_S  # every id is created (pending) by then
    sim_cmd = [sys.executable, __file__, "--simulator", str(port), str(spread_s), str(seed)]
    sim_cmd.append(f"{start:.3f}")
    sim = common.start_process([*sim_cmd, str(out)], log_path=work / f"{name}-sim.log")
    base_url = f"http://127.0.0.1:{port}/v1"
    worker = None
    try:
        common.wait_http(f"{base_url}/responses/probe", proc=sim, want=401)
        cfg = config(work / f"{name}.yaml", base_url, work / f"{name}-data", feed=feed)
        health = common.free_port()
        cmd = [str(common.BIN_DIR / "nopoll"), "worker", "--config", str(cfg)]
        worker = common.start_process(
            [*cmd, "--health-port", str(health)], log_path=work / f"{name}-worker.log"
        )
        common.wait_http(f"http://127.0.0.1:{health}/healthz", proc=worker)
        lines = work / f"{name}.jsonl"
        with lines.open("w") as f:
            for i in range(n):
                f.write(json.dumps({"model": "m-1", "input": f"q {i}", "custom_id": f"c{i}"}))
                f.write("\n")
        started = time.time()
        submit = [str(common.BIN_DIR / "nopoll"), "submit", "--config", str(cfg), "sim"]
        done = subprocess.run(
            [*submit, str(lines), "--concurrency", "200"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=common.REPO_ROOT,
        )
        if done.returncode != 0:
            raise RuntimeError(f"nopoll submit failed:\n{done.stdout}\n{done.stderr}")
        created_s = time.time() - started
        if time.time() > start:
            print(
                f"   note: the creates ended {time.time() - start:.1f} s after the first finished"
            )
        seen = asyncio.run(row_times(n, time.time() + spread_s + 120))
    finally:
        common.stop_process(worker)
        common.stop_process(sim, grace_s=40)  # it writes its counts, then ends its long polls
    found = json.loads(out.read_text())
    ready: dict[str, float] = found["ready"]
    requests: dict[str, int] = found["requests"]
    delays = sorted(max(0.0, seen[rid] - at) for rid, at in ready.items() if rid in seen)
    spent = sum(requests.values())
    landed = len(delays)
    per = spent / landed if landed else float("inf")
    p50, p99 = common.percentile(delays, 50), common.percentile(delays, 99)
    print(f"   created {len(ready)} in {created_s:.1f} s; landed {landed}/{len(ready)}")
    print(
        f"   provider requests besides the creates: {spent} ({requests['events']} feed reads, "
        f"{requests['gets']} GETs by id, {requests['streams']} stream reads, "
        f"{requests['other']} other) = {per:.4f} per landed result"
    )
    p90 = common.percentile(delays, 90)
    print(
        f"   ready -> row: p50 {p50:.2f} s, p90 {p90:.2f} s, p99 {p99:.2f} s, "
        f"max {delays[-1]:.2f} s"
    )
    late = sorted((at, seen[rid] - at) for rid, at in ready.items() if seen.get(rid, at) - at > p99)
    if late:  # when the slowest ones were ready: at the start, or all along
        first = min(ready.values())
        shown = ", ".join(f"{at - first:.0f}s:{d:.1f}" for at, d in late[:12])
        print(f"   slowest 1 % (ready at s since the first : its delay): {shown}")
    return {"n": len(ready), "landed": landed, "per": per, "p50": p50, "p99": p99}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--simulator"]:
        port, spread, seed, start, out = argv[1:6]
        return serve_simulator(int(port), float(spread), int(seed), float(start), Path(out))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--spread-s", type=float, default=60.0)
    parser.add_argument("--baseline-n", type=int, default=2000)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"machine: {common.load_note()}")
    with tempfile.TemporaryDirectory(prefix="nopoll-bench-feed-") as tmp:
        work = Path(tmp)
        fed = run_case("feed", args.n, args.spread_s, args.seed, work, feed=True)
        base = None
        if not args.skip_baseline:
            base = run_case("polling", args.baseline_n, args.spread_s, args.seed, work, feed=False)
    print(f"\nmachine after: {common.load_note()}")
    ok = fed["landed"] == fed["n"]
    print(
        f"\nfeed: {fed['per']:.4f} provider requests per result (target <= {TARGET_PER_RESULT}): "
        f"{'met' if fed['per'] <= TARGET_PER_RESULT else 'MISSED'}; ready -> row p99 "
        f"{fed['p99']:.2f} s (target <= {TARGET_P99_S:g}): "
        f"{'met' if fed['p99'] <= TARGET_P99_S else 'MISSED'}"
    )
    ok = ok and fed["per"] <= TARGET_PER_RESULT and fed["p99"] <= TARGET_P99_S
    if base is not None and base["per"]:
        print(
            f"baseline (per-id polls): {base['per']:.3f} per result, ready -> row p99 "
            f"{base['p99']:.2f} s; the feed costs {fed['per'] / base['per']:.4f}x the requests"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
