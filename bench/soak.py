"""The fault-schedule soak (``tests/soak.py`` does the work): nopoll api + 2 workers,
Postgres, S3 (moto), Kafka (tansu) and the provider simulator under a steady mixed load
while both workers are SIGKILLed mid-batch, Redis is restarted, Postgres is frozen, S3 answers
500, the Kafka broker is restarted, and the provider answers 429 storms and hangs.

    python bench/soak.py                      # 10 minutes, every fault 20 s
    python bench/soak.py --minutes 3 --fault-s 8
    python bench/soak.py --minutes 2 --faults worker_kill   # Postgres is not frozen

For each worker kill it prints how many seconds after the kill the work the killed
workers held (job locks, watches being polled) was all free again (released by the
reaper: the liveness bound) and all resumed (claimed or polled again by a restarted
worker, or finished), and when the reaper forgot each killed worker; or what had not
resumed 120 s after the kill, or that they held nothing.

Prints per fault window: callbacks acknowledged, results expected, found, missing and
duplicated in SQL, S3 and Kafka, and the dead letters (each must say why). Target: 0
missing, 0 duplicated in SQL and S3, every result in Kafka. Exit status 1 otherwise.
Postgres on 127.0.0.1:5432 (database ``test``) is frozen by PID for a while: run it on a
machine where nothing else needs that server meanwhile (root, to signal its processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import PG_URL, load_note
from tests.soak import FAULTS, passed, print_report, run


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fault-s", type=float, default=20.0, help="how long each fault lasts")
    parser.add_argument("--rate", type=float, default=5.0, help="response callbacks a second")
    parser.add_argument("--drain", type=float, default=300.0)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"which faults, comma-separated, in order; one named twice comes twice "
        f"(default all: {','.join(FAULTS)})",
    )
    args = parser.parse_args()
    faults = tuple(f for f in args.faults.split(",") if f)
    result = run(
        args.minutes * 60,
        args.fault_s,
        PG_URL,
        drain_s=args.drain,
        rate=args.rate,
        faults=faults,
    )
    print_report(result)
    print(load_note())
    print(f"logs: {result['workdir']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
