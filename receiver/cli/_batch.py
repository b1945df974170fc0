"""``nopoll fetch-batch``: fetch a batch's results now, with a progress bar."""

from __future__ import annotations

import argparse
import time
from typing import Any

from nopoll.exceptions import ConfigError
from receiver.cli._common import (
    add_config_option,
    add_tenant_option,
    load,
    provider_for,
    run_async,
    setup_logging,
)
from receiver.config.settings import Settings
from receiver.redis.connector import RedisConnector


async def _fetch_batch(args: argparse.Namespace, settings: Settings, redis: RedisConnector) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from nopoll.envelope import now_rfc3339
    from nopoll.wire import safe_id
    from receiver.metrics import Metrics
    from receiver.worker.gc_policy import job_gc
    from receiver.worker.state import build_state

    provider_for(settings, args.provider, args.tenant)
    if not safe_id(args.batch_id):
        raise ConfigError("batch id must match [A-Za-z0-9_.:-]{1,256}")
    state = build_state(settings, redis, Metrics())  # the worker's own resources
    try:
        with (
            job_gc(),  # the worker's GC settings: this process runs the same pipeline
            Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                TextColumn("{task.completed:,.0f} rows"),
                TextColumn("{task.fields[rate]:,.0f} rows/s"),
                TimeElapsedColumn(),
                refresh_per_second=2,
            ) as bar,
        ):
            task = bar.add_task(f"{args.provider}/{args.batch_id}", total=None, rate=0.0)
            started = time.monotonic()

            def progress(rows: int) -> None:
                bar.advance(task, rows)
                done = bar.tasks[0].completed
                bar.update(task, rate=done / max(1e-6, time.monotonic() - started))

            dialect = state.dialect(args.provider, args.tenant)
            assert dialect is not None  # provider_for checked it
            outcome = await state.batch_runner.run(
                dialect,
                provider=args.provider,
                batch_id=args.batch_id,
                event_id=None,
                received_at=now_rfc3339(),
                tenant=args.tenant,
                force=args.force,
                on_progress=progress,
            )
    finally:
        await state.aclose()
    if outcome.already_done:
        print(f"batch {args.batch_id} was already delivered; --force fetches it again")
        return 0
    elapsed = time.monotonic() - started
    print(
        f"{outcome.rows} rows delivered in {elapsed:.1f} s "
        f"({outcome.rows / max(elapsed, 1e-6):,.0f} rows/s): {dict(outcome.by_status)}"
    )
    if outcome.chunks_skipped:
        print(f"resumed after {outcome.chunks_skipped} chunk(s) every sink had already committed")
    if outcome.handed_off:
        print(f"chunks still being retried by the worker: {outcome.handed_off}")
    return 0


def _cmd_fetch_batch(args: argparse.Namespace) -> int:
    from receiver.runtime import redis_for

    settings = load(args)
    setup_logging(settings, "warning")
    with redis_for(settings) as redis:
        return run_async(_fetch_batch(args, settings, redis))


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    p = sub.add_parser("fetch-batch", help="fetch a batch's results now (e.g. a missed callback)")
    add_config_option(p)
    p.add_argument("provider", help="provider name from the config")
    p.add_argument("batch_id")
    p.add_argument("--force", action="store_true", help="fetch again even if already delivered")
    add_tenant_option(p)
    p.set_defaults(func=_cmd_fetch_batch)
