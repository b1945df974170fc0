"""Redis failover under load: what is acknowledged, and what of it is lost.

Usage: ``python bench/failover.py [--rate 200] [--seconds 12]
[--runs kill:1,kill:0,partition:1,partition:0]``

Each run is the failover drill of the test suite (``tests/failover.py``): a primary, two
replicas and three sentinels (``valkey-server`` processes on 127.0.0.1), ``nopoll api``
and two ``nopoll worker`` processes, signed callbacks at ``--rate`` for ``--seconds``;
three seconds in, the primary is SIGKILLed (``kill``: it comes back as it was configured,
with its own data, a few seconds after the promotion) or cut off from its replicas and
the sentinels while the API still reaches it (``partition``: the API is given the
primary's own address, the workers the sentinels'). ``:1`` and ``:0`` are
``redis.min_replicas_acked``. Printed per run: callbacks acknowledged, acknowledged but
missing from Postgres, duplicated rows, seconds of 503, seconds until callbacks were
acknowledged again, the promotion's time.

Expected: with 1, nothing acknowledged is ever missing; with 0, the partition loses what
the old primary acknowledged alone (the documented trade-off). Exits 1 when a run with
``min_replicas_acked`` 1 loses an acknowledged callback.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.failover

import _common as common

from tests.failover import drill


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--runs", default="kill:1,kill:0,partition:1,partition:0")
    args = parser.parse_args(argv)
    runs = []
    for item in args.runs.split(","):
        fault, _, acked = item.partition(":")
        if fault not in ("kill", "partition") or acked not in ("0", "1"):
            parser.error(f"a run is kill:N or partition:N with N 0 or 1, not {item!r}")
        runs.append((fault, int(acked)))
    print(f"machine: {common.load_note()}")
    ok = True
    for fault, acked in runs:
        table = f"bench_failover_{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryDirectory(prefix="nopoll-bench-failover-") as tmp:
            report = asyncio.run(
                drill(
                    Path(tmp),
                    fault=fault,  # type: ignore[arg-type]
                    min_replicas_acked=acked,
                    pg_url=common.PG_URL,
                    table=table,
                    rate=args.rate,
                    seconds=args.seconds,
                    land_within_s=30.0 if acked == 0 else 60.0,
                )
            )
        asyncio.run(common.drop_table(table))
        print()
        for line in report.lines():
            print(f"  {line}")
        if acked and (report.missing or report.crashed):
            ok = False
    print(f"\nmachine after: {common.load_note()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
