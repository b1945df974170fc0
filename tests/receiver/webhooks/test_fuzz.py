"""Generated input, against the real thing: the webhook route under uvicorn and Redis, the
config loader, and every dialect's row parser. Properties: never a 5xx, every webhook
request counted in the metrics with its outcome, never an exception out of a parser or the
loader other than the one that says what is wrong. (``bench/fuzz.py`` runs the same
generators at 100,000 requests and 10,000 rows against ``nopoll serve``.)"""

from __future__ import annotations

import socket
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nopoll.envelope import envelope_from_row
from nopoll.exceptions import ConfigError
from receiver.config.settings import Settings, load_settings
from receiver.providers import openai, sail, sference
from tests.fuzzing import dialect_lines, json_values, webhook_requests
from tests.receiver.helpers import _answer, _ApiThread, _not_http

# a failing example holding a 70,000-character field is reported whole
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

SECRET = "whsec_c2VjcmV0LWZvci10aGUtZnV6ei10ZXN0cy0xMjM0NQ=="
STATUSES = {"completed", "incomplete", "failed", "cancelled", "expired"}


def _send(base: str, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    head = b"POST " + path + b" HTTP/1.1\r\nhost: x\r\n"
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture(scope="module")
def api(_redis_base_url, tmp_path_factory):
    settings = load_settings(
        None,
        env={},
        overrides={
            "redis_url": _redis_base_url,
            "data_dir": str(tmp_path_factory.mktemp("fuzz") / "data"),
            "providers": {
                "sim": {
                    "dialect": "openai",
                    "base_url": "http://127.0.0.1:9/v1",
                    "webhook_secrets": [SECRET],
                }
            },
            "sinks": {"files": {"type": "jsonl", "dir": str(tmp_path_factory.mktemp("out"))}},
            "max_body_bytes": 65536,
        },
    )
    with _ApiThread(settings, _redis_base_url) as server:
        yield server


ENDPOINT_PATHS = {b"/webhooks/sim", b"/webhooks/nope", b"/webhooks/", b"/webhooks/t/abc.def"}
"""Paths the webhook endpoint itself answers (every other one is Starlette's 404/405)."""


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=webhook_requests(SECRET))
def test_no_webhook_request_gets_a_5xx_and_each_is_counted(api, request):
    path, headers, body = request
    before = api.callbacks_counted()
    try:
        raw = _send(api.base, path, headers, body)
    except ConnectionResetError:
        # Only a request that is not valid HTTP (a control byte in a header) may be cut:
        # uvicorn's parser refuses it, answers 400 and closes under the unread body.
        assert any(_not_http(value) for _, value in headers), request
        return
    status, payload = _answer(raw)
    assert status != 0, raw[:200]
    assert status < 500, (status, payload)
    if status >= 400 and payload:
        assert payload.get("error"), payload  # every 4xx nopoll answers says why
    if path in ENDPOINT_PATHS and payload:  # (uvicorn's own 400 for bad HTTP is not JSON)
        # every request the endpoint answered is counted, with its outcome as a label
        assert api.callbacks_counted() == before + 1, (path, status, payload)


@settings(max_examples=300, deadline=None)
@given(raw=st.dictionaries(st.sampled_from([*Settings.model_fields, "junk"]), json_values))
def test_the_config_loader_says_what_is_wrong_or_loads(raw, tmp_path_factory):
    try:
        load_settings(None, env={}, overrides={"data_dir": "/tmp/nopoll-fuzz", **raw})
    except ConfigError as exc:
        assert str(exc)  # names the key and what is wrong


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300))
def test_a_config_file_of_any_text_loads_or_is_a_config_error(text, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "nopoll.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_settings(path, env={})
    except ConfigError as exc:
        assert str(exc)


def _envelope_ok(row: Any, *, provider_said: bool = False) -> None:
    """The row's envelope is well formed; a failed row without a body says why, unless
    the provider's own status said failed (``provider_said``)."""
    env = envelope_from_row(
        row, provider="sim", batch_id="batch_1", received_at="2026-01-01T00:00:00Z", event_id=None
    )
    assert env.status in STATUSES
    assert env.key.startswith("batch_1/")
    if row.status == "failed" and row.body is None and not provider_said:
        assert env.error, "a bad row names its cause"
    orjson.dumps(env.to_dict())  # every field serializable as the sinks write it


def _said_status(line: bytes) -> bool:
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    status = data.get("status") if isinstance(data, dict) else None
    return isinstance(status, str) and status.lower() in STATUSES


@settings(max_examples=500, deadline=None)
@given(line=dialect_lines("openai"), index=st.integers(0, 100_000))
def test_openai_lines_always_become_a_row(line, index):
    row = openai.parse_line(index, line)
    assert row.index == index
    _envelope_ok(row)


@settings(max_examples=500, deadline=None)
@given(line=dialect_lines("sference"), index=st.integers(0, 100_000))
def test_sference_lines_always_become_a_row(line, index):
    row = sference.parse_line(index, line)
    assert row.index == index
    _envelope_ok(row, provider_said=_said_status(line))


@settings(max_examples=500, deadline=None)
@given(item=json_values, index=st.integers(0, 100_000))
def test_sail_inline_items_always_become_a_row(item, index):
    row = sail.row_from_item(index, item)
    assert row.index == index
    _envelope_ok(row)
