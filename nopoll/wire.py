"""What crosses the wire, shared by the receiver and the sinks: safe ids, the statuses and
Retry-After that ask for another try, webhook secrets, and a URL as it may be shown."""

from __future__ import annotations

import base64
import binascii
import email.utils
import re
import time
import urllib.parse
from collections.abc import Callable, Mapping

__all__ = [
    "RETRY_LATER",
    "SAFE_ID",
    "decode_webhook_secret",
    "retry_after_s",
    "safe_id",
    "url_credentials_masked",
    "url_masked",
    "url_origin",
    "url_secrets",
]

_MASK = "***"

SAFE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
"""Ids that may go into a URL path or an object key as one segment."""


def safe_id(value: object) -> bool:
    """True when ``value`` may go into a provider URL path as one segment."""
    return (
        isinstance(value, str) and SAFE_ID.fullmatch(value) is not None and value.strip(".") != ""
    )


RETRY_LATER = frozenset({408, 425, 429})
"""The 4xx answers that mean "not now" rather than "never" (Request Timeout, Too Early, Too
Many Requests): worth another try, with any ``Retry-After`` respected. Each caller adds
its own rule for 5xx, and its own differences (the provider client, ``submit``'s creates,
the ``http`` sink)."""


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


# A sink's URL often carries its credentials: a password, a token in the query (?token=,
# ?sig=), or a secret path segment (/hooks/<secret>). Only the scheme, host and port are
# shown as they are. A URL without a host (sqlite:///path/to/file) is a local file: its
# path is shown too.


def _split(url: str) -> tuple[urllib.parse.SplitResult, str, str] | None:
    """(parts, userinfo, host[:port]) of ``url``, or None when it is no URL."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        return None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    return (parts, userinfo, hostport) if parts.scheme else None


def url_origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url``: all of a sink's URL that a log line shows (and
    a local file's path)."""
    split = _split(url)
    if split is None:
        return _MASK
    parts, _, hostport = split
    if not hostport:
        return url_masked(url)
    return f"{parts.scheme}://{hostport}"


def url_masked(url: str) -> str:
    """``url`` with its user and password, every path segment and every query value
    replaced by ``***`` (query names kept): a sink's URL as ``config check`` shows it."""
    split = _split(url)
    if split is None:
        return _MASK
    parts, userinfo, hostport = split
    query = "&".join(
        f"{name}{sep}{_MASK if sep else ''}"
        for name, sep, _ in (p.partition("=") for p in parts.query.split("&") if p)
    )
    if not hostport:  # a local file, written as it is
        return url.partition("?")[0].partition("#")[0] + (f"?{query}" if query else "")
    netloc = (f"{_MASK}@" if userinfo else "") + hostport
    path = "/".join(_MASK if segment else "" for segment in parts.path.split("/"))
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, query, ""))


def url_credentials_masked(url: str, *, secret_param: Callable[[str], bool] | None = None) -> str:
    """``url`` with its password, and the values of the query parameters ``secret_param``
    picks by name (every one without it), replaced by ``***``; its user, host and path
    kept: a connection URL (Redis, a config value) as a log line shows it."""
    try:
        parts = urllib.parse.urlsplit(url)
        userinfo, at, host = parts.netloc.rpartition("@")
    except ValueError:
        return _MASK
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":" + _MASK
    query = "&".join(
        f"{name}={_MASK}"
        if sep and (secret_param is None or secret_param(name))
        else f"{name}{sep}{value}"
        for name, sep, value in (p.partition("=") for p in parts.query.split("&") if p)
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}", query=query))


def url_secrets(url: str) -> list[str]:
    """The parts of ``url`` that may be secret (user, password, path segments, query
    values, as written and decoded), longest first: what to mask in text that may echo
    them, such as a server's error message."""
    split = _split(url)
    if split is None:
        return [url] if len(url) >= 4 else []
    parts, userinfo, hostport = split
    found = {*userinfo.split(":"), parts.fragment}
    found.update(p.partition("=")[2] for p in parts.query.split("&"))
    if hostport:
        found.update(parts.path.split("/"))
    found |= {urllib.parse.unquote_plus(f) for f in found}
    return sorted((f for f in found if len(f) >= 4), key=len, reverse=True)
