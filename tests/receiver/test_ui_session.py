"""The ``/ui`` session from the outside, against real uvicorn and Redis: a form's CSRF
field is compared safely whatever it holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest

from receiver.config import Settings
from tests.servers import running_api

ADMIN = "session-admin-token-0123456789"
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


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
