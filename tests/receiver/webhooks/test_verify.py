"""Signature verification, with signatures made by standardwebhooks/svix and hmac (never by us)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from datetime import UTC, datetime

import pytest
import svix.webhooks
from standardwebhooks.webhooks import Webhook

from nopoll.exceptions import VerificationError
from nopoll.wire import decode_webhook_secret
from receiver.webhooks.verify import Verifier

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
OTHER = "whsec_" + base64.b64encode(b"o" * 32).decode()
BODY = b'{"type":"response.completed","data":{"id":"resp_1"}}'


def headers(
    secret: str | bytes = SECRET, msg_id: str = "msg_1", ts: int | None = None, body: bytes = BODY
) -> dict[str, str]:
    ts = int(time.time()) if ts is None else ts
    sig = Webhook(secret).sign(msg_id, datetime.fromtimestamp(ts, tz=UTC), body.decode())
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sig}


def verifier(*secrets: str, tolerance: int = 300) -> Verifier:
    return Verifier([decode_webhook_secret(s) for s in secrets or (SECRET,)], tolerance)


def test_valid_signature_returns_webhook_id() -> None:
    assert verifier().verify(headers(), BODY) == "msg_1"


def test_svix_signature_is_accepted() -> None:
    h = svix.webhooks.Webhook(SECRET)
    ts = datetime.now(tz=UTC)
    sig = h.sign("msg_svix", ts, BODY.decode())
    hdrs = {
        "webhook-id": "msg_svix",
        "webhook-timestamp": str(int(ts.timestamp())),
        "webhook-signature": sig,
    }
    assert verifier().verify(hdrs, BODY) == "msg_svix"


def test_tampered_body_is_rejected() -> None:
    with pytest.raises(VerificationError, match="no matching signature"):
        verifier().verify(headers(), BODY.replace(b"resp_1", b"resp_2"))


def test_wrong_secret_is_rejected() -> None:
    with pytest.raises(VerificationError, match="no matching signature"):
        verifier().verify(headers(OTHER), BODY)


def test_rotation_accepts_old_and_new_secret() -> None:
    v = verifier(OTHER, SECRET)
    assert v.verify(headers(SECRET), BODY) == "msg_1"
    assert v.verify(headers(OTHER), BODY) == "msg_1"


def test_several_signatures_in_one_header() -> None:
    good = headers()
    bad = headers(OTHER)
    combined = {
        **good,
        "webhook-signature": f"{bad['webhook-signature']} {good['webhook-signature']}",
    }
    assert verifier().verify(combined, BODY) == "msg_1"


def test_raw_secret_is_used_as_utf8_bytes() -> None:
    raw = "my-raw-openai-style-secret"
    signed = headers(raw.encode())  # standardwebhooks: bytes are the key as-is
    assert verifier(raw).verify(signed, BODY) == "msg_1"


@pytest.mark.parametrize("offset", [-301, 301, -86400])
def test_timestamp_outside_tolerance(offset: int) -> None:
    with pytest.raises(VerificationError, match=r"too old|future"):
        verifier().verify(headers(ts=int(time.time()) + offset), BODY)


def test_configurable_tolerance() -> None:
    old = headers(ts=int(time.time()) - 1000)
    assert verifier(SECRET, tolerance=2000).verify(old, BODY) == "msg_1"


@pytest.mark.parametrize("name", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_header(name: str) -> None:
    h = headers()
    del h[name]
    with pytest.raises(VerificationError, match=f"missing {name}"):
        verifier().verify(h, BODY)


@pytest.mark.parametrize(
    "signature",
    ["nocomma", "v1,", "v1,!!!notbase64!!!", "v2,abc", ",", "v1 , x", "v1," + "A" * 10],
)
def test_malformed_signature_header_is_a_verification_error(signature: str) -> None:
    h = {**headers(), "webhook-signature": signature}
    with pytest.raises(VerificationError):
        verifier().verify(h, BODY)


@pytest.mark.parametrize("ts", ["abc", "1.5e9", "-5", "", "\uff11\uff12\uff13", "9" * 20])
def test_malformed_timestamp(ts: str) -> None:
    h = {**headers(), "webhook-timestamp": ts}
    with pytest.raises(VerificationError):
        verifier().verify(h, BODY)


def test_too_many_signatures_is_rejected() -> None:
    h = {**headers(), "webhook-signature": " ".join(["v1,AAAA"] * 100)}
    with pytest.raises(VerificationError, match="more than"):
        verifier().verify(h, BODY)


def test_non_utf8_body_signed_over_raw_bytes_verifies() -> None:
    body = b"\xff\xfe not utf-8 \x80"
    key = decode_webhook_secret(SECRET)
    ts = str(int(time.time()))
    mac = hmac.new(key, b"msg_9." + ts.encode() + b"." + body, hashlib.sha256).digest()
    h = {
        "webhook-id": "msg_9",
        "webhook-timestamp": ts,
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }
    assert verifier().verify(h, body) == "msg_9"


@pytest.mark.parametrize("bad", ["whsec_%%%notbase64", "whsec_", ""])
def test_bad_secret_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        decode_webhook_secret(bad)
