"""``nopoll watch``: hand ids to nopoll to poll until they are done, optionally waiting."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from nopoll.envelope import DEFAULT_TENANT
from nopoll.kinds import KINDS, SUMMARY_KINDS, WATCHABLE_KINDS
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

_SHOWN_INVALID = 20
_REMOTE_EVERY_S = 5.0
"""How often ``--wait`` asks the provider how the requests stand (sference's streams)."""


def _ids(args: argparse.Namespace) -> list[str]:
    ids = list(args.ids)
    if args.from_file:
        if args.from_file == "-":
            text = sys.stdin.read()
        else:
            with open(args.from_file, encoding="utf-8") as handle:
                text = handle.read()
        ids += [line.strip() for line in text.splitlines() if line.strip()]
    return ids


async def _watch(
    args: argparse.Namespace, settings: Settings, connector: RedisConnector, where: str
) -> int:
    from receiver.queue._arq import arq_pool
    from receiver.watches.store import WatchStore, register_many

    provider = provider_for(settings, args.provider, args.tenant)
    ids = _ids(args)
    redis = arq_pool(connector)
    store = WatchStore(redis, ended_ttl_s=settings.dedupe_ttl_s)
    try:
        await reach(redis, where)
        done = await register_many(
            store,
            args.provider,
            args.kind,
            ids,
            first_poll_s=provider.watch.first_poll_s,
            reconcile_after_s=provider.watch.reconcile_after_s,
            expect_callback=args.expect_callback,
            tenant=args.tenant,
        )
        if args.poll:  # ids watched already, waiting for a callback: polled now too
            await store.poll_now(args.provider, args.kind, ids, tenant=args.tenant)
        for object_id, reason in done.invalid[:_SHOWN_INVALID]:
            print(f"skipped {object_id[:80]!r}: {reason}", file=sys.stderr)
        if len(done.invalid) > _SHOWN_INVALID:
            print(f"... and {len(done.invalid) - _SHOWN_INVALID} more invalid", file=sys.stderr)
        print(
            f"watching {done.watching} new {args.kind} id(s) of {args.provider}"
            f"{f', {done.already} already watched or landed' if done.already else ''}"
            f"{f', {len(done.invalid)} invalid' if done.invalid else ''}"
        )
        if done.watching + done.already == 0:
            return 2
        if not args.wait:
            return 0
        valid = [i for i in dict.fromkeys(ids) if i not in {x for x, _ in done.invalid}]
        limit_s = provider.watch.expire_after_s + provider.watch.max_interval_s + 60
        code = await _wait(store, args.provider, args.kind, valid, limit_s, args.tenant)
        if args.kind in SUMMARY_KINDS and code == 0:
            code = await _wait_rows(redis, settings, args.provider, valid, args.tenant, limit_s)
        return code
    finally:
        await redis.aclose()


async def _states(
    store: Any, provider: str, kind: str, ids: list[str], tenant: str
) -> dict[str, int]:
    """How many of ``tenant``'s watches of ``ids`` are pending, landed or expired, and
    their ``polls`` in all; ``callback_until_ms``: when the first of the pending ones that
    wait for a callback, never polled yet, is polled (0: none waits)."""
    from receiver.watches.store import shown_state, watch_key

    counts = {"pending": 0, "landed": 0, "expired": 0, "polls": 0, "callback_until_ms": 0}
    fields = ["state", "polls", "expect_callback", "next_at"]
    for start in range(0, len(ids), 1000):
        async with store.redis.pipeline(transaction=False) as pipe:
            for object_id in ids[start : start + 1000]:
                pipe.hmget(watch_key(provider, kind, object_id, tenant), fields)
            for raw_state, raw_polls, expect, next_at in await pipe.execute():
                state = shown_state((raw_state or b"landed").decode())  # gone: ended long ago
                counts[state] += 1
                counts["polls"] += int(raw_polls or 0)
                if raw_state == b"pending" and expect == b"1" and not int(raw_polls or 0):
                    at, first = int(next_at or 0), counts["callback_until_ms"]
                    counts["callback_until_ms"] = min(at, first) if first else at
    return counts


def _waiting_for(provider: str, tenant: str, counts: dict[str, int], news: str = "") -> str:
    """What the watches wait for, while they wait for callbacks rather than polls;
    ``news``: how the results come instead (a feed, pushes), when not signed callbacks."""
    until_ms = counts["callback_until_ms"]
    if not until_ms or not counts["pending"]:
        return ""
    left = max(0, int(until_ms / 1000 - time.time()))
    where = f"/webhooks/{provider}" if tenant == DEFAULT_TENANT else f"the endpoint of {tenant}"
    what = news or f"callbacks to {where}"
    return f"waiting for {what}; polling starts in {left // 60}:{left % 60:02d}"


async def _wait(
    store: Any,
    provider: str,
    kind: str,
    ids: list[str],
    limit_s: float,
    tenant: str,
    news: str = "",
    remote: Callable[[], Awaitable[str | None]] | None = None,
) -> int:
    """Show the ids' progress until none is pending (or ``limit_s``); ``remote``: how the
    provider itself counts them, asked every few seconds (best effort)."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    started = time.monotonic()
    counts = await _states(store, provider, kind, ids, tenant)
    waiting = _waiting_for(provider, tenant, counts, news)
    if waiting:  # said once in words, for a log or a terminal without the bar
        print(f"{waiting} (--poll polls at once)", flush=True)
    polls_before = counts["polls"]  # a rerun's earlier polls are not this wait's rate
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "landed {task.fields[landed]}, expired {task.fields[expired]}, "
            "pending {task.fields[pending]}, {task.fields[polls]} polls "
            "({task.fields[rate]:.1f}/s){task.fields[waiting]}{task.fields[remote]}"
        ),
        refresh_per_second=2,
    ) as bar:
        task = bar.add_task(
            f"{provider} {KINDS[kind].plural}",
            total=len(ids),
            completed=counts["landed"] + counts["expired"],  # a rerun: what already ended
            landed=counts["landed"],
            expired=counts["expired"],
            pending=counts["pending"],
            polls=counts["polls"],
            rate=0.0,
            waiting=f"; {waiting}" if waiting else "",
            remote="",
        )
        asked_at = 0.0
        while counts["pending"] and time.monotonic() - started < limit_s:
            await asyncio.sleep(1.0)
            if remote is not None and time.monotonic() - asked_at >= _REMOTE_EVERY_S:
                asked_at = time.monotonic()
                with contextlib.suppress(Exception):  # words for the bar, nothing more
                    said = await remote()
                    bar.update(task, remote=f"; at {provider}: {said}" if said else "")
            counts = await _states(store, provider, kind, ids, tenant)
            # polls come in bursts (every watch due at once, then a longer interval): the
            # rate is over the whole wait, not the last second, which is mostly 0
            bar.update(
                task,
                completed=counts["landed"] + counts["expired"],
                landed=counts["landed"],
                expired=counts["expired"],
                pending=counts["pending"],
                polls=counts["polls"],
                rate=max(0, counts["polls"] - polls_before) / (time.monotonic() - started),
                waiting=f"; {w}" if (w := _waiting_for(provider, tenant, counts, news)) else "",
            )
    elapsed = time.monotonic() - started
    rate = max(0, counts["polls"] - polls_before) / elapsed if elapsed else 0.0
    print(
        f"{counts['landed']} landed, {counts['expired']} expired, {counts['pending']} still "
        f"pending after {elapsed:.0f} s ({counts['polls']} polls, {rate:.1f}/s while waiting)"
    )
    if counts["expired"]:
        print("expired watches are dead letters: nopoll dlq list --sink watch")
    return 0 if counts["landed"] == len(ids) else 1


async def _wait_rows(
    redis: Any, settings: Settings, provider: str, ids: list[str], tenant: str, limit_s: float
) -> int:
    """After batch watches landed: wait until each batch's rows and summary are in the
    sinks (a landed batch is only queued for fetching), showing rows fetched of the total."""
    import asyncio

    from rich.progress import BarColumn, Progress, TextColumn

    from receiver.batches.progress import batch_state_key, summary_job
    from receiver.config.accounts import scoped
    from receiver.queue._arq import JOB_KEY
    from receiver.queue.enqueue import batch_job_id

    name = scoped(provider, tenant)
    keys = {i: batch_state_key(name, i) for i in ids}
    started, unseen_since = time.monotonic(), time.monotonic()
    fetched, total, done = 0, 0, set[str]()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("rows {task.fields[fetched]}/{task.fields[rows]}, batches {task.fields[done]}"),
        refresh_per_second=2,
    ) as bar:
        task = bar.add_task(f"{provider} batch rows", total=None, fetched=0, rows=0, done="")
        while time.monotonic() - started < limit_s:
            fetched, total, waiting, gone = 0, 0, False, []
            for object_id, key in keys.items():
                raw = {k.decode(): v for k, v in (await redis.hgetall(key)).items()}
                fetched += sum(
                    sum(orjson.loads(v).values()) for k, v in raw.items() if k[:2] == "k:"
                )
                total += int(raw.get("rows") or 0)
                summaries = [summary_job(sink, key, {}).job_id for sink in settings.sinks]
                queued = await redis.exists(
                    JOB_KEY + batch_job_id(name, object_id), *(JOB_KEY + j for j in summaries)
                )
                if raw.get("done") and not queued:
                    done.add(object_id)
                elif raw or queued:
                    waiting = True
                else:
                    gone.append(object_id)
            bar.update(
                task, fetched=fetched, rows=total, done=f"{len(done)}/{len(ids)} in the sinks"
            )
            if len(done) == len(ids):
                break
            if waiting:
                unseen_since = time.monotonic()
            elif time.monotonic() - unseen_since > 15:
                print(
                    f"batch(es) {', '.join(gone)}: no progress in Redis and no fetch queued "
                    "(fetched long ago, or the fetch is a dead letter: nopoll dlq list)"
                )
                return 1
            await asyncio.sleep(1.0)
    print(
        f"{fetched} batch row(s) of {total} fetched; {len(done)}/{len(ids)} batch(es) in the sinks"
    )
    return 0 if len(done) == len(ids) else 1


def _cmd_watch(args: argparse.Namespace) -> int:
    settings = load(args)
    return run_on_deployment(args, settings, _watch)


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    p = sub.add_parser(
        "watch",
        help="poll response or batch ids until they are done, and land their results",
        description="Register ids for nopoll's workers to poll (a running `nopoll worker` or "
        "`serve` does the polling), politely and within the provider's rate limit.",
    )
    add_config_option(p)
    p.add_argument("provider", help="provider name from the config")
    p.add_argument("kind", choices=WATCHABLE_KINDS)
    p.add_argument("ids", nargs="*", help="ids to watch")
    p.add_argument("--from", dest="from_file", help="a file of ids, one per line ('-': stdin)")
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--expect-callback",
        action="store_true",
        help="poll only if no callback came within the provider's reconcile_after_s",
    )
    when.add_argument(
        "--poll",
        action="store_true",
        help="poll at once, also ids watched already that wait for a callback",
    )
    p.add_argument(
        "--wait", action="store_true", help="show progress until every id landed or expired"
    )
    add_tenant_option(p)
    p.set_defaults(func=_cmd_watch)
