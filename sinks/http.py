"""The ``http`` sink: POST envelopes to a subscriber, signed with Standard Webhooks.

:class:`HttpSink` POSTs one envelope (or a JSON array of at most ``batch_size``) at a
time, in order, signed by the ``standardwebhooks`` package with the sink's own secret;
the ``webhook-id`` is derived from the envelopes' ``(provider, key)`` pairs, so a retry
carries the same id. A 2xx is success; 408, 429, 5xx, timeouts and connection errors
raise :class:`HttpSinkError` (retried); any other 4xx
:class:`~nopoll.exceptions.SinkRejected`. At most 4 KiB of an answer is read.

See docs/sinks/http.md.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Literal

import httpx
import orjson
from pydantic import Field, SecretStr, field_validator
from standardwebhooks.webhooks import Webhook

from nopoll.envelope import DEFAULT_TENANT, Envelope
from nopoll.exceptions import SinkError, SinkRejected
from nopoll.wire import RETRY_LATER, decode_webhook_secret, retry_after_s, url_origin, url_secrets
from sinks._trace import trace_headers
from sinks.base import SinkBase, SinkConfig

__all__ = ["HttpSink", "HttpSinkConfig", "HttpSinkError", "SinkRejected", "webhook_id"]

MAX_BATCH_SIZE = 500
_ANSWER_BYTES = 4096
"""The most of a subscriber's answer that is read; the rest is never downloaded."""
_EXCERPT_CHARS = 200
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]+")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_RESERVED_HEADERS = frozenset(
    {
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "content-type",
        "content-length",
        "transfer-encoding",
        "host",
    }
)

try:
    _USER_AGENT = f"nopoll/{version('nopoll')}"
except PackageNotFoundError:  # running from a source tree that is not installed
    _USER_AGENT = "nopoll"


_RETRY_4XX = RETRY_LATER - {425}
"""The 4xx a subscriber may answer and be tried again: 425 (Too Early) aside, which this sink
has always taken as a refusal (every 3xx and 5xx is tried again)."""


class HttpSinkError(SinkError):
    """A POST to the subscriber failed and retrying may help (408, 429, 5xx, 3xx, a timeout,
    a connection error); a 4xx that will not change is :class:`~nopoll.exceptions.SinkRejected`
    instead. ``status`` is None when no response came; ``retry_after_s`` is the subscriber's
    ``Retry-After`` in seconds, or None."""

    def __init__(
        self,
        message: str,
        *,
        sink: str,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, sink=sink, retry_after_s=retry_after_s)
        self.status = status


class HttpSinkConfig(SinkConfig):
    """``{type: http, url: https://consumer.example/hook, secret: ${AUDIT_SECRET}}``."""

    type: Literal["http"] = "http"
    url: str
    """The subscriber's http:// or https:// URL; redirects are not followed."""
    secret: SecretStr
    """``whsec_<base64>`` (base64-decoded) or a raw secret (its UTF-8 bytes)."""
    batch_size: int = Field(default=MAX_BATCH_SIZE, ge=1, le=MAX_BATCH_SIZE)
    """Most envelopes in one POST; a write of more is split into several POSTs."""
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    """Extra static headers (e.g. ``Authorization``); their values never print."""
    max_connections: int = Field(default=20, ge=1, le=1000)

    def location(self) -> str:
        """The subscriber URL's origin: its path and query may hold a token."""
        return url_origin(self.url)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        try:
            url = httpx.URL(value)
        except (httpx.InvalidURL, TypeError):
            raise ValueError("must be an http:// or https:// URL") from None
        if url.scheme not in ("http", "https") or not url.host or any(c.isspace() for c in value):
            raise ValueError("must be an http:// or https:// URL")
        if url.userinfo:
            raise ValueError("must not hold credentials; put them in headers (Authorization)")
        return value

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: SecretStr) -> SecretStr:
        decode_webhook_secret(value.get_secret_value())
        return value

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for name, header in value.items():
            if not _TOKEN.match(name):
                raise ValueError(f"{name!r} is not a valid header name")
            if name.lower() in _RESERVED_HEADERS:
                raise ValueError(f"{name!r} is set by the sink and cannot be overridden")
            text = header.get_secret_value()
            if not text.isprintable() or not text.isascii():
                raise ValueError(f"the value of {name!r} must be printable ASCII")
        return value


def webhook_id(envelopes: Sequence[Envelope]) -> str:
    """The ``webhook-id`` of one POST: ``msg_`` and the SHA-256 (hex) of the JSON array of
    the envelopes' sorted ``[provider, key]`` pairs (``[provider, key, tenant]`` for a
    tenant other than ``default``). The same envelopes, in any order, always get the same
    id."""
    pairs = sorted(
        (env.provider, env.key)
        if env.tenant == DEFAULT_TENANT
        else (env.provider, env.key, env.tenant)
        for env in envelopes
    )
    return "msg_" + hashlib.sha256(orjson.dumps(pairs)).hexdigest()


def _describe(exc: httpx.RequestError) -> str:
    """The error's class and, for a socket error, its reason; never a header or URL."""
    cause: BaseException | None = exc
    for _ in range(8):  # a bounded walk down the chain
        if cause is None:
            break
        if isinstance(cause, OSError) and cause.strerror:
            return f"{type(exc).__name__}: {cause.strerror}"
        cause = cause.__cause__ or cause.__context__
    return type(exc).__name__


async def _answer_head(response: httpx.Response) -> bytes:
    """The first ``_ANSWER_BYTES`` of the answer as sent (not decompressed); the caller
    closes the response, which closes a connection whose answer was not read to its end."""
    head = b""
    async for chunk in response.aiter_raw():
        head += chunk
        if len(head) >= _ANSWER_BYTES:
            break
    return head[:_ANSWER_BYTES]


def _excerpt(response: httpx.Response, head: bytes, secrets: Sequence[str]) -> str:
    """The start of a readable answer, for the error message (one printable line), with
    any of ``secrets`` the subscriber echoed masked."""
    if not head or response.headers.get("content-encoding", "identity") != "identity":
        return ""
    text = head.decode("utf-8", "replace")
    for secret in secrets:
        text = text.replace(secret, "***")
    text = _UNPRINTABLE.sub(" ", text).strip()
    if not text:
        return ""
    return f"; answer: {text[:_EXCERPT_CHARS]}" + ("..." if len(text) > _EXCERPT_CHARS else "")


class HttpSink(SinkBase):
    """POSTs envelopes to a subscriber, Standard-Webhooks signed, in arrays of
    ``batch_size``."""

    config_model = HttpSinkConfig
    config: HttpSinkConfig

    def __init__(self, name: str, config: HttpSinkConfig) -> None:
        super().__init__(name, config)
        self._signer = Webhook(decode_webhook_secret(config.secret.get_secret_value()))
        url = httpx.URL(config.url)
        self._host = url.host if url.port is None else f"{url.host}:{url.port}"
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, host={self._host!r})"

    async def open(self) -> None:
        if self._client is not None:
            return
        headers = {k: v.get_secret_value() for k, v in self.config.headers.items()}
        headers.setdefault("user-agent", _USER_AGENT)
        limits = httpx.Limits(
            max_connections=self.config.max_connections,
            max_keepalive_connections=self.config.max_connections,
        )
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(self.config.timeout_s),
            limits=limits,
            follow_redirects=False,
        )

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        if not envelopes:
            return
        if self._client is None:
            raise SinkError("not open", sink=self.name)
        size = self.config.batch_size
        chunks = [envelopes[i : i + size] for i in range(0, len(envelopes), size)]
        for n, chunk in enumerate(chunks, 1):
            count = f"{len(chunk)} envelope" + ("s" if len(chunk) > 1 else "")
            where = f"POST {n} of {len(chunks)} ({count}) to {self._host}"
            await self._post(self._client, chunk, where)

    async def _post(self, client: httpx.AsyncClient, chunk: Sequence[Envelope], where: str) -> None:
        try:
            payload = chunk[0].to_dict() if len(chunk) == 1 else [e.to_dict() for e in chunk]
            body = orjson.dumps(payload)
        except orjson.JSONEncodeError as exc:
            raise SinkError(
                f"{where}: an envelope is not JSON-serializable", sink=self.name
            ) from exc
        msg_id = webhook_id(chunk)
        timestamp = int(time.time())
        signature = self._signer.sign(msg_id, datetime.fromtimestamp(timestamp, UTC), body.decode())
        headers = {
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature,
            "content-type": "application/json",
            "accept-encoding": "identity",  # a bounded read of the answer is its size
            **trace_headers(),  # the W3C traceparent of the write, while tracing
        }
        try:
            async with client.stream(
                "POST", self.config.url, content=body, headers=headers
            ) as response:
                head = await _answer_head(response)
        except httpx.TimeoutException as exc:
            raise HttpSinkError(
                f"{where} timed out after {self.config.timeout_s:g}s", sink=self.name
            ) from exc
        except httpx.RequestError as exc:
            raise HttpSinkError(f"{where} failed: {_describe(exc)}", sink=self.name) from exc
        status = response.status_code
        if 200 <= status < 300:
            return
        message = f"{where} answered HTTP {status}"
        if 400 <= status < 500 and status not in _RETRY_4XX:
            raise SinkRejected(
                message + f" (the subscriber refuses it){self._excerpt(response, head)}",
                sink=self.name,
                status=status,
            )
        if 300 <= status < 400:
            message += " (redirects are not followed: configure the final URL)"
        message += self._excerpt(response, head)
        raise HttpSinkError(
            message,
            sink=self.name,
            status=status,
            retry_after_s=retry_after_s(response.headers),
        )

    def _excerpt(self, response: httpx.Response, head: bytes) -> str:
        secrets = [v.get_secret_value() for v in self.config.headers.values()]
        secrets = [s for s in secrets if len(s) >= 4] + url_secrets(self.config.url)
        return _excerpt(response, head, sorted(secrets, key=len, reverse=True))

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
