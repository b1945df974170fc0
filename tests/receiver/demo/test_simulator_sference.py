"""The simulator speaking sference, judged by sference's contract (:mod:`tests.contracts.sference`):
every answer of every route, in every state (in progress, running, ended, cancelled),
lists and errors included, over real HTTP."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from receiver.demo.ids import uuid7
from tests.contracts import sference
from tests.contracts._strict import parse

KEY = "sk-sference"
BODY = {"model": "m-1", "input": "hello", "background": True}
ROWS = [{"custom_id": f"c-{i}", "body": {"model": "m-1", "input": f"q {i}"}} for i in range(4)]


def client(sim: Any, key: str = KEY) -> httpx.Client:
    auth = {"authorization": f"Bearer {key}"}
    return httpx.Client(base_url=sim.base_url, headers=auth, timeout=10, trust_env=False)


def ok(answer: httpx.Response, model: Any, status: int = 200) -> Any:
    assert answer.status_code == status, answer.text
    return parse(model, answer.content)


def error(answer: httpx.Response, status: int) -> sference.ErrorResponse:
    assert answer.status_code == status, answer.text
    body = parse(sference.ErrorResponse, answer.content)
    assert body.status_code == status
    return body


def wait_until(check: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.03)
    raise AssertionError("never happened")


# --- responses ---------------------------------------------------------------------------
def test_a_created_response_is_in_progress_then_completed_and_never_echoes_metadata(
    provider_sim,
):
    sim = provider_sim(api_key=KEY, dialect="sference", complete_after_s=0.3)
    with client(sim) as c:
        body = {**BODY, "metadata": {"completion_window": "24h", "custom_id": "a"}}
        created = ok(c.post("/responses", json=body), sference.ResponseItem)
        pending = ok(c.get(f"/responses/{created.id}"), sference.ResponseItem)
        done = wait_until(
            lambda: (
                (
                    r := parse(sference.ResponseItem, c.get(f"/responses/{created.id}").content)
                ).status
                == "completed"
                and r
            )
        )
    assert uuid.UUID(created.id).version == 7
    assert (created.status, created.output, created.usage) == ("in_progress", None, None)
    assert (pending.status, pending.output, pending.usage) == ("in_progress", None, None)
    assert done.output[-1].content[0].text and done.usage.total_tokens == 28


def test_registered_responses_in_every_state_are_response_items(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference", auto_respond=True)
    states = {
        uuid7("done"): {},
        uuid7("cut"): {"status": "incomplete", "incomplete_reason": "max_output_tokens"},
        uuid7("failed"): {
            "status": "failed",
            "text": None,
            "error": {"code": "server_error", "message": "boom"},
        },
        uuid7("pending"): {"pending_times": 1},
    }
    for rid, kwargs in states.items():
        sim.add_response(rid, **kwargs)
    with client(sim) as c:
        got = {rid: ok(c.get(f"/responses/{rid}"), sference.ResponseItem) for rid in states}
        generated = ok(c.get(f"/responses/{uuid7('never registered')}"), sference.ResponseItem)
    assert [r.status for r in got.values()] == ["completed", "incomplete", "failed", "in_progress"]
    assert got[uuid7("failed")].error.code == "server_error"
    assert generated.status == "completed"
    assert uuid.UUID(sim.add_response().body["id"]).version == 7


def test_response_errors_are_litestar_bodies(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference")
    with client(sim) as c:
        missing = error(c.get(f"/responses/{uuid7('missing')}"), 404)
        bad = error(c.post("/responses", json={**BODY, "model": ""}), 400)
        window = error(
            c.post("/responses", json={**BODY, "metadata": {"completion_window": "1h"}}), 400
        )
        stream = error(
            c.post("/responses", json={**BODY, "metadata": {"stream_id": uuid7("x")}}), 400
        )
    with client(sim, "sk-wrong") as c:
        denied = error(c.get(f"/responses/{uuid7('missing')}"), 401)
    assert missing.extra is None and bad.extra == {} and "model" in bad.detail
    assert "completion_window" in window.detail and "stream_id" in stream.detail
    assert denied.detail


# --- batches -----------------------------------------------------------------------------
def test_a_batch_is_pending_then_running_then_completed_with_its_totals(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference", complete_after_s=0.8)
    with client(sim) as c:
        created = ok(c.post("/batches", json={"requests": ROWS}), sference.BatchResponse, 201)
        seen = [created]
        while seen[-1].status != "completed":
            seen.append(ok(c.get(f"/batches/{created.id}"), sference.BatchResponse))
            time.sleep(0.05)
        lines = c.get(f"/batches/{created.id}/results.jsonl").content.splitlines()
        listed = ok(c.get("/batches"), sference.BatchListResponse)
    statuses = [b.status for b in seen]
    assert statuses[0] == "pending" and "running" in statuses and statuses[-1] == "completed"
    assert statuses.index("running") > 0 and created.request_count == 4
    assert created.window == "24h" and created.completed_at is None
    running = next(b for b in seen if b.status == "running")
    assert 0 < running.total_tokens < seen[-1].total_tokens
    done = seen[-1]
    assert (done.total_prompt_tokens, done.total_completion_tokens, done.total_tokens) == (
        44,
        12,
        56,
    )
    assert done.total_cost_micros > 0 and done.completed_at is not None
    rows = [parse(sference.BatchResultRow, line) for line in lines]
    assert sorted(r.custom_id for r in rows) == ["c-0", "c-1", "c-2", "c-3"]
    assert {r.status for r in rows} == {"completed"}
    assert [b.id for b in listed.items] == [created.id]


def test_added_batches_in_every_state_are_batch_responses(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference")
    now = time.time()
    half = sim.add_batch("sference", uuid7("half"), 10, created_at=now - 1, pending_until=now + 1)
    failed = sim.add_batch("sference", uuid7("failed"), 5, status="failed", failed_every=2)
    rows = sim.add_batch("sference", uuid7("rows"), 9, failed_every=3, no_custom_id_every=4)
    with client(sim) as c:
        running = ok(c.get(f"/batches/{half.batch_id}"), sference.BatchResponse)
        partial = c.get(f"/batches/{half.batch_id}/results.jsonl").content.splitlines()
        ended = ok(c.get(f"/batches/{failed.batch_id}"), sference.BatchResponse)
        lines = c.get(f"/batches/{rows.batch_id}/results.jsonl").content.splitlines()
        listed = ok(c.get("/batches"), sference.BatchListResponse)
    assert running.status == "running" and 3 <= len(partial) <= 7
    assert ended.status == "failed"
    parsed = [parse(sference.BatchResultRow, line) for line in lines]
    assert sum(r.custom_id is None for r in parsed) == 2
    assert {r.status for r in parsed} == {"completed", "failed"}
    assert all((r.result_json is None) == (r.status != "completed") for r in parsed)
    assert [b.id for b in listed.items] == [rows.batch_id, failed.batch_id, half.batch_id]


def test_a_cancel_ends_the_batch_cancelled_and_its_unfinished_rows_too(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference", complete_after_s=60)
    now = time.time()
    half = sim.add_batch("sference", uuid7("half"), 20, created_at=now - 5, pending_until=now + 5)
    with client(sim) as c:
        created = ok(c.post("/batches", json={"requests": ROWS}), sference.BatchResponse, 201)
        cancelled = ok(c.post(f"/batches/{created.id}/cancel"), sference.BatchResponse)
        again = ok(c.get(f"/batches/{created.id}"), sference.BatchResponse)
        none_ran = c.get(f"/batches/{created.id}/results.jsonl").content.splitlines()
        ok(c.post(f"/batches/{half.batch_id}/cancel"), sference.BatchResponse)
        some_ran = c.get(f"/batches/{half.batch_id}/results.jsonl").content.splitlines()
        unknown = error(c.post(f"/batches/{uuid7('nope')}/cancel"), 404)
    assert cancelled.status == again.status == "cancelled" and cancelled.completed_at
    rows = [parse(sference.BatchResultRow, line) for line in none_ran]
    assert len(rows) == 4 and {r.status for r in rows} == {"cancelled"}
    statuses = [parse(sference.BatchResultRow, line).status for line in some_ran]
    assert len(statuses) == 20 and statuses[:9] == ["completed"] * 9
    assert statuses[11:] == ["cancelled"] * 9
    assert unknown.detail


def test_batch_errors_are_litestar_bodies(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference")
    with client(sim) as c:
        missing = error(c.get(f"/batches/{uuid7('missing')}"), 404)
        window = error(c.post("/batches", json={"window": "1h", "requests": ROWS}), 400)
        rows = error(c.post("/batches", json={"requests": []}), 400)
    with client(sim, "sk-wrong") as c:
        error(c.get("/batches"), 401)
    assert "window" in window.detail and "requests" in rows.detail and missing.detail


# --- streams -----------------------------------------------------------------------------
def test_a_stream_counts_and_lists_the_responses_created_in_it(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference", complete_after_s=0.6)
    with client(sim) as c:
        stream = ok(c.post("/streams", json={"name": "daily"}), sference.StreamDetailResponse, 201)
        meta = {"stream_id": stream.id, "completion_window": "24h"}
        made = [
            ok(
                c.post("/responses", json={**BODY, "input": f"q{i}", "metadata": meta}),
                sference.ResponseItem,
            ).id
            for i in range(3)
        ]
        ok(c.post("/responses", json=BODY), sference.ResponseItem)  # not in the stream
        running = ok(c.get(f"/streams/{stream.id}"), sference.StreamDetailResponse)
        listed = ok(c.get("/responses", params={"stream_id": stream.id}), sference.ResponseList)
        page = ok(
            c.get("/responses", params={"stream_id": stream.id, "limit": 2}), sference.ResponseList
        )
        everything = ok(c.get("/responses"), sference.ResponseList)
        done = wait_until(
            lambda: (
                (
                    s := parse(
                        sference.StreamDetailResponse, c.get(f"/streams/{stream.id}").content
                    )
                ).completed_items
                == 3
                and s
            )
        )
        streams = ok(c.get("/streams"), sference.StreamListResponse)
        missing = error(c.get(f"/streams/{uuid7('nope')}"), 404)
        bad = error(c.post("/streams", json={"name": "x", "window": "1h"}), 400)
    assert (stream.status, stream.window, stream.total_items) == ("open", "24h", 0)
    assert running.total_items == 3 and running.pending_items + running.running_items == 3
    assert [r.id for r in listed.data] == made[::-1] and not listed.has_more
    assert {r.status for r in listed.data} == {"in_progress"}
    assert len(page.data) == 2 and page.has_more and len(everything.data) == 4
    assert done.total_items == done.completed_items == 3 and done.completion_ratio == 1.0
    assert done.total_tokens == 3 * 28 and done.last_completion_at and done.latest_completion_id
    assert [s.id for s in streams.items] == [stream.id]
    assert missing.detail and "window" in bad.detail


def test_the_other_dialects_have_no_streams(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="openai")
    with client(sim) as c:
        assert c.post("/streams", json={"name": "x"}).status_code == 404
        assert c.get("/streams").status_code == 404
        assert c.get("/responses").status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "other"),
    [
        ("/responses", BODY, {**BODY, "model": "m-2"}),
        ("/batches", {"requests": ROWS}, {"requests": ROWS[:1]}),
        ("/streams", {"name": "n"}, {"name": "other"}),
    ],
)
def test_an_idempotency_key_changes_nothing_as_sference_documents_none(
    provider_sim, path, body, other
):
    """sference's contract has no Idempotency-Key: a create sent again under the same key,
    with the same body or another, is made again (what ``nopoll submit`` must not do)."""
    sim = provider_sim(api_key=KEY, dialect="sference")
    with client(sim) as c:
        first = c.post(path, json=body, headers={"idempotency-key": "k"})
        same = c.post(path, json=body, headers={"idempotency-key": "k"})
        changed = c.post(path, json=other, headers={"idempotency-key": "k"})
    assert first.is_success and same.is_success and changed.is_success
    assert len({first.json()["id"], same.json()["id"], changed.json()["id"]}) == 3


def test_injected_faults_answer_litestar_bodies(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference", create_fail_first=1.0)
    rid = uuid7("flaky")
    sim.add_response(rid, fail_times=1, fail_status=429, retry_after=1)
    with client(sim) as c:
        flaky = error(c.get(f"/responses/{rid}"), 429)
        failed = error(c.post("/responses", json=BODY, headers={"idempotency-key": "k"}), 500)
        ok(c.get(f"/responses/{rid}"), sference.ResponseItem)
    assert flaky.detail and failed.detail


# --- the completion feed -----------------------------------------------------------------
def _events(http: httpx.Client, **query: Any) -> sference.StreamEventListResponse:
    return ok(http.get("/responses/events", params=query), sference.StreamEventListResponse)


def test_the_completion_feed_pages_each_feed_in_completion_order(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference", complete_after_s=0.05)
    with client(sim) as http:
        stream = ok(http.post("/streams", json={"name": "s"}), sference.StreamDetailResponse, 201)
        made: dict[str | None, list[str]] = {stream.id: [], None: []}
        for i in range(5):
            meta = {"stream_id": stream.id, "custom_id": f"s{i}"}
            made[stream.id].append(
                http.post("/responses", json={**BODY, "metadata": meta}).json()["id"]
            )
            made[None].append(http.post("/responses", json=BODY).json()["id"])
            time.sleep(0.003)  # each its own millisecond: the order is known
        time.sleep(0.2)
        everything = _events(http, stream_id=stream.id, limit=100)
        assert [e.response_id for e in everything.data] == list(reversed(made[stream.id]))
        assert not everything.has_more  # newest first without a cursor, as the SDK reads it
        assert [e.custom_id for e in everything.data][-1] == "s0"
        own = _events(http, limit=100)  # the account's own feed: the requests outside streams
        assert {e.response_id for e in own.data} == set(made[None])
        oldest = everything.data[-1].completion_id
        after = _events(http, stream_id=stream.id, starting_after=oldest, limit=2)
        assert [e.response_id for e in after.data] == made[stream.id][1:3] and after.has_more
        before = _events(http, stream_id=stream.id, ending_before=after.data[0].completion_id)
        assert [e.response_id for e in before.data] == made[stream.id][:1]
        event = everything.data[0]
        assert event.status == "completed" and event.result is not None
        assert event.result["choices"][0]["message"]["content"]
        assert event.total_tokens == event.prompt_tokens + event.completion_tokens


def test_a_long_poll_waits_for_the_next_completion_and_no_longer(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference", complete_after_s=0.8)
    with client(sim) as http:
        started = time.monotonic()
        empty = _events(http, wait_ms=300)
        assert empty.data == [] and 0.25 <= time.monotonic() - started < 2
        rid = http.post("/responses", json=BODY).json()["id"]
        started = time.monotonic()
        found = _events(http, wait_ms=10_000)
        assert [e.response_id for e in found.data] == [rid]
        assert 0.5 <= time.monotonic() - started < 3  # answered when it completed
