"""The ``/ui`` session from the outside, against real uvicorn and Redis: the cookie is
signed with a secret of its own (never one derived from the admin tokens), log-out ends
it for every copy, it lasts eight hours from login however often it is re-issued, and a
form's CSRF field is compared safely whatever it holds.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable

import httpx
import pytest
from itsdangerous import BadSignature, TimestampSigner, URLSafeTimedSerializer
from redis.asyncio import Redis

from receiver.config.settings import Settings
from receiver.queue.deadletter import DeadLetters
from tests.dead_letters import keep_letter
from tests.servers import ValkeyProcess, running_api

ADMIN = "session-admin-token-0123456789"
SECRET = "a-session-secret-of-more-than-32-characters"
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
COOKIE = "nopoll_ui"
LIFETIME_S = 8 * 3600


@pytest.fixture
def ui_settings(make_settings, redis_url) -> Callable[..., Settings]:
    def make(**overrides) -> Settings:
        overrides.setdefault("admin_tokens", [ADMIN])
        return make_settings(redis_url=overrides.pop("redis_url", redis_url), **overrides)

    return make


def _csrf(page: httpx.Response) -> str:
    found = CSRF.search(page.text)
    assert found is not None, page.text[:300]
    return found.group(1)


async def _log_in(client: httpx.AsyncClient, token: str = ADMIN) -> str:
    """Log ``client`` in; the signed-in page's CSRF token."""
    csrf = _csrf(await client.get("/ui/login"))
    r = await client.post("/ui/login", data={"token": token, "csrf": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/ui/", r.text
    return _csrf(await client.get("/ui/"))


async def _signed_in(base: str, cookie: str) -> bool:
    async with httpx.AsyncClient(base_url=base, cookies={COOKIE: cookie}) as client:
        r = await client.get("/ui/")
    assert r.status_code in (200, 303), r.text[:300]
    return r.status_code == 200


def _serializer(secret: str) -> URLSafeTimedSerializer:
    """The server's own cookie format, under the secret the test configured."""
    from receiver.ui.session import serializer

    return serializer(secret.encode())


async def test_the_login_page_cookie_is_no_test_of_admin_token_guesses(ui_settings, redis_url):
    """Anyone gets a cookie from ``GET /ui/login``; it must not verify under any key made
    from the admin token, or it would confirm a guessed token offline."""
    async with (
        running_api(ui_settings(), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base) as client,
    ):
        assert (await client.get("/ui/login")).status_code == 200
        cookie = client.cookies[COOKIE]
    derived = hashlib.sha256(b"nopoll-ui-session\0" + ADMIN.encode()).digest()
    for key in (derived.hex(), derived, ADMIN):
        with pytest.raises(BadSignature):
            TimestampSigner(key).unsign(cookie)
        with pytest.raises(BadSignature):
            URLSafeTimedSerializer(key).loads(cookie)


async def test_deployments_sharing_an_admin_token_refuse_each_others_cookies(
    ui_settings, redis_url
):
    """Three deployments, one admin token: one keeps its generated session key in its Redis,
    one in another Redis, one has ``ui.session_secret``. Each takes its own cookie only."""
    valkey = ValkeyProcess().start()
    try:
        deployments = {
            "redis": ui_settings(),
            "other-redis": ui_settings(redis_url=valkey.url),
            "secret": ui_settings(ui={"session_secret": SECRET}),
        }
        cookies = {}
        for name, settings in deployments.items():
            url = settings.redis_url.get_secret_value()
            async with (
                running_api(settings, url) as (base, _),
                httpx.AsyncClient(base_url=base) as client,
            ):
                await _log_in(client)
                cookies[name] = client.cookies[COOKIE]
        for name, settings in deployments.items():
            url = settings.redis_url.get_secret_value()
            async with running_api(settings, url) as (base, _):
                for other, cookie in cookies.items():
                    assert await _signed_in(base, cookie) is (other == name), (name, other)
    finally:
        valkey.stop()


async def test_a_cookie_copied_before_log_out_is_refused_after_it(ui_settings, redis_url):
    redis = Redis.from_url(redis_url)
    letters = DeadLetters(redis)
    letter = await keep_letter(letters, "fetch_response")
    try:
        async with running_api(ui_settings(), redis_url) as (base, _):
            async with httpx.AsyncClient(base_url=base) as client:
                csrf = await _log_in(client)
                copied = client.cookies[COOKIE]
                r = await client.post("/ui/logout", data={"csrf": csrf})
                assert r.status_code == 303 and r.headers["location"] == "/ui/login"
            async with httpx.AsyncClient(base_url=base, cookies={COOKIE: copied}) as thief:
                r = await thief.get("/ui/")
                assert r.status_code == 303 and r.headers["location"] == "/ui/login"
                r = await thief.get("/ui/?part=1", headers={"hx-request": "true"})
                assert r.status_code == 401 and r.headers["hx-redirect"] == "/ui/login"
                r = await thief.post("/ui/deadletters/replay", data={"csrf": csrf, "scope": "all"})
                assert r.status_code == 303 and r.headers["location"] == "/ui/login"
            assert [d.id for d in await letters.find()] == [letter.id]  # not replayed
            async with httpx.AsyncClient(base_url=base) as again:  # a new login still works
                await _log_in(again)
                assert await _signed_in(base, again.cookies[COOKIE])
    finally:
        await redis.aclose()


async def test_a_session_ends_eight_hours_after_login_however_often_it_is_reissued(
    ui_settings, redis_url
):
    serializer = _serializer(SECRET)
    async with (
        running_api(ui_settings(ui={"session_secret": SECRET}), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base) as client,
    ):
        csrf = await _log_in(client)
        session = serializer.loads(client.cookies[COOKIE])
        since = session["since"]
        assert abs(since - time.time()) < 60
        # a POST changes the session (the outcome shown next): the cookie is re-issued...
        r = await client.post("/ui/deadletters/replay", data={"csrf": csrf, "scope": "all"})
        assert r.status_code == 303, r.text
        reissued = r.cookies[COOKIE]
        assert serializer.loads(reissued)["since"] == since  # ...with its login time kept
        max_age = int(re.search(r"max-age=(\d+)", r.headers["set-cookie"].lower()).group(1))
        assert max_age <= LIFETIME_S - (time.time() - since) + 1

        # freshly signed (as a re-issue would be), but logged in more than 8 hours ago
        old = serializer.dumps({**session, "since": int(time.time()) - LIFETIME_S - 5})
        assert not await _signed_in(base, old)
        recent = serializer.dumps({**session, "since": int(time.time()) - LIFETIME_S + 300})
        assert await _signed_in(base, recent)


async def test_removing_a_token_from_the_config_ends_its_sessions(ui_settings, redis_url):
    second = "second-admin-token-0123456789"
    both = ui_settings(admin_tokens=[ADMIN, second], ui={"session_secret": SECRET})
    async with (
        running_api(both, redis_url) as (base, _),
        httpx.AsyncClient(base_url=base) as client,
    ):
        await _log_in(client, second)
        cookie = client.cookies[COOKIE]
        assert await _signed_in(base, cookie)
    one = ui_settings(admin_tokens=[ADMIN], ui={"session_secret": SECRET})
    async with running_api(one, redis_url) as (base, _):
        assert not await _signed_in(base, cookie)


async def test_a_team_session_ends_when_its_token_is_removed_or_limited_to_another_tenant(
    ui_settings, redis_url
):
    team = "team-a-session-token-0123456789"

    def limited_to(*tenants: str) -> Settings:
        return ui_settings(
            ui={"session_secret": SECRET},
            tenants={"team-a": {}, "team-b": {}},
            tenant_keys=["k" * 40],
            consumer_tokens=[{"token": team, "tenant": t} for t in tenants],
        )

    async with (
        running_api(limited_to("team-a"), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base) as client,
    ):
        await _log_in(client, team)
        cookie = client.cookies[COOKIE]
        assert await _signed_in(base, cookie)
    for settings, why in ((limited_to("team-b"), "limited to team-b"), (limited_to(), "removed")):
        async with running_api(settings, redis_url) as (base, _):
            assert not await _signed_in(base, cookie), why


@pytest.mark.parametrize("csrf", ["é" * 43, "\u2028", "%FF%FE"], ids=["accents", "sep", "bad-utf8"])
async def test_a_non_ascii_csrf_value_is_403_with_a_reason_on_every_form(
    ui_settings, redis_url, csrf
):
    async with (
        running_api(ui_settings(), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base) as client,
    ):
        await client.get("/ui/login")
        body = f"token={ADMIN}&csrf={csrf}".encode()
        form = {"content-type": "application/x-www-form-urlencoded"}
        r = await client.post("/ui/login", content=body, headers=form)
        assert r.status_code == 403 and "CSRF" in r.text, r.text[:300]
        await _log_in(client)
        for path, fields in (("/ui/deadletters/replay", "scope=all&"), ("/ui/logout", "")):
            body = f"{fields}csrf={csrf}".encode()
            r = await client.post(path, content=body, headers=form)
            assert r.status_code == 403 and "CSRF" in r.text, (path, r.text[:300])
        assert (await client.get("/ui/")).status_code == 200  # still logged in
