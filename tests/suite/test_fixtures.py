"""The suite's own hygiene: what its fixtures leave behind on the shared test servers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parents[2]

_INNER = """
import os

import asyncpg


async def test_makes_a_table(pg_url, pg_table):
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f'CREATE TABLE "{pg_table}" (x int)')
    finally:
        await conn.close()
    with open(os.environ["TABLE_NAME_FILE"], "w") as f:
        f.write(pg_table)
"""


def test_pg_table_is_dropped_after_the_test(tmp_path: Path, pg_url: str) -> None:
    (tmp_path / "test_inner.py").write_text(_INNER)
    name_file = tmp_path / "table-name"
    env = {**os.environ, "TABLE_NAME_FILE": str(name_file), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p"),
            *("no:cacheprovider", "-o", "asyncio_mode=auto", "--rootdir", str(tmp_path)),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    name = name_file.read_text()
    assert name.startswith("t_")

    async def exists() -> bool:
        conn = await asyncpg.connect(pg_url)
        try:
            return await conn.fetchval("SELECT to_regclass($1)", name) is not None
        finally:
            await conn.close()

    assert not asyncio.run(exists()), f"table {name} was left in the test database"
