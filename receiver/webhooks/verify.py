"""Standard Webhooks signature verification for provider callbacks.

The wire format is the Standard Webhooks spec: ``webhook-id``, ``webhook-timestamp`` and
``webhook-signature`` (``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``, several
space-separated). :class:`Verifier` checks the raw bytes against a list of keys (rotation;
raw secrets decoded by :func:`nopoll.wire.decode_webhook_secret`), with a configurable
tolerance, at most :data:`MAX_SIGNATURES`, and raises only :class:`VerificationError`
with a reason safe to send back.

See docs/security.md (forged and replayed callbacks), which says why this is not
``standardwebhooks.Webhook.verify``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping, Sequence

from nopoll.exceptions import VerificationError

__all__ = ["MAX_SIGNATURES", "Verifier"]

MAX_SIGNATURES = 16
"""Signatures looked at per header; a longer list is a malformed header, not more work."""


class Verifier:
    """Checks one provider's callbacks against its secrets."""

    __slots__ = ("_keys", "_tolerance_s")

    def __init__(self, keys: Sequence[bytes], tolerance_s: int = 300) -> None:
        if not keys:
            raise ValueError("at least one webhook secret is required")
        self._keys = tuple(keys)
        self._tolerance_s = tolerance_s

    def verify(self, headers: Mapping[str, str], body: bytes, now: float | None = None) -> str:
        """Return the ``webhook-id`` of a genuine callback; raise VerificationError otherwise."""
        msg_id = headers.get("webhook-id")
        timestamp = headers.get("webhook-timestamp")
        signature = headers.get("webhook-signature")
        for name, value in (
            ("webhook-id", msg_id),
            ("webhook-timestamp", timestamp),
            ("webhook-signature", signature),
        ):
            if not value:
                raise VerificationError(f"missing {name} header")
        assert msg_id is not None and timestamp is not None and signature is not None

        if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
            raise VerificationError("malformed webhook-timestamp header (expected Unix seconds)")
        skew = int(timestamp) - (time.time() if now is None else now)
        if skew < -self._tolerance_s:
            raise VerificationError("webhook-timestamp is too old")
        if skew > self._tolerance_s:
            raise VerificationError("webhook-timestamp is too far in the future")

        candidates = _parse_signatures(signature)
        signed = f"{msg_id}.{timestamp}.".encode() + body
        for key in self._keys:
            expected = hmac.new(key, signed, hashlib.sha256).digest()
            for candidate in candidates:
                if hmac.compare_digest(expected, candidate):
                    return msg_id
        raise VerificationError("no matching signature")


def _parse_signatures(header: str) -> list[bytes]:
    entries = header.split()
    if len(entries) > MAX_SIGNATURES:
        raise VerificationError(f"webhook-signature has more than {MAX_SIGNATURES} signatures")
    found: list[bytes] = []
    well_formed = False
    for entry in entries:
        version, sep, value = entry.partition(",")
        if not sep or not value:
            continue
        well_formed = True
        if version != "v1":
            continue
        try:
            found.append(base64.b64decode(value, validate=True))
        except (binascii.Error, ValueError):
            continue
    if not well_formed:
        raise VerificationError("malformed webhook-signature header (expected 'v1,<base64>')")
    return found
