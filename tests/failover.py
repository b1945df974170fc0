"""The failover drill (the test's and ``bench/failover.py``'s): a Sentinel set on
127.0.0.1 (:mod:`tests.sentinel_set`), ``nopoll api`` and two ``nopoll worker``
processes on it, signed callbacks sent at a steady rate while the primary is SIGKILLed
(``kill``) or cut off from its replicas and sentinels while the API still reaches it
(``partition``), then every acknowledged callback looked for in Postgres.

``kill``: everyone reaches Redis through the sentinels; the old primary comes back, as it
was configured, a few seconds after the promotion (and is made a replica). ``partition``:
the API is given the first primary's own address (a client whose view of the primary did
not change, as behind a DNS name not yet updated), the workers the sentinels'; the
partition heals at the end, and the old primary is made a replica of the new one, dropping
what only it held.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import httpx
import orjson
from standardwebhooks.webhooks import Webhook

from receiver.demo.simulator import ProviderSimulator
from tests.e2e.helpers import NOPOLL, pg_rows
from tests.sentinel_set import SentinelSet
from tests.servers import free_port

Fault = Literal["kill", "partition"]


@dataclass
class DrillReport:
    """What the drill saw, from the provider's side and from Postgres."""

    fault: Fault
    min_replicas_acked: int
    sent: int = 0
    acknowledged: int = 0
    answers: dict[int, int] = field(default_factory=dict)
    """Each status code (0: no answer in time) and how often."""
    missing: list[str] = field(default_factory=list)
    """Acknowledged callbacks whose row never came."""
    rows: int = 0
    duplicate_rows: int = 0
    promoted_after_s: float | None = None
    answer_ms_before: tuple[float, float] = (0.0, 0.0)
    """The callbacks' answer time before the fault, p50 and p99 (ms): what waiting for
    the replicas costs at this rate."""
    refused_before: int = 0
    """Callbacks answered 503 before the fault (none expected: the replicas keep up)."""
    seconds_of_503: float = 0.0
    """From the first 503 after the fault to the last."""
    first_2xx_after_s: float | None = None
    """From the fault to the first 2xx after the last 503: callbacks acknowledged again."""
    crashed: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        shown = ", ".join(f"{code or 'none'}: {n}" for code, n in sorted(self.answers.items()))
        return [
            f"fault {self.fault}, redis.min_replicas_acked {self.min_replicas_acked}: "
            f"{self.sent} callbacks sent ({shown})",
            f"acknowledged {self.acknowledged}; acknowledged but missing from SQL "
            f"{len(self.missing)}; rows {self.rows}, duplicated {self.duplicate_rows}",
            f"before the fault: answers p50 {self.answer_ms_before[0]:.1f} ms, p99 "
            f"{self.answer_ms_before[1]:.1f} ms, {self.refused_before} refused; promoted after "
            f"{_s(self.promoted_after_s)}; 503s for {self.seconds_of_503:.1f} s; "
            f"acknowledged again {_s(self.first_2xx_after_s)} after the fault"
            + (f"; CRASHED: {', '.join(self.crashed)}" if self.crashed else ""),
        ]


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _config(
    path: Path, redis_url: str, sim: ProviderSimulator, pg_url: str, table: str, min_acked: int
) -> Path:
    path.write_text(
        "redis:\n"
        f"  url: '{redis_url}'\n"
        f"  min_replicas_acked: {min_acked}\n"
        "  wait_timeout_ms: 500\n"
        f"data_dir: {path.parent / 'data'}\n"
        "redis_policy_check: warn\n"
        "providers:\n"
        "  sim:\n"
        "    dialect: openai\n"
        f"    base_url: {sim.base_url}\n"
        "    webhook_secrets: ['${SIM_SECRET}']\n"
        f"sinks:\n  db: {{type: sql, url: '{pg_url}', table: {table}}}\n"
        "fetch_retry: {max_tries: 20, base_delay_s: 0.2, max_delay_s: 2}\n"
        "worker: {poll_delay_s: 0.05, response_job_timeout_s: 10, health_check_interval_s: 1}\n"
    )
    return path


async def drill(
    work: Path,
    *,
    fault: Fault,
    min_replicas_acked: int,
    pg_url: str,
    table: str,
    rate: float = 200.0,
    seconds: float = 12.0,
    fault_at_s: float = 3.0,
    land_within_s: float = 60.0,
) -> DrillReport:
    """Run the drill (see the module docs); every process it starts is stopped by its PID."""
    secret = "whsec_" + __import__("base64").b64encode(os.urandom(32)).decode()
    env = {**os.environ, "SIM_SECRET": secret}
    report = DrillReport(fault, min_replicas_acked)
    redis_set = SentinelSet(partitioned=fault == "partition").start()
    sim = ProviderSimulator(auto_respond=True).start()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(*args: str) -> None:
        log = work / f"nopoll-{len(procs)}.log"
        logs.append(log)
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [str(NOPOLL), *args], env=env, stdout=out, stderr=subprocess.STDOUT
                )
            )

    try:
        api_url = redis_set.direct_url if fault == "partition" else redis_set.url
        api_config = _config(work / "api.yaml", api_url, sim, pg_url, table, min_replicas_acked)
        worker_config = _config(work / "worker.yaml", redis_set.url, sim, pg_url, table, 0)
        port = free_port()
        start("api", "--config", str(api_config), "--port", str(port))
        for _ in range(2):
            start("worker", "--config", str(worker_config))
        base = f"http://127.0.0.1:{port}"
        await _ready(base)
        answers: list[tuple[float, str, int]] = []
        took_ms: list[float] = []
        signer = Webhook(secret)
        old_primary = redis_set.primary_port()
        assert old_primary is not None
        fault_time: float | None = None

        async def faults() -> None:
            nonlocal fault_time
            await asyncio.sleep(fault_at_s)
            fault_time = time.monotonic()
            if fault == "kill":
                redis_set.kill(old_primary)
            else:
                redis_set.cut()
            await asyncio.to_thread(redis_set.wait_for_new_primary, old_primary, 60)
            report.promoted_after_s = time.monotonic() - fault_time
            if fault == "kill":
                await asyncio.sleep(2.0)
                redis_set.restart(old_primary)  # back as a primary, until demoted

        # a provider waits 15-30 s for an answer; 10 s leaves a loaded machine room while a
        # blackholed primary costs the API its Redis socket timeouts (2 s each)
        async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=64)) as http:

            async def send(i: int) -> None:
                rid = f"resp_fo{i:06d}_{uuid.uuid4().hex[:6]}"
                body = orjson.dumps(
                    {"id": f"evt_{i}", "type": "response.completed", "data": {"id": rid}}
                )
                msg_id = f"msg_fo_{i}_{uuid.uuid4().hex[:8]}"
                now = datetime.now(tz=UTC)
                headers = {
                    "webhook-id": msg_id,
                    "webhook-timestamp": str(int(now.timestamp())),
                    "webhook-signature": signer.sign(msg_id, now, body.decode()),
                    "content-type": "application/json",
                }
                asked = time.monotonic()
                try:
                    r = await http.post(f"{base}/webhooks/sim", content=body, headers=headers)
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                answers.append((time.monotonic(), rid, status))
                if fault_time is None:
                    took_ms.append((time.monotonic() - asked) * 1000)

            fault_task = asyncio.create_task(faults())
            started, sending = time.monotonic(), []
            for i in range(int(rate * seconds)):
                await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
                sending.append(asyncio.create_task(send(i)))
            await asyncio.gather(*sending)
            await fault_task
        if fault == "partition":
            redis_set.heal()  # the old primary becomes a replica, dropping what only it held
        report.sent = len(answers)
        for _, _, status in answers:
            report.answers[status] = report.answers.get(status, 0) + 1
        acked = {rid for _, rid, status in answers if 200 <= status < 300}
        report.acknowledged = len(acked)
        assert fault_time is not None
        took_ms.sort()
        if took_ms:
            p99 = took_ms[min(len(took_ms) - 1, int(len(took_ms) * 0.99))]
            report.answer_ms_before = (took_ms[len(took_ms) // 2], p99)
        report.refused_before = sum(
            1 for t, _, status in answers if t < fault_time and status != 202
        )
        after = sorted((t - fault_time, status) for t, _, status in answers if t >= fault_time)
        refused = [t for t, status in after if status == 503]
        if refused:  # the 503s' span, and the first 2xx once they ended
            report.seconds_of_503 = refused[-1] - refused[0]
            report.first_2xx_after_s = next(
                (t for t, status in after if t > refused[-1] and 200 <= status < 300), None
            )
        else:
            report.first_2xx_after_s = next((t for t, status in after if 200 <= status < 300), None)
        deadline = time.monotonic() + land_within_s
        rows: list[dict] = []
        while time.monotonic() < deadline:
            rows = await pg_rows(pg_url, table)
            if acked <= {r["key"] for r in rows}:
                break
            await asyncio.sleep(0.5)
        keys = [r["key"] for r in rows]
        report.rows, report.duplicate_rows = len(keys), len(keys) - len(set(keys))
        report.missing = sorted(acked - set(keys))
        report.crashed = [
            f"{log.name} exited {p.returncode}"
            for p, log in zip(procs, logs, strict=True)
            if p.poll() is not None
        ]
        return report
    finally:
        for process in procs:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in procs:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        sim.stop()
        redis_set.stop()


async def _ready(base: str) -> None:
    async with httpx.AsyncClient(timeout=2) as http:
        for _ in range(300):
            try:
                if (await http.get(f"{base}/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("nopoll api did not become ready")
