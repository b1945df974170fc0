"""A real S3 API for the tests: moto in server mode, in its own process on 127.0.0.1.

``s3_server`` (session) starts ``python -m moto.server`` on a free port and stops it by
PID; ``s3_endpoint`` (per test) sets fake AWS credentials in the environment (after
conftest's ``clean_environ`` has cleared the developer's) and yields the endpoint URL.
Without moto installed the tests skip, or fail in CI (``missing()``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import free_port, missing, port_open

__all__ = ["FAKE_CREDENTIALS", "MotoServer", "s3_endpoint", "s3_server"]

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing-access-key",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
    # never ask the EC2 metadata address for credentials: tests stay on loopback
    "AWS_EC2_METADATA_DISABLED": "true",
}


# moto's server as ``python -m moto.server`` runs it, but answering one request at a
# time: moto checks a conditional PUT's If-Match / If-None-Match and then writes, in two
# steps, so two concurrent conditional PUTs of one key can both succeed. S3 makes them
# atomic, and tansu's S3 storage relies on that for its offsets.
_SERIAL_MOTO = """
import os, sys, threading
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app)
host, port = sys.argv[1], int(sys.argv[2])
os.environ["MOTO_PORT"] = str(port)
app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()
def serial(environ, start_response):
    with lock:
        return list(app(environ, start_response))
run_simple(host, port, serial, threaded=True, request_handler=MotoRequestHandler)
"""


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 and a free port; ``serial=True`` answers
    one request at a time, so conditional writes are atomic as in S3."""

    def __init__(self, port: int | None = None, *, serial: bool = False) -> None:
        self.port = port or free_port()
        self.serial = serial
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open while it runs
            prefix="nopoll-test-moto-", suffix=".log", delete=False
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> MotoServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(FAKE_CREDENTIALS)
        if self.serial:
            command = [sys.executable, "-c", _SERIAL_MOTO, "127.0.0.1", str(self.port)]
        else:
            command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            if port_open("127.0.0.1", self.port) and self._answers():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not start: {self.log_tail()}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def log_tail(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    """A moto S3 server for the whole session."""
    if importlib.util.find_spec("moto") is None:
        missing("moto is not installed (pip install 'nopoll[test]')")
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_endpoint(
    s3_server: MotoServer, clean_environ: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> str:
    """The moto endpoint URL, with fake credentials set for this test only."""
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    # no ~/.aws files of the developer's either
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    return s3_server.url
