"""The pooled HTTP client every provider dialect uses.

:class:`ProviderClient` only ever calls the configured ``base_url``: paths are built from
ids that passed :func:`safe_id`, redirects are never followed, and nothing taken from a
callback is used as a URL. Transient failures (429, 5xx, timeouts, connection errors)
are retried a few times in place, honouring ``Retry-After``; what still fails raises
:class:`~receiver.exceptions.TransientProviderError` so the job is retried later.
"""

from __future__ import annotations

import email.utils
import itertools
import re
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from receiver.config import HttpConfig, ProviderConfig
from receiver.exceptions import ProviderError, TransientProviderError

__all__ = ["SAFE_ID", "ProviderClient", "retry_after_s", "safe_id"]

SAFE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [httpx.TransportError, OSError]
    try:
        import aiohttp

        errors.append(aiohttp.ClientError)  # anything httpx-aiohttp does not map
    except ImportError:  # pragma: no cover - a core dependency
        pass
    return tuple(errors)


_NETWORK_ERRORS = _network_errors()


def _timeout_text(exc: BaseException) -> str:
    # httpx-aiohttp reports a refused connection as ConnectTimeout; say what happened.
    cause = exc.__cause__
    if cause is not None and "Connector" in type(cause).__name__:
        return f"connection failed ({type(cause).__name__})"
    return "timed out"


def safe_id(value: object) -> bool:
    """True when ``value`` may go into a provider URL path as one segment."""
    return (
        isinstance(value, str) and SAFE_ID.fullmatch(value) is not None and value.strip(".") != ""
    )


def retry_after_s(response: httpx.Response) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (seconds or an HTTP date), or None."""
    value = response.headers.get("retry-after")
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
    ) -> None:
        self.name = name
        self.config = config
        self._http = http
        self._on_request = on_request
        headers = {"user-agent": "nopoll/0.1", "accept": "application/json"}
        if config.api_key is not None:
            headers["authorization"] = f"Bearer {config.api_key.get_secret_value()}"
        self._headers = httpx.Headers(headers)
        self._base = config.base_url + "/"
        timeout = httpx.Timeout(http.read_timeout_s, connect=http.connect_timeout_s)
        self._extensions = {"timeout": timeout.as_dict()}
        # Requests go straight to an httpx transport: nopoll never follows redirects, sends
        # no cookies and needs no auth flow, so AsyncClient's layers are pure overhead on
        # 100,000 per-row GETs.
        self._transports = [transport] if transport is not None else _transports(http)
        self._next = itertools.cycle(self._transports)

    async def _send(self, path: str) -> httpx.Response:
        """GET ``{base_url}/{path}``; the caller reads or streams the body and closes it."""
        request = httpx.Request(
            "GET", self._base + path, headers=self._headers, extensions=self._extensions
        )
        response = await next(self._next).handle_async_request(request)
        response.request = request
        return response

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        retry_after = exc.retry_after_s if isinstance(exc, TransientProviderError) else None
        backoff = min(4.0, 0.25 * 2.0 ** (state.attempt_number - 1))
        return max(backoff, retry_after or 0.0)

    def _worth_retrying_now(self, exc: BaseException) -> bool:
        if not isinstance(exc, TransientProviderError):
            return False
        # A long Retry-After defers the whole job instead of holding a worker slot.
        return (exc.retry_after_s or 0.0) <= self._http.max_retry_after_s

    async def get_json(self, path: str) -> dict[str, Any]:
        """GET ``{base_url}/{path}`` and return its JSON object, retrying transient failures."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._http.attempts),
            wait=self._wait,
            retry=retry_if_exception(self._worth_retrying_now),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._get_once(path)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _get_once(self, path: str) -> dict[str, Any]:
        response = await self._request(path, read=True)
        try:
            data = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            raise ProviderError(
                "answer is not JSON", provider=self.name, path=path, status=200
            ) from None
        if not isinstance(data, dict):
            raise ProviderError(
                "answer is not a JSON object", provider=self.name, path=path, status=200
            )
        return data

    async def _request(self, path: str, *, read: bool) -> httpx.Response:
        """One GET, measured; a 200 comes back (its body read when ``read``, else open for
        streaming), anything else raises, transient or not."""
        started = time.perf_counter()
        status: int | None = None
        try:
            response = await self._send(path)
            if read:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            status = response.status_code
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise TransientProviderError(
                _timeout_text(exc), provider=self.name, path=path
            ) from None
        except _NETWORK_ERRORS as exc:
            raise TransientProviderError(
                f"connection failed ({type(exc).__name__})", provider=self.name, path=path
            ) from None
        finally:
            if self._on_request is not None:
                self._on_request(self.name, status, time.perf_counter() - started)
        if status == 200:
            return response
        if not read:
            await response.aclose()
        if status in _RETRY_STATUS:
            raise TransientProviderError(
                "provider busy or failing",
                provider=self.name,
                path=path,
                status=status,
                retry_after_s=retry_after_s(response),
            )
        raise ProviderError("unexpected status", provider=self.name, path=path, status=status)

    async def stream_bytes(self, path: str) -> AsyncIterator[bytes]:
        """GET ``{base_url}/{path}`` as a byte stream; opening is retried like :meth:`get_json`,
        a break mid-stream raises TransientProviderError (the batch job resumes later)."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._http.attempts),
            wait=self._wait,
            retry=retry_if_exception(self._worth_retrying_now),
            reraise=True,
        )
        response: httpx.Response | None = None
        async for attempt in retrying:
            with attempt:
                response = await self._request(path, read=False)
        assert response is not None
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        except (httpx.TimeoutException, TimeoutError):
            raise TransientProviderError(
                "stream timed out", provider=self.name, path=path
            ) from None
        except _NETWORK_ERRORS as exc:
            raise TransientProviderError(
                f"stream broke ({type(exc).__name__})", provider=self.name, path=path
            ) from None
        finally:
            await response.aclose()

    async def stream_lines(self, path: str) -> AsyncIterator[bytes]:
        """The non-empty lines of a streamed JSONL answer, as bytes, never all in memory."""
        pending = b""
        async for chunk in self.stream_bytes(path):
            pending += chunk
            if b"\n" not in chunk:
                continue
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    yield line
        if pending.strip():
            yield pending

    async def aclose(self) -> None:
        for transport in self._transports:
            await transport.aclose()
