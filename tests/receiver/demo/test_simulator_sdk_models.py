"""The official SDKs judge the provider simulator: every object it serves parses with the
``anthropic`` and ``openai`` packages' own models, with no field those models do not know
(a misspelt field in the simulator fails here instead of hiding a bug in nopoll), and every
callback the tests sign as OpenAI passes the ``openai`` SDK's ``webhooks.unwrap``."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest
from pydantic import BaseModel

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse  # noqa: E402
from anthropic.types.shared import ErrorResponse  # noqa: E402
from openai.types import Batch, FileObject  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.responses import Response  # noqa: E402
from openai.types.webhooks import (  # noqa: E402
    BatchCancelledWebhookEvent,
    BatchCompletedWebhookEvent,
    BatchExpiredWebhookEvent,
    BatchFailedWebhookEvent,
    ResponseCancelledWebhookEvent,
    ResponseCompletedWebhookEvent,
    ResponseFailedWebhookEvent,
    ResponseIncompleteWebhookEvent,
)

from receiver.demo.responses import send_callback, sign_callback  # noqa: E402

KEY = "sk-sim-test"
ANTHROPIC = {"authorization": f"Bearer {KEY}", "anthropic-version": "2026-10-21"}
OPENAI = {"authorization": f"Bearer {KEY}"}


def _no_extra(value: Any, where: str) -> None:
    if isinstance(value, BaseModel):
        extra = value.model_extra or {}
        assert not extra, f"{where}: fields the SDK's model does not know: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_extra(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_extra(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_extra(item, f"{where}.{key}")


def strict(model: type[BaseModel], data: Any) -> Any:
    """``data`` validated by an SDK model, with nothing the model does not know."""
    parsed = model.model_validate(data)
    _no_extra(parsed, model.__name__)
    return parsed


# --- anthropic --------------------------------------------------------------------------
def test_every_anthropic_batch_state_is_an_sdk_message_batch(provider_sim):
    sim = provider_sim(api_key=KEY)
    sim.add_batch("anthropic", "msgbatch_a", 12, in_progress_polls=1, canceling_polls=1)
    sim.add_batch("anthropic", "msgbatch_old", 3, archived=True)
    url = f"{sim.host_url}/v1/messages/batches"
    seen = []
    with httpx.Client(headers=ANTHROPIC) as http:
        first = strict(MessageBatch, http.get(f"{url}/msgbatch_a").json())
        canceled = strict(MessageBatch, http.post(f"{url}/msgbatch_a/cancel").json())
        for _ in range(2):
            seen.append(strict(MessageBatch, http.get(f"{url}/msgbatch_a").json()))
        archived = strict(MessageBatch, http.get(f"{url}/msgbatch_old").json())
    assert first.processing_status == "in_progress" and first.results_url is None
    assert canceled.cancel_initiated_at is not None
    assert [b.processing_status for b in seen] == ["canceling", "ended"]
    ended = seen[-1]
    assert ended.ended_at is not None and ended.results_url.startswith(sim.host_url)
    assert sum(ended.request_counts.model_dump().values()) == 12
    assert ended.request_counts.canceled == 4 and ended.request_counts.processing == 0
    assert archived.archived_at is not None


def test_every_anthropic_result_line_is_an_sdk_individual_response(provider_sim):
    sim = provider_sim(api_key=KEY)
    sim.add_batch(
        "anthropic",
        "msgbatch_r",
        40,
        errored_every=5,
        expired_every=7,
        max_tokens_every=3,
        canceled_every=4,
        cancel_after_polls=0,
    )
    url = f"{sim.host_url}/v1/messages/batches/msgbatch_r"
    with httpx.Client(headers=ANTHROPIC) as http:
        batch = strict(MessageBatch, http.get(url).json())
        lines = http.get(batch.results_url).content.splitlines()
    rows = [strict(MessageBatchIndividualResponse, orjson.loads(line)) for line in lines]
    assert {r.result.type for r in rows} == {"succeeded", "errored", "expired", "canceled"}
    assert [r.custom_id for r in rows] != sorted(r.custom_id for r in rows)  # out of order
    assert len({r.custom_id for r in rows}) == 40
    succeeded = [r.result.message for r in rows if r.result.type == "succeeded"]
    assert {m.stop_reason for m in succeeded} == {"end_turn", "max_tokens"}


def test_the_anthropic_create_route_answers_sdk_objects_and_errors(provider_sim):
    sim = provider_sim(api_key=KEY, complete_after_s=30)
    client = anthropic.Anthropic(base_url=sim.host_url, api_key=KEY, max_retries=0)
    params = {"model": "m-1", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    requests = [{"custom_id": f"c{i}", "params": params} for i in range(3)]
    with httpx.Client(headers=ANTHROPIC) as http:
        url = f"{sim.host_url}/v1/messages/batches"
        created = strict(MessageBatch, http.post(url, json={"requests": requests}).json())
        bad = http.post(url, json={"requests": [{"custom_id": "a b", "params": params}]})
        unknown = http.get(f"{url}/msgbatch_nope")
        no_version = http.get(f"{url}/{created.id}", headers={"anthropic-version": ""})
        old_bearer = http.get(f"{url}/{created.id}", headers={"anthropic-version": "2023-06-01"})
    assert created.processing_status == "in_progress" and created.request_counts.processing == 3
    for answer, status, kind in (
        (bad, 400, "invalid_request_error"),
        (unknown, 404, "not_found_error"),
        (no_version, 400, "invalid_request_error"),
        (old_bearer, 401, "authentication_error"),
    ):
        assert answer.status_code == status
        assert strict(ErrorResponse, answer.json()).error.type == kind
    # the SDK itself, end to end, as users of Anthropic's API call it
    assert client.messages.batches.retrieve(created.id).id == created.id
    assert client.messages.batches.cancel(created.id).processing_status == "canceling"
    old = anthropic.Anthropic(
        base_url=sim.host_url,
        api_key=None,
        max_retries=0,
        default_headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
    )
    assert old.messages.batches.retrieve(created.id).id == created.id


@pytest.mark.parametrize(("status", "kind"), [(429, "rate_limit_error"), (529, "overloaded_error")])
def test_anthropic_storms_are_sdk_errors_with_retry_after(provider_sim, status, kind):
    sim = provider_sim(api_key=KEY)
    sim.add_batch("anthropic", "msgbatch_s", 2, fail_times=1, fail_status=status)
    sim.add_batch("anthropic", "msgbatch_t", 2, results_fail_times=1, results_fail_status=status)
    url = f"{sim.host_url}/v1/messages/batches"
    with httpx.Client(headers=ANTHROPIC) as http:
        stormy = http.get(f"{url}/msgbatch_s")
        strict(MessageBatch, http.get(f"{url}/msgbatch_s").json())
        ended = strict(MessageBatch, http.get(f"{url}/msgbatch_t").json())
        results = http.get(ended.results_url)
    for answer in (stormy, results):
        assert answer.status_code == status and float(answer.headers["retry-after"]) > 0
        assert strict(ErrorResponse, answer.json()).error.type == kind


# --- openai -----------------------------------------------------------------------------
def test_openai_responses_served_and_created_are_sdk_responses(provider_sim):
    sim = provider_sim(api_key=KEY, auto_respond=True)
    sim.add_response("resp_done", text="hello")
    sim.add_response("resp_cut", status="incomplete", incomplete_reason="max_output_tokens")
    sim.add_response("resp_pending", pending_times=1)
    with httpx.Client(headers=OPENAI) as http:
        bodies = [
            http.get(f"{sim.base_url}/responses/{rid}").json()
            for rid in ("resp_done", "resp_cut", "resp_pending", "resp_generated_1")
        ]
        created = http.post(
            f"{sim.base_url}/responses",
            json={"model": "m-1", "input": "hi", "background": True},
            headers={"idempotency-key": "k1"},
        ).json()
        bodies.append(created)
        bodies.append(http.get(f"{sim.base_url}/responses/{created['id']}").json())
    parsed = [strict(Response, body) for body in bodies]
    assert parsed[0].output_text == "hello"
    assert parsed[1].incomplete_details.reason == "max_output_tokens"
    assert parsed[2].status == "in_progress"


def test_openai_batches_files_and_file_lines_are_sdk_shapes(provider_sim):
    sim = provider_sim(api_key=KEY)
    sim.add_batch("openai", "batch_o", 10, failed_every=4, pending_times=1)
    with httpx.Client(headers=OPENAI) as http:
        pending = strict(Batch, http.get(f"{sim.base_url}/batches/batch_o").json())
        done = strict(Batch, http.get(f"{sim.base_url}/batches/batch_o").json())
        out = http.get(f"{sim.base_url}/files/{done.output_file_id}/content").content
        err = http.get(f"{sim.base_url}/files/{done.error_file_id}/content").content
        line = {
            "custom_id": "c0",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": "m-1", "input": "hi"},
        }
        upload = http.post(
            f"{sim.base_url}/files",
            files={"file": ("b.jsonl", orjson.dumps(line) + b"\n")},
            data={"purpose": "batch"},
            headers={"idempotency-key": "f1"},
        ).json()
        created = http.post(
            f"{sim.base_url}/batches",
            json={
                "input_file_id": upload["id"],
                "endpoint": "/v1/responses",
                "completion_window": "24h",
            },
            headers={"idempotency-key": "b1"},
        ).json()
    assert pending.status != "completed" and done.status == "completed"
    assert strict(FileObject, upload).purpose == "batch"
    assert strict(Batch, created).input_file_id == upload["id"]
    lines = [orjson.loads(x) for x in out.splitlines() + err.splitlines()]
    assert len(lines) == 10
    for item in lines:
        # OpenAI's batch output line (the SDK has no model for it: its documented keys)
        assert set(item) == {"id", "custom_id", "response", "error"}
        assert set(item["response"]) == {"status_code", "request_id", "body"}
        if item["response"]["status_code"] == 200:
            strict(Response, item["response"]["body"])


def test_an_openai_chat_completions_batch_serves_sdk_chat_completions(provider_sim):
    """A batch of ``/v1/chat/completions`` lines answers chat completions in its output file,
    as OpenAI does, not Responses objects (created by ``POST /v1/batches`` or added)."""
    sim = provider_sim(api_key=KEY)
    sim.add_batch("openai", "batch_chat", 6, failed_every=4, endpoint="/v1/chat/completions")
    line = {
        "custom_id": "c0",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m-1", "messages": [{"role": "user", "content": "hi"}]},
    }
    with httpx.Client(headers=OPENAI) as http:
        upload = http.post(
            f"{sim.base_url}/files",
            files={"file": ("b.jsonl", orjson.dumps(line) + b"\n")},
            data={"purpose": "batch"},
        ).json()
        created = http.post(
            f"{sim.base_url}/batches",
            json={
                "input_file_id": upload["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        ).json()
        bodies = []
        for batch_id in ("batch_chat", created["id"]):
            batch = strict(Batch, http.get(f"{sim.base_url}/batches/{batch_id}").json())
            assert batch.endpoint == "/v1/chat/completions"
            out = http.get(f"{sim.base_url}/files/{batch.output_file_id}/content").content
            bodies += [orjson.loads(x)["response"]["body"] for x in out.splitlines()]
    assert len(bodies) == 5 + 1
    for body in bodies:
        assert strict(ChatCompletion, body).choices[0].message.content


def test_sferences_result_rows_carry_sdk_chat_completions(provider_sim):
    """sference's batch routes have no official SDK, but its ``result_json`` is OpenAI's
    chat completion. (Sail's and Valar's Responses objects are their own, not OpenAI's:
    ``tests/contracts`` judges them.)"""
    sim = provider_sim(api_key=KEY)
    sim.add_batch("sference", "b_sference", 6, failed_every=3)
    with httpx.Client(headers=OPENAI) as http:
        lines = http.get(f"{sim.base_url}/batches/b_sference/results.jsonl").content
    chats = [r["result_json"] for r in map(orjson.loads, lines.splitlines()) if r["result_json"]]
    assert len(chats) == 4
    for chat in chats:
        assert strict(ChatCompletion, chat).choices[0].message.content


# --- signed callbacks -------------------------------------------------------------------
_EVENTS = {
    "response.completed": ResponseCompletedWebhookEvent,
    "response.incomplete": ResponseIncompleteWebhookEvent,
    "response.failed": ResponseFailedWebhookEvent,
    "response.cancelled": ResponseCancelledWebhookEvent,
    "batch.completed": BatchCompletedWebhookEvent,
    "batch.failed": BatchFailedWebhookEvent,
    "batch.cancelled": BatchCancelledWebhookEvent,
    "batch.expired": BatchExpiredWebhookEvent,
}


@pytest.mark.parametrize("event_type", sorted(_EVENTS))
def test_the_suites_signed_callbacks_pass_openais_own_unwrap(
    signed_callback, webhook_secret, event_type
):
    client = openai.OpenAI(api_key="unused", webhook_secret=webhook_secret)
    object_id = ("batch_" if event_type.startswith("batch.") else "resp_") + "abc123"
    body, headers = signed_callback(object_id, event_type=event_type)
    event = client.webhooks.unwrap(body, headers)
    assert isinstance(event, _EVENTS[event_type]) and event.data.id == object_id
    strict(_EVENTS[event_type], orjson.loads(body))
    # and the simulator's own signer (nopoll demo, send-test, the benchmarks)
    headers = sign_callback(webhook_secret, "msg_1", body, int(time.time()))
    assert client.webhooks.unwrap(body, headers).type == event_type


def test_a_callback_signed_with_another_secret_fails_openais_unwrap(signed_callback):
    client = openai.OpenAI(api_key="unused", webhook_secret="whsec_" + "A" * 44)
    body, headers = signed_callback("resp_abc123")
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body, headers)


def _unwrapped_by_openai(secret: str, body: bytes, headers: Any, event_type: str, oid: str) -> None:
    """``body`` and ``headers`` pass the openai SDK's ``webhooks.unwrap`` with ``secret`` and
    parse strictly as the SDK's event type for ``event_type``, about ``oid``."""
    client = openai.OpenAI(api_key="unused", webhook_secret=secret)
    event = client.webhooks.unwrap(body, dict(headers))
    assert isinstance(event, _EVENTS[event_type]) and event.data.id == oid
    strict(_EVENTS[event_type], orjson.loads(body))


def _object_id(event_type: str) -> str:
    return ("batch_" if event_type.startswith("batch.") else "resp_") + "abc123"


@pytest.mark.parametrize("event_type", sorted(_EVENTS))
async def test_the_simulators_callbacks_pass_openais_own_unwrap(webhook_secret, event_type):
    """What the simulator sends (callbacks of created responses, ``nopoll demo``, the
    deploy tests): ``send_callback``'s request as it goes out."""
    sent: list[httpx.Request] = []

    def capture(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(202)

    oid = _object_id(event_type)
    async with httpx.AsyncClient(transport=httpx.MockTransport(capture)) as client:
        url = "http://nopoll.test/webhooks/sim"
        await send_callback(client, url, webhook_secret, oid, event_type=event_type)
    [request] = sent
    _unwrapped_by_openai(webhook_secret, request.content, request.headers, event_type, oid)


@pytest.mark.parametrize("secret_form", ["whsec", "raw"])
@pytest.mark.parametrize("event_type", sorted(_EVENTS))
def test_nopoll_send_test_callbacks_pass_openais_own_unwrap(
    tmp_path, monkeypatch, webhook_secret, event_type, secret_form
):
    """``nopoll send-test`` signs as the provider would: with a ``whsec_`` secret or a raw
    one (used as its bytes, the openai SDK's rule too)."""
    from receiver.cli import _try, main

    secret = webhook_secret if secret_form == "whsec" else "a-raw-secret-0123456789abcdef"
    config = tmp_path / "nopoll.yaml"
    config.write_text(
        "providers:\n  sim:\n    dialect: openai\n    base_url: http://127.0.0.1:9/v1\n"
        f"    webhook_secrets: ['{secret}']\n"
    )
    sent: list[tuple[bytes, dict[str, str]]] = []

    def capture(url: str, target: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        sent.append((body, headers))
        return httpx.Response(202, json={"status": "queued"})

    monkeypatch.setattr(_try, "_post_callback", capture)
    oid = _object_id(event_type)
    which = "--batch-id" if event_type.startswith("batch.") else "--response-id"
    args = ["send-test", "--config", str(config), "sim", which, oid, "--event", event_type]
    assert main(args) == 0
    [(body, headers)] = sent
    _unwrapped_by_openai(secret, body, headers, event_type, oid)


def test_the_soaks_callbacks_pass_openais_own_unwrap():
    """The soak (tests/soak.py, bench/soak.py) signs its own callbacks."""
    from types import SimpleNamespace

    from standardwebhooks.webhooks import Webhook

    from tests import soak

    signer = SimpleNamespace(signer=Webhook(soak.SECRET))
    for event_type in ("response.completed", "response.failed", "batch.completed"):
        oid = _object_id(event_type)
        body, headers = soak.Soak._signed(signer, event_type, oid, f"msg_{oid}")  # type: ignore[arg-type]
        _unwrapped_by_openai(soak.SECRET, body, headers, event_type, oid)
