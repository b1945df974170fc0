"""What a client sends on the webhook route, however odd, against a real uvicorn server:
repeated headers (docs/http.md) and hostile input. Every 4xx
says why in ``{"error": ...}``; nothing gives a 500.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import httpx
import orjson
import pytest

from nopoll.wire import decode_webhook_secret
from receiver.queue.enqueue import JOBS_QUEUE
from receiver.webhooks.verify import MAX_SIGNATURES
from tests.receiver.rawhttp import raw_request


def sign(secret: str, msg_id: str | bytes, timestamp: str, body: bytes) -> str:
    """A v1 signature over raw bytes (standardwebhooks only signs text)."""
    msg_id = msg_id.encode() if isinstance(msg_id, str) else msg_id
    signed = msg_id + b"." + timestamp.encode() + b"." + body
    mac = hmac.new(decode_webhook_secret(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def as_list(headers: dict[str, str], *extra: tuple[str, str]) -> list[tuple[str, str]]:
    return [*headers.items(), *extra]


def assert_says_why(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert isinstance(error, str) and error
    return error


# -- repeated headers ---------------------------------------------------------------------


@pytest.mark.parametrize("junk", ["v1,AAAA", "v1,###", "garbage", "", "v2,abc"])
@pytest.mark.parametrize("valid_first", [True, False])
async def test_a_valid_signature_beside_junk_signature_headers_is_accepted(
    api, signed_callback, redis_sync_client, junk, valid_first
):
    body, headers = signed_callback("resp_rep")
    valid = headers.pop("webhook-signature")
    sigs = [("webhook-signature", valid), ("webhook-signature", junk)]
    r = await api.post(
        "/webhooks/sim", content=body, headers=as_list(headers, *sigs[:: 1 if valid_first else -1])
    )
    assert r.status_code == 202, r.text
    assert redis_sync_client.zrange(JOBS_QUEUE, 0, -1) == [b"resp:sim:resp_rep"]


async def test_signature_headers_count_together_towards_the_signature_cap(api, signed_callback):
    body, headers = signed_callback("resp_cap")
    valid = headers.pop("webhook-signature")
    # MAX_SIGNATURES in all is fine, one more over however many headers is malformed
    junk = [("webhook-signature", "v1,AAAA")] * (MAX_SIGNATURES - 1)
    r = await api.post(
        "/webhooks/sim", content=body, headers=as_list(headers, *junk, ("webhook-signature", valid))
    )
    assert r.status_code == 202, r.text
    body, headers = signed_callback("resp_cap2")
    valid = headers.pop("webhook-signature")
    r = await api.post(
        "/webhooks/sim",
        content=body,
        headers=as_list(
            headers, *junk, ("webhook-signature", "v1,AAAA v1,AAAA"), ("webhook-signature", valid)
        ),
    )
    assert f"more than {MAX_SIGNATURES}" in assert_says_why(r, 401)


@pytest.mark.parametrize("name", ["webhook-id", "webhook-timestamp"])
async def test_repeated_identical_id_or_timestamp_is_fine(api, signed_callback, name):
    body, headers = signed_callback("resp_same")
    r = await api.post(
        "/webhooks/sim", content=body, headers=as_list(headers, (name, headers[name]))
    )
    assert r.status_code == 202, r.text


@pytest.mark.parametrize("name", ["webhook-id", "webhook-timestamp"])
@pytest.mark.parametrize("genuine_first", [True, False])
async def test_repeated_id_or_timestamp_that_differ_is_400(
    api, signed_callback, redis_sync_client, name, genuine_first
):
    body, headers = signed_callback("resp_differ")
    other = str(int(headers["webhook-timestamp"]) + 1) if name == "webhook-timestamp" else "msg_x"
    pair = [(name, headers.pop(name)), (name, other)]
    r = await api.post(
        "/webhooks/sim",
        content=body,
        headers=as_list(headers, *pair[:: 1 if genuine_first else -1]),
    )
    error = assert_says_why(r, 400)
    assert name in error and "differ" in error
    assert redis_sync_client.zrange(JOBS_QUEUE, 0, -1) == []


# -- hostile input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        b"webhook-id: msg_\xff\xfe\xc3\xa9",
        b"webhook-timestamp: \xb2\xb3\xb9",  # latin-1 superscript digits: str.isdigit() is True
        b"webhook-signature: v1,\xff\xff\xff\xff",
        b"x-anything: \x80\x81\x82",
    ],
)
async def test_non_ascii_header_bytes_are_a_4xx_with_a_reason(api, signed_callback, header):
    body, headers = signed_callback("resp_bytes")
    name = header.split(b":")[0].decode()
    head = b"POST /webhooks/sim HTTP/1.1\r\nhost: x\r\n"
    for k, v in headers.items():
        if k != name:
            head += f"{k}: {v}\r\n".encode()
    head += header + b"\r\n"
    status, payload = await raw_request(str(api.base_url), head, body)
    if name == "x-anything":  # an unrelated header is ignored: the callback is genuine
        assert status == 202, payload
    else:
        assert status in (400, 401) and isinstance(payload["error"], str), payload


async def test_a_signed_non_ascii_webhook_id_is_refused_with_a_reason(api, webhook_secret):
    body = orjson.dumps({"id": "e", "type": "response.completed", "data": {"id": "r"}})
    ts = str(int(time.time()))
    msg_id = "msg_é".encode("latin-1")
    head = (
        b"POST /webhooks/sim HTTP/1.1\r\nhost: x\r\n"
        + b"webhook-id: " + msg_id + b"\r\n"
        + f"webhook-timestamp: {ts}\r\n".encode()
        + f"webhook-signature: {sign(webhook_secret, 'msg_é', ts, body)}\r\n".encode()
    )  # fmt: skip
    status, payload = await raw_request(str(api.base_url), head, body)
    assert status in (400, 401) and payload["error"], payload


async def test_empty_bodies(api, signed_callback, webhook_secret):
    _, headers = signed_callback("resp_empty")
    assert "signature" in assert_says_why(
        await api.post("/webhooks/sim", content=b"", headers=headers), 401
    )
    headers["webhook-signature"] = sign(
        webhook_secret, headers["webhook-id"], headers["webhook-timestamp"], b""
    )
    assert "JSON" in assert_says_why(
        await api.post("/webhooks/sim", content=b"", headers=headers), 400
    )
    assert_says_why(await api.post("/webhooks/sim"), 401)  # no headers, no body


async def test_huge_header_values(api, signed_callback, webhook_secret):
    body, headers = signed_callback("resp_huge")
    cases = {
        "many signatures": {"webhook-signature": " ".join(["v1,AAAA"] * 4000)},
        "one huge signature": {"webhook-signature": "v1," + "A" * 32000},
        "huge timestamp": {"webhook-timestamp": "9" * 30000},
        "huge unrelated header": {"x-padding": "p" * 30000},
    }
    for name, extra in cases.items():
        r = await api.post("/webhooks/sim", content=body, headers={**headers, **extra})
        if name == "huge unrelated header":
            assert r.status_code == 202, r.text
        else:
            assert_says_why(r, 401)
    long_id = "m" * 30000  # genuinely signed, but not a webhook-id nopoll accepts
    signature = sign(webhook_secret, long_id, headers["webhook-timestamp"], body)
    r = await api.post(
        "/webhooks/sim",
        content=body,
        headers={**headers, "webhook-id": long_id, "webhook-signature": signature},
    )
    assert "webhook-id" in assert_says_why(r, 400)


@pytest.mark.parametrize(
    "body",
    [b"[" * 4000, b'{"type":"response.completed","data":' * 100, b"\x00" * 100, b"{}" * 1000],
)
async def test_signed_pathological_json_is_400(api, signed_callback, webhook_secret, body):
    _, headers = signed_callback("resp_path")
    headers["webhook-signature"] = sign(
        webhook_secret, headers["webhook-id"], headers["webhook-timestamp"], body
    )
    r = await api.post("/webhooks/sim", content=body, headers=headers)
    assert_says_why(r, 400)


@pytest.mark.parametrize(
    "path", ["/webhooks/", "/webhooks/%FF", "/webhooks/%00", "/webhooks/sim/x"]
)
async def test_odd_webhook_paths_are_404_with_a_reason(api, signed_callback, path):
    body, headers = signed_callback()
    assert_says_why(await api.post(path, content=body, headers=headers), 404)


async def test_other_methods_say_why(api):
    r = await api.get("/webhooks/sim")
    assert_says_why(r, 405)
    assert "POST" in r.headers["allow"]
