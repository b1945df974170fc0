"""The write coalescer's splitting rules, over an in-memory all-or-nothing store.

The sql sink's tests run the same rules against real Postgres and SQLite; here the store
can also go down in the middle of a split, and flushes are counted exactly.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError, SinkRejected, SinkRowsRejected
from sinks.coalesce import WriteCoalescer


def env(key: str, text: str = "ok") -> Envelope:
    return Envelope(
        provider="sim",
        kind="response",
        key=key,
        status="completed",
        usable=True,
        output_text=text,
        received_at="2026-11-29T10:00:00.000Z",
        fetched_at="2026-11-29T10:00:00.000Z",
    )


class Store:
    """Commits a flush whole, refuses it whole when a row's text is ``bad``, and fails
    like a database that went away once ``down_after`` flushes were made."""

    def __init__(self, down_after: int | None = None) -> None:
        self.rows: dict[str, str | None] = {}
        self.flushes: list[int] = []
        self.down_after = down_after

    async def flush(self, envelopes: list[Envelope]) -> None:
        self.flushes.append(len(envelopes))
        await asyncio.sleep(0)
        if self.down_after is not None and len(self.flushes) > self.down_after:
            raise SinkError("connection refused", sink="mem")
        for e in envelopes:
            if e.output_text == "bad":
                raise SinkRejected(f"bad value in {e.key}", sink="mem")
        self.rows.update({e.key: e.output_text for e in envelopes})


async def test_only_the_caller_with_a_refused_row_fails() -> None:
    store = Store()
    coalescer = WriteCoalescer(store.flush)
    writes = [[env(f"a{i}")] for i in range(6)]
    writes[4] = [env("b1"), env("b2", "bad"), env("b3")]
    results = await asyncio.gather(*(coalescer.write(w) for w in writes), return_exceptions=True)
    error = results[4]
    assert isinstance(error, SinkRowsRejected) and error.sink == "mem"
    assert error.rejected == {"b2": "bad value in b2"}
    assert "1 of 3 rows" in str(error)
    assert results[:4] + results[5:] == [None] * 5
    assert sorted(store.rows) == ["a0", "a1", "a2", "a3", "a5", "b1", "b3"]
    assert store.flushes[0] == 8  # first one grouped flush


async def test_latest_write_wins_as_if_callers_wrote_in_turn() -> None:
    """A key written by an earlier and a later caller: the later version when it is
    stored; the earlier one when the later is refused; never neither."""
    store = Store()
    coalescer = WriteCoalescer(store.flush)
    results = await asyncio.gather(
        coalescer.write([env("k", "v1"), env("x")]),
        coalescer.write([env("k", "v2")]),
        coalescer.write([env("k", "bad"), env("y")]),
        return_exceptions=True,
    )
    assert results[:2] == [None, None]
    assert isinstance(results[2], SinkRowsRejected) and set(results[2].rejected) == {"k"}
    assert store.rows == {"k": "v2", "x": "ok", "y": "ok"}


async def test_an_outage_during_the_split_is_transient_for_the_unsettled() -> None:
    """Callers committed before the database went away succeed; every other caller gets
    the plain SinkError (retry it all), never a rejection."""
    store = Store(down_after=2)
    coalescer = WriteCoalescer(store.flush)
    writes = [[env("a")], [env("b")], [env("c", "bad")], [env("d")]]
    results = await asyncio.gather(*(coalescer.write(w) for w in writes), return_exceptions=True)
    # flush 1: all four, refused; flush 2: [a, b] committed; flush 3: down
    assert results[:2] == [None, None]
    for error in results[2:]:
        assert isinstance(error, SinkError) and not isinstance(error, SinkRejected)
    assert sorted(store.rows) == ["a", "b"]


async def test_a_down_store_is_not_split() -> None:
    store = Store(down_after=0)
    coalescer = WriteCoalescer(store.flush)
    results = await asyncio.gather(
        *(coalescer.write([env(str(i))]) for i in range(10)), return_exceptions=True
    )
    assert all(type(r) is SinkError for r in results)
    assert store.flushes == [10]


@pytest.mark.parametrize("n, bad", [(4096, [0]), (4096, [4095]), (4096, [5, 2000, 4000])])
async def test_bisection_costs_about_two_log2_n_flushes_per_bad_row(n: int, bad: list[int]) -> None:
    store = Store()
    coalescer = WriteCoalescer(store.flush, max_rows=n)
    rows = [env(str(i), "bad" if i in bad else "ok") for i in range(n)]
    with pytest.raises(SinkRowsRejected) as info:
        await coalescer.write(rows)
    assert set(info.value.rejected) == {str(i) for i in bad}
    assert len(store.rows) == n - len(bad)
    assert len(store.flushes) <= 1 + len(bad) * 2 * math.ceil(math.log2(n))
