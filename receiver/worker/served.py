"""Which provider accounts the live worker processes serve, so that a worker never
dead-letters work merely because its own config lacks a provider another worker has.

Every worker process publishes the accounts it can fetch with (``provider`` for the
default tenant, ``provider@tenant`` for the others: :func:`receiver.config.accounts.scoped`) in
one hash, refreshed every ``worker.health_check_interval_s`` and valid for three of those
(plus 5 s), and withdraws them when it stops::

    nopoll:workers:accounts     hash: process id -> {"until": ms, "accounts": [...]}

A job for an account this process lacks is left to a live worker that serves it (run
again shortly, its try not counted); only when none does is it a dead letter. At start-up
a worker says loudly which accounts it lacks that other live workers serve or queued jobs
name: a ``nopoll serve`` started without its ``--config`` on a shared Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from receiver.config.accounts import scoped, tenant_providers
from receiver.config.settings import Settings
from receiver.queue.enqueue import BATCHES_QUEUE, JOBS_QUEUE

__all__ = ["SERVED_KEY", "ServedAccounts", "accounts_of", "publish_while_running"]

log = logging.getLogger("nopoll.worker")

SERVED_KEY = "nopoll:workers:accounts"
_QUEUED_LOOKED_AT = 1000
"""Queued job ids read at start-up to find the accounts they name."""


def accounts_of(settings: Settings) -> frozenset[str]:
    """The accounts a process with ``settings`` fetches with."""
    default = {scoped(name, "default") for name in settings.providers}
    tenants = {scoped(provider, tenant) for tenant, provider in tenant_providers(settings)}
    return frozenset(default | tenants)


class ServedAccounts:
    """The published accounts of the live worker processes (see the module docs)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def publish(self, process: str, accounts: Iterable[str], ttl_s: float) -> None:
        until = int((time.time() + ttl_s) * 1000)
        entry = orjson.dumps({"until": until, "accounts": sorted(accounts)}).decode()
        await self.redis.hset(SERVED_KEY, process, entry)  # type: ignore[misc]

    async def withdraw(self, process: str) -> None:
        await self.redis.hdel(SERVED_KEY, process)  # type: ignore[misc]

    async def live(self) -> dict[str, set[str]]:
        """The accounts of every live process, by process id (stale entries dropped)."""
        raw = await self.redis.hgetall(SERVED_KEY)  # type: ignore[misc]
        now, found, stale = time.time() * 1000, {}, []
        for process, entry in raw.items():
            try:
                data = orjson.loads(entry)
                until, accounts = float(data["until"]), set(data["accounts"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                until, accounts = 0.0, set()
            if until < now:
                stale.append(process)
            else:
                found[process.decode()] = accounts
        if stale:
            await self.redis.hdel(SERVED_KEY, *stale)  # type: ignore[misc]
        return found

    async def served(self, account: str) -> bool:
        """Whether a live worker process serves ``account``."""
        return any(account in accounts for accounts in (await self.live()).values())


async def _queued_accounts(redis: Redis) -> set[str]:
    """The accounts the first queued jobs name (job ids are ``kind:account:id``)."""
    found = set()
    for queue in (JOBS_QUEUE, BATCHES_QUEUE):
        for job_id in await redis.zrange(queue, 0, _QUEUED_LOOKED_AT - 1):
            kind, _, rest = job_id.decode().partition(":")
            account = rest.partition(":")[0]
            if kind in ("resp", "batch") and account:
                found.add(account)
    return found


async def publish_while_running(redis: Redis, settings: Settings) -> None:
    """Publish this process's accounts until cancelled, then withdraw them; at the first
    publication, warn about the accounts other workers serve or queued jobs name that
    this one lacks (a missing or wrong ``--config``)."""
    store = ServedAccounts(redis)
    process = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    mine = accounts_of(settings)
    interval = settings.worker.health_check_interval_s
    warned = False
    try:
        while True:
            try:
                if not warned:
                    others = set().union(*(await store.live()).values())
                    lacking = sorted((others | await _queued_accounts(redis)) - mine)
                    if lacking:
                        log.warning(
                            "provider account(s) %s are served by other workers or named by "
                            "queued jobs, but this worker does not have them (is its --config "
                            "missing or another one?); it leaves their jobs to a worker that "
                            "has them",
                            ", ".join(lacking),
                        )
                    warned = True
                await store.publish(process, mine, 3 * interval + 5)
            except (RedisError, OSError) as exc:
                log.debug("cannot publish this worker's accounts now: %s", exc)
            await asyncio.sleep(interval)
    finally:
        with contextlib.suppress(RedisError, OSError):
            await store.withdraw(process)
