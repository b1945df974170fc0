"""The completion feeds: each worker process offers to follow the feeds of every account
whose provider has one (sference); one process at a time holds an account's feeds
(:class:`~receiver.feeds.store.FeedStore`) and long-polls them.

A stream's feed (a submit's) lands everything; the account's own feed the ids the tenant
watches. A whole event lands as it is, another queues a fetch by id. A cursor moves only
once its page is durable, so a holder killed mid-page leaves the page to be read again.

See docs/watches.md (the completion feed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence

from redis.exceptions import RedisError

from nopoll.envelope import now_rfc3339
from nopoll.exceptions import ProviderError
from receiver.aio import cancel_requested
from receiver.feeds.store import ACCOUNT_FEED, NEW, FeedAccount, FeedStore, feed_accounts
from receiver.providers.base import CompletionFeed, FeedEvent, FeedPage
from receiver.providers.budget import NoRequestSlot
from receiver.queue.enqueue import EnqueueOutcome, Enqueuer
from receiver.queue.jobs import fetch_payload
from receiver.watches.store import WatchStore
from receiver.worker.fetch import land_event
from receiver.worker.state import WorkerState

__all__ = ["FeedFollower"]

log = logging.getLogger("nopoll.feed")

_LANDING_AT_ONCE = 16
"""Events of a page landed side by side."""
_STREAMS_LOOK_S = 0.5
"""How often the holder looks for streams to follow (a new submit's)."""
_ERROR_PAUSE_S = (1.0, 30.0)
"""A feed whose request failed waits this long, doubling, before it asks again."""
_BACK_PAGES = 1000
"""At most this many pages are read back to a new stream's first completion."""
_READ_MARGIN_S = 5.0
"""A long poll's wait stays this far below the client's read timeout."""


class FeedFollower:
    """Offers to hold every feed account for one worker process (see the module docs)."""

    def __init__(self, state: WorkerState, *, owner: str) -> None:
        self.state = state
        self.owner = owner
        """Who holds: the worker id (a worker restarted under its id holds on at once;
        ``nopoll:worker:<id>:process`` says which process runs as it)."""
        self.store = FeedStore(state.redis)
        self.watches = state.watches or WatchStore(
            state.redis, ended_ttl_s=state.settings.dedupe_ttl_s
        )
        self.enqueuer = Enqueuer(
            state.redis,
            dedupe_ttl_s=state.settings.dedupe_ttl_s,
            job_expiry_s=state.settings.job_expiry_s,
            journey_ttl_s=state.settings.journey_ttl_s,
        )
        self.accounts = feed_accounts(state.settings)
        self.held: set[str] = set()
        """The accounts this process holds now."""

    async def run(self) -> None:
        """Follow until cancelled; then give up every hold at once."""
        tasks = [asyncio.create_task(self._offer(a), name=f"feed {a.name}") for a in self.accounts]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for name in list(self.held):
                with contextlib.suppress(RedisError, OSError):
                    await self.store.release(name, self.owner)
            self.held.clear()

    async def _offer(self, account: FeedAccount) -> None:
        """Take the account's feeds whenever no other process holds them."""
        hold_s = account.config.feed.lease_s
        while True:
            try:
                if await self.store.take(account.name, self.owner, hold_s):
                    self.held.add(account.name)
                    log.info("following the completion feeds of %s", account.name)
                    await self._hold(account)
                    log.info("no longer following the completion feeds of %s", account.name)
            except (RedisError, OSError) as exc:
                if cancel_requested():  # redis-py turned the stop into a connection error
                    raise asyncio.CancelledError from exc
                log.debug("feed %s waits for Redis: %s", account.name, type(exc).__name__)
            finally:
                self.held.discard(account.name)
            await asyncio.sleep(hold_s / 3 * random.uniform(0.8, 1.0))

    async def _hold(self, account: FeedAccount) -> None:
        """Follow every feed of the account while the hold is renewed; return once it is
        lost (another process took it after a stall, or Redis went away)."""
        hold_s = account.config.feed.lease_s
        feeds: dict[str, asyncio.Task[None]] = {}
        try:
            renewed_at = asyncio.get_running_loop().time()
            while True:
                cursors = await self.store.cursors(account.name)
                for feed, cursor in cursors.items():
                    if feed not in feeds or feeds[feed].done():
                        feeds[feed] = asyncio.create_task(
                            self._follow(account, feed, cursor), name=f"feed {account.name} {feed}"
                        )
                for feed in [f for f in feeds if f not in cursors]:  # a stream past its window
                    feeds.pop(feed).cancel()
                await asyncio.sleep(min(_STREAMS_LOOK_S, hold_s / 3))
                if asyncio.get_running_loop().time() - renewed_at >= hold_s / 3:
                    if not await self.store.take(account.name, self.owner, hold_s):
                        log.warning("the feeds of %s were taken over", account.name)
                        return
                    renewed_at = asyncio.get_running_loop().time()
        finally:
            for task in feeds.values():
                task.cancel()
            await asyncio.gather(*feeds.values(), return_exceptions=True)

    async def _follow(self, account: FeedAccount, feed: str, cursor: str | None) -> None:
        """Read one feed page after page, landing each, until cancelled."""
        dialect = self.state.dialect(account.provider, account.tenant)
        if not isinstance(dialect, CompletionFeed):
            return
        config = account.config.feed
        read_timeout_s = self.state.settings.http.read_timeout_s
        wait_ms = max(0, min(config.wait_ms, int((read_timeout_s - _READ_MARGIN_S) * 1000)))
        stream = None if feed == ACCOUNT_FEED else feed
        pause_s = _ERROR_PAUSE_S[0]
        loop = asyncio.get_running_loop()
        next_read = loop.time()
        while True:
            if (gap := next_read - loop.time()) > 0:
                await asyncio.sleep(gap)
            read_at = loop.time()
            try:
                page = await dialect.feed_page(
                    stream_id=stream,
                    after=cursor or None,
                    limit=config.limit,
                    wait_ms=wait_ms,
                    wait_s=max(1.0, wait_ms / 1000),
                )
            except NoRequestSlot as exc:
                await asyncio.sleep(max(1.0, exc.retry_after_s or 0.0))
                continue
            except ProviderError as exc:
                log.warning("completion feed %s %s: %s", account.name, feed, exc)
                await asyncio.sleep(pause_s)
                pause_s = min(_ERROR_PAUSE_S[1], pause_s * 2)
                continue
            pause_s = _ERROR_PAUSE_S[0]
            if cursor == NEW and page.has_more:  # a new stream: its first completions too
                page = await self._back_to_the_start(dialect, stream, page, config.limit)
            first_read = cursor is None  # the account's feed, never read: its past is not ours
            landed = 0 if first_read else await self._land(account, stream, page.events)
            moved = page.events[-1].completion_id if page.events else (cursor or NEW)
            if moved != cursor:
                newest = page.events[-1].completed_at if page.events else None
                if not await self.store.advance(
                    account.name, self.owner, feed, moved, landed=landed, last_completed_at=newest
                ):
                    return  # the hold was lost: the next holder reads on from the cursor
                cursor = moved
            # completions coming, none waiting: gather a few before the next read
            flowing = bool(page.events) and not page.has_more
            next_read = read_at + config.min_interval_ms / 1000 if flowing else loop.time()
            if page.skipped and not page.events:
                log.warning(
                    "completion feed %s %s: a page with no usable event", account.name, feed
                )
                await asyncio.sleep(max(1.0, wait_ms / 1000))
            elif not page.events and wait_ms == 0:
                await asyncio.sleep(1.0)

    async def _back_to_the_start(
        self, dialect: CompletionFeed, stream: str | None, page: FeedPage, limit: int
    ) -> FeedPage:
        """A feed read without a cursor answers its newest completions: page back
        (``ending_before``) to its first, for a stream whose every completion is nopoll's.
        Bounded; what lies further back lands by the watches' reconcile polls."""
        events = list(page.events)
        for _ in range(_BACK_PAGES):
            if not events:
                break
            older = await dialect.feed_page(
                stream_id=stream, after=None, before=events[0].completion_id, limit=limit, wait_ms=0
            )
            seen = {e.completion_id for e in events}
            events = [e for e in older.events if e.completion_id not in seen] + events
            if not older.has_more or not older.events:
                break
        return FeedPage(events, page.has_more, page.skipped)

    async def _land(
        self, account: FeedAccount, stream: str | None, events: Sequence[FeedEvent]
    ) -> int:
        """Land what the page names (see the module docs); the count landed or queued."""
        ours = [e for e in events if e.response_id is not None]
        if stream is None:  # the account's own feed: the ids the tenant watches
            ids = [e.response_id for e in ours if e.response_id is not None]
            watched = await self.watches.waiting(account.provider, "response", ids, account.tenant)
            ours = [e for e in ours if e.response_id in watched]
        gate = asyncio.Semaphore(_LANDING_AT_ONCE)

        async def one(event: FeedEvent) -> None:
            async with gate:
                await self._land_one(account, event)

        await asyncio.gather(*(one(e) for e in ours))
        return len(ours)

    async def _land_one(self, account: FeedAccount, event: FeedEvent) -> None:
        received_at = now_rfc3339()
        if event.whole:
            envelope = event.envelope(
                account.provider, tenant=account.tenant, received_at=received_at
            )
            await land_event(self.state, envelope, completion_id=event.completion_id)
            return
        assert event.response_id is not None
        job = fetch_payload("response").callback(
            account.provider,
            event.response_id,
            f"feed:{event.completion_id}",
            tenant=account.tenant,
            event_type=f"response.{event.status or 'completed'}",
        )
        outcome = await self.enqueuer.enqueue(job)
        if outcome is EnqueueOutcome.DUPLICATE:
            log.debug("feed event %s was queued before", event.completion_id)
