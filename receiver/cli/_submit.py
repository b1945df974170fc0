"""``nopoll submit``: a JSONL file of requests in, rows in the sinks out (with ``--wait``)."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from receiver.cli._common import (
    add_config_option,
    add_tenant_option,
    load,
    provider_for,
    reach,
    run_on_deployment,
)
from receiver.config.settings import Settings
from receiver.redis.connector import RedisConnector

_SHOWN = 10


async def _submit(
    args: argparse.Namespace, settings: Settings, connector: RedisConnector, where: str
) -> int:
    from receiver.providers.budget import account_budget
    from receiver.providers.client import ProviderClient
    from receiver.providers.push import PushTokens
    from receiver.queue._arq import arq_pool
    from receiver.submit.creates import Submitter, file_digest
    from receiver.watches.store import WatchStore
    from receiver.webhooks.push import push_target

    provider = provider_for(settings, args.provider, args.tenant)
    if not provider.dialect_info.single_responses and not args.batch:
        print(
            f"nopoll: {args.provider} speaks the {provider.dialect} dialect, which has batches "
            "only (no single background requests): submit the file with --batch",
            file=sys.stderr,
        )
        return 2
    path = Path(args.file)
    digest = file_digest(path)
    redis = arq_pool(connector)
    # as many connections as creates in flight (the pool would otherwise cap them)
    http = settings.http.model_copy(
        update={"max_connections": max(settings.http.max_connections, args.concurrency)}
    )
    # the account's budget: these creates share it with the workers' polls and fetches
    budget = account_budget(redis, args.provider, args.tenant, provider)
    client = ProviderClient(args.provider, provider, http, budget=budget)
    started = time.monotonic()
    try:
        await reach(redis, where)  # before anything is created at the provider
        push = (
            None
            if args.poll
            else await push_target(settings, PushTokens(redis), args.provider, args.tenant)
        )
        submitter_for = functools.partial(
            Submitter,
            args.provider,
            provider,
            client,
            redis,
            tenant=args.tenant,
            poll=args.poll,
            settle_after_s=args.settle_after,
            push=push,
        )
        if args.batch:
            return await _batch(args, submitter_for(), path, digest, settings)
        total = _count_lines(path)
        with _Bar(f"submitting to {args.provider}", total) as bar:
            submitter = submitter_for(concurrency=args.concurrency, on_progress=bar.update)
            result = await submitter.submit_lines(_lines(path), digest)
            bar.update(result, force=True)
        elapsed = time.monotonic() - started
        print(
            f"{result.submitted} submitted, {result.already} already submitted, "
            f"{len(result.rejected)} rejected in {elapsed:.1f} s "
            f"({result.submitted / elapsed if elapsed else 0:.0f}/s, {result.requests} POSTs)"
        )
        code = _report_rejected(args, path, result.rejected)
        if submitter.refused is not None:
            print(f"stopped creating: {submitter.refused}", file=sys.stderr)
        if args.poll and result.ids:  # a run before registered them to wait for callbacks
            await WatchStore(redis).poll_now(
                args.provider, "response", result.ids, tenant=args.tenant
            )
        if args.wait and result.ids:
            code = max(
                code,
                await _wait_for(
                    redis,
                    settings,
                    args.provider,
                    "response",
                    result.ids,
                    result.requests,
                    args.tenant,
                    remote=functools.partial(submitter.dialect.group_progress, submitter.group)
                    if submitter.group is not None
                    else None,
                ),
            )
        return code
    finally:
        await client.aclose()
        await redis.aclose()


async def _batch(
    args: argparse.Namespace, submitter: Any, path: Path, digest: str, settings: Settings
) -> int:
    from receiver.submit.batch import submit_batch

    result = await submit_batch(submitter, _FileLines(path), digest, path.name)
    ids = result.batch_ids or ([result.batch_id] if result.batch_id else [])
    if result.rejected and ids:  # a file split in several batches: a later create failed
        print(
            f"{len(ids)} batch(es) created ({', '.join(ids)}), then a create failed; "
            "run the same command again to create the rest"
        )
        return _report_rejected(args, path, result.rejected) or 1
    if result.rejected:
        shown = len(result.rejected)
        more = f" (the first {shown} listed)" if result.problems > shown else ""
        print(f"nothing submitted: {result.problems} problem(s) in {path.name}{more}")
        return _report_rejected(args, path, result.rejected) or 1
    state = "already submitted" if result.already else f"submitted ({result.rows} rows)"
    if len(ids) > 1:
        print(f"{len(ids)} batches {state}: {', '.join(ids)}; watching them")
    else:
        print(f"batch {result.batch_id} {state}; watching it")
    if args.poll and ids:
        from receiver.watches.store import WatchStore

        await WatchStore(submitter.redis).poll_now(
            submitter.name, "batch", ids, tenant=submitter.tenant
        )
    if args.wait and ids:
        from receiver.cli._watch import _wait_rows

        code = await _wait_for(
            submitter.redis,
            None,
            submitter.name,
            "batch",
            ids,
            result.requests,
            submitter.tenant,
        )
        if code == 0:  # the batch is done at the provider: now its rows stream in
            code = await _wait_rows(
                submitter.redis,
                settings,
                submitter.name,
                ids,
                submitter.tenant,
                86_400 + 120,
            )
        return code
    return 0


async def _wait_for(
    redis: Any,
    settings: Settings | None,
    provider: str,
    kind: str,
    ids: list[str],
    creates: int,
    tenant: str,
    remote: Callable[[], Awaitable[str | None]] | None = None,
) -> int:
    from receiver.cli._watch import _states, _wait
    from receiver.watches.store import WatchStore

    store = WatchStore(redis)
    config = settings.providers[provider].watch if settings is not None else None
    limit_s = (config.expire_after_s + config.max_interval_s + 60) if config else 86_400 + 120
    news = ""
    if settings is not None and kind == "response":
        account = settings.providers[provider]
        if account.follows_feed:
            news = f"{provider}'s completion feed"
        elif settings.public_url and account.dialect_info.completion_webhooks:
            news = f"{provider}'s completion webhooks"
    code = await _wait(store, provider, kind, ids, limit_s, tenant, news, remote)
    counts = await _states(store, provider, kind, ids, tenant)
    landed = counts["landed"]
    if landed:
        # Each id landed by a callback (or a push) costs one GET (its fetch), one landed by a
        # poll none beyond its polls, one landed from the feed a share of its long polls.
        by_callback, statuses = await _landed_detail(redis, provider, kind, ids, tenant)
        requests = creates + counts["polls"] + by_callback
        shown = ", ".join(f"{n} {status}" for status, n in sorted(statuses.items()))
        print(f"landed by status: {shown}")
        print(
            f"provider requests per result: {requests / landed:.2f} "
            f"({creates} creates, {counts['polls']} polls, {by_callback} callback fetches)"
        )
    return code


async def _landed_detail(
    redis: Any, provider: str, kind: str, ids: list[str], tenant: str
) -> tuple[int, dict[str, int]]:
    """How many landed ids a callback's fetch landed (one GET each), and the landed ones
    by their final status."""
    from collections import Counter

    from receiver.watches.store import watch_key

    by_callback, statuses = 0, Counter[str]()
    for start in range(0, len(ids), 1000):
        async with redis.pipeline(transaction=False) as pipe:
            for object_id in ids[start : start + 1000]:
                pipe.hmget(watch_key(provider, kind, object_id, tenant), ["state", "via", "status"])
            for state, via, status in await pipe.execute():
                if state == b"landed":
                    by_callback += via == b"callback"
                    statuses[(status or b"unknown").decode()] += 1
    return by_callback, dict(statuses)


def _report_rejected(args: argparse.Namespace, path: Path, rejected: list[Any]) -> int:
    report = Path(args.report) if args.report else path.with_name(path.name + ".rejected.jsonl")
    if not rejected:
        report.unlink(missing_ok=True)  # an older run's report no longer holds
        return 0
    import orjson

    with report.open("wb") as f:
        for item in sorted(rejected, key=lambda r: r.line):
            f.write(orjson.dumps(item.to_dict()) + b"\n")
    for item in sorted(rejected, key=lambda r: r.line)[:_SHOWN]:
        where = f"line {item.line}" if item.line else path.name
        status = f" (HTTP {item.status})" if item.status else ""
        print(f"  {where}{status}: {item.error}", file=sys.stderr)
    if len(rejected) > _SHOWN:
        print(f"  ... and {len(rejected) - _SHOWN} more", file=sys.stderr)
    print(f"rejected lines: {report}", file=sys.stderr)
    return 1


def _count_lines(path: Path) -> int:
    """The non-blank lines: what the progress bar counts."""
    from receiver.submit.creates import read_lines

    return sum(1 for _ in read_lines(path))


class _FileLines:
    """The file's lines, read anew on every pass (a batch file is checked, then sent)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self) -> Any:
        return _lines(self.path)


def _lines(path: Path) -> Any:
    from receiver.submit.creates import read_lines

    return read_lines(path)


class _Bar:
    """A rich progress bar of submitted / already / rejected lines and the rate."""

    def __init__(self, title: str, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "new {task.fields[new]}, already {task.fields[already]}, "
                "rejected {task.fields[rejected]}, {task.fields[rate]:.0f}/s"
            ),
            refresh_per_second=4,
        )
        self.task = self.progress.add_task(
            title, total=total, new=0, already=0, rejected=0, rate=0.0
        )
        self.started = time.monotonic()
        self.last = 0.0

    def __enter__(self) -> _Bar:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)

    def update(self, result: Any, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < 0.1 and result.done % 100:
            return
        self.last = now
        elapsed = max(1e-6, now - self.started)
        self.progress.update(
            self.task,
            completed=result.done,
            new=result.submitted,
            already=result.already,
            rejected=len(result.rejected),
            rate=result.submitted / elapsed,
        )


def _cmd_submit(args: argparse.Namespace) -> int:
    settings = load(args)
    if not Path(args.file).is_file():
        print(f"nopoll submit: no such file: {args.file}", file=sys.stderr)
        return 2
    if not _count_lines(Path(args.file)):
        print(
            f"nopoll submit: {args.file} holds no request (no line that is not blank): "
            "nothing to submit",
            file=sys.stderr,
        )
        return 2
    return run_on_deployment(args, settings, _submit)


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    p = sub.add_parser(
        "submit",
        help="submit a JSONL file of requests (or one batch) and watch every result",
        description="Create background responses from FILE (one Responses create body per "
        "line), or with --batch one batch from OpenAI batch-input lines; each id is watched "
        "until its result lands in the sinks. Running it again on the same file submits "
        "nothing new.",
    )
    add_config_option(p)
    p.add_argument("provider", help="provider name from the config")
    p.add_argument("file", help="the JSONL file")
    p.add_argument("--batch", action="store_true", help="submit the file as one batch")
    p.add_argument(
        "--concurrency", type=int, default=200, help="create calls in flight (default 200)"
    )
    p.add_argument("--wait", action="store_true", help="show progress until every result landed")
    p.add_argument(
        "--poll",
        action="store_true",
        help="poll for the results at once, even for a provider that sends callbacks "
        "(else polling starts only reconcile_after_s after a create, if no callback came)",
    )
    p.add_argument(
        "--report", help="where rejected lines are written (default FILE.rejected.jsonl)"
    )
    p.add_argument(
        "--settle-after",
        type=float,
        default=10.0,
        metavar="S",
        help="at a provider without idempotent creates (sference): how long a create whose "
        "answer was lost is given to show up before nopoll counts what the provider has "
        "(default 10 s)",
    )
    add_tenant_option(p)
    p.set_defaults(func=_cmd_submit)
