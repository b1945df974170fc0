"""Helpers shared by the benchmarks: ports, processes, readiness, Redis db 13, configs.

Everything here talks to 127.0.0.1 only, every wait is bounded in time and in count,
and every process is stopped by its own PID.
"""

from __future__ import annotations

import base64
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
BIN_DIR = Path(sys.executable).parent

REDIS_URL = "redis://127.0.0.1:6379/13"
"""Benchmarks use Redis database 13 only (flushed before each run); never db 0."""
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
SECRET_ENV = "NOPOLL_BENCH_SECRET"
"""The environment variable that carries the webhook secret into the servers' configs."""
PROVIDER = "bench"


def new_secret() -> str:
    """A fresh Standard Webhooks secret, ``whsec_<base64 of 32 random bytes>``."""
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flush_bench_db() -> None:
    """FLUSHDB on Redis database 13 (and nothing else)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
    try:
        assert client.connection_pool.connection_kwargs.get("db") == 13
        client.flushdb()
    finally:
        client.close()


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
""",
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


def load_note() -> str:
    """The machine's load average and core count, to judge how noisy a run was."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (``q`` in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), math.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]
