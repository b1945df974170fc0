"""Secrets inside sink URLs (a password, ``?token=``/``?sig=``/``?code=``, a secret path
segment) never show: not in the start-up log of a real ``nopoll serve``, not in
``nopoll config check --redacted``, not on ``/readyz``, not in a dead letter's error,
even when the subscriber echoes them back."""

from __future__ import annotations

import asyncio
import base64
import secrets

import httpx
from redis.asyncio import Redis

from receiver.queue.deadletter import DeadLetters
from tests.e2e.helpers import NOPOLL, await_ready, wait_for, write_config
from tests.servers import free_port
from tests.subscriber import Subscriber


async def test_secrets_in_sink_urls_never_show(
    procs, tmp_path, provider_sim, redis_url, pg_table, signed_callback
):
    token, sig, code = (f"{p}{secrets.token_hex(6)}" for p in ("T1", "S2", "C3"))
    segment, password = "SECRETSEG" + secrets.token_hex(4), "pw" + secrets.token_hex(6)
    hidden = [token, sig, code, segment, password]
    hook_secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    echo = f"refused token={token}&sig={sig} for /abc/{segment}".encode()
    subscriber = await Subscriber(hook_secret, status=400, answer=echo).start()
    sim = provider_sim()
    sim.add_response("resp_secret_urls")
    hook = f"http://127.0.0.1:{subscriber.port}/abc/{segment}?token={token}&sig={sig}&code={code}"
    sinks = (
        f"  hook: {{type: http, url: '{hook}', secret: '${{HOOK_SECRET}}'}}\n"
        f"  warehouse: {{type: sql, url: '${{DB_URL}}', table: {pg_table}}}\n"
        "  archive: {type: s3, bucket: nopoll-archive, access_key_id: '${AWS_KEY}',"
        f" secret_access_key: '${{AWS_SECRET}}', endpoint_url: 'http://127.0.0.1:{free_port()}"
        f"/{segment}?X-Token={token}'}}\n"
    )
    config = write_config(tmp_path, sim.base_url, redis_url=redis_url, sinks=sinks)
    procs.env.update(
        HOOK_SECRET=hook_secret,
        DB_URL=f"postgresql://postgres:{password}@127.0.0.1:5432/test",
        AWS_KEY="AKIATEST",
        AWS_SECRET="s3-" + secrets.token_hex(8),
    )
    port = free_port()
    try:
        procs.start("serve", "--config", str(config), "--port", str(port))
        await await_ready(port)
        body, headers = signed_callback("resp_secret_urls")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            r = await client.post("/webhooks/sim", content=body, headers=headers)
            assert r.status_code == 202, r.text

            async def readyz_with_failing_archive() -> dict | None:
                sinks = (await client.get("/readyz")).json().get("sinks") or {}
                return sinks if str(sinks.get("archive", "")).startswith("failing") else None

            readyz = await wait_for(readyz_with_failing_archive, timeout=30, interval=0.3)
        redis = Redis.from_url(redis_url)
        try:
            letters = await wait_for(lambda: DeadLetters(redis).find(sink="hook"), timeout=30)
        finally:
            await redis.aclose()
    finally:
        await subscriber.stop()
    check = await asyncio.create_subprocess_exec(
        str(NOPOLL),
        "config",
        "check",
        "--redacted",
        "--config",
        str(config),
        env=procs.env,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(check.communicate(), 60)
    assert check.returncode == 0
    redacted = out.decode()
    logs = procs.logs()

    for name, text in [
        ("start-up log", logs),
        ("config check --redacted", redacted),
        ("/readyz", str(readyz)),
        ("dead letter", letters[0].error),
    ]:
        for secret in hidden:
            assert secret not in text, (name, secret, text[-3000:])
    assert f"sink hook: http -> http://127.0.0.1:{subscriber.port}" in logs  # where, at least
    assert 'sink warehouse: sql -> postgresql+asyncpg://127.0.0.1:5432"' in logs
    assert "HTTP 400" in letters[0].error and "refused token=***" in letters[0].error
    assert "?token=***&sig=***&code=***" in redacted
