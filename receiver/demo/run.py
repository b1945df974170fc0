"""``nopoll demo``: the whole product on one machine, no config, no environment.

Starts the provider simulator and ``nopoll serve`` (embedded Redis, SQLite and JSONL
sinks), completes N background responses with signed callbacks (a few sent twice), waits
for every row in SQLite, prints rows, duplicates, requests per result and latency, and
exits non-zero when a result is missing. The demo folder is removed unless ``--keep`` or
``--data-dir``; its ``nopoll.yaml`` (mode 0600) holds the webhook secret, so a kept folder
works with every command.

See README.md (the demo).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from receiver.demo.simulator import ProviderSimulator, send_callback

__all__ = ["run_demo"]

_DUPLICATE_EVERY = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _answers_in_words(first: Counter[int], again: Counter[int]) -> str:
    """``200 callbacks accepted (202), 20 duplicates answered 200``, and anything else."""
    parts = [f"{first.pop(202, 0)} callbacks accepted (202)"]
    parts += [f"{n} answered {code}" for code, n in sorted(first.items())]
    parts.append(f"{again.pop(200, 0)} duplicates answered 200 (none fetched again)")
    parts += [f"{n} duplicates answered {code}" for code, n in sorted(again.items())]
    return ", ".join(parts)


def _write_config(root: Path, base_url: str, secret: str) -> Path:
    """The demo's config, usable as it is by every command: the secret is in the file
    (mode 0600, created so from the start) rather than in a variable nobody will set."""
    config = root / "nopoll.yaml"
    text = (
        "# Written by `nopoll demo`. The webhook secret is in this file (mode 0600) so this\n"
        "# folder works with every command without environment variables; the provider\n"
        "# simulator at base_url stopped with the demo.\n"
        f"data_dir: {json.dumps(str(root))}\n"
        "providers:\n"
        "  sim:\n"
        "    dialect: openai\n"
        f"    base_url: {json.dumps(base_url)}\n"
        f"    webhook_secrets: [{json.dumps(secret)}]\n"
    )
    config.unlink(missing_ok=True)
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return config


def _landed(db: Path) -> dict[str, float]:
    """Keys visible in SQLite now, with the time they were first seen."""
    if not db.exists():
        return {}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            rows = conn.execute("SELECT key FROM nopoll_results WHERE provider = 'sim'").fetchall()
    except sqlite3.Error:
        return {}
    now = time.monotonic()
    return {r[0]: now for r in rows}


def _add_responses(sim: ProviderSimulator, n: int) -> list[str]:
    """N finished responses at the simulator (every 17th incomplete but usable)."""
    ids = [f"resp_demo_{i:06d}" for i in range(n)]
    for i, rid in enumerate(ids):
        if i % 17 == 5:
            sim.add_response(
                rid, status="incomplete", incomplete_reason="max_output_tokens", text="positiv"
            )
        else:
            sim.add_response(rid, text="positive" if i % 2 else "negative")
    return ids


@dataclass
class _Tally:
    """What the demo saw: when each callback went and each row landed, and the answers."""

    sent_at: dict[str, float] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    again_statuses: Counter[int] = field(default_factory=Counter)


async def _send_and_watch(
    ids: list[str], url: str, secret: str, db: Path, console: Console, tally: _Tally
) -> None:
    """Send every callback (every tenth twice, as a provider's retry) while a progress bar
    follows the rows landing in SQLite; bounded by a deadline."""
    n = len(ids)
    sem = asyncio.Semaphore(32)

    async with httpx.AsyncClient(timeout=10) as client:

        async def one(i: int, rid: str) -> None:
            async with sem:
                msg_id = f"msg_demo_{i:06d}"
                tally.sent_at[rid] = time.monotonic()
                r = await send_callback(client, url, secret, rid, msg_id=msg_id)
                tally.statuses[r.status_code] += 1
                if i % _DUPLICATE_EVERY == 0:  # the provider retries: same webhook-id again
                    again = await send_callback(client, url, secret, rid, msg_id=msg_id)
                    tally.again_statuses[again.status_code] += 1

        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            sending = progress.add_task("callbacks sent", total=n)
            landing = progress.add_task("rows landed  ", total=n)
            tasks = [asyncio.create_task(one(i, rid)) for i, rid in enumerate(ids)]
            deadline = time.monotonic() + 60 + n / 20
            while time.monotonic() < deadline:
                progress.update(sending, completed=sum(1 for t in tasks if t.done()))
                for key, when in (await asyncio.to_thread(_landed, db)).items():
                    tally.seen.setdefault(key, when)
                progress.update(landing, completed=len(tally.seen))
                if len(tally.seen) >= n and all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.02)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _report(
    ids: list[str], tally: _Tally, provider_requests: int, db: Path, console: Console
) -> int:
    """Print rows landed, the answers, provider requests per result and the latency; the
    exit status (1 when a result is missing)."""
    seen, sent_at = tally.seen, tally.sent_at
    latencies = [(seen[k] - sent_at[k]) * 1000 for k in ids if k in seen and k in sent_at]
    missing = [k for k in ids if k not in seen]
    console.print()
    console.print(
        f"[bold]rows landed[/]        {len(seen)}/{len(ids)} in SQLite ({escape(str(db))})",
        soft_wrap=True,
    )
    answers = _answers_in_words(tally.statuses, tally.again_statuses)
    console.print(f"[bold]callback answers[/]   {answers}", soft_wrap=True)
    console.print(
        f"[bold]provider requests[/]  {provider_requests / max(1, len(seen)):.2f} per result"
    )
    console.print(
        f"[bold]callback → row[/]     p50 {_percentile(latencies, 0.5):.0f} ms, "
        f"p99 {_percentile(latencies, 0.99):.0f} ms (as polled every 20 ms)"
    )
    if missing:
        console.print(f"[red]missing {len(missing)} results, e.g. {missing[:5]}[/]")
        return 1
    console.print("[green]every result landed exactly once[/]")
    return 0


async def _drive(
    n: int, url: str, secret: str, sim: ProviderSimulator, db: Path, console: Console
) -> int:
    ids = _add_responses(sim, n)
    tally = _Tally()
    await _send_and_watch(ids, url, secret, db, console, tally)
    return _report(ids, tally, sim.request_count("/v1/responses/"), db, console)


def _start_serve(config: Path, port: int, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """``nopoll serve`` on the demo's config, as a child process logging to ``log``."""
    env = dict(os.environ)
    env.pop("NOPOLL_CONFIG", None)
    command = [sys.executable, "-m", "receiver", "serve", "--config", str(config)]
    return subprocess.Popen(
        [*command, "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


def _wait_ready(process: subprocess.Popen[bytes], base: str, limit_s: float = 30) -> bool:
    """True once ``/readyz`` answers 200; False if the process ended or time ran out."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM (a clean shutdown), then SIGKILL after 30 s."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(30)
        return
    process.kill()
    process.wait(5)


def _leave_folder(console: Console, root: Path, config: Path, kept: bool, failed: bool) -> None:
    """Keep the demo folder (asked for, or a failed run: nopoll.log says why) or remove it."""
    if kept:
        _say_kept(console, root, config)
    elif failed:
        console.print(
            f"the demo failed; its folder {escape(str(root))} is kept for nopoll.log",
            soft_wrap=True,
        )
    else:
        shutil.rmtree(root, ignore_errors=True)
        console.print(
            f"the demo folder {escape(str(root))} is removed; "
            "use --keep (or --data-dir DIR) to keep it",
            soft_wrap=True,
        )


def run_demo(n: int = 200, data_dir: str | None = None, keep: bool = False) -> int:
    """Run the demo; returns the process exit code."""
    console = Console()
    if n < 1:
        console.print("[red]--n must be at least 1[/]")
        return 2
    root = Path(data_dir).resolve() if data_dir else Path(tempfile.mkdtemp(prefix="nopoll-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    port = _free_port()
    process: subprocess.Popen[bytes] | None = None
    with ProviderSimulator() as sim:
        config = _write_config(root, sim.base_url, secret)
        log = (root / "nopoll.log").open("wb")
        console.print(
            f"[bold]nopoll demo[/]: {n} background responses, data in {escape(str(root))}",
            soft_wrap=True,
        )
        outcome: int | None = None
        try:
            process = _start_serve(config, port, log)
            base = f"http://127.0.0.1:{port}"
            if not _wait_ready(process, base):
                where = escape(str(root / "nopoll.log"))
                console.print(f"[red]nopoll did not become ready; see {where}[/]", soft_wrap=True)
                outcome = 1
            else:
                outcome = asyncio.run(
                    _drive(n, f"{base}/webhooks/sim", secret, sim, root / "results.db", console)
                )
        finally:
            _stop(process)
            log.close()
            _leave_folder(console, root, config, keep or data_dir is not None, bool(outcome))
    return outcome


def _say_kept(console: Console, root: Path, config: Path) -> None:
    """What a kept demo folder holds and the exact commands that use it."""
    db = root / "results.db"
    console.print(f"[bold]kept[/] {escape(str(root))}:", soft_wrap=True)
    for name, what in (
        ("nopoll.yaml", "the config, with the demo's webhook secret in it (file mode 0600)"),
        ("results.db", "the SQLite sink"),
        ("results/", "the JSONL sink"),
        ("redis/", "the embedded Redis data"),
        ("nopoll.log", "the log of nopoll serve"),
    ):
        console.print(f"  {name:12} {what}")
    console.print("use it with any command, no environment needed:")
    for command in (
        f"nopoll dlq list --config {shlex.quote(str(config))}",
        f"nopoll config check --config {shlex.quote(str(config))}",
        f"sqlite3 {shlex.quote(str(db))} "
        '"SELECT key, status, output_text FROM nopoll_results LIMIT 5"',
    ):
        console.print(f"  {escape(command)}", soft_wrap=True, highlight=False)
