"""The Helm chart's pods, running: rendered by Helm's engine, played with podman kube play
on the machine's Redis and Postgres with the provider simulator, as users deploy it.

Two API and two worker pods pass the config-check init container, answer their probe
paths, turn signed callbacks into rows, and pass the chart's own ``helm test`` pod (a full
round trip). Then every pod is replaced one by one under load (test_upgrade_under_load).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from receiver.demo.simulator import ProviderSimulator, send_callback
from receiver.queue.deadletter import DeadLetters
from tests.deploy.chart import Rendered, pod_spec, with_changes
from tests.deploy.podman import Image, KubePlay, Pod, release_name, wait_http
from tests.e2e.helpers import pg_rows, wait_for
from tests.servers import free_port

pytestmark = [pytest.mark.pods, pytest.mark.timeout(1500)]


@dataclass
class Stack:
    """A release of the chart on podman: its values, its pods and where they listen."""

    render: Any
    play: KubePlay
    values: dict[str, Any]
    sim: ProviderSimulator
    secret: str
    consumer_token: str
    rendered: Rendered
    revision: int = 0
    api: list[Pod] = field(default_factory=list)
    workers: list[Pod] = field(default_factory=list)

    @property
    def fullname(self) -> str:
        return f"{self.play.release}-nopoll"

    def deployment(self, role: str) -> dict[str, Any]:
        return self.rendered.component("Deployment", role)

    def check_config(self) -> str:
        """The config-check init container, run once as its own pod: its logs."""
        pod = self.play.play(
            self.deployment("api"), f"{self.fullname}-check-r{self.revision}", init_only=True
        )
        code, logs = self.play.wait_exit(pod)
        self.play.remove(pod)
        assert code == 0, logs
        return logs

    def port_values(self, role: str, port: int) -> dict[str, Any]:
        """This revision's Deployment of ``role`` with its port set in values (api.port,
        worker.healthPort): each pod on the host network needs a port of its own."""
        # the consumers' API takes its port from api.port
        key = {"api": "api__port", "consumers": "api__port", "worker": "worker__healthPort"}[role]
        rendered = self.render(with_changes(self.values, **{key: port}), release=self.play.release)
        deployment: dict[str, Any] = rendered.component("Deployment", role)
        [container] = pod_spec(deployment)["containers"]
        assert str(port) in container["command"], container["command"]
        return deployment

    def start_api(self, index: int) -> Pod:
        name = f"{self.fullname}-api-r{self.revision}-{index}"
        port = free_port()
        pod = self.play.play(self.port_values("api", port), name, port=port)
        wait_http(f"http://127.0.0.1:{pod.port}/healthz", pod=pod)  # the startup probe
        wait_http(f"http://127.0.0.1:{pod.port}/readyz", pod=pod)  # ready: takes traffic
        return pod

    def start_consumers(self, index: int) -> Pod:
        """A pod of the consumers' API Deployment (consumers.enabled), which takes its port
        from api.port."""
        name = f"{self.fullname}-consumers-r{self.revision}-{index}"
        port = free_port()
        pod = self.play.play(self.port_values("consumers", port), name, port=port)
        wait_http(f"http://127.0.0.1:{pod.port}/readyz", pod=pod)
        return pod

    def start_worker(self, index: int) -> Pod:
        name = f"{self.fullname}-worker-r{self.revision}-{index}"
        port = free_port()
        pod = self.play.play(self.port_values("worker", port), name, port=port)
        wait_http(f"http://127.0.0.1:{pod.port}/healthz", pod=pod)  # the liveness probe
        return pod

    def upgrade(self, image: Image | None = None, **config: Any) -> None:
        """A new revision: the chart rendered with changed config (a new checksum), or
        with another image."""
        old = self.deployment("api")["spec"]["template"]["metadata"]["annotations"]
        self.values["config"].update(config)
        if image is not None:
            repository, tag = image.ref.rsplit(":", 1)
            self.values["image"].update(repository=repository, tag=tag)
        self.rendered = self.render(self.values, release=self.play.release)
        new = self.deployment("api")["spec"]["template"]["metadata"]["annotations"]
        if image is None:
            assert new["checksum/config"] != old["checksum/config"]
        else:
            [container] = pod_spec(self.deployment("worker"))["containers"]
            assert container["image"] == image.ref, container["image"]
        self.revision += 1
        self.play.config_maps = self.play.release_config_maps(self.rendered, self.revision)


def _values(
    image: Image, redis_url: str, pg_url: str, table: str, sim: ProviderSimulator, batch_sim: Any
) -> tuple[dict[str, Any], str, str]:
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    token = secrets.token_urlsafe(24)
    repository, tag = image.ref.rsplit(":", 1)
    providers: dict[str, Any] = {
        "sim": {
            "dialect": "openai",
            "base_url": sim.base_url,
            "api_key": "${SIM_API_KEY}",
            "webhook_secrets": ["${SIM_WEBHOOK_SECRET}"],
        }
    }
    if batch_sim is not None:
        providers["bat"] = {
            "dialect": "valar",
            "base_url": batch_sim.base_url,
            "max_concurrency": 4,
            "rate_limit_rps": None,  # the simulator has no request limit
            "api_key": "${SIM_API_KEY}",
            "webhook_secrets": ["${SIM_WEBHOOK_SECRET}"],
        }
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "redis": {"url": redis_url},
        "config": {
            "log_level": "info",
            "providers": providers,
            "sinks": {"warehouse": {"type": "sql", "url": "${DATABASE_URL}", "table": table}},
            "consumer_tokens": [{"token": "${NOPOLL_CONSUMER_TOKEN}"}],
            "batch": {"chunk_size": 100},
        },
        "secret": {
            "env": {
                "SIM_API_KEY": "sk-test-not-a-real-key",
                "SIM_WEBHOOK_SECRET": secret,
                "DATABASE_URL": pg_url,
                "NOPOLL_CONSUMER_TOKEN": token,
            }
        },
        "tests": {"roundTrip": {"responseId": f"resp_helmtest_{uuid.uuid4().hex[:12]}"}},
    }
    return values, secret, token


@pytest.fixture
def stack(
    nopoll_image: Image,
    render: Any,
    kube_play: Any,
    redis_url: str,
    pg_url: str,
    pg_table: str,
    provider_sim: Any,
) -> Iterator[Any]:
    """Factory: a release with 2 API and 2 worker pods, config checked first (``config``:
    more of nopoll's config in the values)."""

    def make(
        *, batch_sim: Any = None, config: dict[str, Any] | None = None, consumers: bool = False
    ) -> Stack:
        sim = provider_sim(auto_respond=True, api_key="sk-test-not-a-real-key")
        values, secret, token = _values(nopoll_image, redis_url, pg_url, pg_table, sim, batch_sim)
        values["config"].update(config or {})
        if consumers:  # the consumers' API Deployment beside the API's
            values["consumers"] = {"enabled": True, "replicas": 1}
        release = release_name()
        rendered = render(values, release=release)
        play = kube_play(rendered, release)
        built = Stack(render, play, values, sim, secret, token, rendered)
        logs = built.check_config()
        assert "config OK" in logs and "sink warehouse:" in logs, logs
        built.api = [built.start_api(i) for i in range(2)]
        built.workers = [built.start_worker(i) for i in range(2)]
        return built

    yield make


async def test_the_chart_runs_two_apis_and_two_workers_and_passes_helm_test(
    stack: Any, pg_url: str, pg_table: str
) -> None:
    s: Stack = await asyncio.to_thread(stack, consumers=True)
    consumers = await asyncio.to_thread(s.start_consumers, 0)
    ids = [f"resp_chart_{i:02d}_{uuid.uuid4().hex[:8]}" for i in range(20)]
    async with httpx.AsyncClient(timeout=10) as client:
        for pod in [*s.api, *s.workers]:
            metrics = await client.get(f"http://127.0.0.1:{pod.port}/metrics")
            assert metrics.status_code == 200 and "nopoll_" in metrics.text
        for i, response_id in enumerate(ids):
            url = f"http://127.0.0.1:{s.api[i % 2].port}/webhooks/sim"
            answer = await send_callback(client, url, s.secret, response_id)
            assert answer.status_code == 202, answer.text

    async def all_landed() -> list[dict[str, Any]] | None:
        rows = await pg_rows(pg_url, pg_table)
        return rows if len(rows) >= len(ids) else None

    rows = await wait_for(all_landed, timeout=60)
    assert sorted(r["key"] for r in rows) == sorted(ids)
    # the consumers' API pod serves the results the providers' callbacks brought
    async with httpx.AsyncClient(timeout=10) as client:
        headers = {"authorization": f"Bearer {s.consumer_token}"}
        url = f"http://127.0.0.1:{consumers.port}/v1/results/sim/{ids[0]}"
        answer = await client.get(url, headers=headers)
        assert answer.status_code == 200, answer.text
        assert answer.json()["response_id"] == ids[0], answer.text

    # the chart's `helm test` pod, pointed at one API pod (podman runs no Service)
    [test_pod] = [
        d for d in s.rendered.of_kind("Pod") if "helm.sh/hook" in d["metadata"]["annotations"]
    ]
    pod = await asyncio.to_thread(
        s.play.play,
        test_pod,
        f"{s.fullname}-helm-test",
        env={"NOPOLL_TEST_URL": f"http://127.0.0.1:{s.api[0].port}"},
    )
    code, logs = await asyncio.to_thread(s.play.wait_exit, pod, 120)
    assert code == 0, logs
    response_id = s.values["tests"]["roundTrip"]["responseId"]
    assert f"{response_id} landed" in logs, logs
    rows = await pg_rows(pg_url, pg_table)
    assert [r["key"] for r in rows if r["key"] == response_id] == [response_id]

    for pod in [*s.api, consumers, *s.workers]:  # stopped as Kubernetes stops them
        await asyncio.to_thread(s.play.pre_stop, pod)
        await asyncio.to_thread(s.play.stop, pod)


# --- an upgrade under load ------------------------------------------------------------------

RATE = 100  # callbacks a second
PROVIDER_DELAY_S = 0.2
BATCH_ROWS = 1200
BATCH_ROW_DELAY_S = 0.25  # 4 rows at a time (the provider's max_concurrency): 75 s


@dataclass
class Load:
    """Signed callbacks at RATE/s to the API pods that are ready, retried like a provider
    retries (503 or no connection: again, on another pod), every answer counted."""

    secret: str
    endpoints: list[int]
    sent: dict[str, float] = field(default_factory=dict)
    acknowledged: set[str] = field(default_factory=set)
    statuses: dict[int, int] = field(default_factory=dict)
    connection_errors: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _one(self, client: httpx.AsyncClient, response_id: str, turn: int) -> None:
        self.sent[response_id] = time.time()
        for attempt in range(200):
            port = self.endpoints[(turn + attempt) % len(self.endpoints)]
            url = f"http://127.0.0.1:{port}/webhooks/sim"
            try:
                answer = await send_callback(client, url, self.secret, response_id)
            except httpx.HTTPError:
                self.connection_errors += 1
            else:
                self.statuses[answer.status_code] = self.statuses.get(answer.status_code, 0) + 1
                if answer.status_code // 100 == 2:
                    self.acknowledged.add(response_id)
                    return
            await asyncio.sleep(0.2)

    async def run(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=15, limits=limits) as client:
            start, turn = time.monotonic(), 0
            while not self.stop.is_set():
                task = asyncio.create_task(self._one(client, f"resp_roll_{turn:06d}", turn))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                turn += 1
                await asyncio.sleep(max(0.0, start + turn / RATE - time.monotonic()))
            await asyncio.gather(*tasks)


_SEEN = """
CREATE TABLE "{t}_seen" (key text, at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION "{t}_seen"() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO "{t}_seen"(key) VALUES (NEW.key); RETURN NEW; END $$;
CREATE TRIGGER "{t}_seen" AFTER INSERT OR UPDATE ON "{t}" FOR EACH ROW
EXECUTE FUNCTION "{t}_seen"();
"""


@pytest.fixture
def row_times(pg_url: str, pg_table: str) -> Iterator[Any]:
    """Factory: a trigger recording when each row of the results table is written."""

    async def install() -> None:
        conn = await asyncpg.connect(pg_url)
        try:
            await wait_for(lambda: conn.fetchval("SELECT to_regclass($1)", pg_table), 60)
            await conn.execute(_SEEN.format(t=pg_table))
        finally:
            await conn.close()

    yield install

    async def drop() -> None:
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(f'DROP TABLE IF EXISTS "{pg_table}", "{pg_table}_seen" CASCADE')
            await conn.execute(f'DROP FUNCTION IF EXISTS "{pg_table}_seen"() CASCADE')
        finally:
            await conn.close()

    asyncio.run(drop())


async def _roll(s: Stack, load: Load, batch: Any) -> list[str]:
    """Every API then every worker pod replaced, one by one, as a Deployment rolls."""
    steps: list[str] = []
    await asyncio.to_thread(s.upgrade, log_level="warning")
    await asyncio.to_thread(s.check_config)
    for i, old in enumerate(list(s.api)):
        new = await asyncio.to_thread(s.start_api, i)  # maxSurge: the new one first
        load.endpoints.append(new.port)  # ready: the Service sends it traffic
        load.endpoints.remove(old.port)  # terminating: out of the Service's endpoints
        started = time.monotonic()
        await asyncio.to_thread(s.play.pre_stop, old)  # while in-flight requests finish
        await asyncio.to_thread(
            s.play.stop, old, grace_s=old.grace_s - (time.monotonic() - started)
        )
        s.api[i] = new
        steps.append(f"api {old.name} -> {new.name} in {time.monotonic() - started:.1f} s")
    fetched = batch.request_count("/v1/batches/batch_roll/")
    assert fetched < BATCH_ROWS, "the batch ended before the workers were replaced"
    steps.append(f"batch at {fetched}/{BATCH_ROWS} rows when the workers roll")
    for i, old in enumerate(list(s.workers)):
        new = await asyncio.to_thread(s.start_worker, i)
        started = time.monotonic()
        await asyncio.to_thread(s.play.stop, old)
        s.workers[i] = new
        steps.append(f"worker {old.name} -> {new.name} in {time.monotonic() - started:.1f} s")
    return steps


@pytest.mark.slow
async def test_upgrade_under_load(
    stack: Any,
    provider_sim: Any,
    pg_url: str,
    pg_table: str,
    row_times: Any,
    record_property: Any,
) -> None:
    """100 callbacks/s, a provider answering after 200 ms and a batch streaming while every
    API and worker pod is replaced one by one (a new config checksum, the preStop hook,
    SIGTERM, the chart's grace period): nothing lost, nothing twice in SQL, no 5xx but 503.
    """
    batch_sim = provider_sim(api_key="sk-test-not-a-real-key")
    batch_sim.add_batch("valar", "batch_roll", BATCH_ROWS, row_delay_s=BATCH_ROW_DELAY_S)
    s: Stack = await asyncio.to_thread(stack, batch_sim=batch_sim)
    s.sim.set_delay(PROVIDER_DELAY_S)
    await row_times()
    load = Load(s.secret, [p.port for p in s.api])
    sender = asyncio.create_task(load.run())
    try:
        await asyncio.sleep(3)
        async with httpx.AsyncClient(timeout=10) as client:
            url = f"http://127.0.0.1:{s.api[0].port}/webhooks/bat"
            answer = await send_callback(
                client, url, s.secret, "batch_roll", event_type="batch.completed"
            )
        assert answer.status_code // 100 == 2, answer.text
        await wait_for(lambda: _async(batch_sim.request_count("/v1/batches/batch_roll/") > 0))
        roll_start = time.time()
        steps = await _roll(s, load, batch_sim)
        roll_end = time.time()
    finally:
        load.stop.set()
        await sender

    async def landed() -> bool:
        conn = await asyncpg.connect(pg_url)
        try:
            n = await conn.fetchval(f'SELECT count(*) FROM "{pg_table}" WHERE provider = $1', "sim")
            b = await conn.fetchval(
                f'SELECT count(*) FROM "{pg_table}" WHERE provider = $1 AND key LIKE $2',
                "bat",
                "batch_roll/%",
            )
        finally:
            await conn.close()
        return n >= len(load.acknowledged) and b >= BATCH_ROWS

    with contextlib.suppress(AssertionError):  # what is missing is counted below
        await wait_for(landed, timeout=240, interval=0.5)
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(f'SELECT provider, key, received_at FROM "{pg_table}"')
        writes = await conn.fetch(
            f'SELECT key, min(at) AS first, count(*) AS n FROM "{pg_table}_seen" GROUP BY key'
        )
    finally:
        await conn.close()
    seen = {r["key"]: r["first"].timestamp() for r in writes}

    keys = [(r["provider"], r["key"]) for r in rows]
    responses = {k for p, k in keys if p == "sim"}
    batch_rows = [k for p, k in keys if p == "bat" and k.startswith("batch_roll/")]
    twice = len(keys) - len(set(keys))
    lost = len(set(load.sent) - responses) + max(0, BATCH_ROWS - len(batch_rows))
    other_5xx = {c: n for c, n in load.statuses.items() if c >= 500 and c != 503}
    rewrites = sum(r["n"] - 1 for r in writes)  # the same row upserted again: harmless

    def latencies(start: float, end: float) -> str:
        found = sorted(seen[k] - t for k, t in load.sent.items() if start <= t < end and k in seen)
        if not found:
            return "none"
        p50, p99 = found[len(found) // 2], found[int(len(found) * 0.99)]
        return (
            f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {found[-1] * 1000:.0f} ms "
            f"({len(found)} callbacks)"
        )

    figures = (
        f"roll: {sum('->' in x for x in steps)} pods replaced in {roll_end - roll_start:.0f} s; "
        + "; ".join(steps)
        + f"\ncallbacks: {len(load.sent)} sent at {RATE}/s, answers {load.statuses}, "
        f"{load.connection_errors} refused connections retried; batch: {len(batch_rows)}"
        f"/{BATCH_ROWS} rows\nlost {lost}, twice in SQL {twice}, 5xx other than 503 "
        f"{sum(other_5xx.values())}, rows written again (idempotent upserts) {rewrites}"
        f"\ncallback -> row before the roll: {latencies(0, roll_start)}"
        f"\ncallback -> row during the roll: {latencies(roll_start, roll_end)}"
    )
    print(f"\n{figures}")
    record_property("figures", figures)

    assert twice == 0, "a result is in SQL twice"
    assert responses == load.acknowledged == set(load.sent), "a callback was lost"
    assert len(batch_rows) == BATCH_ROWS  # and the batch's own row, ("bat", "batch_roll")
    assert not other_5xx, load.statuses


async def _async(value: bool) -> bool:
    return value


# --- a rolling upgrade to a newer image -----------------------------------------------------

NEWER_ROWS = 400


@pytest.mark.slow
async def test_a_batch_begun_on_a_newer_image_while_an_old_worker_runs(
    stack: Any, provider_sim: Any, newer_image: Image, redis_url: str, pg_url: str, pg_table: str
) -> None:
    """A rolling upgrade to an image that writes newer job and batch-progress versions
    (tests/newer.py). The API pods roll first: a batch's callback reaches a newer API pod
    while only older worker pods run, and they retry it (no live worker reads it yet)
    rather than keep it as a dead letter. Then the worker pods roll one by one: a newer
    worker runs the batch while an older one still runs. Every row lands once."""
    batch_sim = provider_sim(api_key="sk-test-not-a-real-key")
    batch_sim.add_batch("valar", "batch_newer", NEWER_ROWS, row_delay_s=0.02)
    retry = {"max_tries": 40, "base_delay_s": 0.5, "max_delay_s": 3.0}
    s: Stack = await asyncio.to_thread(stack, batch_sim=batch_sim, config={"fetch_retry": retry})
    await asyncio.to_thread(s.upgrade, newer_image)
    await asyncio.to_thread(s.check_config)
    for i, old in enumerate(list(s.api)):  # the API Deployment rolls
        s.api[i] = await asyncio.to_thread(s.start_api, i)
        await asyncio.to_thread(s.play.stop, old)
    old_workers = list(s.workers)
    letters = Redis.from_url(redis_url)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            url = f"http://127.0.0.1:{s.api[0].port}/webhooks/bat"
            answer = await send_callback(
                client, url, s.secret, "batch_newer", event_type="batch.completed"
            )
            assert answer.status_code // 100 == 2, answer.text

            async def refused() -> bool:  # an older worker took it and read its version
                logs = "".join([s.play.logs(pod) for pod in old_workers])
                return "no live worker reads it yet: retrying" in logs

            await wait_for(refused, timeout=60, interval=0.2)
            assert await DeadLetters(letters).count() == 0
            # the worker Deployment rolls: a newer worker first, then an older one goes
            s.workers[0] = await asyncio.to_thread(s.start_worker, 0)
            refusals = _refusals(await _metrics(client, old_workers[0]))
            await asyncio.to_thread(s.play.stop, old_workers[0])

            async def landed() -> int | None:
                rows = await pg_rows(pg_url, pg_table)
                found = [r for r in rows if r["key"].startswith("batch_newer/")]
                return len(found) if len(found) >= NEWER_ROWS else None

            await wait_for(landed, timeout=180, interval=0.5)
            still_old = old_workers[1]  # it ran beside the newer worker all along
            refusals += _refusals(await _metrics(client, still_old))
        rows = await pg_rows(pg_url, pg_table)
        keys = [r["key"] for r in rows if r["key"].startswith("batch_newer/")]
        assert len(keys) == len(set(keys)) == NEWER_ROWS
        assert await DeadLetters(letters).count() == 0
        assert refusals >= 1  # counted in the older workers' /metrics
    finally:
        await letters.aclose()
    s.workers[1] = await asyncio.to_thread(s.start_worker, 1)
    await asyncio.to_thread(s.play.stop, still_old)
    for pod in [*s.api, *s.workers]:
        await asyncio.to_thread(s.play.stop, pod)


async def _metrics(client: httpx.AsyncClient, pod: Pod) -> str:
    answer = await client.get(f"http://127.0.0.1:{pod.port}/metrics")
    assert answer.status_code == 200, answer.text
    return answer.text


def _refusals(metrics: str) -> float:
    """fetch_batch jobs a worker left (retried or handed back) for their version."""
    found = re.findall(
        r'nopoll_jobs_total\{function="fetch_batch",outcome="(?:retry|handed_back)"\} (\S+)',
        metrics,
    )
    return sum(float(n) for n in found)
