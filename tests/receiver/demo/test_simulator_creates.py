"""The provider simulator's create side (``nopoll submit``'s provider), over real HTTP:
background responses, idempotency keys, injected faults, the four batch dialects, the
OpenAI file upload, and signed callbacks on completion."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import orjson
import pytest
from standardwebhooks.webhooks import Webhook

from receiver.demo.creates import created_output_text
from tests.subscriber import Subscriber

KEY = "sk-test"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY = {"model": "sim-1", "input": "hello", "background": True, "metadata": {"custom_id": "a"}}


def client(sim: Any) -> httpx.Client:
    return httpx.Client(base_url=sim.base_url, headers=AUTH, timeout=10, trust_env=False)


def post(sim: Any, path: str, body: Any, key: str | None = None) -> httpx.Response:
    headers = {"idempotency-key": key} if key else {}
    with client(sim) as c:
        return c.post(path, json=body, headers=headers)


def message(answer: httpx.Response) -> str:
    """An error answer's message: OpenAI's, Sail's and Valar's ``error.message``, or
    sference's ``detail``."""
    body = answer.json()
    return body["detail"] if "detail" in body else body["error"]["message"]


# --- responses ------------------------------------------------------------------------------
def test_created_response_is_pending_then_completed_with_its_metadata(provider_sim):
    sim = provider_sim(api_key=KEY, complete_after_s=0.4)
    r = post(sim, "/responses", BODY)
    assert r.status_code == 200
    created = r.json()
    assert created["id"].startswith("resp_") and created["status"] == "queued"
    assert created["metadata"] == {"custom_id": "a"} and created["output"] == []
    with client(sim) as c:
        pending = c.get(f"/responses/{created['id']}").json()
        assert pending["status"] == "in_progress" and pending["usage"] is None
        time.sleep(0.45)
        done = c.get(f"/responses/{created['id']}").json()
    assert done["status"] == "completed" and done["model"] == "sim-1"
    assert done["metadata"] == {"custom_id": "a"}
    assert done["output"][-1]["content"][0]["text"] == created_output_text("hello")
    assert sim.creations("responses") == 1
    assert sim.creates.received("/v1/responses") == [("/v1/responses", None, BODY)]
    assert len({created_output_text(f"review {i}") for i in range(20)}) == 20


def test_same_idempotency_key_replays_the_answer_and_creates_once(provider_sim):
    sim = provider_sim(api_key=KEY, create_delay_s=0.05)
    first, again, other = (post(sim, "/responses", BODY, key=k) for k in ("k-1", "k-1", "k-2"))
    assert first.status_code == again.status_code == 200 and first.content == again.content
    assert other.json()["id"] != first.json()["id"] and sim.creations("responses") == 2
    assert [r.idempotency_key for r in sim.creates.received()] == ["k-1", "k-1", "k-2"]


def test_concurrent_tries_with_one_key_create_once(provider_sim):
    sim = provider_sim(api_key=KEY, create_delay_s=0.2)

    async def burst() -> set[str]:
        async with httpx.AsyncClient(base_url=sim.base_url, headers=AUTH, trust_env=False) as c:
            tries = [c.post("/responses", json=BODY, headers={"idempotency-key": "k"})] * 5
            answers = await asyncio.gather(*tries)
        return {a.json()["id"] for a in answers}

    assert len(asyncio.run(burst())) == 1
    assert sim.creations("responses") == 1


@pytest.mark.parametrize(
    ("dialect", "status", "kind"),
    [
        ("openai", 422, "invalid_request_error"),
        ("sail", 400, "idempotency_error"),
        ("valar", 400, "idempotency_error"),
    ],
)
def test_a_key_reused_with_another_body_is_refused(provider_sim, dialect, status, kind):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    assert post(sim, "/responses", BODY, key="k").is_success
    r = post(sim, "/responses", {**BODY, "input": "other"}, key="k")
    assert r.status_code == status and "Idempotency-Key" in message(r)
    if kind is not None:
        assert r.json()["error"]["type"] == kind
    assert sim.creations("responses") == 1


def test_fail_first_before_creating_then_the_retry_creates(provider_sim):
    sim = provider_sim(api_key=KEY, create_fail_first=1.0, create_retry_after=0.5)
    first = post(sim, "/responses", BODY, key="k-1")
    assert first.status_code == 500 and first.headers["retry-after"] == "0.5"
    assert sim.creations("responses") == 0
    retry = post(sim, "/responses", BODY, key="k-1")
    assert retry.status_code == 200 and sim.creations("responses") == 1
    assert post(sim, "/responses", BODY, key="k-1").json()["id"] == retry.json()["id"]
    assert sim.creations("responses") == 1


def test_fail_first_after_creating_then_the_retry_replays_the_id(provider_sim):
    sim = provider_sim(api_key=KEY, create_fail_first=1.0, create_fail_mode="after")
    first = post(sim, "/responses", BODY, key="k-1")
    assert first.status_code == 500 and "retry-after" not in first.headers
    assert sim.creations("responses") == 1
    retry = post(sim, "/responses", BODY, key="k-1")
    assert retry.status_code == 200 and sim.creations("responses") == 1
    with client(sim) as c:
        assert c.get(f"/responses/{retry.json()['id']}").json()["status"] == "completed"


def test_fail_first_picks_a_deterministic_share_of_keys(provider_sim):
    a = provider_sim(api_key=KEY, create_fail_first=0.3, create_fail_status=503)
    b = provider_sim(api_key=KEY, create_fail_first=0.3, create_fail_status=503)
    keys = [f"key-{i}" for i in range(200)]
    with client(a) as ca, client(b) as cb:
        fa = [ca.post("/responses", json=BODY, headers={"idempotency-key": k}) for k in keys]
        fb = [cb.post("/responses", json=BODY, headers={"idempotency-key": k}) for k in keys]
    failed = [k for k, r in zip(keys, fa, strict=True) if r.status_code == 503]
    assert failed == [k for k, r in zip(keys, fb, strict=True) if r.status_code == 503]
    assert 30 <= len(failed) <= 90
    assert {r.status_code for r in fa} == {200, 503}


def test_create_delay_applies_to_every_create_answer(provider_sim):
    sim = provider_sim(api_key=KEY, create_delay_s=0.2)
    started = time.monotonic()
    assert post(sim, "/responses", {"model": ""}).status_code == 400
    assert time.monotonic() - started >= 0.2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "x", "background": True}, "model"),
        ({**BODY, "model": ""}, "model"),
        ({**BODY, "model": 7}, "model"),
        ({"model": "m", "background": True}, "input"),
        ({**BODY, "input": {"text": "x"}}, "input"),
        ({"model": "m", "input": "x"}, "background"),
        ({**BODY, "background": False}, "background"),
        ({**BODY, "metadata": ["a"]}, "metadata"),
        ({**BODY, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({**BODY, "metadata": {"n": 1}}, "metadata.n"),
        ({**BODY, "custom_id": "a"}, "custom_id"),
        ({**BODY, "model": "reject-me"}, "model reject-me does not exist"),
        ([BODY], "JSON object"),
    ],
)
def test_bad_response_bodies_are_400_naming_the_field(provider_sim, body, field):
    sim = provider_sim(api_key=KEY)
    r = post(sim, "/responses", body, key="k")
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]
    assert sim.creations("responses") == 0
    assert post(sim, "/responses", BODY, key="k").status_code == 200  # refusals are not stored


def test_non_json_bodies_missing_auth_and_non_multipart_uploads(provider_sim):
    sim = provider_sim(api_key=KEY)
    with client(sim) as c:
        assert c.post("/responses", content=b"{nope").status_code == 400
        r = c.post("/files", json={"purpose": "batch"})
        assert r.status_code == 400 and "purpose" in r.json()["error"]["message"]
    assert httpx.post(f"{sim.base_url}/responses", json=BODY, trust_env=False).status_code == 401
    assert sim.creations("responses") == sim.creations("files") == 0


def test_the_request_log_is_bounded(provider_sim):
    sim = provider_sim(api_key=KEY, log_size=5)
    with client(sim) as c:
        for i in range(12):
            c.post("/responses", json=BODY, headers={"idempotency-key": f"k{i}"})
    assert [r.idempotency_key for r in sim.creates.received()] == [f"k{i}" for i in range(7, 12)]
    assert sim.creations("responses") == 12


# --- batches --------------------------------------------------------------------------------
ROWS = [{"model": "m-1", "input": f"text {i}"} for i in range(3)]


def sference(*rows: Any, **top: Any) -> dict[str, Any]:
    return {"window": "24h", "requests": list(rows), **top}


def sail(*rows: Any, **top: Any) -> dict[str, Any]:
    return {"endpoint": "/v1/responses", "label": "job", "requests": list(rows), **top}


INLINE = {
    "sference": sference(*({"custom_id": f"c-{i}", "body": b} for i, b in enumerate(ROWS))),
    "sail": sail(*({"custom_id": f"c-{i}", "params": b} for i, b in enumerate(ROWS))),
}
INLINE["valar"] = INLINE["sail"]


def test_an_sference_batch_is_created_pending_runs_then_serves_its_rows(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference", complete_after_s=0.6)
    r = post(sim, "/batches", INLINE["sference"], key="b-1")
    assert r.status_code == 201
    batch = r.json()
    assert uuid.UUID(batch["id"]).version == 7 and batch["status"] == "pending"
    # sference documents no idempotency: the same key again is another batch
    assert post(sim, "/batches", INLINE["sference"], key="b-1").json()["id"] != batch["id"]
    assert sim.creations("batches") == 2
    seen = []
    with client(sim) as c:
        for _ in range(12):
            seen.append(c.get(f"/batches/{batch['id']}").json()["status"])
            time.sleep(0.06)
        lines = c.get(f"/batches/{batch['id']}/results.jsonl").text.splitlines()
    assert seen[0] == "pending" and "running" in seen and seen[-1] == "completed"
    assert {orjson.loads(line)["custom_id"] for line in lines} == {"c-0", "c-1", "c-2"}


@pytest.mark.parametrize("dialect", ["sail", "valar"])
def test_a_request_status_batch_is_created_then_its_rows_settle(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect, complete_after_s=0.3)
    r = post(sim, "/batches", INLINE[dialect], key="b-1")
    assert r.status_code == 200
    batch = r.json()
    assert set(batch) == {"id", "request_counts", "created_at", "label"}
    assert batch["request_counts"] == 3 and batch["label"] == "job"
    assert post(sim, "/batches", INLINE[dialect], key="b-1").json()["id"] == batch["id"]
    assert sim.creations("batches") == 1
    with client(sim) as c:
        running = c.get(f"/batches/{batch['id']}").json()
        time.sleep(0.35)
        done = c.get(f"/batches/{batch['id']}").json()
        row = c.get(f"/batches/{batch['id']}/c-1")
    assert "status" not in running and "status" not in done
    assert {"RUNNING", "PENDING"} & {s["status"] for s in running["request_status"].values()}
    assert done["request_status"] == {f"c-{i}": {"status": "COMPLETED"} for i in range(3)}
    assert row.status_code == 200 and row.json()["status"] == "completed"


def test_sference_rows_may_leave_out_custom_id(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sference")
    batch = post(sim, "/batches", sference(*({"body": b} for b in ROWS))).json()
    with client(sim) as c:
        lines = c.get(f"/batches/{batch['id']}/results.jsonl").text.splitlines()
    assert len(lines) == 3 and all("custom_id" not in orjson.loads(line) for line in lines)


ASAP = {**ROWS[0], "metadata": {"completion_window": "asap"}}
OTHER = {"custom_id": "row-b", "body": {**ROWS[1], "model": "other-model"}}
SAME_MODEL = 'requests[1] (custom_id="row-b"): all batch rows must use the same model; '
SAME_MODEL += 'expected "m-1", got "other-model"'
BAD_BATCHES = [
    ("sference", {**INLINE["sference"], "window": "1h"}, "window"),
    ("sference", {"window": "24h"}, "requests"),
    ("sference", sference(), "requests"),
    ("sference", sference({"custom_id": "a"}), 'requests[0] (custom_id="a"): body'),
    ("sference", sference({"custom_id": "row-a", "body": ROWS[0]}, OTHER), SAME_MODEL),
    ("sference", sference({"body": {"model": "m", "messages": []}}), "messages"),
    ("sference", sference({"body": {**ROWS[0], "model": "reject-me"}}), 'Model "reject-me"'),
    ("sail", {**INLINE["sail"], "endpoint": "/v1/chat/completions"}, "endpoint"),
    ("sail", {**INLINE["sail"], "label": ""}, "label"),
    ("sail", INLINE["sference"], "window: unknown parameter"),
    ("sail", sail({"custom_id": "a", "params": {"model": "m"}}), "params.input"),
    ("sail", sail({"custom_id": "a", "params": {**ROWS[0], "model": "reject-me"}}), "reject-me"),
    ("valar", sail({"custom_id": "a", "body": ROWS[0]}), "requests[0].body: unknown parameter"),
    ("valar", sail({"custom_id": "a"}), 'requests[0] (custom_id="a"): params: required'),
    ("valar", sail({"params": ROWS[0]}), "requests[0].custom_id"),
    ("valar", sail(*[{"custom_id": "a", "params": ROWS[0]}] * 2), "custom_id a is not unique"),
    ("valar", sail({"custom_id": "a", "params": ASAP}), "completion_window: must be standard"),
    ("openai", INLINE["sference"], "input_file_id"),
]


@pytest.mark.parametrize(("dialect", "body", "expected"), BAD_BATCHES)
def test_wrong_batch_shapes_are_400_naming_the_field(provider_sim, dialect, body, expected):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    r = post(sim, "/batches", body)
    assert r.status_code == 400 and expected in message(r)
    assert sim.creations("batches") == 0


def test_message_batches_are_not_created_at_v1_batches(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="anthropic")
    r = post(sim, "/batches", INLINE["sail"])
    assert r.status_code == 404 and "/v1/batches" in r.json()["error"]["message"]
    assert sim.creations("batches") == 0


def test_message_batch_results_come_in_another_order_on_each_download(provider_sim):
    sim = provider_sim(api_key=KEY)
    sim.add_batch("anthropic", "msgbatch_orders", 50, results_break_after=20)
    headers = {**AUTH, "anthropic-version": "2026-10-21"}
    path = "/v1/messages/batches/msgbatch_orders"

    def ids(text: str) -> list[str]:
        return [orjson.loads(line)["custom_id"] for line in text.splitlines()]

    with httpx.Client(base_url=sim.host_url, headers=headers, timeout=10, trust_env=False) as c:
        assert c.get(path).json()["processing_status"] == "ended"
        with c.stream("GET", f"{path}/results") as r:  # the first download breaks off
            got = b""
            with pytest.raises(httpx.RemoteProtocolError):
                for piece in r.iter_raw():
                    got += piece
        first = ids(got.decode())
        second, third = (ids(c.get(f"{path}/results").text) for _ in range(2))
    assert len(first) == 20 and sorted(second) == sorted(third) == [
        f"row-{i:06d}" for i in range(50)
    ]
    assert first != second[:20] and second != third


def test_inline_batches_have_a_row_limit(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sail")
    rows = ({"custom_id": f"c{i}", "params": ROWS[0]} for i in range(100_001))
    r = post(sim, "/batches", sail(*rows))
    assert r.status_code == 400 and "at most 100,000" in r.json()["error"]["message"]


# --- the openai dialect: file upload, then batch --------------------------------------------
def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


LINE = {"method": "POST", "url": "/v1/responses"}
LINES = [{"custom_id": f"c-{i}", **LINE, "body": body} for i, body in enumerate(ROWS)]
CREATE = {"endpoint": "/v1/responses", "completion_window": "24h"}


def upload(sim: Any, content: bytes, purpose: str = "batch", key: str | None = None) -> Any:
    headers, file = {"idempotency-key": key} if key else {}, ("in.jsonl", content, "text/plain")
    with client(sim) as c:
        return c.post("/files", data={"purpose": purpose}, files={"file": file}, headers=headers)


def test_openai_file_then_batch(provider_sim):
    sim = provider_sim(api_key=KEY, complete_after_s=0.2)
    content = jsonl(LINES)
    file = upload(sim, content, key="f-1").json()
    assert file["id"].startswith("file-") and file["purpose"] == "batch"
    assert file["bytes"] == len(content) and file["filename"] == "in.jsonl"
    assert upload(sim, content, key="f-1").json() == file
    assert sim.creations("files") == 1
    logged = sim.creates.received("/v1/files")[0].body
    assert logged["purpose"] == "batch" and logged["file"] == LINES
    batch = post(sim, "/batches", {"input_file_id": file["id"], **CREATE}, key="b-1").json()
    assert batch["status"] == "in_progress" and batch["output_file_id"] is None
    with client(sim) as c:
        time.sleep(0.25)
        done = c.get(f"/batches/{batch['id']}").json()
        assert done["status"] == "completed"
        out = c.get(f"/files/{done['output_file_id']}/content").text.splitlines()
    assert {orjson.loads(line)["custom_id"] for line in out} == {"c-0", "c-1", "c-2"}


@pytest.mark.parametrize(
    ("content", "purpose", "message"),
    [
        (jsonl(LINES), "fine-tune", "purpose"),
        (b"", "batch", "file: 1 to 50,000 requests"),
        (b"not json\n", "batch", "file line 1: not a JSON object"),
        (jsonl([{**LINES[0], "custom_id": ""}]), "batch", "file line 1: custom_id"),
        (jsonl([{**LINES[0], "method": "GET"}]), "batch", "method"),
        (jsonl([{**LINES[0], "url": "/v1/nope"}]), "batch", "url"),
        (jsonl([LINES[0], {**LINES[1], "body": None}]), "batch", "file line 2: body"),
        (jsonl([LINES[0], LINES[0]]), "batch", "custom_id c-0 is not unique"),
    ],
)
def test_bad_openai_files_are_400(provider_sim, content, purpose, message):
    sim = provider_sim(api_key=KEY)
    r = upload(sim, content, purpose)
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert sim.creations("files") == 0


TWO_MODELS = [LINES[0], {**LINES[1], "body": {**ROWS[1], "model": "m-2"}}]


@pytest.mark.parametrize(
    ("lines", "change", "message"),
    [
        (LINES, {"completion_window": "1h"}, "completion_window"),
        (LINES, {"endpoint": "/v1/chat/completions"}, "is not the endpoint"),
        (LINES, {"endpoint": "/v1/nope"}, "endpoint"),
        (LINES, {"input_file_id": "file-unknown"}, "no file file-unknown"),
        (LINES, {"input_file_id": None}, "input_file_id"),
        (TWO_MODELS, {}, "one model per batch, got m-2"),
    ],
)
def test_bad_openai_batches_are_400(provider_sim, lines, change, message):
    sim = provider_sim(api_key=KEY)
    file = upload(sim, jsonl(lines)).json()
    r = post(sim, "/batches", {"input_file_id": file["id"], **CREATE, **change})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert sim.creations("batches") == 0


# --- callbacks ------------------------------------------------------------------------------
async def eventually(check: Any) -> None:
    for _ in range(250):
        if check():
            return
        await asyncio.sleep(0.02)


async def test_completed_responses_are_announced_with_verified_callbacks(
    provider_sim, webhook_secret
):
    subscriber = await Subscriber(webhook_secret, script=[500]).start()
    hook = {"webhook_url": subscriber.url(), "webhook_secret": webhook_secret}
    try:
        sim = provider_sim(api_key=KEY, complete_after_s=0.3, **hook)
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=sim.base_url, headers=AUTH, trust_env=False) as c:
            made = [(await c.post("/responses", json=BODY)).json()["id"] for _ in range(3)]
            await eventually(lambda: len(sim.creates.deliveries) == 3)
            for rid in made:
                assert (await c.get(f"/responses/{rid}")).json()["status"] == "completed"
        assert time.monotonic() - started >= 0.3
        assert sorted(rid for rid, _, _ in sim.creates.deliveries) == sorted(made)
        assert sorted((a, s) for _, a, s in sim.creates.deliveries) == [
            (1, 200),
            (1, 200),
            (2, 200),
        ]
        assert len(subscriber.deliveries) == 4 and all(d.verified for d in subscriber.deliveries)
        for d in subscriber.deliveries:
            Webhook(webhook_secret).verify(d.body, d.headers)
            assert d.payload["type"] == "response.completed" and d.payload["data"]["id"] in made
        assert len({d.headers["webhook-id"] for d in subscriber.deliveries}) == 3  # retry: same id
    finally:
        await subscriber.stop()


async def test_callbacks_give_up_after_a_few_tries(provider_sim, webhook_secret):
    subscriber = await Subscriber(webhook_secret, status=503).start()
    hook = {"webhook_url": subscriber.url(), "webhook_secret": webhook_secret}
    try:
        sim = provider_sim(api_key=KEY, webhook_attempts=3, **hook)
        async with httpx.AsyncClient(base_url=sim.base_url, headers=AUTH, trust_env=False) as c:
            await c.post("/responses", json=BODY)
        await eventually(lambda: sim.creates.deliveries)
        assert [(a, s) for _, a, s in sim.creates.deliveries] == [(3, 503)]
        assert len(subscriber.deliveries) == 3
    finally:
        await subscriber.stop()


def test_simulator_stops_promptly_with_callbacks_still_due(provider_sim, webhook_secret):
    hook = {"webhook_url": "http://127.0.0.1:9/hook", "webhook_secret": webhook_secret}
    sim = provider_sim(api_key=KEY, complete_after_s=600, **hook)
    assert post(sim, "/responses", BODY).status_code == 200
    started = time.monotonic()
    sim.stop()
    assert time.monotonic() - started < 5 and not sim.creates.deliveries
