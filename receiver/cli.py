"""The ``nopoll`` command line.

``nopoll serve|api|worker``, ``nopoll dlq list|replay``, ``nopoll config check`` and
``nopoll demo``. Config problems print one clear message and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from receiver.config import Settings, load_settings
from receiver.exceptions import ConfigError, NopollError

__all__ = ["main"]


def _settings(args: argparse.Namespace) -> Settings:
    path = args.config or os.environ.get("NOPOLL_CONFIG") or None
    return load_settings(path)


def _setup_logging(settings: Settings, level: str | None = None) -> None:
    from receiver.logs import configure_logging

    configure_logging(level or settings.log_level, settings.log_format)


def _cmd_run(args: argparse.Namespace) -> int:
    from receiver.runtime import run

    settings = _settings(args)
    _setup_logging(settings)
    api = args.command in ("serve", "api")
    worker = args.command in ("serve", "worker")
    health_port = getattr(args, "health_port", None)
    run(
        settings,
        api=api,
        worker=worker,
        health=(args.health_host, health_port) if health_port else None,
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 8000),
    )
    return 0


async def _dlq(args: argparse.Namespace, settings: Settings, url: str) -> int:
    from receiver.deadletter import DeadLetters
    from receiver.queue import arq_pool

    pool = arq_pool(url)
    try:
        letters = DeadLetters(pool)
        found = await letters.find(sink=args.sink, key=getattr(args, "key", None))
        if args.dlq_command == "list":
            if not found:
                print("no dead letters")
                return 0
            print(f"{'id':32}  {'sink':12} {'provider':12} {'tries':>5}  keys / last error")
            for d in found:
                keys = ", ".join(d.keys[:3]) + (
                    f" (+{len(d.keys) - 3} more)" if len(d.keys) > 3 else ""
                )
                print(f"{d.id:32}  {d.sink:12} {d.provider:12} {d.attempts:>5}  {keys}")
                print(f"{'':32}  {d.error}")
            print(f"{len(found)} dead letter(s)")
            return 0
        count = await letters.replay(found)
        print(f"{count} dead letter(s) queued again; a running worker delivers them")
        return 0
    finally:
        await pool.aclose()


def _run_async(coro: Any) -> int:
    try:
        import uvloop

        return int(uvloop.run(coro))
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        return int(asyncio.run(coro))


def _cmd_dlq(args: argparse.Namespace) -> int:
    from receiver.runtime import redis_url_for

    settings = _settings(args)
    with redis_url_for(settings) as url:
        return asyncio.run(_dlq(args, settings, url))


def _cmd_config_check(args: argparse.Namespace) -> int:
    settings = _settings(args)
    print("config OK")
    print(
        "  redis: "
        + (f"embedded (under {settings.data_dir})" if settings.embedded_redis else "external")
    )
    for name, p in settings.providers.items():
        print(
            f"  provider {name}: dialect {p.dialect}, {p.base_url}, "
            f"{len(p.webhook_secrets)} webhook secret(s), tolerance {p.tolerance_s}s"
        )
    for name, s in settings.sinks.items():
        print(f"  sink {name}: {s.type}")
    if settings.routes:
        for i, r in enumerate(settings.routes):
            print(f"  route {i}: {r.match.model_dump(exclude_none=True)} -> {', '.join(r.sinks)}")
    else:
        print("  routes: none (every result goes to every sink)")
    return 0


async def _fetch_batch(args: argparse.Namespace, settings: Settings, url: str) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from receiver.batches import BatchRunner
    from receiver.deadletter import DeadLetters
    from receiver.envelope import now_rfc3339
    from receiver.fanout import FanOut, ManagedSink
    from receiver.metrics import Metrics
    from receiver.providers import ProviderClient, dialect_for, safe_id
    from receiver.queue import arq_pool
    from receiver.routing import Router

    provider = settings.providers.get(args.provider)
    if provider is None:
        known = ", ".join(sorted(settings.providers)) or "none"
        raise ConfigError(f"unknown provider {args.provider!r} (configured: {known})")
    if not safe_id(args.batch_id):
        raise ConfigError("batch id must match [A-Za-z0-9_.:-]{1,256}")
    metrics = Metrics()
    sinks = {n: ManagedSink(n, c, metrics) for n, c in settings.sinks.items()}
    fanout = FanOut(sinks, Router(settings.routes, list(sinks)), metrics)
    pool = arq_pool(url, expires_ms=settings.job_expiry_s * 1000)
    client = ProviderClient(args.provider, provider, settings.http)
    runner = BatchRunner(
        settings, redis=pool, fanout=fanout, dead_letters=DeadLetters(pool), metrics=metrics
    )
    try:
        with Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            TextColumn("{task.completed:,.0f} rows"),
            TextColumn("{task.fields[rate]:,.0f} rows/s"),
            TimeElapsedColumn(),
            refresh_per_second=2,
        ) as bar:
            task = bar.add_task(f"{args.provider}/{args.batch_id}", total=None, rate=0.0)
            started = time.monotonic()

            def progress(rows: int) -> None:
                bar.advance(task, rows)
                done = bar.tasks[0].completed
                bar.update(task, rate=done / max(1e-6, time.monotonic() - started))

            outcome = await runner.run(
                dialect_for(provider.dialect, client),
                provider=args.provider,
                batch_id=args.batch_id,
                event_id=None,
                received_at=now_rfc3339(),
                force=args.force,
                on_progress=progress,
            )
    finally:
        await client.aclose()
        await fanout.aclose()
        await pool.aclose()
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
    from receiver.runtime import redis_url_for

    settings = _settings(args)
    _setup_logging(settings, "warning")
    with redis_url_for(settings) as url:
        return _run_async(_fetch_batch(args, settings, url))


def _cmd_demo(args: argparse.Namespace) -> int:
    from receiver.demo import run_demo

    return run_demo(n=args.n, data_dir=args.data_dir, keep=args.keep)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nopoll",
        description="Webhook receiver and result sink for asynchronous LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config", help="YAML config file (default: $NOPOLL_CONFIG, else built-in defaults)"
        )

    for name, help_ in (
        ("serve", "run the API and the worker in one process"),
        ("api", "run the API only"),
    ):
        p = sub.add_parser(name, help=help_)
        with_config(p)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=8000)
        p.set_defaults(func=_cmd_run)
    p = sub.add_parser("worker", help="run the worker only")
    with_config(p)
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve GET /healthz and /metrics of this worker process on this port",
    )
    p.add_argument("--health-host", default="127.0.0.1", help="address for --health-port")
    p.set_defaults(func=_cmd_run)

    dlq = sub.add_parser("dlq", help="list or replay dead letters")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    p = dlq_sub.add_parser("list", help="show dead letters")
    with_config(p)
    p.add_argument("--sink", help="only this sink's ('fetch' for failed fetches)")
    p.set_defaults(func=_cmd_dlq)
    p = dlq_sub.add_parser(
        "replay", help="queue dead letters again (all of them without a selector)"
    )
    with_config(p)
    p.add_argument("--sink", help="only this sink's ('fetch' for failed fetches)")
    p.add_argument("--key", help="only dead letters that hold this result key")
    p.set_defaults(func=_cmd_dlq)

    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    p = cfg_sub.add_parser("check", help="validate a config file and print what it configures")
    with_config(p)
    p.set_defaults(func=_cmd_config_check)

    p = sub.add_parser("fetch-batch", help="fetch a batch's results now (e.g. a missed callback)")
    with_config(p)
    p.add_argument("provider", help="provider name from the config")
    p.add_argument("batch_id")
    p.add_argument("--force", action="store_true", help="fetch again even if already delivered")
    p.set_defaults(func=_cmd_fetch_batch)

    p = sub.add_parser("demo", help="run nopoll end to end against a built-in provider simulator")
    p.add_argument(
        "--n", type=int, default=200, help="background responses to complete (default 200)"
    )
    p.add_argument(
        "--data-dir", default=None, help="where to keep results (default: a temporary folder)"
    )
    p.add_argument("--keep", action="store_true", help="keep the data folder afterwards")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nopoll`` console script."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"nopoll: {exc}", file=sys.stderr)
        return 2
    except NopollError as exc:
        print(f"nopoll: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
