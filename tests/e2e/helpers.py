"""Helpers shared by the end-to-end tests: polling, reading sinks, running nopoll."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import httpx
from redis import asyncio as redis_asyncio

from receiver.queue.enqueue import BATCHES_QUEUE, HEALTH_CHECK_KEY, JOBS_QUEUE


async def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):  # noqa: ASYNC109
    """Poll an async predicate until it returns something truthy (bounded in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def requested(sim, path: str):
    """A :func:`wait_for` predicate: the provider simulator got a request for ``path``."""

    async def check() -> bool:
        return sim.request_count(path) >= 1

    return check


async def queues_empty(redis_url: str) -> bool:
    """True once no job is queued, waiting for a retry or running, on either queue (arq
    takes a job off its queue only when it finished)."""
    client = redis_asyncio.Redis.from_url(redis_url)
    try:
        return await client.zcard(JOBS_QUEUE) + await client.zcard(BATCHES_QUEUE) == 0
    finally:
        await client.aclose()


async def worker_started(redis_url: str) -> bool:
    """True once a worker's poll loop runs (its start-up, sinks opened, is done)."""
    client = redis_asyncio.Redis.from_url(redis_url)
    try:
        return bool(await client.exists(HEALTH_CHECK_KEY))
    finally:
        await client.aclose()


async def pg_rows(url: str, table: str) -> list[dict]:
    conn = await asyncpg.connect(url)
    try:
        exists = await conn.fetchval("SELECT to_regclass($1)", table)
        if exists is None:
            return []
        return [dict(r) for r in await conn.fetch(f'SELECT * FROM "{table}"')]
    finally:
        await conn.close()


async def wait_pg_rows(
    url: str,
    table: str,
    n: int,
    *,
    timeout: float = 60.0,  # noqa: ASYNC109
    interval: float = 0.2,
) -> list[dict]:
    """The rows of ``table`` once there are at least ``n`` (polled, bounded in time)."""

    async def enough():
        rows = await pg_rows(url, table)
        return rows if len(rows) >= n else None

    return await wait_for(enough, timeout=timeout, interval=interval)


def jsonl_rows(root: Path) -> list[dict]:
    return [
        json.loads(line)
        for p in sorted(root.glob("*/*.jsonl"))
        for line in p.read_text().splitlines()
    ]


async def post(base: str, body: bytes, headers: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(f"{base}/webhooks/sim", content=body, headers=headers)


NOPOLL = Path(sys.executable).parent / "nopoll"
"""The installed ``nopoll`` command, as users run it."""


class Processes:
    """Starts the installed ``nopoll`` command; stops each one by its PID at the end."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env, self.started = tmp, env, []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        with (self.tmp / f"nopoll-{len(self.started)}.log").open("wb") as log:
            p = subprocess.Popen(
                [str(NOPOLL), *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.started.append(p)
        return p

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.tmp.glob("nopoll-*.log"))
        )

    def stop_all(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.kill()
                p.wait(10)


SIGNED = "    webhook_secrets: ['${SIM_SECRET}']\n"
"""The ``write_config`` provider's default lines: callbacks signed with ``$SIM_SECRET``."""


def sql_sink(url: str, table: str) -> str:
    """``write_config``'s ``sinks`` for one ``sql`` sink ``db``."""
    return f"  db: {{type: sql, url: '{url}', table: {table}}}\n"


def write_config(
    tmp: Path,
    base_url: str,
    *,
    redis_url: str = "",
    sinks: str = "",
    extra: str = "",
    dialect: str = "openai",
    provider: str = SIGNED,
) -> Path:
    """A config file for provider ``sim`` at ``base_url``; ``provider`` is the rest of
    its lines (indented four spaces), ``sinks`` the lines under ``sinks:``."""
    path = tmp / "nopoll.yaml"
    path.write_text(
        f"redis_url: '{redis_url}'\n"
        f"data_dir: {tmp / 'data'}\n"
        "providers:\n"
        "  sim:\n"
        f"    dialect: {dialect}\n"
        f"    base_url: {base_url}\n"
        + provider
        + (f"sinks:\n{sinks}" if sinks else "")
        + "fetch_retry: {max_tries: 5, base_delay_s: 0.1, max_delay_s: 0.5}\n"
        "worker: {poll_delay_s: 0.01, response_job_timeout_s: 4, health_check_interval_s: 1}\n"
        + extra
    )
    return path


def run_nopoll(
    *args: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``nopoll ARGS...`` run to its end, its output captured as text."""
    return subprocess.run(
        [str(NOPOLL), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def nopoll_submit(
    procs: Processes, config: Path, *args, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``nopoll submit --config CONFIG sim ARGS...`` run to its end."""
    return run_nopoll(
        "submit", "--config", str(config), "sim", *map(str, args), env=procs.env, timeout=timeout
    )


def wait_ready(port: int, limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("nopoll did not become ready")


async def await_ready(port: int) -> None:
    await asyncio.to_thread(wait_ready, port)


CSRF = re.compile(r'name="csrf" value="([^"]+)"')
"""The CSRF token of a status page (/ui) form."""


async def logged_in_as(client: httpx.AsyncClient, token: str) -> None:
    """Log ``client`` in to the status page (/ui) with an admin ``token``."""
    page = await client.get("/ui/login")
    csrf = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
    r = await client.post("/ui/login", data={"token": token, "csrf": csrf})
    assert r.status_code == 303
