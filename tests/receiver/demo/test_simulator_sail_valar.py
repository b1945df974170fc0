"""The simulator speaking Sail and Valar, judged by their OpenAPI references
(:mod:`tests.contracts.sail`, :mod:`tests.contracts.valar`): every answer of every route in
every state, lists and errors, Sail's older guide shape, and every refusal of the
references' rules (``additionalProperties: false``, patterns, limits, enums, idempotency),
provoked over real HTTP."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.contracts import sail, valar
from tests.contracts._strict import parse

KEY = "sk-responses-api"
BODY = {"model": "m-1", "input": "hello", "background": True}
PARAMS = {"model": "m-1", "input": "hi"}
ROWS = [{"custom_id": f"c-{i}", "params": {**PARAMS, "input": f"q {i}"}} for i in range(3)]
BATCH = {"endpoint": "/v1/responses", "label": "job_1", "requests": ROWS}
MODELS = {"sail": sail, "valar": valar}
DIALECTS = pytest.mark.parametrize("dialect", ["sail", "valar"])


def client(sim: Any, key: str = KEY) -> httpx.Client:
    auth = {"authorization": f"Bearer {key}"}
    return httpx.Client(base_url=sim.base_url, headers=auth, timeout=30, trust_env=False)


def ok(answer: httpx.Response, model: Any, status: int = 200) -> Any:
    assert answer.status_code == status, answer.text
    return parse(model, answer.content)


def refused(answer: httpx.Response, status: int = 400) -> sail.ErrorObject:
    assert answer.status_code == status, answer.text
    return parse(sail.ErrorResponse, answer.content).error


# --- responses ---------------------------------------------------------------------------
@DIALECTS
def test_a_created_response_is_pending_then_running_then_completed(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect, complete_after_s=0.6)
    models = MODELS[dialect]
    with client(sim) as c:
        body = {**BODY, "metadata": {"completion_window": "standard", "job": "42"}}
        created = ok(c.post("/responses", json=body), models.ResponseObject, 202)
        seen = [created]
        while seen[-1].status != "completed":
            seen.append(ok(c.get(f"/responses/{created.id}"), models.ResponseObject))
            time.sleep(0.05)
    statuses = [r.status for r in seen]
    assert statuses[0] == "pending" and "running" in statuses
    assert statuses.index("running") > statuses.index("pending")
    assert created.metadata == {"completion_window": "standard", "job": "42"}
    assert (
        created.usage.total_tokens == 0 and created.usage.output_tokens_details.cached_tokens == 0
    )
    assert seen[-1].usage.total_tokens == 28 and seen[-1].output
    assert seen[-1].metadata == created.metadata


@DIALECTS
def test_registered_responses_in_every_state_are_response_objects(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect, auto_respond=True)
    sim.add_response("resp_done")
    sim.add_response("resp_failed", status="failed", text=None, error={"message": "boom"})
    sim.add_response("resp_cancelled", status="cancelled", text=None)
    sim.add_response("resp_waiting", pending_times=2)
    models = MODELS[dialect]
    with client(sim) as c:
        got = [
            ok(c.get(f"/responses/{rid}"), models.ResponseObject).status
            for rid in ("resp_done", "resp_failed", "resp_cancelled", "resp_waiting")
        ]
        got += [ok(c.get("/responses/resp_waiting"), models.ResponseObject).status]
        got += [ok(c.get("/responses/resp_generated_1"), models.ResponseObject).status]
        missing = refused(c.get("/responses/msg_not_a_response"), 404)
    with client(sim, "sk-wrong") as c:
        denied = refused(c.get("/responses/resp_done"), 401)
    assert got == ["completed", "failed", "cancelled", "pending", "running", "completed"]
    assert missing.message and denied.type == "authentication_error"


# --- batches -----------------------------------------------------------------------------
@DIALECTS
def test_a_created_batch_is_its_summary_then_its_rows_settle(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect, complete_after_s=0.5)
    models = MODELS[dialect]
    with client(sim) as c:
        created = ok(c.post("/batches", json=BATCH), models.BatchSummary)
        other = ok(c.post("/batches", json={**BATCH, "label": "x"}), models.BatchSummary)
        first = ok(c.get(f"/batches/{created.id}"), models.BatchStatus)
        time.sleep(0.55)
        done = ok(c.get(f"/batches/{created.id}"), models.BatchStatus)
        row = ok(c.get(f"/batches/{created.id}/c-1"), models.ResponseObject)
    assert (created.request_counts, created.label) == (3, "job_1") and other.label == "x"
    assert {"RUNNING", "PENDING"} & {s.status for s in first.request_status.values()}
    assert {k: s.status for k, s in done.request_status.items()} == {
        "c-0": "COMPLETED",
        "c-1": "COMPLETED",
        "c-2": "COMPLETED",
    }
    assert row.status == "completed" and row.output


@DIALECTS
def test_a_batch_without_a_label_has_no_label_key(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    with client(sim) as c:
        created = c.post("/batches", json={"endpoint": "/v1/responses", "requests": ROWS})
        assert created.status_code == 200 and "label" not in created.json()
        assert "label" not in c.get(f"/batches/{created.json()['id']}").json()


@DIALECTS
def test_a_running_batch_has_rows_ended_running_and_pending(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    now = time.time()
    batch = sim.add_batch(
        # half-way through 400 s: a row's state changes once in 10 s, not while it is read
        dialect,
        "batch_half",
        40,
        created_at=now - 200,
        pending_until=now + 200,
        failed_every=5,
    )
    models = MODELS[dialect]
    with client(sim) as c:
        running = ok(c.get("/batches/batch_half"), models.BatchStatus)
        rows = {
            cid: ok(c.get(f"/batches/batch_half/{cid}"), models.ResponseObject)
            for cid in running.request_status
        }
    states = {cid: s.status for cid, s in running.request_status.items()}
    assert "status" not in running.model_dump(exclude_none=True)
    assert set(states.values()) == {"COMPLETED", "FAILED", "RUNNING", "PENDING"}
    assert 15 <= sum(s in ("COMPLETED", "FAILED") for s in states.values()) <= 25
    for cid, state in states.items():
        assert rows[cid].status == state.lower()
        assert (rows[cid].output is not None) == (state == "COMPLETED")
    assert batch.object_served == 1


@DIALECTS
def test_an_ended_batch_has_every_row_settled_and_each_row_served(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    sim.add_batch(dialect, "batch_done", 30, failed_every=4, cancelled_every=7, label="nightly")
    models = MODELS[dialect]
    with client(sim) as c:
        done = ok(c.get("/batches/batch_done"), models.BatchStatus)
        rows = [
            ok(c.get(f"/batches/batch_done/{cid}"), models.ResponseObject)
            for cid in done.request_status
        ]
        missing = refused(c.get("/batches/batch_done/row-999999"), 404)
        unknown = refused(c.get("/batches/batch_nope"), 404)
    states = [s.status for s in done.request_status.values()]
    assert set(states) == {"COMPLETED", "FAILED", "CANCELLED"} and done.request_counts == 30
    assert done.label == "nightly"
    assert [r.status for r in rows] == [s.lower() for s in states]
    assert all(r.error for r in rows if r.status == "failed")
    assert missing.message and unknown.message


@DIALECTS
def test_batches_are_listed_as_a_bare_array_paged_by_id(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    now = time.time()
    for i in range(30):
        sim.add_batch(dialect, f"batch_{i:02d}", 2, created_at=now - 100 + i)
    sim.add_batch("sference", "batch_other_dialect", 2)
    models = MODELS[dialect]
    with client(sim) as c:
        first = ok(c.get("/batches"), models.BatchList)
        older = ok(
            c.get("/batches", params={"before_id": "batch_05", "limit": 3}), models.BatchList
        )
        newer = ok(c.get("/batches", params={"after_id": "batch_25", "limit": 2}), models.BatchList)
        everything = ok(c.get("/batches", params={"limit": 200}), models.BatchList)
        bad = [
            refused(c.get("/batches", params=params))
            for params in ({"limit": 0}, {"limit": 201}, {"limit": "x"}, {"after_id": "nope"})
        ]
    assert [b.id for b in first] == [f"batch_{i:02d}" for i in range(29, 4, -1)]  # 25
    assert [b.id for b in older] == ["batch_04", "batch_03", "batch_02"]
    assert [b.id for b in newer] == ["batch_27", "batch_26"]
    assert len(everything) == 30 and all(b.request_counts == 2 for b in everything)
    assert all(e.type == "invalid_request_error" for e in bad)


def test_sails_guide_shape_is_an_explicit_option(provider_sim):
    sim = provider_sim(api_key=KEY, dialect="sail")
    sim.add_batch("sail", "batch_guide", 12, shape="guide", failed_every=5, pending_times=1)
    sim.add_batch("sail", "batch_guide_big", 12, shape="guide", inline=False)
    with client(sim) as c:
        pending = ok(c.get("/batches/batch_guide"), sail.GuideBatch)
        inline = ok(c.get("/batches/batch_guide"), sail.GuideBatch)
        too_large = ok(c.get("/batches/batch_guide_big"), sail.GuideBatch)
        row = ok(c.get("/batches/batch_guide_big/row-000003"), sail.ResponseObject)
    assert pending.status == "in_progress" and pending.results is None
    assert inline.status == "completed" and len(inline.results) == 12
    assert inline.request_counts.model_dump() == {"total": 12, "completed": 10, "failed": 2}
    assert sum(r.error is not None for r in inline.results) == 2
    assert too_large.results is None and too_large.error.message
    assert row.status == "completed"
    with pytest.raises(ValueError, match="no shape"):
        sim.add_batch("valar", "batch_valar_guide", 2, shape="guide")
    with pytest.raises(ValueError, match="no status"):
        sim.add_batch("valar", "batch_valar_status", 2, status="failed")


# --- refusals ----------------------------------------------------------------------------
def _with(**top: Any) -> dict[str, Any]:
    return {**BATCH, **top}


def _row(**item: Any) -> dict[str, Any]:
    return _with(requests=[{**ROWS[0], **item}])


def _meta(**metadata: Any) -> dict[str, Any]:
    return _row(params={**PARAMS, "metadata": metadata})


BAD_BATCHES = [
    (_with(completion_window="24h"), "completion_window"),
    (_row(body=PARAMS), "requests[0].body"),
    (_with(label="a b"), "label"),
    (_with(label="x" * 129), "label"),
    (_with(label=""), "label"),
    (_row(custom_id="Row-1"), "requests[0].custom_id"),
    (_row(custom_id="-row"), "requests[0].custom_id"),
    (_row(custom_id="r" * 65), "requests[0].custom_id"),
    (_row(custom_id=""), "requests[0].custom_id"),
    (_with(requests=[{"params": PARAMS}]), "requests[0].custom_id"),
    (_with(endpoint="/v1/chat/completions"), "endpoint"),
    (_with(requests=[]), "requests"),
    (_with(requests=[ROWS[0], {**ROWS[1], "custom_id": "c-0"}]), "requests"),
    (_meta(n=1), "requests[0].params.metadata.n"),
    (_meta(completion_window="asap"), "requests[0].params.metadata.completion_window"),
    (_meta(completion_window="priority"), "requests[0].params.metadata.completion_window"),
]


@DIALECTS
@pytest.mark.parametrize(("body", "param"), BAD_BATCHES)
def test_a_batch_against_the_reference_is_refused_naming_the_param(
    provider_sim, dialect, body, param
):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    with client(sim) as c:
        error = refused(c.post("/batches", json=body, headers={"idempotency-key": "k"}))
        assert c.post("/batches", json=BATCH, headers={"idempotency-key": "k"}).status_code == 200
    assert (error.type, error.param, error.code) == ("invalid_request_error", param, None)
    assert sim.creations("batches") == 1  # the refusal did not take the key


@DIALECTS
def test_more_than_100000_requests_are_refused(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    rows = [{"custom_id": f"c{i}", "params": PARAMS} for i in range(100_001)]
    with client(sim) as c:
        error = refused(c.post("/batches", json=_with(requests=rows)))
    assert error.param == "requests" and "100,000" in error.message


@DIALECTS
@pytest.mark.parametrize(
    ("body", "param", "only"),
    [
        ({**BODY, "metadata": {"n": 1}}, "metadata.n", None),
        ({**BODY, "metadata": {"completion_window": "24h"}}, "metadata.completion_window", None),
        (
            {**BODY, "metadata": {"completion_window": "priority"}},
            "metadata.completion_window",
            "valar",
        ),
        ({**BODY, "store": False}, "store", "valar"),
        ({**BODY, "stream": True}, "stream", "valar"),
        ({**BODY, "truncation": "auto"}, "truncation", None),
    ],
)
def test_a_response_against_the_reference_is_refused_naming_the_param(
    provider_sim, dialect, body, param, only
):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    with client(sim) as c:
        answer = c.post("/responses", json=body)
    if only not in (None, dialect):
        assert answer.status_code == 202  # the other reference takes it
        return
    error = refused(answer)
    assert (error.type, error.param) == ("invalid_request_error", param)


@DIALECTS
@pytest.mark.parametrize(
    ("path", "body", "other"),
    [
        ("/responses", BODY, {**BODY, "input": "other"}),
        ("/batches", BATCH, _with(label="other")),
    ],
)
def test_a_reused_key_with_another_body_is_an_idempotency_error(
    provider_sim, dialect, path, body, other
):
    sim = provider_sim(api_key=KEY, dialect=dialect)
    with client(sim) as c:
        first = c.post(path, json=body, headers={"idempotency-key": "k"})
        replay = c.post(path, json=body, headers={"idempotency-key": "k"})
        error = refused(c.post(path, json=other, headers={"idempotency-key": "k"}))
    assert first.is_success and replay.status_code == first.status_code
    assert replay.json()["id"] == first.json()["id"]
    assert error.type == "idempotency_error" and "Idempotency-Key" in error.message


@DIALECTS
def test_injected_faults_answer_error_envelopes(provider_sim, dialect):
    sim = provider_sim(api_key=KEY, dialect=dialect, create_fail_first=1.0)
    sim.add_response("resp_flaky", fail_times=1, fail_status=503, retry_after=1)
    sim.add_batch(dialect, "batch_flaky", 2, row_failures={"row-000001": 1})
    with client(sim) as c:
        flaky = refused(c.get("/responses/resp_flaky"), 503)
        row = refused(c.get("/batches/batch_flaky/row-000001"), 500)
        failed = refused(c.post("/responses", json=BODY, headers={"idempotency-key": "k"}), 500)
        ok(c.get("/batches/batch_flaky/row-000001"), MODELS[dialect].ResponseObject)
    assert {flaky.type, row.type, failed.type} == {"api_error"}
