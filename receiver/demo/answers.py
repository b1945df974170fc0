"""Answers of the provider simulator built from parts, streamed: plain, gzip-encoded, or
larger than nopoll's caps (:class:`Oversize`: padded, endless, a gzip bomb).

An oversized answer is described as parts (bytes, and :class:`Run` for its padding) and
streamed; gzip is produced lazily too, so a 10 GiB gzip bomb costs 10 MiB on the wire and
nothing in memory.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import orjson
from starlette.responses import Response, StreamingResponse

__all__ = ["Oversize", "Part", "Run", "answer", "blocks", "gzip_stream", "json_answer"]

_BLOCK = 256 * 1024
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"


class Run(NamedTuple):
    """``n`` copies of one byte: the padding of an oversized answer, never built whole."""

    byte: bytes
    n: int


Part = bytes | Run


@dataclass(frozen=True)
class Oversize:
    """An answer larger than nopoll's caps, as a broken or hostile provider sends it.

    ``padded``: complete and valid JSON, just ``size`` bytes long (a JSON answer says so in
    its Content-Length); ``endless``: it never ends (no closing brace, no newline, no
    Content-Length), the answer just stops after ``size`` bytes; ``gzip_bomb``: like
    ``padded``, sent with ``Content-Encoding: gzip`` (about 1,000 times smaller on the wire).
    """

    kind: Literal["padded", "endless", "gzip_bomb"]
    size: int

    def parts(self, obj: dict[str, Any], end: bytes = b"") -> list[Part]:
        """``obj`` as JSON with a ``padding`` string that makes it ``size`` bytes, then ``end``."""
        head = orjson.dumps(obj)[:-1] + b',"padding":"'
        if self.kind == "endless":
            return [head, Run(b"x", max(0, self.size - len(head)))]
        tail = b'"}' + end
        return [head, Run(b"x", max(0, self.size - len(head) - len(tail))), tail]


def _expand(parts: Iterable[Part]) -> Iterator[bytes]:
    for part in parts:
        if isinstance(part, Run):
            full, rest = divmod(part.n, _BLOCK)
            block = part.byte * _BLOCK if full else b""
            for _ in range(full):
                yield block
            if rest:
                yield part.byte * rest
        elif part:
            yield part


def gzip_stream(parts: Iterable[Part]) -> Iterator[bytes]:
    """``parts`` as one gzip member, compressed as they come. A :class:`Run` is compressed
    256 KiB at a time after a full flush, so each block compresses to the same bytes: they
    are computed once and repeated (only the CRC is computed per block, as it is sent)."""
    yield _GZIP_HEADER
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    crc = size = 0
    for part in parts:
        if isinstance(part, Run):
            full, rest = divmod(part.n, _BLOCK)
            if full:
                yield deflate.flush(zlib.Z_FULL_FLUSH)
                block = part.byte * _BLOCK
                unit = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
                for _ in range(full):
                    crc = zlib.crc32(block, crc)
                    yield unit
                size += full * _BLOCK
            data = part.byte * rest
        else:
            data = part
        crc = zlib.crc32(data, crc)
        size += len(data)
        out = deflate.compress(data)
        if out:
            yield out
    yield deflate.flush() + struct.pack("<II", crc, size & 0xFFFFFFFF)


def _size(parts: Iterable[Part]) -> int:
    return sum(p.n if isinstance(p, Run) else len(p) for p in parts)


def answer(parts: Iterable[Part], *, media_type: str, gzip: bool = False) -> Response:
    """Stream ``parts`` (gzip-encoded when ``gzip``). A list of parts that ends complete gets a
    Content-Length; a generator is sent chunked."""
    if gzip:
        return StreamingResponse(
            blocks(gzip_stream(parts)), media_type=media_type, headers={"content-encoding": "gzip"}
        )
    headers = {"content-length": str(_size(parts))} if isinstance(parts, list) else None
    return StreamingResponse(blocks(_expand(parts)), media_type=media_type, headers=headers)


def json_answer(
    body: dict[str, Any], *, oversize: Oversize | None = None, gzip: bool = False
) -> Response:
    """A JSON object as a provider answers it: plain, gzip-encoded, or too large."""
    if oversize is None:
        data = orjson.dumps(body)
        if not gzip:
            return Response(data, media_type="application/json")
        encoded = b"".join(gzip_stream([data]))
        return Response(
            encoded, media_type="application/json", headers={"content-encoding": "gzip"}
        )
    parts = oversize.parts(body)
    if oversize.kind == "endless":
        return answer(iter(parts), media_type="application/json", gzip=gzip)
    return answer(parts, media_type="application/json", gzip=gzip or oversize.kind == "gzip_bomb")


async def blocks(lines: Iterable[bytes]) -> AsyncIterator[bytes]:
    """Join small pieces into ~256 KiB blocks for a streaming response. After each block the
    event loop runs once: a client that went away (e.g. at a size cap) stops the stream
    there, instead of after the whole generated answer."""
    buffer: list[bytes] = []
    size = 0
    for piece in lines:
        buffer.append(piece)
        size += len(piece)
        if size >= _BLOCK:
            yield b"".join(buffer)
            buffer, size = [], 0
            await asyncio.sleep(0)
    if buffer:
        yield b"".join(buffer)
