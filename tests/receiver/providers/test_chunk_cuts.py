"""Where batch chunks end (:class:`~receiver.providers.base.ChunkCut`): by rows or bytes,
and the same on a resumed run that reads past the rows it skips."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from nopoll.envelope import BatchRow
from receiver.providers.base import PER_ROW_BYTES, BatchFetch, chunk_rows, id_chunks

# rows of irregular sizes: 40 to 3,000 bytes
LINES = [b"x" * (40 + (i * 7919) % 2960) for i in range(300)]


async def _lines() -> AsyncIterator[bytes]:
    for line in LINES:
        yield line


def _parse(index: int, line: bytes) -> BatchRow:
    return BatchRow(index, f"row-{index}", "completed")


async def _chunks(fetch: BatchFetch) -> list[tuple[int, list[int], int]]:
    out = []
    async for number, rows in chunk_rows(_lines(), fetch, _parse):
        out.append((number, [r.index for r in rows], fetch.last_chunk_bytes))
    return out


@pytest.mark.parametrize(("size", "max_bytes"), [(50, 0), (50, 10_000), (1000, 4_000), (3, 1)])
async def test_a_resumed_run_cuts_where_the_first_one_did(size: int, max_bytes: int) -> None:
    full = await _chunks(BatchFetch("b", chunk_size=size, chunk_bytes=max_bytes))
    assert [i for _, rows, _ in full for i in rows] == list(range(len(LINES)))
    assert [n for n, _, _ in full] == list(range(len(full)))
    for _, rows, nbytes in full:
        assert len(rows) <= size
        assert nbytes == sum(len(LINES[i]) for i in rows)
        if max_bytes:  # over the bound only by the row that reached it
            assert nbytes - len(LINES[rows[-1]]) < max_bytes
    for skip in (1, len(full) // 2, len(full) - 1):
        resumed = await _chunks(
            BatchFetch("b", chunk_size=size, chunk_bytes=max_bytes, skip_before=skip)
        )
        assert resumed == full[skip:]


def test_per_row_chunks_count_each_row_as_per_row_bytes() -> None:
    ids = [f"row-{i:04d}" for i in range(1000)]
    rows_only = id_chunks(ids, BatchFetch("b", chunk_size=300))
    assert [len(rows) for _, rows in rows_only] == [300, 300, 300, 100]
    bounded = id_chunks(ids, BatchFetch("b", chunk_size=300, chunk_bytes=100 * PER_ROW_BYTES))
    assert [len(rows) for _, rows in bounded] == [100] * 10
    resumed = id_chunks(
        ids, BatchFetch("b", chunk_size=300, chunk_bytes=100 * PER_ROW_BYTES, skip_before=4)
    )
    assert resumed == bounded[4:]
    tiny = id_chunks(ids[:3], BatchFetch("b", chunk_size=300, chunk_bytes=1))
    assert [len(rows) for _, rows in tiny] == [1, 1, 1]
