"""The pooled HTTP client every provider dialect uses.

:class:`ProviderClient` only ever calls the configured ``base_url`` (ids pass
:func:`safe_id`, no redirects, no URL from a callback). Every request takes a slot of its
account's budget (:mod:`receiver.providers.budget`); ``insufficient_quota`` raises
:class:`~nopoll.exceptions.QuotaExceeded`; transient failures are retried in place
(``http.attempts``) with :class:`~receiver.backoff.Backoff`, then raise
:class:`~nopoll.exceptions.TransientProviderError`. Answers are capped
(``http.max_response_bytes``, ``http.max_line_bytes``) and gzip and deflate are decoded
here in small steps, so a gzip bomb costs the cap.

See docs/security.md and docs/reliability.md (retries and their bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import re
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from nopoll.exceptions import ProviderError, QuotaExceeded, TransientProviderError
from nopoll.wire import RETRY_LATER, SAFE_ID, retry_after_s, safe_id
from receiver.backoff import Backoff
from receiver.config.dialects import DIALECTS
from receiver.config.settings import HttpConfig, ProviderConfig
from receiver.providers._aiohttp import AiohttpGets
from receiver.providers._decode import ENCODINGS, PIECE, Answer, Decoder, raw_stream
from receiver.providers.budget import AccountBudget
from receiver.tracing import enabled as tracing_enabled
from receiver.tracing import span

__all__ = [
    "SAFE_ID",
    "SAID",
    "ProviderClient",
    "error_reason",
    "provider_said",
    "retry_after_s",
    "safe_id",
]

_QUOTA_STATUS = frozenset({402, 403, 429})
"""Statuses whose error may say ``insufficient_quota``: a spent quota, not a rate limit."""
_QUOTA = "insufficient_quota"
_IN_JOB_FIRST_S = 0.25
_IN_JOB_MAX_S = 4.0
"""In-job waits stay short: a longer outage is the job's retries' to ride out."""


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [httpx.TransportError, OSError]
    try:
        import aiohttp

        errors.append(aiohttp.ClientError)  # anything httpx-aiohttp does not map
    except ImportError:  # pragma: no cover - a core dependency
        pass
    return tuple(errors)


_NETWORK_ERRORS = _network_errors()


SAID = "; the provider said: "
"""What ends an error that carries the provider's own reason (a JSON string follows):
:func:`provider_said` reads it back."""
_SAID_BYTES = 4096
"""How much of an error answer is read for the provider's own reason."""
_SAID_CHARS = 300


async def _error_head(response: Answer) -> bytes:
    """The first 4 KiB of an error answer, where its reason is (:func:`_said`,
    :func:`_refused_for_quota`); empty when it is encoded. At most 64 KiB of the answer is
    read (the rest is not: the connection is then closed rather than reused), and a
    failure to read it only loses the reason."""
    head = bytearray()
    read = 0
    try:
        async for chunk in raw_stream(response):
            read += len(chunk)
            head += chunk[: _SAID_BYTES - len(head)]
            if read > PIECE:
                break
    except _NETWORK_ERRORS:
        pass
    if response.headers.get("content-encoding", "identity").lower() not in ("", "identity"):
        return b""
    return bytes(head)


def _said(raw: bytes) -> str:
    """``; the provider said: "..."`` with the provider's own error message from an error
    answer (:func:`error_reason`), truncated and JSON-escaped so it cannot forge a log
    line; empty when there is none."""
    message = error_reason(raw)
    if message is None:
        return ""
    if len(message) > _SAID_CHARS:
        message = message[: _SAID_CHARS - 1] + "\u2026"
    return SAID + orjson.dumps(message).decode()


def error_reason(raw: bytes) -> str | None:
    """The provider's own words in an error answer, whitespace folded: OpenAI's, Sail's and
    Valar's ``{"error": {"message", "type", "code"}}`` (or ``{"error": "..."}``),
    sference's ``{"status_code", "detail", "extra"}`` (with what ``extra`` says of each
    field), a bare ``{"message"}``, or the text itself; None when there is none."""
    message: Any = None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        message = _cut_message(raw) or raw.decode("utf-8", "replace")
    else:
        if isinstance(data, dict):
            error = data.get("error")
            if isinstance(error, dict):
                message = error.get("message") or error.get("type") or error.get("code")
            else:
                message = error or data.get("message") or data.get("detail")
                if isinstance(message, str) and message == data.get("detail"):
                    message += _extra(data.get("extra"))
    if not isinstance(message, str):
        return None
    message = " ".join(message.split())
    return message or None


def _extra(extra: Any) -> str:
    """What a Litestar-style ``extra`` (sference's errors) says of each field: ``"; key:
    message"`` for the first three entries that have a message."""
    if isinstance(extra, dict):
        extra = [extra]
    if not isinstance(extra, list):
        return ""
    said = []
    for item in extra:
        if isinstance(item, dict) and isinstance(item.get("message"), str):
            key = item.get("key")
            said.append(f"{key}: {item['message']}" if isinstance(key, str) else item["message"])
        if len(said) == 3:
            break
    return "".join(f"; {part}" for part in said)


def _refused_for_quota(raw: bytes) -> bool:
    """Whether an error answer says ``insufficient_quota``: in ``error.type`` (Valar) or
    ``error.code`` (OpenAI, which sets both)."""
    if _QUOTA.encode() not in raw:  # most error answers: no parse
        return False
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    return isinstance(error, dict) and _QUOTA in (error.get("type"), error.get("code"))


def provider_said(error: str) -> tuple[str, str | None]:
    """``error`` split into what nopoll says and the provider's own reason (None when it
    carries none)."""
    head, found, said = error.rpartition(SAID)
    if not found:
        return error, None
    try:
        reason = orjson.loads(said)
    except orjson.JSONDecodeError:
        return error, None
    return (head, reason) if isinstance(reason, str) else (error, None)


_MESSAGE = re.compile(rb'"message"\s*:\s*"((?:[^"\\]|\\.)*)')


def _cut_message(raw: bytes) -> str | None:
    """The ``"message"`` string of a JSON error cut short by the read limit."""
    found = _MESSAGE.search(raw)
    if found is None:
        return None
    text = found.group(1)
    for cut in range(7):  # the cut may have split an escape such as \u2026
        with contextlib.suppress(orjson.JSONDecodeError):
            value = orjson.loads(b'"' + text[: len(text) - cut] + b'"')
            return value if isinstance(value, str) else None
    return None


def _never_connected(exc: BaseException) -> bool:
    """The request failed before a connection was made (refused, unreachable, a connect
    timeout), so the provider cannot have acted on it."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return True
    cause = exc.__cause__ or exc
    return "Connector" in type(cause).__name__ or isinstance(cause, ConnectionRefusedError)


def _timeout_text(exc: BaseException) -> str:
    # httpx-aiohttp reports a refused connection as ConnectTimeout; say what happened.
    cause = exc.__cause__
    if cause is not None and "Connector" in type(cause).__name__:
        return f"connection failed ({type(cause).__name__})"
    return "timed out"


def _transports(http: HttpConfig) -> list[httpx.AsyncBaseTransport]:
    """The httpx transports for ``http.transport``.

    ``aiohttp`` (httpx-aiohttp, what the OpenAI SDK's DefaultAioHttpClient uses) costs about
    half the CPU per request of httpx's own httpcore transport under concurrency (measured:
    bench/batch.py). ``httpcore`` scans its whole pool on every request, so its connections
    are spread over several small pools ("lanes") taken in turn.
    """
    tls = ssl.create_default_context()
    if http.transport == "aiohttp":
        from httpx_aiohttp import AiohttpTransport

        limits = httpx.Limits(
            max_connections=http.max_connections, max_keepalive_connections=http.max_connections
        )
        return [AiohttpTransport(limits=limits, verify=tls)]
    lanes = max(1, min(http.lanes, http.max_connections))
    per_lane = max(1, http.max_connections // lanes)
    limits = httpx.Limits(max_connections=per_lane, max_keepalive_connections=per_lane)
    return [httpx.AsyncHTTPTransport(limits=limits, verify=tls) for _ in range(lanes)]


def _fast_gets(
    transports: list[httpx.AsyncBaseTransport], headers: httpx.Headers, timeout: httpx.Timeout
) -> AiohttpGets | None:
    """GETs straight on aiohttp when the one transport is httpx-aiohttp's (the default)."""
    from httpx_aiohttp import AiohttpTransport

    if len(transports) != 1 or type(transports[0]) is not AiohttpTransport:
        return None
    return AiohttpGets(transports[0], headers, timeout)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an absolute http(s) URL; None for anything else."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return None
    if parsed.scheme not in _DEFAULT_PORTS or not parsed.host or parsed.userinfo:
        return None
    return parsed.scheme, parsed.host, parsed.port or _DEFAULT_PORTS[parsed.scheme]


def _origin_of(url: str) -> str:
    """scheme://host:port of ``url`` (never its path or query, which may hold a token)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return "<not a URL>"
    port = f":{parsed.port}" if parsed.port else ""
    return f"{parsed.scheme}://{parsed.host}{port}/..."


class _Measured:
    """One request, timed and reported to its client's ``on_request`` with the status the
    block sets (None: it failed in transit), in a span while tracing is on; timeouts and
    network failures leave the block as :class:`TransientProviderError`. A class rather
    than a generator context manager: it wraps every GET."""

    __slots__ = ("_client", "_path", "_span", "_started", "_traced", "status")

    def __init__(self, client: ProviderClient, path: str) -> None:
        self._client = client
        self._path = path
        self._span: contextlib.AbstractContextManager[Any] | None = None
        self._traced: Any = None
        self.status: int | None = None

    def __enter__(self) -> _Measured:
        self._started = time.perf_counter()
        if tracing_enabled():  # the path without its query (a signed URL's is a secret)
            path = self._path
            where = urlsplit(path).path if "://" in path else path.partition("?")[0]
            attributes = {"nopoll.provider": self._client.name, "url.path": where[:200]}
            self._span = span("GET", attributes, kind="client")
            self._traced = self._span.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        client = self._client
        error = None if exc is None else client.in_transit(self._path, exc)
        if client._on_request is not None:
            client._on_request(client.name, self.status, time.perf_counter() - self._started)
        if self._span is not None:
            if self._traced is not None and self.status is not None:
                self._traced.set_attribute("http.response.status_code", self.status)
            raised = error or exc
            self._span.__exit__(type(raised) if raised else None, raised, tb)
        if error is not None:
            raise error from None


class ProviderClient:
    """A pooled httpx client bound to one provider's ``base_url``."""

    def __init__(
        self,
        name: str,
        config: ProviderConfig,
        http: HttpConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        on_request: Any = None,
        budget: AccountBudget | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self._retry_status = RETRY_LATER | DIALECTS[config.dialect].retry_statuses
        """The answers worth another try: ``not now`` and the dialect's own 5xx."""
        self.budget = budget
        """The account's request budget (:mod:`receiver.providers.budget`): a slot of it before
        every request, its pauses after the answers that ask for one. None: neither."""
        self._http = http
        self._on_request = on_request
        self._backoff = Backoff(_IN_JOB_FIRST_S, _IN_JOB_MAX_S, http.max_retry_after_s)
        headers = {
            "user-agent": "nopoll/0.1",
            "accept": "application/json",
            # Decoded here with bounded steps (see Decoder); never br or zstd.
            "accept-encoding": "gzip, deflate",
        }
        if config.api_key is not None:
            headers["authorization"] = f"Bearer {config.api_key.get_secret_value()}"
        self._headers = httpx.Headers(headers)
        self._base = config.base_url + "/"
        self._origin = _origin(config.base_url)
        timeout = httpx.Timeout(http.read_timeout_s, connect=http.connect_timeout_s)
        self._extensions = {"timeout": timeout.as_dict()}
        # Requests go straight to an httpx transport: nopoll never follows redirects, sends
        # no cookies and needs no auth flow, so AsyncClient's layers are pure overhead on
        # 100,000 per-row GETs.
        self._transports = [transport] if transport is not None else _transports(http)
        self._next = itertools.cycle(self._transports)
        self._gets = _fast_gets(self._transports, self._headers, timeout)
        """The hot path's GETs, on the aiohttp transport's session (None: through httpx)."""

    def authenticate(self, headers: Mapping[str, str]) -> None:
        """Send ``headers`` instead of ``Authorization: Bearer`` (a dialect whose API
        authenticates its own way, e.g. ``x-api-key`` and ``anthropic-version``)."""
        merged = self._headers.copy()
        merged.pop("authorization", None)
        merged.update(headers)
        self._headers = merged
        if self._gets is not None:
            self._gets.set_headers(merged)

    def on_origin(self, url: str) -> bool:
        """Whether ``url`` has the scheme, host and port of ``base_url``."""
        return _origin(url) == self._origin

    def _url(self, path: str) -> str:
        """``{base_url}/{path}``; or ``path`` itself when it is an absolute URL that a
        provider's object gave (a results URL), and only on ``base_url``'s origin."""
        if "://" not in path:
            return self._base + path
        if not self.on_origin(path):
            raise ProviderError(
                "refused a URL that is not on base_url's scheme, host and port",
                provider=self.name,
                path=_origin_of(path),
            )
        return path

    async def _send(self, path: str) -> Answer:
        """GET ``{base_url}/{path}``; the caller reads or streams the body and closes it."""
        if self._gets is not None:
            return await self._gets.get(self._url(path))
        request = httpx.Request(
            "GET", self._url(path), headers=self._headers, extensions=self._extensions
        )
        return await self._handle(request)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        """``request`` sent on the next transport in turn."""
        response = await next(self._next).handle_async_request(request)
        response.request = request
        return response

    def _measured(self, path: str) -> _Measured:
        """One request, measured (see :class:`_Measured`)."""
        return _Measured(self, path)

    def _wait(self, state: RetryCallState, tried_before: int = 0) -> float:
        exc = state.outcome.exception() if state.outcome else None
        retry_after = exc.retry_after_s if isinstance(exc, TransientProviderError) else None
        return self._backoff.delay(tried_before + state.attempt_number, retry_after)

    def _retrying(self, attempts: int | None = None, *, tried_before: int = 0) -> AsyncRetrying:
        """Tries up to ``attempts`` (default ``http.attempts``) in all, ``tried_before`` of
        them made already: the waits go on from there."""
        return AsyncRetrying(
            stop=stop_after_attempt((attempts or self._http.attempts) - tried_before),
            wait=functools.partial(self._wait, tried_before=tried_before),
            retry=retry_if_exception(self._worth_retrying_now),
            reraise=True,
        )

    def _worth_retrying_now(self, exc: BaseException) -> bool:
        if not isinstance(exc, TransientProviderError):
            return False
        # A long Retry-After defers the whole job instead of holding a worker slot.
        return (exc.retry_after_s or 0.0) <= self._http.max_retry_after_s

    async def get_json(
        self, path: str, *, attempts: int | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        """GET ``{base_url}/{path}`` and return its JSON object, trying transient failures
        up to ``attempts`` times (default ``http.attempts``); each try waits at most
        ``wait_s`` for its slot of the account's budget (default
        :data:`~receiver.providers.budget.WAIT_S`)."""
        try:  # the first try outside the retry loop: most GETs need no more, at less cost
            return await self._get_once(path, wait_s)
        except TransientProviderError as exc:
            if (attempts or self._http.attempts) <= 1 or not self._worth_retrying_now(exc):
                raise
            await asyncio.sleep(self._backoff.delay(1, exc.retry_after_s))
        async for attempt in self._retrying(attempts, tried_before=1):
            with attempt:
                return await self._get_once(path, wait_s)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _get_once(self, path: str, wait_s: float | None = None) -> dict[str, Any]:
        _, content = await self._request(path, read=True, wait_s=wait_s)
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise ProviderError(
                "answer is not JSON", provider=self.name, path=path, status=200
            ) from None
        if not isinstance(data, dict):
            raise ProviderError(
                "answer is not a JSON object", provider=self.name, path=path, status=200
            )
        return data

    async def _take(self, path: str, wait_s: float | None) -> None:
        """A slot of the account's budget for one request (nothing to wait for, and no Redis
        call, when the account has no rate and no pause)."""
        budget = self.budget
        if budget is not None and not budget.free_now():
            await budget.take(path, wait_s)

    async def _heard(self, status: int, headers: Mapping[str, str], quota: bool) -> None:
        """Pause the account when an answer asks for it (its rate-limit headers, a 429)."""
        budget = self.budget
        if budget is not None and (pause := budget.pause_after(status, headers, quota=quota)):
            await budget.pause(pause)

    def useful_concurrency(self, wanted: int) -> int:
        """Requests of one kind worth having in flight at once: ``wanted``, or what the
        account's budget lets through in a few seconds when that is fewer."""
        return wanted if self.budget is None else self.budget.useful_concurrency(wanted)

    async def _request(
        self, path: str, *, read: bool, wait_s: float | None = None
    ) -> tuple[Answer, bytearray]:
        """One GET, measured, once the account's budget gives it a slot (waiting at most
        ``wait_s``); a 200 comes back (its body read, within the cap, when ``read``, else
        open for streaming), anything else raises, transient or not."""
        await self._take(path, wait_s)
        content = bytearray()
        said = ""
        quota = False
        with self._measured(path) as measured:
            response = await self._send(path)
            if read or response.status_code != 200:
                try:
                    if response.status_code == 200:
                        content = await self._read_capped(response, path)
                    else:
                        head = await _error_head(response)
                        said = _said(head)
                        quota = response.status_code in _QUOTA_STATUS and _refused_for_quota(head)
                finally:
                    await response.aclose()
            measured.status = status = response.status_code
        await self._heard(status, response.headers, quota)
        if status == 200:
            return response, content
        if quota:
            raise self._quota_spent(path, status, said)
        if status in self._retry_status:
            raise TransientProviderError(
                "provider busy or failing" + said,
                provider=self.name,
                path=path,
                status=status,
                retry_after_s=retry_after_s(response.headers),
            )
        if status in (401, 403):
            reason = f"the provider refused the API key: check providers.{self.name}.api_key"
            raise ProviderError(reason + said, provider=self.name, path=path, status=status)
        raise ProviderError(
            "unexpected status" + said, provider=self.name, path=path, status=status
        )

    @contextlib.contextmanager
    def _transient(
        self, path: str, timed_out: Callable[[BaseException], str], broke: str
    ) -> Iterator[None]:
        """Timeouts and network failures as :class:`TransientProviderError` (retried)."""
        try:
            yield
        except _NETWORK_ERRORS as exc:
            raise self.in_transit(path, exc, timed_out, broke) or exc from None

    def in_transit(
        self,
        path: str,
        exc: BaseException,
        timed_out: Callable[[BaseException], str] = _timeout_text,
        broke: str = "connection failed",
    ) -> TransientProviderError | None:
        """A timeout or network failure (``exc``) as the :class:`TransientProviderError` it
        makes (``unsent`` when no connection was made: the request never left); None for
        anything else."""
        if isinstance(exc, httpx.TimeoutException | TimeoutError):
            error = TransientProviderError(timed_out(exc), provider=self.name, path=path)
        elif isinstance(exc, _NETWORK_ERRORS):
            reason = f"{broke} ({type(exc).__name__})"
            error = TransientProviderError(reason, provider=self.name, path=path)
        else:
            return None
        error.unsent = _never_connected(exc)
        return error

    def _error(self, path: str, message: str) -> ProviderError:
        return ProviderError(message, provider=self.name, path=path, status=200)

    @property
    def http(self) -> HttpConfig:
        """The HTTP settings: timeouts, retries and the caps on what a provider sends."""
        return self._http

    def too_large(self, path: str, what: str, setting: str, detail: str = "") -> ProviderError:
        """The permanent error for ``what`` passing the cap ``http.{setting}``."""
        cap = getattr(self._http, setting)
        message = f"{what} larger than http.{setting} ({cap} bytes)"
        return self._error(path, f"{message}: {detail}" if detail else message)

    def _decoder(self, response: Answer, path: str) -> Decoder:
        value = response.headers.get("content-encoding", "")
        codings = [c.strip().lower() for c in value.split(",")]
        codings = [c for c in codings if c not in ("", "identity")]
        if len(codings) > 1 or (codings and codings[0] not in ENCODINGS):
            raise self._error(path, f"unsupported Content-Encoding {value[:40]!r}")
        return Decoder(codings[0] if codings else "", lambda m: self._error(path, m))

    async def _decoded(
        self, response: Answer, decoder: Decoder, path: str, wire_cap: int | None = None
    ) -> AsyncIterator[bytes]:
        """The decoded body in pieces of at most 64 KiB; ``wire_cap`` caps the bytes read."""
        wire = 0
        async for chunk in raw_stream(response):
            wire += len(chunk)
            if wire_cap is not None and wire > wire_cap:
                raise self.too_large(
                    path, "answer", "max_response_bytes", "more than that on the wire"
                )
            for piece in decoder.feed(chunk):
                yield piece
        for piece in decoder.end():
            yield piece

    async def _read_capped(self, response: Answer, path: str) -> bytearray:
        """The whole decoded body, refused as soon as it passes ``http.max_response_bytes``:
        by its Content-Length, on the wire, or after decoding."""
        cap = self._http.max_response_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise self.too_large(
                path, "answer", "max_response_bytes", f"Content-Length {int(declared)}"
            )
        decoder = self._decoder(response, path)
        content = bytearray()
        if decoder.name == "identity":  # the bytes on the wire are the answer: no steps
            async for chunk in raw_stream(response):
                if len(content) + len(chunk) > cap:
                    raise self.too_large(
                        path, "answer", "max_response_bytes", "more than that on the wire"
                    )
                content += chunk
            return content
        async for piece in self._decoded(response, decoder, path, wire_cap=cap):
            if len(content) + len(piece) > cap:
                raise self.too_large(
                    path, "answer", "max_response_bytes", f"more after {decoder.name} decoding"
                )
            content += piece
        return content

    def _quota_spent(self, path: str, status: int, said: str, method: str = "GET") -> QuotaExceeded:
        reason = f"the account's quota is spent ({_QUOTA}): not retried"
        return QuotaExceeded(
            reason + said, provider=self.name, path=path, status=status, method=method
        )

    async def stream_bytes(
        self, path: str, *, attempts: int | None = None, wait_s: float | None = None
    ) -> AsyncGenerator[bytes, None]:
        """GET ``{base_url}/{path}`` as a decoded byte stream, in pieces of at most 64 KiB;
        opening is tried like :meth:`get_json` (up to ``attempts``), a break mid-stream
        raises TransientProviderError (the batch job resumes later)."""
        response: Answer | None = None
        async for attempt in self._retrying(attempts):
            with attempt:
                response, _ = await self._request(path, read=False, wait_s=wait_s)
        assert response is not None
        try:
            with self._transient(path, lambda _: "stream timed out", "stream broke"):
                async for piece in self._decoded(response, self._decoder(response, path), path):
                    yield piece
        finally:
            await response.aclose()

    async def stream_lines(self, path: str) -> AsyncIterator[bytes]:
        """The non-empty lines of a streamed JSONL answer, as bytes, never all in memory; a
        line longer than ``http.max_line_bytes`` stops the stream as soon as it is."""
        cap = self._http.max_line_bytes
        parts: list[bytes] = []  # the start of a line that has not ended yet
        size = 0
        number = 1
        async for piece in self.stream_bytes(path):
            start = 0
            while (end := piece.find(b"\n", start)) != -1:
                line = piece[start:end]
                if parts:
                    line = b"".join((*parts, line))
                    parts.clear()
                    size = 0
                if len(line) > cap:
                    raise self.too_large(path, f"JSONL line {number}", "max_line_bytes")
                if line.strip():
                    yield line
                number += 1
                start = end + 1
            if start < len(piece):
                size += len(piece) - start
                if size > cap:
                    raise self.too_large(path, f"JSONL line {number}", "max_line_bytes")
                parts.append(piece[start:] if start else piece)
        line = b"".join(parts)
        if line.strip():
            yield line

    async def post_once(
        self,
        path: str,
        content: bytes,
        *,
        content_type: str,
        idempotency_key: str,
        wait_s: float | None = None,
    ) -> tuple[int, bytes, float | None]:
        """One POST to ``{base_url}/{path}`` (a create call), once the account's budget gives
        it a slot (waiting at most ``wait_s``): its status, its body (capped like every
        answer) and its Retry-After. Timeouts, network failures and no slot in time raise
        :class:`TransientProviderError`; the caller retries with the same key. A refusal for
        ``insufficient_quota`` raises :class:`QuotaExceeded`: no retry helps."""
        await self._take(path, wait_s)
        headers = self._headers.copy()
        headers["content-type"] = content_type
        headers["idempotency-key"] = idempotency_key
        request = httpx.Request(
            "POST",
            self._base + path,
            headers=headers,
            content=content,
            extensions=self._extensions,
        )
        with self._measured(path) as measured:
            response = await self._handle(request)
            try:
                body = await self._read_capped(response, path)
            finally:
                await response.aclose()
            measured.status = status = response.status_code
        quota = status in _QUOTA_STATUS and _refused_for_quota(bytes(body[:_SAID_BYTES]))
        await self._heard(status, response.headers, quota)
        if quota:
            raise self._quota_spent(path, status, _said(bytes(body[:_SAID_BYTES])), "POST")
        return status, bytes(body), retry_after_s(response.headers)

    async def aclose(self) -> None:
        if self.budget is not None:
            await self.budget.aclose()
        for transport in self._transports:
            await transport.aclose()
