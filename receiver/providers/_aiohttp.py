"""GETs straight on aiohttp: the provider client's hot path (one GET per result).

:class:`AiohttpGets` sends a GET on the httpx-aiohttp transport's own aiohttp session
(the same pool, limits, TLS context and timeouts) and answers an
:class:`AiohttpAnswer`: the status, headers, raw byte stream and ``aclose`` that the
provider client reads, without building an ``httpx.Request`` and ``httpx.Response``
around aiohttp's own. Everything above it is unchanged; anything else (a POST, a test's
transport) still goes through httpx.

See docs/architecture.md (the provider client's GETs) for why.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
import httpx
from httpx_aiohttp.transport import AiohttpResponseStream, AiohttpTransport, map_aiohttp_exceptions

__all__ = ["AiohttpAnswer", "AiohttpGets"]


class AiohttpAnswer:
    """A GET's answer as the provider client reads an ``httpx.Response``: ``status_code``,
    ``headers`` (aiohttp's case-insensitive ones), the body as it came over the wire
    (``stream``), and ``aclose``."""

    __slots__ = ("headers", "status_code", "stream")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.status_code: int = response.status
        self.headers: Mapping[str, str] = response.headers
        self.stream: httpx.AsyncByteStream = AiohttpResponseStream(response)

    async def aclose(self) -> None:
        await self.stream.aclose()


class AiohttpGets:
    """GETs with fixed ``headers`` and ``timeout`` on ``transport``'s aiohttp session."""

    def __init__(
        self, transport: AiohttpTransport, headers: Mapping[str, str], timeout: httpx.Timeout
    ) -> None:
        self._transport = transport
        self._headers = dict(headers)
        self._timeout = aiohttp.ClientTimeout(
            sock_connect=timeout.connect, sock_read=timeout.read, connect=timeout.pool
        )

    def set_headers(self, headers: Mapping[str, str]) -> None:
        self._headers = dict(headers)

    async def get(self, url: str) -> AiohttpAnswer:
        """GET ``url``; the caller reads or streams the body and closes the response.
        aiohttp's failures come as httpx's exceptions, as from the transport."""
        transport = self._transport
        if not isinstance(transport.client, aiohttp.ClientSession):
            transport.client = transport.get_client()  # the transport's own, made once
        with map_aiohttp_exceptions():
            response = await transport.client.request(
                "GET",
                url,
                headers=self._headers,
                allow_redirects=False,
                auto_decompress=False,
                compress=False,
                timeout=self._timeout,
            ).__aenter__()
        return AiohttpAnswer(response)
