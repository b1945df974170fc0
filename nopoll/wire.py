"""What crosses the wire, shared by the receiver and the sinks: safe ids, Retry-After,
webhook secrets."""

from __future__ import annotations

import base64
import binascii
import email.utils
import re
import time
from collections.abc import Mapping

__all__ = ["SAFE_ID", "decode_webhook_secret", "retry_after_s", "safe_id"]

SAFE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
"""Ids that may go into a URL path or an object key as one segment."""


def safe_id(value: object) -> bool:
    """True when ``value`` may go into a provider URL path as one segment."""
    return (
        isinstance(value, str) and SAFE_ID.fullmatch(value) is not None and value.strip(".") != ""
    )


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (seconds or an HTTP date), or None."""
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def decode_webhook_secret(secret: str) -> bytes:
    """The HMAC key of a webhook secret.

    ``whsec_<base64>`` is base64-decoded (the Standard Webhooks rule); any other string is
    used as its UTF-8 bytes (the OpenAI SDK's rule for raw secrets).
    """
    if secret.startswith("whsec_"):
        raw = secret[len("whsec_") :]
        try:
            key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a 'whsec_' secret must be base64 after the prefix") from None
    else:
        key = secret.encode()
    if not key:
        raise ValueError("webhook secret is empty")
    return key
