"""A watch's poll of a finished Sail batch with inline results: read whole, or streamed.

Usage: ``python bench/sail_poll.py [--rows 2000] [--body-bytes 50000] [--rounds 3]``

Sail's requests-at-scale guide inlines a finished batch's results in its batch object (up
to ~1 GiB). A watch only needs to know that the batch is over, then hands it to the batch
job, which reads the rows once. The baseline reads the object whole, as every poll did
before (with ``http.max_response_bytes`` raised so it can); the case is the Sail dialect's
streamed poll, which stops where the inline results begin. Both run in this process
against the provider simulator (a real HTTP server on 127.0.0.1), alternated for
``--rounds``; prints each one's seconds and peak Python memory (tracemalloc) per poll,
and the ratios (case / baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common

from receiver.config.sections import HttpConfig
from receiver.config.settings import ProviderConfig
from receiver.demo.simulator import ProviderSimulator
from receiver.providers import ProviderClient, dialect_for

KEY = "sk-bench"


async def _poll(sim: ProviderSimulator, whole: bool) -> tuple[float, int, str]:
    """One poll: (seconds, peak bytes allocated, what it decided)."""
    http = HttpConfig(max_response_bytes=4 << 30)  # the whole read must be allowed to finish
    config = ProviderConfig(dialect="sail", base_url=sim.base_url, api_key=KEY)
    client = ProviderClient("bench", config, http)
    dialect = dialect_for("sail", client)
    try:
        tracemalloc.start()
        started = time.perf_counter()
        if whole:
            batch = await client.get_json("batches/b_big", attempts=1)
        else:
            batch = await dialect.fetch_batch_object("b_big", attempts=1)
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        pending = dialect.batch_pending(batch)
        return took, peak, "finished" if pending is None else f"pending ({pending})"
    finally:
        await client.aclose()


async def _run(args: argparse.Namespace) -> int:
    sim = ProviderSimulator(api_key=KEY).start()
    try:
        batch = sim.add_batch("sail", "b_big", args.rows, shape="guide", body_bytes=args.body_bytes)
        size = sum(len(part) for part in batch.guide_document(1.0) if isinstance(part, bytes))
        print(f"{common.load_note()}")
        print(f"a finished Sail batch: {args.rows:,} inline rows, {size / 1e6:,.1f} MB")
        results: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for whole in (True, False):
                took, peak, decided = await _poll(sim, whole)
                results[whole].append((took, peak))
                name = "whole read" if whole else "streamed poll"
                print(f"  {name:14} {took:7.3f} s  peak {peak / 1e6:8.1f} MB  ({decided})")
        best = {w: min(r) for w, r in results.items()}
        peak = {w: min(p for _, p in r) for w, r in results.items()}
        print(
            f"streamed / whole: time {best[False][0] / best[True][0]:.4f}, "
            f"peak memory {peak[False] / peak[True]:.4f} (best of {args.rounds})"
        )
        return 0
    finally:
        sim.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--body-bytes", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=3)
    return asyncio.run(_run(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
