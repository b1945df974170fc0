"""``nopoll results get|tail`` against a running ``nopoll serve`` with a consumer token:
the installed command, as a user runs it."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess

import pytest

from tests.e2e.helpers import NOPOLL, await_ready, post, wait_for, write_config
from tests.servers import free_port

pytestmark = pytest.mark.slow

TOKEN = "consumer-token-cli-0123456789"


@pytest.fixture
async def served(procs, tmp_path, provider_sim, redis_url):
    sim = provider_sim()
    config = write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        extra="consumer_tokens: [{token: '${CONSUMER_TOKEN}'}]\n",
    )
    procs.env = {**procs.env, "CONSUMER_TOKEN": TOKEN}
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    return sim, f"http://127.0.0.1:{port}"


def _results(env, *args):
    return subprocess.run(
        [str(NOPOLL), "results", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


async def test_get_prints_a_landed_result_and_says_when_it_has_not(served, procs, signed_callback):
    sim, base = served
    sim.add_response("resp_cli", text="hello from the cli")
    env = {**procs.env, "NOPOLL_TOKEN": TOKEN}
    body, headers = signed_callback("resp_cli")
    assert (await post(base, body, headers)).status_code == 202
    got = await asyncio.to_thread(
        _results, env, "get", "sim", "resp_cli", "--url", base, "--wait", "20"
    )
    assert got.returncode == 0, got.stdout + got.stderr
    envelope = json.loads(got.stdout)
    assert (envelope["key"], envelope["status"]) == ("resp_cli", "completed")
    assert envelope["output_text"] == "hello from the cli"

    missing = await asyncio.to_thread(_results, env, "get", "sim", "resp_nope", "--url", base)
    assert missing.returncode == 1
    assert "sim/resp_nope has not landed" in missing.stderr

    wrong = await asyncio.to_thread(
        _results, procs.env, "get", "sim", "resp_cli", "--url", base, "--token", "x" * 30
    )
    assert wrong.returncode == 2 and "401" in wrong.stderr, wrong.stderr
    assert "x" * 30 not in wrong.stderr

    no_token = await asyncio.to_thread(_results, procs.env, "get", "sim", "resp_cli")
    assert no_token.returncode == 2 and "NOPOLL_TOKEN" in no_token.stderr


async def test_tail_follows_the_stream_until_ctrl_c_and_stops_cleanly(
    served, procs, signed_callback, tmp_path
):
    sim, base = served
    out = tmp_path / "tail.out"
    err = tmp_path / "tail.err"
    env = {**procs.env, "NOPOLL_TOKEN": TOKEN, "NOPOLL_URL": base}
    with out.open("wb") as o, err.open("wb") as e:
        tail = subprocess.Popen(  # noqa: ASYNC220 - started once, stopped by its PID below
            [str(NOPOLL), "results", "tail", "--provider", "sim", "--kind", "response"],
            env=env,
            stdout=o,
            stderr=e,
            stdin=subprocess.DEVNULL,
        )
    try:
        landed = 0

        async def shown():
            nonlocal landed
            sim.add_response(f"resp_tail_{landed}", text=f"tail {landed}")
            body, headers = signed_callback(f"resp_tail_{landed}")
            assert (await post(base, body, headers)).status_code == 202
            landed += 1
            return "resp_tail_" in out.read_text()

        await wait_for(shown, timeout=30, interval=0.3)
        tail.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(tail.wait, 20)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait(10)
    lines = out.read_text().splitlines()
    assert (
        lines
        and lines[0].startswith("sim/resp_tail_")
        and " response completed tail " in (lines[0])
    ), lines
    assert code == 130
    assert "Traceback" not in err.read_text() and "stopped after" in err.read_text()

    # --limit bounds it; --from-start reads what is kept from the oldest on
    bounded = await asyncio.to_thread(
        _results, env, "tail", "--from-start", "--limit", "2", "--json"
    )
    assert bounded.returncode == 0, bounded.stderr
    keys = [json.loads(line)["key"] for line in bounded.stdout.splitlines()]
    assert keys == ["resp_tail_0", "resp_tail_1"]
