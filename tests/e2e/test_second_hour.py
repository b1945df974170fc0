"""What a new user fell into in the second hour (issue 21): each trap run as the user ran
it, with the installed ``nopoll`` command in temporary folders, against the provider
simulator and embedded or real Redis."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from redis import asyncio as redis_asyncio

from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import put_job
from receiver.queue.jobs import DeliverJob
from tests.e2e.helpers import NOPOLL, wait_for, wait_ready
from tests.receiver.helpers import envelope
from tests.servers import free_port

pytestmark = pytest.mark.slow

FAST = (
    "fetch_retry: {max_tries: 3, base_delay_s: 0.1, max_delay_s: 0.5}\n"
    "worker: {poll_delay_s: 0.01, response_job_timeout_s: 4, health_check_interval_s: 1}\n"
)
WATCH = "    watch: {first_poll_s: 0.2, max_interval_s: 0.5, rate_limit_rps: 200}\n"


class Started:
    """``nopoll`` processes started in a folder; each stopped by its PID at the end."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, cwd: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
        out = cwd / f"{name}.out"
        with out.open("wb") as f:
            p = subprocess.Popen(
                [str(NOPOLL), *args],
                cwd=cwd,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.procs.append((p, out))
        return p

    def output(self, name: str) -> str:
        return "\n".join(o.read_text(errors="replace") for _, o in self.procs if o.stem == name)

    def stop(self) -> None:
        for p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


@pytest.fixture
def started(procs) -> Iterator[Started]:
    s = Started(procs.env)
    yield s
    s.stop()


def run(env, cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``nopoll ARGS`` in ``cwd``; a run past ``timeout`` is killed and is a failure."""
    try:
        return subprocess.run(
            [str(NOPOLL), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if exc.stdout else ""
        pytest.fail(f"nopoll {' '.join(args)} still ran after {timeout:g} s; its output:\n{out}")


def _requests(path: Path, n: int) -> Path:
    with path.open("wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"model": "m-1", "input": f"q {i}", "custom_id": f"q{i}"}) + b"\n")
    return path


def _config(folder: Path, base_url: str, *, redis_url: str = "", callbacks: bool = False) -> Path:
    """A config as the README writes it: relative paths, the embedded Redis by default."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nopoll.yaml"
    path.write_text(
        (f"redis_url: '{redis_url}'\n" if redis_url else "") + "providers:\n"
        "  sim:\n"
        "    dialect: openai\n"
        f"    base_url: {base_url}\n"
        + ("    webhook_secrets: ['${SIM_SECRET}']\n" if callbacks else WATCH)
        + "sinks:\n"
        '  db: {type: sql, url: "sqlite:///nopoll-data/results.db"}\n'
        "  files: {type: jsonl, dir: out/results}\n" + FAST
    )
    return path


def _rows(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT key, status FROM nopoll_results").fetchall()


# --- 1: relative paths, and no second embedded Redis ------------------------------------


async def test_from_another_folder_submit_wait_lands_every_row_in_the_configs_folder(
    started, tmp_path, provider_sim
):
    """The issue's "done when": the config's folder runs nopoll, another folder submits."""
    sim = provider_sim(complete_after_s=0.3)
    home, elsewhere = tmp_path / "deploy", tmp_path / "elsewhere"
    config = _config(home, sim.base_url)
    elsewhere.mkdir()
    port = free_port()
    started.start(home, "serve", "serve", "--config", "nopoll.yaml", "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    source = _requests(elsewhere / "cli.jsonl", 3)
    result = await asyncio.to_thread(
        run, started.env, elsewhere, "submit", "--config", str(config), "sim", "cli.jsonl", "--wait"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 landed, 0 expired, 0 still pending" in result.stdout
    # item 5: the polls made while waiting, and their rate, on the final line (it said 0.0)
    polls = re.search(r"\((\d+) polls, (\d+\.\d)/s while waiting\)", result.stdout)
    assert polls and int(polls[1]) >= 3 and float(polls[2]) > 0, result.stdout
    assert sim.creations("responses") == 3
    assert sorted(p.name for p in elsewhere.iterdir()) == [source.name]  # no nopoll-data here
    rows = _rows(home / "nopoll-data" / "results.db")
    assert len(rows) == 3 and {s for _, s in rows} == {"completed"}
    assert list((home / "out" / "results" / "sim").glob("*.jsonl"))
    # item 5: a rerun creates nothing again, and its bar starts at what already landed
    # (it showed "0/3 landed 3")
    wide = {**started.env, "COLUMNS": "200"}
    again = await asyncio.to_thread(
        run, wide, elsewhere, "submit", "--config", str(config), "sim", "cli.jsonl", "--wait"
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 submitted, 3 already submitted" in again.stdout, again.stdout
    assert re.search(r"sim responses .* 3/3 landed 3,", again.stdout), again.stdout
    assert sim.creations("responses") == 3


async def test_submit_with_no_nopoll_running_stops_at_once_and_creates_nothing(
    started, tmp_path, provider_sim
):
    sim = provider_sim(complete_after_s=0.3)
    home, elsewhere = tmp_path / "deploy", tmp_path / "elsewhere"
    config = _config(home, sim.base_url)
    elsewhere.mkdir()
    _requests(elsewhere / "cli.jsonl", 3)
    result = await asyncio.to_thread(
        run,
        started.env,
        elsewhere,
        "submit",
        "--config",
        str(config),
        "sim",
        "cli.jsonl",
        "--wait",
        timeout=30,
    )
    assert result.returncode != 0, result.stdout + result.stderr
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "no nopoll is running" in err and str(home / "nopoll-data") in err, err
    assert "nopoll serve --config" in err, err
    assert sim.creations("responses") == 0  # nothing created at the provider
    assert not (home / "nopoll-data").exists()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["cli.jsonl"]
    watch = await asyncio.to_thread(
        run, started.env, elsewhere, "watch", "--config", str(config), "sim", "response", "r1"
    )
    assert watch.returncode != 0
    assert "no nopoll is running" in watch.stderr and "Traceback" not in watch.stderr


def test_config_check_shows_paths_relative_to_the_config_file(started, tmp_path):
    home, elsewhere = tmp_path / "deploy", tmp_path / "elsewhere"
    config = _config(home, "http://127.0.0.1:9/v1")
    config.write_text(config.read_text() + "data_dir: ./state\n")
    elsewhere.mkdir()
    result = run(started.env, elsewhere, "config", "check", "--redacted", "--config", str(config))
    assert result.returncode == 0, result.stderr
    shown = result.stdout
    assert f"data_dir: {home / 'state'}" in shown, shown
    assert f"sqlite+aiosqlite:///{home / 'nopoll-data' / 'results.db'}" in shown, shown
    assert f"dir: {home / 'out' / 'results'}" in shown, shown


# --- 2: a worker without the provider leaves the job to one that has it ------------------


async def test_a_worker_without_the_provider_leaves_its_jobs_to_one_that_has_it(
    started, tmp_path, provider_sim, redis_url, signed_callback
):
    sim = provider_sim()
    ids = [f"resp_{i}" for i in range(10)]
    for i in ids:
        sim.add_response(i)
    home, other = tmp_path / "deploy", tmp_path / "other"
    config = _config(home, sim.base_url, redis_url=redis_url, callbacks=True)
    # one job at a time: the other worker, taking what it can, gets most of them
    config.write_text(config.read_text().replace("poll_delay_s: 0.01,", "max_jobs: 1,"))
    port = free_port()
    started.start(home, "serve", "serve", "--config", "nopoll.yaml", "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    other.mkdir()
    bare = other / "nopoll.yaml"  # the "forgotten --config": no providers, same Redis
    bare.write_text(f"redis_url: '{redis_url}'\n" + FAST)
    started.start(other, "bare", "worker", "--config", str(bare))

    async def bare_started():
        return "worker for nopoll:jobs" in started.output("bare")

    await wait_for(bare_started, timeout=20)
    await asyncio.sleep(1.5)  # its poll loop is turning
    async with httpx.AsyncClient(timeout=10) as client:
        for i in ids:
            body, headers = signed_callback(i)
            r = await client.post(
                f"http://127.0.0.1:{port}/webhooks/sim", content=body, headers=headers
            )
            assert r.status_code == 202

    db = home / "nopoll-data" / "results.db"

    async def all_landed():
        return db.exists() and len(_rows(db)) == len(ids)

    await wait_for(all_landed, timeout=60, interval=0.2)
    client = redis_asyncio.Redis.from_url(redis_url)
    try:
        letters = [k async for k in client.scan_iter("nopoll:dlq*")]
    finally:
        await client.aclose()
    log = started.output("bare")
    assert "no longer configured" not in log and not letters, log
    assert "sim" in log and "this worker does not have" in log, log  # said at start-up


async def test_a_worker_without_the_sink_leaves_its_deliveries_to_one_that_has_it(
    started, tmp_path, provider_sim, redis_url
):
    """A delivery names a sink (a sink's own retry, a batch summary, a ``dlq replay``): a
    worker whose config lacks that sink leaves it to one that has it, as it does the jobs
    of a provider it lacks, instead of dead-lettering it as "no longer configured"."""
    sim = provider_sim()
    home, other = tmp_path / "deploy", tmp_path / "other"
    config = _config(home, sim.base_url, redis_url=redis_url, callbacks=True)
    config.write_text(
        config.read_text()
        .replace("  db: {", "  warehouse: {")  # a sink the built-in defaults do not have
        .replace("poll_delay_s: 0.01,", "max_jobs: 1,")
    )
    port = free_port()
    started.start(home, "serve", "serve", "--config", "nopoll.yaml", "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    other.mkdir()
    bare = other / "nopoll.yaml"  # the "forgotten --config": the built-in sinks, same Redis
    bare.write_text(f"redis_url: '{redis_url}'\n" + FAST)
    started.start(other, "bare", "worker", "--config", str(bare))

    async def bare_started():
        return "worker for nopoll:jobs" in started.output("bare")

    await wait_for(bare_started, timeout=20)
    await asyncio.sleep(1.5)  # its poll loop is turning
    keys = [f"resp_{i}" for i in range(10)]
    db = home / "nopoll-data" / "results.db"
    client = redis_asyncio.Redis.from_url(redis_url)
    try:
        for key in keys:
            job = DeliverJob.of("warehouse", [envelope(key)]).handoff(defer_s=0)
            assert await put_job(client, job, expiry_ms=120_000)

        async def all_done():  # each delivery landed, or was dead-lettered
            landed = len(_rows(db)) if db.exists() else 0
            return landed + len(await DeadLetters(client).find()) == len(keys)

        await wait_for(all_done, timeout=60, interval=0.2)
        letters = await DeadLetters(client).find()
    finally:
        await client.aclose()
    log = started.output("bare")
    assert not letters, [letter.error for letter in letters]
    assert "no longer configured" not in log, log
    assert len(_rows(db)) == len(keys)
    assert "warehouse" in log and "this worker does not have" in log, log  # said at start-up


# --- 3: waiting for callbacks says so; --poll polls at once -------------------------------


async def test_submit_wait_says_it_waits_for_callbacks_and_poll_polls_at_once(
    started, tmp_path, provider_sim, redis_url
):
    sim = provider_sim(complete_after_s=0.2)
    config = _config(tmp_path, sim.base_url, redis_url=redis_url, callbacks=True)
    port = free_port()
    started.start(tmp_path, "serve", "serve", "--config", "nopoll.yaml", "--port", str(port))
    await asyncio.to_thread(wait_ready, port)
    _requests(tmp_path / "a.jsonl", 3)
    waiting = started.start(
        tmp_path, "waiting", "submit", "--config", str(config), "sim", "a.jsonl", "--wait"
    )

    async def says_what_it_waits_for():
        return "waiting for callbacks to /webhooks/sim; polling starts in 1" in started.output(
            "waiting"
        )

    try:
        await wait_for(says_what_it_waits_for, timeout=30)
    finally:
        waiting.send_signal(signal.SIGINT)
        await asyncio.to_thread(waiting.wait, 20)
    assert "--poll" in started.output("waiting")
    # the same file with --poll: the watches it registered are polled now
    polled = await asyncio.to_thread(
        run, started.env, tmp_path, "submit", "--config", str(config), "sim", "a.jsonl",
        "--wait", "--poll",
    )  # fmt: skip
    assert polled.returncode == 0, polled.stdout + polled.stderr
    assert "3 landed, 0 expired, 0 still pending" in polled.stdout
    # and a new file with --poll, then ids handed to watch --poll
    _requests(tmp_path / "b.jsonl", 2)
    before = await _watched(redis_url)
    created = await asyncio.to_thread(
        run, started.env, tmp_path, "submit", "--config", str(config), "sim", "b.jsonl"
    )
    assert created.returncode == 0, created.stderr
    new = sorted(await _watched(redis_url) - before)
    assert len(new) == 2
    watched = await asyncio.to_thread(
        run, started.env, tmp_path, "watch", "--config", str(config), "sim", "response", *new,
        "--wait", "--poll",
    )  # fmt: skip
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "2 landed, 0 expired, 0 still pending" in watched.stdout


async def _watched(redis_url: str) -> set[str]:
    """The response ids watched for sim's default tenant."""
    client = redis_asyncio.Redis.from_url(redis_url)
    try:
        prefix = "nopoll:watch:sim:response:"
        return {k.decode()[len(prefix) :] async for k in client.scan_iter(prefix + "*")}
    finally:
        await client.aclose()


# --- 7: one clear line instead of a traceback ---------------------------------------------


def _dead_redis_config(folder: Path) -> Path:
    return _config(folder, "http://127.0.0.1:9/v1", redis_url=f"redis://127.0.0.1:{free_port()}/0")


def test_an_unreachable_redis_is_one_line_in_submit_and_watch(started, tmp_path):
    config = _dead_redis_config(tmp_path)
    _requests(tmp_path / "a.jsonl", 1)
    for args in (("submit", "sim", "a.jsonl"), ("watch", "sim", "response", "resp_1")):
        result = run(started.env, tmp_path, args[0], "--config", str(config), *args[1:])
        assert result.returncode == 1, result.stdout + result.stderr
        err = result.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert "cannot reach" in err and "127.0.0.1" in err, err


def test_a_port_in_use_on_serve_is_one_clear_line(started, tmp_path, redis_url):
    config = _config(tmp_path, "http://127.0.0.1:9/v1", redis_url=redis_url)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        result = run(started.env, tmp_path, "serve", "--config", str(config), "--port", str(port))
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "Traceback" not in out and "SystemExit" not in out, out
    assert "unreachable" not in out, out
    assert f"127.0.0.1:{port} is already in use" in out and "--port" in out, out
    assert time.monotonic() - began < 30
