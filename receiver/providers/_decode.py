"""Decoding a provider's answer in bounded steps (gzip, deflate, identity).

httpx's own decoders inflate a whole network chunk in one call, so one 64 KiB chunk of a
gzip bomb can become gigabytes. :class:`Decoder` uses zlib's ``max_length`` instead: no
step produces more than :data:`PIECE` bytes, whatever the compression ratio.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Protocol

import httpx

from nopoll.exceptions import ProviderError

__all__ = ["ENCODINGS", "PIECE", "Answer", "Decoder", "raw_stream"]

PIECE = 64 * 1024
"""The most bytes one decoding step produces (and the largest piece a stream yields)."""
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class Answer(Protocol):
    """What the provider client reads of an answer: an ``httpx.Response``, or the GETs'
    lighter :class:`~receiver.providers._aiohttp.AiohttpAnswer`."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def stream(self) -> httpx.SyncByteStream | httpx.AsyncByteStream: ...

    async def aclose(self) -> None: ...


def raw_stream(response: Answer) -> AsyncIterator[bytes]:
    """The body as it came over the wire (httpx's ``aiter_raw`` without its bookkeeping,
    which refuses a body httpx itself has already read, as MockTransport's are)."""
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    return stream.__aiter__()


class Decoder:
    """One Content-Encoding (identity, gzip or deflate) decoded in bounded steps.

    zlib's ``max_length`` keeps each step at :data:`PIECE` output bytes whatever the
    compression ratio; input not decoded yet waits in ``unconsumed_tail``. A gzip answer of
    several members (concatenated gzip files) is decoded whole, never cut at the first.
    """

    def __init__(self, encoding: str, fail: Callable[[str], ProviderError]) -> None:
        self.name = encoding or "identity"
        self._fail = fail
        self._zlib = zlib.decompressobj(ENCODINGS[encoding]) if encoding else None
        self._fed = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._zlib is None:
            for start in range(0, len(data), PIECE):
                yield data[start : start + PIECE]  # the same object when it is all of data
            return
        while data:
            if self._zlib.eof:  # the next gzip member; trailing bytes after deflate are ignored
                if self.name == "deflate":
                    return
                self._zlib = zlib.decompressobj(ENCODINGS[self.name])
            try:
                piece = self._zlib.decompress(data, PIECE)
            except zlib.error:
                if self.name == "deflate" and not self._fed:
                    # Raw deflate without the zlib header, which some servers send (httpx too
                    # accepts it).
                    self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
                    self._fed = True
                    continue
                raise self._fail(f"answer is not valid {self.name}") from None
            self._fed = True
            if piece:
                yield piece
            data = self._zlib.unused_data if self._zlib.eof else self._zlib.unconsumed_tail

    def end(self) -> Iterator[bytes]:
        if self._zlib is None or not self._fed:
            return
        if not self._zlib.eof:
            raise self._fail(f"{self.name} answer ended early")
        rest = self._zlib.flush()
        if rest:
            yield rest
