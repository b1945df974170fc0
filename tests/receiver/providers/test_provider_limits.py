"""Caps on what a provider can make nopoll read: a JSON answer (``http.max_response_bytes``),
a line of a streamed results file and one inline Sail item (``http.max_line_bytes``),
counted on the wire and after gzip decoding, against the real simulator.

Every oversized answer is a permanent ProviderError naming the cap, raised as soon as the
cap is passed: peak memory stays near the cap however large the answer or its gzip bomb.
gzip and deflate are decoded by nopoll itself, whole (every gzip member) or refused with a
reason; other encodings are refused.
"""

from __future__ import annotations

import contextlib
import gzip
import time
import tracemalloc
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from nopoll.envelope import BatchRow
from nopoll.exceptions import ProviderError, TransientProviderError
from receiver.config.settings import HttpConfig, ProviderConfig
from receiver.demo.answers import Oversize
from receiver.providers import BatchFetch, ProviderClient, ResponsesDialect, dialect_for

MIB = 1024 * 1024
CAP = 1 * MIB
BOMB = 256 * MIB  # decoded; about 256 KiB on the wire
SLACK = 3 * MIB  # the cap plus a few chunks, buffers and the test's own allocations
RESPONSE_CAP = f"http.max_response_bytes ({CAP} bytes)"
LINE_CAP = f"http.max_line_bytes ({CAP} bytes)"


def client(base_url: str, dialect: str = "openai", transport: str = "aiohttp") -> ProviderClient:
    cfg = ProviderConfig(
        dialect=dialect, base_url=base_url, api_key="sk-test", webhook_secrets=["whsec_aGk="]
    )
    http = HttpConfig(
        attempts=2,
        transport=transport,
        max_response_bytes=CAP,
        max_line_bytes=CAP,
        read_timeout_s=10,
    )
    return ProviderClient("sim", cfg, http)


async def peak_memory(
    c: ProviderClient, call: Callable[[], Awaitable[Any]]
) -> tuple[int, BaseException | None]:
    """Peak traced allocation (bytes) while ``call`` runs, and what it raised; one request
    first, so that the transport's own set-up (a connection pool) is not counted."""
    with contextlib.suppress(ProviderError):
        await c.get_json("responses/warm-up")
    tracemalloc.start()
    error: BaseException | None = None
    try:
        await call()
    except Exception as exc:
        error = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, error


async def all_rows(c: ProviderClient, dialect: str, batch_id: str) -> list[BatchRow]:
    rows: list[BatchRow] = []
    async for _, chunk in dialect_for(dialect, c).batch_chunks(BatchFetch(batch_id, 100)):
        rows.extend(chunk)
    return rows


def permanent(error: BaseException | None, cap: str) -> str:
    assert isinstance(error, ProviderError), repr(error)
    assert not isinstance(error, TransientProviderError)
    assert cap in str(error), str(error)
    return str(error)


# --- one JSON answer: responses, batch objects, per-row results --------------------------


@pytest.mark.parametrize("transport", ["aiohttp", "httpcore"])
async def test_answer_over_the_cap_is_refused_by_its_content_length(provider_sim, transport):
    sim = provider_sim(api_key="sk-test")
    sim.add_response("resp_big", oversize=Oversize("padded", 8 * MIB))
    c = client(sim.base_url, transport=transport)
    with pytest.raises(ProviderError) as info:
        await ResponsesDialect(c).fetch_response("resp_big")
    message = permanent(info.value, RESPONSE_CAP)
    assert "Content-Length 8388608" in message and "sim GET responses/resp_big" in message
    assert sim.request_count() == 1  # permanent: not retried
    await c.aclose()


@pytest.mark.parametrize("transport", ["aiohttp", "httpcore"])
async def test_endless_answer_without_content_length_stops_at_the_cap(provider_sim, transport):
    sim = provider_sim(api_key="sk-test")
    sim.add_response("resp_endless", oversize=Oversize("endless", 64 * MIB))
    c = client(sim.base_url, transport=transport)
    peak, error = await peak_memory(c, lambda: ResponsesDialect(c).fetch_response("resp_endless"))
    permanent(error, RESPONSE_CAP)
    assert peak < CAP + SLACK, f"peak {peak / MIB:.1f} MiB"
    await c.aclose()


@pytest.mark.parametrize("transport", ["aiohttp", "httpcore"])
async def test_gzip_bomb_answer_never_inflates_past_the_cap(provider_sim, transport):
    sim = provider_sim(api_key="sk-test")
    sim.add_response("resp_bomb", oversize=Oversize("gzip_bomb", BOMB))
    c = client(sim.base_url, transport=transport)
    started = time.monotonic()
    peak, error = await peak_memory(c, lambda: ResponsesDialect(c).fetch_response("resp_bomb"))
    assert "after gzip decoding" in permanent(error, RESPONSE_CAP)
    assert peak < CAP + SLACK, f"peak {peak / MIB:.1f} MiB"
    assert time.monotonic() - started < 10
    await c.aclose()


@pytest.mark.parametrize("transport", ["aiohttp", "httpcore"])
async def test_gzip_answers_within_the_cap_decode(provider_sim, transport):
    sim = provider_sim(api_key="sk-test")
    sim.add_response("resp_gz", gzip=True, text="é" * 200_000)  # 400 kB, under the cap
    c = client(sim.base_url, transport=transport)
    body = await ResponsesDialect(c).fetch_response("resp_gz")
    assert body["output"][-1]["content"][0]["text"] == "é" * 200_000
    await c.aclose()


async def test_per_row_result_over_the_cap_fails_the_batch_naming_the_cap(provider_sim):
    sim = provider_sim(api_key="sk-test")
    sim.add_batch(
        "valar", "batch_rows", 20, row_oversize={"row-000002": Oversize("gzip_bomb", BOMB)}
    )
    sim.add_batch(
        "sail",
        "batch_rows_sail",
        20,
        inline=False,
        row_oversize={"row-000007": Oversize("padded", 4 * MIB)},
    )
    for dialect, batch_id in (("valar", "batch_rows"), ("sail", "batch_rows_sail")):
        c = client(sim.base_url, dialect)
        peak, error = await peak_memory(c, lambda c=c, d=dialect, b=batch_id: all_rows(c, d, b))
        permanent(error, RESPONSE_CAP)
        assert peak < CAP + SLACK, f"{dialect}: peak {peak / MIB:.1f} MiB"
        await c.aclose()


# --- streamed results files: one line at most max_line_bytes -----------------------------


def sference_results(provider_sim, batch_id: str, oversize: Oversize) -> ProviderClient:
    """A client of a simulated sference batch of 10 rows whose results file is ``oversize``."""
    sim = provider_sim(api_key="sk-test")
    sim.add_batch("sference", batch_id, 10, oversize=oversize)
    return client(sim.base_url, "sference")


async def test_endless_line_in_a_results_file_stops_at_the_line_cap(provider_sim):
    c = sference_results(provider_sim, "batch_endless", Oversize("endless", 8 * MIB))
    peak, error = await peak_memory(c, lambda: all_rows(c, "sference", "batch_endless"))
    assert "line 4 " in permanent(error, LINE_CAP)
    assert peak < CAP + SLACK, f"peak {peak / MIB:.1f} MiB"
    await c.aclose()


async def test_long_line_then_more_lines_is_refused(provider_sim):
    c = sference_results(provider_sim, "batch_long", Oversize("padded", 3 * MIB))
    with pytest.raises(ProviderError) as info:
        await all_rows(c, "sference", "batch_long")
    permanent(info.value, LINE_CAP)
    await c.aclose()


@pytest.mark.parametrize("transport", ["aiohttp", "httpcore"])
async def test_gzip_bomb_results_file_never_inflates_past_the_line_cap(provider_sim, transport):
    sim = provider_sim(api_key="sk-test")
    sim.add_batch("openai", "batch_bomb", 10, oversize=Oversize("gzip_bomb", BOMB))
    c = client(sim.base_url, "openai", transport)
    peak, error = await peak_memory(c, lambda: all_rows(c, "openai", "batch_bomb"))
    permanent(error, LINE_CAP)
    assert peak < CAP + SLACK, f"peak {peak / MIB:.1f} MiB"
    await c.aclose()


async def test_stream_lines_caps_a_line_and_passes_the_rest(provider_sim):
    sim = provider_sim(api_key="sk-test")
    sim.add_batch("sference", "batch_ok", 300, body_bytes=2000, gzip=True)
    sim.add_batch("sference", "batch_bad", 10, oversize=Oversize("gzip_bomb", BOMB))
    c = client(sim.base_url, "sference")
    lines = [line async for line in c.stream_lines("batches/batch_ok/results.jsonl")]
    assert len(lines) == 300 and all(len(line) < 4000 for line in lines)
    got: list[bytes] = []
    with pytest.raises(ProviderError) as info:
        async for line in c.stream_lines("batches/batch_bad/results.jsonl"):
            got.append(line)
    permanent(info.value, LINE_CAP)
    assert len(got) == 3  # the lines before the bomb came through
    await c.aclose()


async def test_gzip_results_file_within_the_caps_gives_every_row(provider_sim):
    sim = provider_sim(api_key="sk-test")
    sim.add_batch("sference", "batch_gz", 1500, failed_every=11, gzip=True, body_bytes=3000)
    c = client(sim.base_url, "sference")
    rows = await all_rows(c, "sference", "batch_gz")  # ~5 MB decoded: over CAP, no line is
    assert len(rows) == 1500 and len({r.custom_id for r in rows}) == 1500
    assert sum(r.status == "failed" for r in rows) == 136
    await c.aclose()


# --- Sail's inline results (its guide's shape): ~1 GiB streams, one item is capped -------


async def test_sail_document_larger_than_every_cap_still_streams(provider_sim):
    sim = provider_sim(api_key="sk-test")
    sim.add_batch("sail", "batch_sail_big", 500, shape="guide", body_bytes=8000, gzip=True)
    c = client(sim.base_url, "sail")
    rows = await all_rows(c, "sail", "batch_sail_big")  # ~4.5 MB decoded, items of ~9 kB
    assert len(rows) == 500 and all(r.status == "completed" for r in rows)
    await c.aclose()


@pytest.mark.parametrize(
    "oversize",
    [Oversize("endless", 8 * MIB), Oversize("padded", 3 * MIB), Oversize("gzip_bomb", BOMB)],
    ids=["endless", "padded", "gzip_bomb"],
)
async def test_sail_inline_item_over_the_line_cap_is_refused(provider_sim, oversize):
    sim = provider_sim(api_key="sk-test")
    sim.add_batch("sail", "batch_sail_item", 10, shape="guide", oversize=oversize)
    c = client(sim.base_url, "sail")
    peak, error = await peak_memory(c, lambda: all_rows(c, "sail", "batch_sail_item"))
    assert "results item 3 " in permanent(error, LINE_CAP)
    assert peak < CAP + SLACK, f"peak {peak / MIB:.1f} MiB"
    await c.aclose()


async def test_sail_inline_item_over_the_line_cap_is_refused_wherever_the_reads_cut_it():
    """An item is measured whole, not by the reads that carried it. Here (reads of 1 MiB) the
    read that ends the items before it carries the first MiB of a 2.5 MiB item, and the read
    that ends it carries its last half MiB: only one whole read lies inside the item."""
    items = [orjson.dumps({"custom_id": f"r{i}", "result": {"n": i}}) for i in range(3)]
    long_item = b'{"custom_id":"r3","padding":"' + b"x" * (5 * MIB // 2) + b'"}'
    document = b'{"id":"b","results":[' + b",".join([*items, long_item]) + b',{"custom_id":"r4"}]}'
    chunks = [document[:MIB], document[MIB : 2 * MIB], document[2 * MIB :]]

    class Chunked(httpx.AsyncByteStream):
        async def __aiter__(self):
            for chunk in chunks:
                yield chunk

    cfg = ProviderConfig(
        dialect="sail", base_url="https://api.example/v1", webhook_secrets=["whsec_aGk="]
    )
    http = HttpConfig(attempts=1, max_response_bytes=CAP, max_line_bytes=CAP)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=Chunked()))
    c = ProviderClient("sim", cfg, http, transport=transport)
    with pytest.raises(ProviderError) as info:
        await all_rows(c, "sail", "batch_cut")
    assert "results item 3 " in permanent(info.value, LINE_CAP)
    await c.aclose()


# --- Content-Encoding: decoded whole by nopoll, or refused -------------------------------


def encoded_client(body: bytes, encoding: str) -> ProviderClient:
    """A client whose every answer is ``body`` sent as is with ``Content-Encoding``."""

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["accept-encoding"] == "gzip, deflate"
        headers = {"content-encoding": encoding} if encoding else {}
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(body))

    cfg = ProviderConfig(
        dialect="openai", base_url="https://api.example/v1", webhook_secrets=["whsec_aGk="]
    )
    http = HttpConfig(attempts=1, max_response_bytes=CAP, max_line_bytes=CAP)
    return ProviderClient("sim", cfg, http, transport=httpx.MockTransport(handler))


LINES = [b'{"custom_id":"a","n":%d}' % i for i in range(3)]


def raw_deflate(data: bytes) -> bytes:
    deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return deflate.compress(data) + deflate.flush()


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", raw_deflate),
        ("identity", bytes),
        ("", bytes),
    ],
    ids=["gzip", "x-gzip", "deflate", "raw-deflate", "identity", "none"],
)
async def test_supported_encodings_decode(encoding, encode):
    body = b"\n".join(LINES) + b"\n"
    c = encoded_client(encode(body), encoding)
    assert [line async for line in c.stream_lines("files/f/content")] == LINES
    c = encoded_client(encode(LINES[0]), encoding)
    assert await c.get_json("responses/r") == {"custom_id": "a", "n": 0}


async def test_gzip_of_several_members_is_read_to_the_end():
    """Concatenated gzip files are one valid gzip stream (RFC 1952); httpx's decoder stops
    at the first member and silently dropped every row after it."""
    body = b"".join(gzip.compress(line + b"\n") for line in LINES)
    c = encoded_client(body, "gzip")
    assert [line async for line in c.stream_lines("files/f/content")] == LINES


@pytest.mark.parametrize(
    ("body", "encoding", "message"),
    [
        (b"{}", "br", "unsupported Content-Encoding 'br'"),
        (b"{}", "zstd", "unsupported Content-Encoding 'zstd'"),
        (gzip.compress(gzip.compress(b"{}")), "gzip, gzip", "unsupported Content-Encoding"),
        (gzip.compress(b'{"a":1}')[:-12], "gzip", "gzip answer ended early"),
        (b"\x1f\x8b not gzip at all", "gzip", "answer is not valid gzip"),
        (gzip.compress(b'{"a":1}') + b"trailing junk", "gzip", "answer is not valid gzip"),
    ],
    ids=["br", "zstd", "stacked", "truncated", "corrupt", "trailing-junk"],
)
async def test_other_or_broken_encodings_are_refused_naming_why(body, encoding, message):
    for read in ("get_json", "stream_lines"):
        c = encoded_client(body, encoding)
        with pytest.raises(ProviderError) as info:
            if read == "get_json":
                await c.get_json("responses/r")
            else:
                _ = [line async for line in c.stream_lines("files/f/content")]
        assert message in str(info.value) and not isinstance(info.value, TransientProviderError)
