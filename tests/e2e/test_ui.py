"""The status page in a real browser: Playwright drives Debian's chromium against a real
``nopoll serve`` (API and worker), the provider simulator and Postgres.

Screenshots go to ``$NOPOLL_UI_SCREENSHOTS`` when it is set (``docs/ui/`` is made that
way), else into the test's own temporary folder.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from receiver.batches.progress import BatchState
from receiver.config.accounts import scoped
from receiver.queue.deadletter import DeadLetters
from receiver.queue.enqueue import FETCH_RESPONSE, JOBS_QUEUE
from receiver.watches.store import WatchStore
from tests.dead_letters import keep_letter
from tests.e2e.helpers import CSRF, await_ready, logged_in_as, pg_rows, wait_for, write_config
from tests.servers import free_port, running_api

pytestmark = pytest.mark.slow

ADMIN = "ui-admin-token-0123456789abcdef"
TEAM_A = "team-a-consumer-token-0123456789"
TEAM_B = "team-b-consumer-token-0123456789"
PHONE = {"width": 390, "height": 844}
HEADER_MAX_PX = 56
"""The header on a phone: one line of links and a button (three lines were ~130 px)."""


@pytest.fixture
async def ui_stack(procs, tmp_path, provider_sim, redis_url, pg_url, pg_table):
    """(simulator, base URL): ``nopoll serve`` with a valar provider ``sim`` (4 requests
    at a time), a Postgres sink, 100-row chunks and an admin token."""
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    config = write_config(
        tmp_path,
        sim.base_url,
        redis_url=redis_url,
        sinks=f"  db: {{type: sql, url: '{pg_url}', table: {pg_table}}}\n",
        extra=f"batch: {{chunk_size: 100}}\nadmin_tokens: ['{ADMIN}']\n",
    )
    # the simulator has no request limit (valar's default budget would be 1/s)
    text = config.read_text().replace(
        "    dialect: openai\n", "    dialect: valar\n    rate_limit_rps: null\n"
    )
    text = text.replace(
        "    base_url:",
        "    max_concurrency: 4\n    api_key: sk-test-not-a-real-key\n    base_url:",
    )
    config.write_text(text)
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    return sim, f"http://127.0.0.1:{port}"


async def _post_callback(base: str, signed_callback, object_id: str, event_type: str) -> None:
    body, headers = signed_callback(object_id, event_type=event_type)
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{base}/webhooks/sim", content=body, headers=headers)
    assert r.status_code == 202, r.text


def _number(text: str) -> int:
    return int(text.replace(",", "").strip())


async def _fits_a_phone(page, what: str) -> None:
    """The page at 390 px: a header of one line, and nothing wider than the screen."""
    header = await page.locator("header.top").bounding_box()
    assert header is not None and header["height"] <= HEADER_MAX_PX, (what, header)
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], (what, width)


async def test_log_in_watch_a_batch_rise_replay_a_dead_letter_and_log_out(
    browser, ui_stack, signed_callback, pg_url, pg_table, shots
):
    sim, base = ui_stack
    page = await browser.new_page(viewport={"width": 1280, "height": 900})

    await page.goto(f"{base}/ui/")
    assert page.url == f"{base}/ui/login"  # not logged in: sent to the login page
    await page.screenshot(path=shots / "login.png")
    await page.get_by_label("Admin token").fill("not-the-admin-token-000000")
    await page.get_by_role("button", name="Log in").click()
    await page.get_by_text("That is not an admin token.").wait_for()
    assert page.url == f"{base}/ui/login"
    await page.get_by_label("Admin token").fill(ADMIN)
    await page.get_by_role("button", name="Log in").click()
    await page.wait_for_url(f"{base}/ui/")

    # A batch's progress rises on the page while it runs, without a reload (htmx).
    sim.add_batch("valar", "batch_ui", 1000, row_delay_s=0.02)
    await _post_callback(base, signed_callback, "batch_ui", "batch.completed")
    await page.get_by_role("link", name="Batches").click()
    counter = page.get_by_test_id("rows-batch_ui-db")
    await counter.wait_for(timeout=30_000)
    first = _number(await counter.inner_text())
    risen = first
    for _ in range(60):  # up to 15 s, the page refreshing itself every 2 s
        await asyncio.sleep(0.25)
        if await counter.count() == 0:
            break  # finished meanwhile
        risen = _number(await counter.inner_text())
        if risen > first:
            break
    assert risen > first, f"the rows written stayed at {first}"
    await page.screenshot(path=shots / "batches.png", full_page=True)
    finished = page.locator("section", has_text="Finished").locator("tr[data-batch=batch_ui]")
    await finished.wait_for(timeout=60_000)
    assert "1,000" in await finished.inner_text()

    # A fetch that failed for good is a dead letter; replayed from the page, its row lands.
    await _post_callback(base, signed_callback, "resp_gone", "response.completed")
    await page.get_by_role("link", name="Dead letters").click()
    letter = page.locator("tr[data-letter]", has_text="resp_gone")
    for _ in range(40):
        if await letter.count():
            break
        await asyncio.sleep(0.5)
        await page.reload()
    await letter.wait_for(timeout=1_000)
    said = letter.get_by_test_id("provider-said")  # the provider's own reason, in full
    assert "no such response" in await said.inner_text()
    assert await said.is_visible()
    await page.screenshot(path=shots / "deadletters.png", full_page=True)
    sim.add_response("resp_gone")  # the provider has it now
    await letter.get_by_role("button", name=re.compile("Replay dead letter")).click()
    outcome = page.get_by_test_id("outcome")
    await outcome.wait_for()
    assert "Replayed 1" in await outcome.inner_text()

    async def landed():
        rows = await pg_rows(pg_url, pg_table)
        return [r for r in rows if r["key"] == "resp_gone"] or None

    [row] = await wait_for(landed, timeout=30)
    assert row["status"] == "completed"
    await page.reload()
    await page.get_by_text("Nothing failed for good").wait_for()

    # The overview counts what happened (every process adds its counts every 5 s).
    await page.get_by_role("link", name="Overview").click()
    # (each process adds its counts on its own beat: wait for both charts, not the first)
    for _ in range(40):
        label = await page.locator("svg.chart").first.get_attribute("aria-label") or ""
        results = await page.locator("svg.chart").nth(1).get_attribute("aria-label") or ""
        if "2 in all" in label and "1,002 in all" in results:
            break
        await asyncio.sleep(0.5)
        await page.reload()
    assert "2 in all" in label, label
    assert "1,002 in all" in results, results  # 1,000 rows, summary, response
    assert await page.get_by_test_id("dead-letters").inner_text() == "0"
    await page.screenshot(path=shots / "overview.png", full_page=True)
    phone = await browser.new_page(viewport=PHONE)
    await phone.context.add_cookies(await page.context.cookies())
    for path in ("batches", "deadletters", ""):
        await phone.goto(f"{base}/ui/{path}")
        await _fits_a_phone(phone, path or "overview")
    await phone.screenshot(path=shots / "overview-phone.png", full_page=True)

    # A batch that takes a second or two says so (it read "0 s": whole seconds, rounded).
    sim.add_batch("valar", "batch_quick", 240, row_delay_s=0.02)
    await _post_callback(base, signed_callback, "batch_quick", "batch.completed")
    await page.get_by_role("link", name="Batches").click()
    quick = page.locator("section", has_text="Finished").locator("tr[data-batch=batch_quick]")
    await quick.wait_for(timeout=60_000)
    took = (await quick.get_by_test_id("took").inner_text()).strip()
    assert re.fullmatch(r"\d+\.\d s|\d+ s", took) and float(took.split()[0]) >= 0.5, took

    await page.get_by_role("button", name="Log out").click()
    await page.wait_for_url(f"{base}/ui/login")
    await page.goto(f"{base}/ui/deadletters")
    assert page.url == f"{base}/ui/login"  # the session is gone


async def _logged_in(client: httpx.AsyncClient) -> str:
    """Log ``client`` in; the session's CSRF token."""
    page = await client.get("/ui/login")
    token = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
    r = await client.post("/ui/login", data={"token": ADMIN, "csrf": token})
    assert r.status_code == 303 and r.headers["location"] == "/ui/", r.text
    return CSRF.search((await client.get("/ui/")).text).group(1)  # type: ignore[union-attr]


async def test_a_post_without_its_csrf_token_is_refused_and_changes_nothing(
    make_settings, redis_url
):
    settings = make_settings(redis_url=redis_url, admin_tokens=[ADMIN])
    redis = Redis.from_url(redis_url)
    async with running_api(settings, redis_url) as (base, _):
        store_client = DeadLetters(redis)
        letter = await keep_letter(store_client, "fetch_response")
        async with httpx.AsyncClient(base_url=base) as client:
            page = await client.get("/ui/login")
            cookie = page.headers["set-cookie"].lower()
            assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
            token = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
            for data in ({"token": ADMIN}, {"token": ADMIN, "csrf": token[::-1]}):
                r = await client.post("/ui/login", data=data)
                assert r.status_code == 403 and "CSRF" in r.text
            assert (await client.get("/ui/")).status_code == 303  # still not logged in

            csrf = await _logged_in(client)
            hostile = await keep_letter(
                store_client, "fetch_response", error="<script>alert(1)</script> & co"
            )
            listing = (await client.get("/ui/deadletters")).text
            assert "<script>alert" not in listing  # what a provider or sink said is escaped
            assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in listing
            await store_client.replay([hostile])
            for data in ({"id": letter.id}, {"id": letter.id, "csrf": "x" * 43}):
                r = await client.post("/ui/deadletters/replay", data=data)
                assert r.status_code == 403 and "CSRF" in r.text
            assert [d.id for d in await store_client.find()] == [letter.id]  # not replayed
            r = await client.post("/ui/logout", data={})
            assert r.status_code == 403
            assert (await client.get("/ui/")).status_code == 200  # still logged in
            r = await client.post("/ui/logout", data={"csrf": csrf})
            assert r.status_code == 303
            assert (await client.get("/ui/")).status_code == 303

        # a session cookie signed by another deployment (other admin tokens) is no login
        other = make_settings(redis_url=redis_url, admin_tokens=["another-admin-token-000000"])
        async with (
            running_api(other, redis_url) as (other_base, _),
            httpx.AsyncClient(base_url=other_base) as foreign,
        ):
            await logged_in_as(foreign, "another-admin-token-000000")
            stolen = foreign.cookies.get("nopoll_ui")
        async with httpx.AsyncClient(base_url=base, cookies={"nopoll_ui": stolen}) as client:
            assert (await client.get("/ui/")).status_code == 303
        await redis.aclose()


async def test_without_admin_tokens_there_is_no_ui_and_https_makes_the_cookie_secure(
    make_settings, redis_url
):
    async with (
        running_api(make_settings(redis_url=redis_url), redis_url) as (base, _),
        httpx.AsyncClient(base_url=base) as client,
    ):
        for path in ("/ui/", "/ui/login", "/ui/static/htmx.min.js"):
            assert (await client.get(path)).status_code == 404, path
    settings = make_settings(
        redis_url=redis_url, admin_tokens=[ADMIN], public_url="https://nopoll.example"
    )
    async with (
        running_api(settings, redis_url) as (base, _),
        httpx.AsyncClient(base_url=base) as client,
    ):
        page = await client.get("/ui/login")
        assert "secure" in page.headers["set-cookie"].lower()
        assert page.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        r = await client.get("/ui/static/htmx.min.js")
        assert r.status_code == 200 and b"htmx" in r.content[:200]


@pytest.fixture
async def two_tenants(make_settings, redis_url):
    """(base URL, Redis, dead letters store, {tenant: its letter}): the API alone (no
    worker: replayed work stays queued) with tenants ``team-a`` and ``team-b``, each with
    a consumer token of its own, and each with a running and a finished batch, a
    watch and a dead letter; the default tenant has a dead letter too."""

    def account(tenant: str) -> dict[str, Any]:
        return {"providers": {"sim": {"api_key": f"sk-test-{tenant}-key"}}}

    settings = make_settings(
        redis_url=redis_url,
        admin_tokens=[ADMIN],
        tenants={"team-a": account("team-a"), "team-b": account("team-b")},
        tenant_keys=["tenant-key-0123456789abcdef0123456789"],
        consumer_tokens=[
            {"token": TEAM_A, "tenant": "team-a"},
            {"token": TEAM_B, "tenant": "team-b"},
        ],
    )
    redis = Redis.from_url(redis_url)
    letters = DeadLetters(redis)
    watches = WatchStore(redis)
    kept = {}
    for tenant in ("team-a", "team-b", "default"):
        short = tenant[-1] if tenant != "default" else "d"
        for batch_id, done in ((f"batch_run_{short}", False), (f"batch_end_{short}", True)):
            state = BatchState.of(
                redis, scoped("sim", tenant), batch_id, ttl_s=3600, job_expiry_ms=60_000
            )
            await state.begin(100)
            await state.record_rows(2)
            await state.record_counts(0, Counter({"completed": 2}))
            if done:
                await state.commit("files", 0)
                await state.finish()
        await watches.register(
            "sim", "response", f"resp_watch_{short}", first_poll_in_s=600, tenant=tenant
        )
        kwargs = {"provider": "sim", "response_id": f"resp_dl_{short}", "tenant": tenant}
        kept[tenant] = await keep_letter(
            letters,
            FETCH_RESPONSE,
            keys=[f"resp_dl_{short}"],
            kwargs=kwargs,
            error=f"sim GET responses/resp_dl_{short} (HTTP 404): unexpected status; "
            f'the provider said: "no such response {short}"',
        )
    async with running_api(settings, redis_url) as (base, _):
        yield base, redis, letters, kept
    await redis.aclose()


def _ids(text: str) -> set[str]:
    return set(re.findall(r"(?:batch_run|batch_end|resp_watch|resp_dl)_[abd]", text))


async def test_every_page_shows_and_filters_by_tenant_and_a_tenant_login_sees_only_its_own(
    two_tenants,
):
    base, _redis, letters, kept = two_tenants
    every = {
        f"{kind}_{t}" for kind in ("batch_run", "batch_end", "resp_watch", "resp_dl") for t in "abd"
    }
    pages = ("/ui/batches", "/ui/watches", "/ui/deadletters")
    async with httpx.AsyncClient(base_url=base) as admin:
        await logged_in_as(admin, ADMIN)
        seen = set()
        for path in pages:
            for tenant in ("", "*"):
                r = await admin.get(path, params={"tenant": tenant} if tenant else None)
                assert r.status_code == 200 and '<th scope="col">Tenant</th>' in r.text, path
                found = _ids(r.text)
                seen |= found
                assert {"team-a", "team-b", "default"} <= set(
                    re.findall(r'data-testid="tenant">([^<]+)<', r.text)
                ), path
            r = await admin.get(path, params={"tenant": "team-a"})
            assert r.status_code == 200
            assert _ids(r.text) and all(i.endswith("_a") for i in _ids(r.text)), (
                path,
                _ids(r.text),
            )
            assert set(re.findall(r'data-testid="tenant">([^<]+)<', r.text)) == {"team-a"}
            assert '<option value="team-a" selected>' in r.text  # the select says the filter
            live = await admin.get(path, params={"tenant": "team-b", "part": "1"})
            assert all(i.endswith("_b") for i in _ids(live.text)), path  # the live refresh too
            assert (await admin.get(path, params={"tenant": "nobody"})).status_code == 400
        assert seen == every
        overview = (await admin.get("/ui/")).text
        for tenant in ("team-a", "team-b", "default"):
            row = re.search(rf'<tr data-tenant="{tenant}">(.*?)</tr>', overview, re.S)
            assert row is not None, tenant
            # batches running, finished, watches pending, dead letters: one each
            assert re.findall(r">(\d+)<", row.group(1)) == ["1", "1", "1", "1"], tenant

    # A consumer token limited to team-b logs in and sees team-b's rows only, whatever it asks.
    async with httpx.AsyncClient(base_url=base) as team_b:
        await logged_in_as(team_b, TEAM_B)
        for path in (*pages, "/ui/"):
            for params in ({}, {"tenant": "*"}, {"tenant": "team-b"}, {"part": "1"}):
                r = await team_b.get(path, params=params)
                assert r.status_code == 200, (path, params)
                assert _ids(r.text) <= {i for i in every if i.endswith("_b")}, (path, params)
                assert "team-a" not in r.text and "_a<" not in r.text, (path, params)
                assert "tenant-key" not in r.text
        for path in pages:
            r = await team_b.get(path, params={"tenant": "team-a"})
            assert r.status_code == 403 and "team-b" in r.text, path
        assert _ids((await team_b.get("/ui/deadletters")).text) == {"resp_dl_b"}
        overview = (await team_b.get("/ui/")).text
        assert re.findall(r'<tr data-tenant="([^"]+)">', overview) == ["team-b"]
        # its replays reach its own letters only: another tenant's by id, or "all", never
        csrf = CSRF.search(overview).group(1)  # type: ignore[union-attr]
        r = await team_b.post(
            "/ui/deadletters/replay", data={"csrf": csrf, "id": kept["team-a"].id}
        )
        assert r.status_code == 303
        r = await team_b.post("/ui/deadletters/replay", data={"csrf": csrf, "scope": "all"})
        assert r.status_code == 303
        assert {d.tenant for d in await letters.find()} == {"team-a", "default"}
        r = await team_b.post(
            "/ui/deadletters/replay", data={"csrf": csrf, "scope": "all", "tenant": "team-a"}
        )
        assert r.status_code == 403
        assert {d.tenant for d in await letters.find()} == {"team-a", "default"}
    async with httpx.AsyncClient(base_url=base) as nobody:  # a token not configured: no login
        page = await nobody.get("/ui/login")
        token = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
        r = await nobody.post("/ui/login", data={"token": TEAM_A[::-1], "csrf": token})
        assert r.status_code == 401


async def test_a_tenant_login_finds_its_own_tenants_journeys_only(two_tenants):
    """The search box of a team's session looks in its own tenant: another tenant's id (or
    the default tenant's) is not found, and naming another tenant is a 403."""
    base, _redis, _letters, _kept = two_tenants
    async with httpx.AsyncClient(base_url=base) as admin:
        await logged_in_as(admin, ADMIN)
        for q in ("resp_watch_a", "resp_watch_b", "resp_dl_d"):
            r = await admin.get("/ui/journey", params={"q": q})
            assert r.status_code == 200 and q in r.text, q  # an admin finds every tenant's
    async with httpx.AsyncClient(base_url=base) as team_b:
        await logged_in_as(team_b, TEAM_B)
        mine = await team_b.get("/ui/journey", params={"q": "resp_watch_b"})
        assert mine.status_code == 200 and "team-b" in mine.text
        for q in ("resp_watch_a", "resp_dl_a", "resp_watch_d", "resp_dl_d"):
            r = await team_b.get("/ui/journey", params={"q": q})
            assert r.status_code == 404 and 'data-testid="not-found"' in r.text, q
            assert "team-a" not in r.text, q
        for tenant in ("team-a", "default"):
            r = await team_b.get("/ui/journey", params={"q": "resp_watch_a", "tenant": tenant})
            assert r.status_code == 403 and "team-b" in r.text, tenant
        for tenant in ("team-b", "*"):
            r = await team_b.get("/ui/journey", params={"q": "resp_watch_b", "tenant": tenant})
            assert r.status_code == 200, tenant


async def test_replay_all_asks_first_with_the_count_and_fits_a_phone(browser, two_tenants, shots):
    base, redis, letters, _kept = two_tenants
    await keep_letter(
        letters,
        FETCH_RESPONSE,
        keys=["resp_more"],
        kwargs={"provider": "sim", "response_id": "resp_more"},
    )
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    await page.goto(f"{base}/ui/login")
    await page.get_by_label("Admin token").fill(ADMIN)
    await page.get_by_role("button", name="Log in").click()
    await page.wait_for_url(f"{base}/ui/")
    await page.get_by_role("link", name="Dead letters").click()

    # filtered to one tenant: its letters, with the provider's reason under each
    await page.get_by_label("Tenant", exact=True).select_option("team-a")
    await page.get_by_role("button", name="Show").click()
    await page.wait_for_url(re.compile(r"tenant=team-a"))
    rows = page.locator("tr[data-letter]")
    assert await rows.count() == 1
    assert await rows.first.get_by_test_id("tenant").inner_text() == "team-a"
    assert "no such response a" in await rows.first.get_by_test_id("provider-said").inner_text()

    # every tenant's: "Replay all 4" asks first, and nothing is replayed until confirmed
    await page.get_by_label("Tenant", exact=True).select_option("*")
    await page.get_by_role("button", name="Show").click()
    await page.wait_for_url(re.compile(r"tenant=%2A|tenant=\*"))
    assert await rows.count() == 4
    await page.screenshot(path=shots / "deadletters-tenants.png", full_page=True)
    await page.get_by_role("button", name=re.compile(r"^Replay all 4")).click()
    await page.get_by_role("heading", name="Replay all 4 dead letters?").wait_for()
    await page.screenshot(path=shots / "replay-confirm.png")
    assert await letters.count() == 4  # asked, not done
    await page.get_by_role("link", name="Cancel").click()
    await page.wait_for_url(re.compile(r"/ui/deadletters"))
    assert await letters.count() == 4
    await page.get_by_role("button", name=re.compile(r"^Replay all 4")).click()
    await page.get_by_role("button", name="Yes, replay all 4").click()
    outcome = page.get_by_test_id("outcome")
    await outcome.wait_for()
    assert "Replayed 4" in await outcome.inner_text()
    assert await letters.count() == 0
    assert await redis.zcard(JOBS_QUEUE) == 4  # every one queued again

    # on a phone: one line of header, nothing wider than the screen, on every page
    phone = await browser.new_page(viewport=PHONE)
    await phone.context.add_cookies(await page.context.cookies())
    for path in ("", "batches", "watches", "deadletters", "deadletters/replay"):
        await phone.goto(f"{base}/ui/{path}")
        await _fits_a_phone(phone, path or "overview")
    await phone.goto(f"{base}/ui/batches")
    await phone.screenshot(path=shots / "batches-phone.png", full_page=True)
