"""Where is my result? in a real browser: Playwright drives Debian's chromium against the
API and worker (in this process), the provider simulator and Redis. The search box finds
an id, its journey shows the failed fetch in the provider's words, a replay from the page
lands it, and the journey ends in its row.

Screenshots go to ``$NOPOLL_UI_SCREENSHOTS`` when it is set (``docs/ui/`` is made that
way), else into the test's own temporary folder.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.helpers import post
from tests.servers import running_api, running_worker

pytestmark = pytest.mark.slow

ADMIN = "ui-journey-token-0123456789abcdef"


async def test_find_an_id_see_its_failed_fetch_replay_it_and_see_it_land(
    browser, make_settings, redis_url, provider_sim, signed_callback, shots
):
    sim = provider_sim(api_key="sk-test-not-a-real-key")
    sim.add_response("resp_where", text="here it is", fail_times=1, fail_status=404)
    settings = make_settings(
        sim.base_url,
        redis_url=redis_url,
        admin_tokens=[ADMIN],
        consumer_tokens=[{"token": "ui-journey-consumer-0123456789"}],
    )
    async with running_api(settings, redis_url) as (base, _), running_worker(settings, redis_url):
        body, headers = signed_callback("resp_where")
        assert (await post(base, body, headers)).status_code == 202
        assert (await post(base, body, headers)).status_code == 200

        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        await page.goto(f"{base}/ui/login")
        await page.get_by_label("Admin token").fill(ADMIN)
        await page.get_by_role("button", name="Log in").click()
        await page.wait_for_url(f"{base}/ui/")

        # the search box, on every page, takes the webhook-id as well as the id
        timeline = page.get_by_test_id("timeline")
        for _ in range(40):  # until the worker has kept its dead letter
            await page.get_by_role("searchbox").fill("resp_where")
            await page.get_by_role("button", name="Find").click()
            await page.wait_for_load_state()
            if await page.locator("tr[data-letter]").count():
                break
            await asyncio.sleep(0.25)
        assert "/ui/journey?q=resp_where" in page.url
        failed = timeline.locator("tr[data-step=fetch]")
        assert "HTTP 404" in await failed.inner_text()
        assert 'the provider said: "try again"' in await failed.inner_text()
        answers = await timeline.locator("tr[data-step=callback]").all_inner_texts()
        assert "202 queued" in answers[0] and "200 duplicate" in answers[1]
        assert await page.get_by_test_id("result").inner_text() == "not stored (yet)"
        await page.screenshot(path=shots / "journey-failed.png", full_page=True)

        await page.get_by_role("button", name="Replay dead letter").click()
        await page.get_by_test_id("outcome").wait_for()
        for _ in range(40):  # the worker fetches it again and writes it
            if await timeline.locator("tr[data-step=sink]").count():
                break
            await asyncio.sleep(0.25)
            await page.reload()
        last = timeline.locator("tbody tr").last
        assert await last.get_attribute("data-step") == "sink"
        assert "written to _results, files" in await last.inner_text()
        assert await page.locator("tr[data-letter]").count() == 0
        link = page.get_by_role("link", name="/v1/results/sim/resp_where")
        assert await link.get_attribute("href") == "/v1/results/sim/resp_where"
        await page.screenshot(path=shots / "journey.png", full_page=True)

        await page.get_by_role("searchbox").fill(headers["webhook-id"])
        await page.get_by_role("button", name="Find").click()
        await page.get_by_text("webhook-id " + headers["webhook-id"]).first.wait_for()
        await page.get_by_role("searchbox").fill("resp_nobody")
        await page.get_by_role("button", name="Find").click()
        await page.get_by_test_id("not-found").wait_for()
