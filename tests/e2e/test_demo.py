"""``nopoll demo`` as a new user runs it: what it says, what it keeps, and that a kept
folder works with every command with no environment at all."""

from __future__ import annotations

import os
import re
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NOPOLL = str(Path(sys.executable).parent / "nopoll")


def _bare_env(**extra: str) -> dict[str, str]:
    """Only what any shell has: no DEMO_*, SIM_* or NOPOLL_* variable."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "COLUMNS": "200", **extra}


def _run(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NOPOLL, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_kept_demo_folder_works_with_every_command_and_no_environment(tmp_path):
    folder = tmp_path / "D"
    demo = _run(
        "demo", "--n", "30", "--keep", "--data-dir", str(folder), env=_bare_env(), timeout=180
    )
    out = demo.stdout
    assert demo.returncode == 0, out + demo.stderr
    assert "30/30" in out
    assert "30 callbacks accepted (202), 3 duplicates answered 200" in out
    assert "{" not in out  # the answers in words, no raw {202: 30} dict
    assert f"kept {folder}" in out and "mode 0600" in out
    config = folder / "nopoll.yaml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert f"nopoll dlq list --config {config}" in out
    with sqlite3.connect(folder / "results.db") as conn:
        assert conn.execute("SELECT count(*) FROM nopoll_results").fetchone() == (30,)

    dlq = _run("dlq", "list", "--config", str(config), env=_bare_env())
    assert dlq.returncode == 0, dlq.stdout + dlq.stderr
    assert "no dead letters" in dlq.stdout
    check = _run("config", "check", "--config", str(config), env=_bare_env())
    assert check.returncode == 0, check.stdout + check.stderr
    assert "provider sim: dialect openai" in check.stdout
    assert "whsec_" not in dlq.stdout + dlq.stderr + check.stdout + check.stderr


def test_demo_without_keep_says_its_folder_is_removed_and_removes_it(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    demo = _run("demo", "--n", "5", env=_bare_env(TMPDIR=str(temp)), timeout=180)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    said = re.search(r"the demo folder (\S+) is removed; use --keep \(or --data-dir", demo.stdout)
    assert said, demo.stdout
    assert Path(said.group(1)).parent == temp
    assert not Path(said.group(1)).exists()
    assert list(temp.iterdir()) == []
