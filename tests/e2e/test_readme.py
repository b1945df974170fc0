"""The README as a new user follows it: its commands run as written, its code runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from pathlib import Path

from tests.e2e.helpers import post, wait_for, worker_started
from tests.servers import running_api, running_worker

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[tuple[int, str]]:
    """(offset in the README, text) of every fenced block in ``language``."""
    return [
        (m.start(), m.group(1))
        for m in re.finditer(rf"^```{language}\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)
    ]


def test_a_bare_nopoll_command_comes_after_saying_to_activate_the_venv():
    """The install line puts nopoll into .venv; a shell block that runs a bare ``nopoll``
    works only in a shell where that venv is active, so the README says so first."""
    activate = README.find("source .venv/bin/activate")
    bare = [
        (at, line)
        for at, block in _blocks("bash")
        for line in block.splitlines()
        if re.match(r"^nopoll\b", line)
    ]
    assert bare, "the README runs no bare nopoll command any more: drop this test"
    assert activate != -1, "the README never says to activate .venv"
    early = [line for at, line in bare if at < activate]
    assert not early, f"run before the README says to activate .venv: {early}"


async def test_the_client_snippet_runs_as_written_and_stops_cleanly(
    make_settings, redis_url, provider_sim, signed_callback, tmp_path
):
    """The README's Python snippet, saved as a file and run with ``python``: it waits for
    one result, prints three streamed ones and breaks out of the stream, exiting 0 with
    nothing on stderr (breaking out once printed ``RuntimeError: aclose(): asynchronous
    generator is already running``). Only the provider and id it waits for are ours."""
    [snippet] = [text for _, text in _blocks("python") if "nopoll.client" in text]
    assert 'results.wait("openai", "resp_68af1c2d"' in snippet
    script = tmp_path / "snippet.py"
    script.write_text(snippet.replace('"openai", "resp_68af1c2d"', '"sim", "resp_readme"'))
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    sim.add_response("resp_readme", text="the awaited one")
    token = "consumer-token-readme-0123456789"
    settings = make_settings(sim.base_url, redis_url=redis_url, consumer_tokens=[{"token": token}])
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        await wait_for(lambda: worker_started(redis_url))
        body, headers = signed_callback("resp_readme")
        assert (await post(base, body, headers)).status_code == 202
        env = {**os.environ, "NOPOLL_URL": base, "NOPOLL_TOKEN": token}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            for i in range(100):  # results keep landing until the snippet has seen three
                if proc.returncode is not None:
                    break
                sim.add_response(f"resp_more_{i}")
                body, headers = signed_callback(f"resp_more_{i}")
                assert (await post(base, body, headers)).status_code == 202
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 0.3)
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, out.decode() + err.decode()
    assert err.decode() == ""
    lines = out.decode().splitlines()
    assert lines[0] == "completed"
    assert len(lines) == 4 and all(line.startswith("resp_more_") for line in lines[1:]), lines
