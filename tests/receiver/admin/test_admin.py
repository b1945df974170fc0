"""The admin API (/admin/v1) under a real uvicorn server and Redis: bearer tokens, watch
registration, listing, ending, and a 4xx that names the field for every bad input."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from receiver.queue.jobs import FETCH_BATCH, JOBS
from tests.receiver.helpers import ADMIN_TOKEN as TOKEN
from tests.servers import running_api


async def test_without_admin_tokens_the_admin_api_does_not_exist(make_settings, redis_url):
    settings = make_settings(redis_url=redis_url)
    async with running_api(settings, redis_url) as (base, _), httpx.AsyncClient() as client:
        for method, path in [
            ("POST", "/admin/v1/watches"),
            ("GET", "/admin/v1/watches"),
            ("GET", "/admin/v1/openapi.json"),
            ("DELETE", "/admin/v1/watches/sim/response/r1"),
        ]:
            r = await client.request(method, base + path, headers={"authorization": "Bearer x"})
            assert r.status_code == 404, (method, path)


@pytest.mark.parametrize(
    "header", [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}", "Bearer", TOKEN]
)
async def test_a_missing_or_wrong_token_is_401(admin, header):
    async with httpx.AsyncClient(base_url=str(admin.base_url)) as client:
        headers = {"authorization": header} if header else {}
        r = await client.get("/admin/v1/watches", headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "token" in r.json()["error"]


async def test_every_configured_token_works(admin):
    r = await admin.get(
        "/admin/v1/watches", headers={"authorization": "Bearer second-token-0123456789"}
    )
    assert r.status_code == 200


async def test_register_list_and_end_watches(admin):
    body = {"provider": "sim", "kind": "response", "ids": ["r1", "r2", "r2", "bad id!"]}
    r = await admin.post("/admin/v1/watches", json=body)
    assert r.status_code == 202, r.text
    assert r.json() == {
        "watching": 2,
        "already": 0,
        "invalid": [{"id": "bad id!", "reason": "must match [A-Za-z0-9_.:-]{1,256}"}],
    }
    again = await admin.post("/admin/v1/watches", json={**body, "ids": ["r1", "r3"]})
    assert again.json()["watching"] == 1 and again.json()["already"] == 1
    await admin.post("/admin/v1/watches", json={"provider": "sim", "kind": "batch", "ids": ["b1"]})

    listed = (await admin.get("/admin/v1/watches", params={"kind": "response"})).json()
    assert sorted(w["id"] for w in listed["watches"]) == ["r1", "r2", "r3"]
    assert all(w["state"] == "pending" and w["polls"] == 0 for w in listed["watches"])
    assert listed["next_cursor"] == ""
    pending = await admin.get("/admin/v1/watches", params={"state": "pending", "provider": "sim"})
    assert len(pending.json()["watches"]) == 4

    assert (await admin.delete("/admin/v1/watches/sim/response/r1")).status_code == 204
    gone = await admin.delete("/admin/v1/watches/sim/response/r1")
    assert gone.status_code == 404 and gone.json() == {"error": "no such watch"}


async def test_a_kind_no_job_polls_is_refused_at_registration(admin, monkeypatch):
    spec = JOBS[FETCH_BATCH]
    monkeypatch.setitem(JOBS, FETCH_BATCH, dataclasses.replace(spec, poll=None))
    r = await admin.post(
        "/admin/v1/watches", json={"provider": "sim", "kind": "batch", "ids": ["b1"]}
    )
    assert r.status_code == 400, r.text
    assert r.json() == {"error": "kind: a batch cannot be polled (no job polls it)"}
    assert (await admin.get("/admin/v1/watches")).json()["watches"] == []


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{not json", "body: not valid JSON"),
        (b'{"provider":"sim","kind":"response","ids":["a"],"x":1}', "x: unknown field"),
        (b'{"provider":"sim","kind":"file","ids":["a"]}', "kind: "),
        (b'{"provider":"sim","kind":"batch","ids":[]}', "ids: "),
        (b'{"provider":"sim","kind":"batch"}', "ids: Field required"),
        (b'{"provider":"nope","kind":"batch","ids":["a"]}', "provider: unknown provider 'nope'"),
        (b'["a"]', "body: "),
    ],
)
async def test_bad_input_is_400_naming_the_field(admin, body, error):
    r = await admin.post(
        "/admin/v1/watches", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(error), r.json()


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"kind": "file"}, "kind: "),
        ({"state": "done"}, "state: "),
        ({"provider": "nope"}, "provider: "),
        ({"limit": "0"}, "limit: "),
        ({"cursor": "x"}, "cursor and limit"),
    ],
)
async def test_bad_query_is_400_naming_the_field(admin, params, error):
    r = await admin.get("/admin/v1/watches", params=params)
    assert r.status_code == 400 and r.json()["error"].startswith(error), r.text


async def test_a_huge_body_is_413_without_being_read_whole(admin):
    r = await admin.post(
        "/admin/v1/watches",
        content=b'{"ids":["' + b"a" * (5 * 1024 * 1024) + b'"]}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"].startswith("body: larger than")


async def test_listing_pages_through_every_watch(admin):
    ids = [f"r{i:04d}" for i in range(250)]
    await admin.post("/admin/v1/watches", json={"provider": "sim", "kind": "response", "ids": ids})
    seen: list[str] = []
    cursor = ""
    for _ in range(100):  # bounded
        page = await admin.get("/admin/v1/watches", params={"limit": 50, "cursor": cursor or 0})
        data = page.json()
        seen += [w["id"] for w in data["watches"]]
        cursor = data["next_cursor"]
        if not cursor:
            break
    assert sorted(set(seen)) == ids


async def test_the_openapi_document_describes_the_routes(admin):
    doc = (await admin.get("/admin/v1/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/admin/v1/watches",
        "/admin/v1/watches/{provider}/{kind}/{id}",
        "/admin/v1/openapi.json",
        "/admin/v1/submit",
        "/admin/v1/overview",
        "/admin/v1/batches",
        "/admin/v1/feeds",
        "/admin/v1/deadletters",
        "/admin/v1/deadletters/replay",
        "/admin/v1/journey/{provider}/{id}",
    }
    request = doc["components"]["schemas"]["WatchRequest"]
    assert set(request["required"]) == {"provider", "kind", "ids"}
