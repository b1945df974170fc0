"""Helpers shared by the benchmarks: ports, processes, readiness, Redis db 13, configs,
CPU accounting, and driving ``wrk`` with pre-signed callbacks.

Everything here talks to 127.0.0.1 only, every wait is bounded in time and in count,
and every process is stopped by its own PID.
"""

from __future__ import annotations

import base64
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
BIN_DIR = Path(sys.executable).parent

REDIS_URL = os.environ.get("NOPOLL_BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
"""Benchmarks use Redis database 13 (flushed before each run), or the database of
``NOPOLL_BENCH_REDIS_URL`` on a shared machine; never db 0."""
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
SECRET_ENV = "NOPOLL_BENCH_SECRET"
"""The environment variable that carries the webhook secret into the servers' configs."""
PROVIDER = "bench"
WEBHOOK_PATH = f"/webhooks/{PROVIDER}"


def new_secret() -> str:
    """A fresh Standard Webhooks secret, ``whsec_<base64 of 32 random bytes>``."""
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flush_bench_db() -> None:
    """FLUSHDB on the benchmarks' Redis database (13 unless overridden; never 0)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
    try:
        assert client.connection_pool.connection_kwargs.get("db", 0) != 0
        client.flushdb()
    finally:
        client.close()


async def drop_table(table: str) -> None:
    """DROP TABLE IF EXISTS ``table`` in the benchmarks' Postgres (:data:`PG_URL`)."""
    import asyncpg

    conn = await asyncpg.connect(PG_URL)
    try:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
    finally:
        await conn.close()


def redis_db13():  # type: ignore[no-untyped-def]
    """A sync client on database 13."""
    import redis

    return redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


def start_process(
    args: list[str], *, env: dict[str, str] | None = None, log_path: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start a server process (its output goes to ``log_path``, or is discarded)."""
    out = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(
            args,
            cwd=REPO_ROOT,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    finally:
        if log_path is not None:
            out.close()  # type: ignore[union-attr]


def stop_process(proc: subprocess.Popen[bytes] | None, *, grace_s: float = 10.0) -> None:
    """SIGTERM the process by its PID, wait, then SIGKILL it if it is still there."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(5)


def wait_http(
    url: str,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    want: int = 200,
    timeout_s: float = 30.0,
    log_path: Path | None = None,
) -> None:
    """Poll ``url`` (GET) until it answers ``want``; bounded by time and attempts."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    for _ in range(int(timeout_s / 0.05) + 1):
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
            raise RuntimeError(f"server exited with {proc.returncode} before {url} was up\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == want:
                    return
                last = f"status {resp.status}"
        except urllib.error.HTTPError as exc:
            if exc.code == want:
                return
            last = f"status {exc.code}"
        except OSError as exc:
            last = type(exc).__name__
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
    raise RuntimeError(f"{url} did not answer {want} within {timeout_s:.0f}s ({last})\n{tail}")


def nopoll_config(
    path: Path,
    *,
    base_url: str,
    data_dir: Path,
    sinks_yaml: str,
    log_level: str = "warning",
    extra_yaml: str = "",
) -> Path:
    """Write a nopoll YAML config: Redis db 13, provider ``bench`` (openai dialect), the
    webhook secret taken from ``${NOPOLL_BENCH_SECRET}`` (never written to the file)."""
    path.write_text(
        f"""\
redis_url: {REDIS_URL}
data_dir: {data_dir}
log_level: {log_level}
providers:
  {PROVIDER}:
    dialect: openai
    base_url: {base_url}
    api_key: bench-key
    webhook_secrets: ["${{{SECRET_ENV}}}"]
    tolerance_s: 300
sinks:
{sinks_yaml}
{extra_yaml}""",
        encoding="utf-8",
    )
    return path


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds a local process has used so far (0.0 if unknown)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from ``/proc/stat``."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0, 0.0
    ticks = [int(f) for f in fields[:8]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def load_note(sample_s: float = 0.5) -> str:
    """The machine's load average and core count, and what else was busy on the cores
    over ``sample_s`` (the processes outside this bench's own tree above 5 % of a core),
    to judge how noisy a run was: a figure from a busy machine is never a quiet one's."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    note = f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"
    busy = busy_elsewhere(sample_s)
    others = ", ".join(f"{name} {share:.0f} %" for name, share in busy[:4]) or "nothing"
    return f"{note}; busy besides this bench: {others}"


def _cpu_ticks() -> dict[int, tuple[str, int, int]]:
    """Every process's (name, parent pid, utime + stime ticks), from /proc."""
    found: dict[int, tuple[str, int, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        name = text[text.find("(") + 1 : text.rfind(")")]
        fields = text[text.rfind(")") + 2 :].split()
        found[int(entry.name)] = (name, int(fields[1]), int(fields[11]) + int(fields[12]))
    return found


def busy_elsewhere(sample_s: float = 0.5) -> list[tuple[str, float]]:
    """The processes outside this one's tree that used more than 5 % of a core over
    ``sample_s``, busiest first, as (name, percent of one core)."""
    before = _cpu_ticks()
    time.sleep(sample_s)
    after = _cpu_ticks()
    ours = {os.getpid()}
    for _ in range(8):  # this process's descendants: the bench's own servers
        ours |= {pid for pid, (_, parent, _) in after.items() if parent in ours}
    hz = os.sysconf("SC_CLK_TCK")
    shares: dict[str, float] = {}
    for pid, (name, _, ticks) in after.items():
        if pid in ours or pid not in before:
            continue
        share = (ticks - before[pid][2]) / hz / sample_s * 100
        shares[name] = shares.get(name, 0.0) + share
    return sorted(((n, v) for n, v in shares.items() if v > 5), key=lambda x: -x[1])


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (``q`` in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), math.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


# --- wrk: pre-signed callbacks, one file per thread, walked by a generated Lua script ---

WRK_LUA = r"""
-- Generated by bench/ingest.py: each wrk thread walks its own file of pre-signed,
-- pre-formatted requests (NUL-separated), so every request is a distinct callback.
local threads = {}
local next_tid = 0

function setup(thread)
  thread:set("tid", next_tid)
  next_tid = next_tid + 1
  table.insert(threads, thread)
end

function init(args)
  local f = assert(io.open(args[1] .. "." .. tid, "rb"))
  local data = f:read("*a")
  f:close()
  reqs = {}
  local pos, count = 1, 0
  while true do
    local sep = string.find(data, "\0", pos, true)
    if not sep then break end
    count = count + 1
    reqs[count] = string.sub(data, pos, sep - 1)
    pos = sep + 1
  end
  n = count
  i = 0
  wrapped = 0
end

function request()
  i = i + 1
  if i > n then
    i = 1
    wrapped = wrapped + 1
  end
  return reqs[i]
end

function done(summary, latency, requests)
  for _, t in ipairs(threads) do
    io.write(string.format("POOL tid=%d pos=%d size=%d wrapped=%d\n",
      t:get("tid"), t:get("i"), t:get("n"), t:get("wrapped")))
  end
end
"""


@dataclass
class WrkResult:
    requests: int
    seconds: float
    rps: float
    non_2xx: int
    socket_errors: str
    p50_ms: float
    p99_ms: float
    wrapped: int
    used: list[int] = field(default_factory=list)
    raw: str = ""
    server_cpu_s: float = 0.0
    redis_cpu_s: float = 0.0

    def cpu_us_per_request(self, seconds: float) -> float:
        return seconds / self.requests * 1e6 if self.requests else float("nan")


def _ms(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value.strip())
    if not m:
        return float("nan")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[m.group(2)]
    return float(m.group(1)) * scale


def parse_wrk(out: str) -> WrkResult:
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", out)
    if not m:
        raise RuntimeError(f"cannot read wrk's output:\n{out}")
    seconds = _ms(m.group(2) + m.group(3)) / 1000
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2 = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: (.*)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    used: list[int] = []
    wrapped = 0
    for pm in re.finditer(r"POOL tid=(\d+) pos=(\d+) size=(\d+) wrapped=(\d+)", out):
        pos, size, wraps = int(pm.group(2)), int(pm.group(3)), int(pm.group(4))
        used.append(wraps * size + pos)
        wrapped += wraps
    return WrkResult(
        requests=int(m.group(1)),
        seconds=seconds,
        rps=float(rps.group(1)) if rps else float("nan"),
        non_2xx=int(non2.group(1)) if non2 else 0,
        socket_errors=sock.group(1).strip() if sock else "none",
        p50_ms=_ms(p50.group(1)) if p50 else float("nan"),
        p99_ms=_ms(p99.group(1)) if p99 else float("nan"),
        wrapped=wrapped,
        used=used,
        raw=out,
    )


def write_pool(
    prefix: Path, *, threads: int, per_thread: int, secret: str, port: int, tag: str
) -> None:
    """``per_thread`` distinct signed callbacks per wrk thread, as raw HTTP/1.1 requests."""
    from standardwebhooks.webhooks import Webhook

    webhook = Webhook(secret)
    ts = int(time.time())
    when = datetime.fromtimestamp(ts, tz=UTC)
    nonce = uuid.uuid4().hex[:10]
    head = f"POST {WEBHOOK_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    for t in range(threads):
        parts: list[bytes] = []
        for k in range(per_thread):
            uid = f"{tag}{nonce}t{t}n{k}"
            body = (
                f'{{"id":"evt_{uid}","type":"response.completed","created_at":{ts},'
                f'"data":{{"id":"resp_{uid}"}}}}'
            )
            msg_id = f"msg_{uid}"
            signature = webhook.sign(msg_id, when, body)
            parts.append(
                (
                    f"{head}webhook-id: {msg_id}\r\nwebhook-timestamp: {ts}\r\n"
                    f"webhook-signature: {signature}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n{body}\0"
                ).encode()
            )
        Path(f"{prefix}.{t}").write_bytes(b"".join(parts))


def run_wrk(
    *, port: int, script: Path, pool: Path, threads: int, connections: int, seconds: float
) -> WrkResult:
    args = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "5s",
        "--latency",
        "-s",
        str(script),
        f"http://127.0.0.1:{port}{WEBHOOK_PATH}",
        "--",
        str(pool),
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=seconds + 60)
    finally:
        stop_process(proc, grace_s=5)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}):\n{out.decode(errors='replace')}")
    return parse_wrk(out.decode(errors="replace"))
