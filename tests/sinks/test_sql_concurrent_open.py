"""Several sinks, in one process or in several, creating the same fresh SQLite file's table
at the same moment: every one opens, writes, and nothing logs an error."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sinks.registry import create_sink, validate_sink_config
from sinks.sql import SCHEMA_VERSION
from tests.sinks.helpers import envelope

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, logging, sys, time
from pathlib import Path
from nopoll.envelope import envelope_from_response
from receiver.demo.simulator import make_response
from sinks.registry import create_sink, validate_sink_config

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
db, go, i = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])

async def main():
    sink = create_sink("s", validate_sink_config("s", {"type": "sql", "url": f"sqlite:///{db}"}))
    go.with_name(f"{go.name}.ready{i}").touch()  # imported, sink made: waiting for go
    deadline = time.monotonic() + 30
    while not go.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    await sink.open()
    body = make_response(f"resp_p{i}", text="x")
    env = envelope_from_response(body, provider="sim", received_at="2026-01-01T00:00:00Z")
    await sink.write([env])
    await sink.aclose()

asyncio.run(main())
"""


def rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM nopoll_schema").fetchall() == [(SCHEMA_VERSION,)]
        return int(conn.execute("SELECT count(*) FROM nopoll_results").fetchone()[0])


async def test_sinks_in_one_process_open_a_fresh_file_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    for round_ in range(8):
        db = tmp_path / f"r{round_}" / "results.db"
        sinks = [
            create_sink("s", validate_sink_config("s", {"type": "sql", "url": f"sqlite:///{db}"}))
            for _ in range(6)
        ]
        try:
            await asyncio.gather(*(s.open() for s in sinks))
            await asyncio.gather(*(s.write([envelope(i)]) for i, s in enumerate(sinks)))
        finally:
            for s in sinks:
                await s.aclose()
        assert rows(db) == 6
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_processes_open_a_fresh_file_at_once(tmp_path: Path) -> None:
    for round_ in range(3):
        db = tmp_path / f"r{round_}" / "results.db"
        go = tmp_path / f"go{round_}"
        children = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(db), str(go), str(i)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(4)
        ]
        try:
            ready = [go.with_name(f"{go.name}.ready{i}") for i in range(len(children))]
            deadline = time.monotonic() + 30
            while not all(r.exists() for r in ready) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert all(r.exists() for r in ready), "a child never got ready"
            go.touch()
            results = [c.communicate(timeout=60) for c in children]
        finally:
            for c in children:
                if c.poll() is None:
                    c.kill()
                    c.wait(5)
        for c, (_, err) in zip(children, results, strict=True):
            assert c.returncode == 0, err
            assert err == "", err
        assert rows(db) == 4
