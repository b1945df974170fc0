"""The watch poller: each worker process polls the due watches of every provider.

One loop per process reads each provider's earliest due time, takes as many due watches
as it has room for (``max_concurrency``), and polls each once the provider's poll rate
limit and its account's request budget give it a slot. A watch not final yet is polled
again on a backing-off schedule, and ends as a dead letter past ``expire_after_s``; a
final one is landed unless a callback claimed it; a ``429`` pauses the provider.

See docs/watches.md (the poll schedule and why, the rate limit, quota refusals).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

from redis.exceptions import RedisError

from nopoll.envelope import now_rfc3339
from nopoll.exceptions import ProviderError, QuotaExceeded, TransientProviderError
from receiver.aio import cancel_requested
from receiver.config.settings import ProviderConfig, Settings, WatchConfig
from receiver.logs import bind
from receiver.providers.budget import NoRequestSlot
from receiver.providers.ratelimit import RateLimiter
from receiver.queue.enqueue import put_job
from receiver.queue.jobs import Poll, QueuedJob, fetch_payload, poll_job
from receiver.watches.store import Watch, WatchStore
from receiver.worker.fetch import land_response
from receiver.worker.state import WorkerState

__all__ = ["GROWTH", "JITTER", "WatchPoller", "lease_s", "next_interval_s"]

log = logging.getLogger("nopoll.watch")


def lease_s(settings: Settings) -> float:
    """How long a taken watch is this process's at most: the wait for a rate-limit slot (a
    third of it), the GET (its timeouts, every try) and the landing must fit, else the watch
    comes due again for any process. A backstop: the watches of a worker that died come
    due again once its heartbeat stops (:mod:`receiver.worker.liveness`), long before."""
    http = settings.http
    request_s = (http.connect_timeout_s + http.read_timeout_s) * http.attempts
    return max(15.0, 3.0 * float(request_s))


GROWTH = 4.0
"""Each interval between polls is this many times the one before, up to the cap."""
JITTER = 0.1
"""Each interval is its ceiling times a random 1-JITTER ... 1."""

_IDLE_S = 1.0
"""The longest sleep between looks at the due times (new watches are seen this soon)."""


def next_interval_s(config: WatchConfig, polls: int) -> float:
    """Seconds until the next poll of a watch polled ``polls`` times."""
    ceiling = min(config.max_interval_s, config.first_poll_s * GROWTH ** max(0, polls - 1))
    return float(ceiling * random.uniform(1.0 - JITTER, 1.0))


class WatchPoller:
    """Polls due watches for one worker process (see the module docs)."""

    def __init__(self, state: WorkerState, *, owner: str | None = None) -> None:
        self.state = state
        self.owner = owner
        """This process's worker id (:mod:`receiver.worker.liveness`): the watches it takes
        name it."""
        self.store = state.watches or WatchStore(
            state.redis, ended_ttl_s=state.settings.dedupe_ttl_s
        )
        self.providers: dict[str, ProviderConfig] = dict(state.settings.providers)
        self.limiters = {
            name: RateLimiter(state.redis, name, cfg.watch.rate_limit_rps)
            for name, cfg in self.providers.items()
        }
        self._free = {name: cfg.max_concurrency for name, cfg in self.providers.items()}
        self.lease_s = lease_s(state.settings)
        self._tasks: set[asyncio.Task[None]] = set()
        self._freed = asyncio.Event()
        """Set when a poll ends: a loop that was full takes more at once, not a second later."""

    async def run(self) -> None:
        """Poll until cancelled; a Redis outage pauses the loop, it never ends it."""
        try:
            while True:
                self._freed.clear()  # before the round: a poll ending during it counts
                try:
                    wait_s = await self._round()
                except (RedisError, OSError) as exc:
                    if cancel_requested():  # redis-py turned the stop into a connection error
                        raise asyncio.CancelledError from exc
                    log.debug("watch poller waits for Redis: %s", type(exc).__name__)
                    wait_s = _IDLE_S
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the
                # cancel that stops this loop when it races the event
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await self._freed.wait()
                    await asyncio.sleep(0.01)  # gather the polls ending together
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _round(self) -> float:
        """Take and start what is due; returns how long to sleep."""
        wait_s = _IDLE_S
        for name in self.providers:
            if self._free[name] > 0:
                for watch in await self.store.take_due(
                    name, limit=self._free[name], lease_s=self.lease_s, owner=self.owner
                ):
                    self._start(watch)
            due_in = await self.store.next_due_in_s(name)
            if due_in is not None and self._free[name] > 0:
                wait_s = min(wait_s, due_in)
        return max(0.01, wait_s)

    def _start(self, watch: Watch) -> None:
        self._free[watch.provider] -= 1
        task = asyncio.create_task(self._poll_logged(watch))
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._free[watch.provider] += 1
            self._freed.set()

        task.add_done_callback(done)

    async def _poll_logged(self, watch: Watch) -> None:
        with bind(watch_provider=watch.provider, watch_kind=watch.kind, watch_id=watch.id):
            try:
                await self._poll(watch)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError):
                pass  # the watch comes due again when its lease runs out
            except Exception:
                log.exception("polling %s %s failed", watch.kind, watch.id)

    async def _poll(self, watch: Watch) -> None:
        config = self.providers.get(watch.provider)
        dialect = self.state.dialect(watch.provider, watch.tenant)
        if config is None or dialect is None:
            return  # the provider (or tenant) left the config: the watch stays for a later one
        spec = poll_job(watch.kind)
        if spec is None or spec.poll is None:  # registration refuses these: none polls it
            log.warning("watch %s %s ended: no job polls a %s", watch.kind, watch.id, watch.kind)
            await self.store.end(watch, "expired")
            return
        poll: Poll = spec.poll
        limiter = self.limiters[watch.provider]
        try:
            waited = await limiter.acquire(limit_s=self.lease_s / 3)
        except TimeoutError:  # no slot in time: no request made, so no poll counted
            await self.store.reschedule(watch, in_s=1.0, status=watch.status, polled=False)
            return
        metrics = self.state.metrics
        if waited:
            metrics.rate_limit_wait_seconds.labels(watch.provider).inc(waited)
        wait_s = max(0.0, self.lease_s / 3 - waited)  # for the account's slot, what is left
        try:
            obj = await poll.get(dialect, watch.id, wait_s)
            status = poll.pending(dialect, obj)
        except NoRequestSlot as exc:  # the account's budget had none in time: no poll made
            in_s = max(1.0, exc.retry_after_s or 0.0)
            await self.store.reschedule(watch, in_s=in_s, status=watch.status, polled=False)
            return
        except QuotaExceeded as exc:
            metrics.watch_polls.labels(watch.provider, "error").inc()
            await self._end_as_letter(watch, f"refused: {exc}", watch.polls + 1)
            return
        except TransientProviderError as exc:
            outcome = "429" if exc.status == 429 else "error"
            metrics.watch_polls.labels(watch.provider, outcome).inc()
            # the watch's own backoff, or longer when the provider asks for it
            retry_s = max(exc.retry_after_s or 0.0, next_interval_s(config.watch, watch.polls))
            if exc.status == 429:
                await limiter.pause(max(exc.retry_after_s or 0.0, 1.0))
            await self._again(watch, config, retry_s, watch.status)
            return
        except ProviderError as exc:
            metrics.watch_polls.labels(watch.provider, "error").inc()
            log.info("poll of %s %s failed: %s", watch.kind, watch.id, exc)
            await self._again(watch, config, next_interval_s(config.watch, watch.polls), None)
            return
        if status is not None:
            metrics.watch_polls.labels(watch.provider, "pending").inc()
            await self._again(watch, config, next_interval_s(config.watch, watch.polls), status)
            return
        metrics.watch_polls.labels(watch.provider, "terminal").inc()
        await self._land(watch, poll, obj, poll.final(dialect, obj))

    async def _again(
        self, watch: Watch, config: ProviderConfig, in_s: float, status: str | None
    ) -> None:
        """Poll again later, or end the watch as a dead letter once it is too old."""
        age_s = time.time() - watch.registered_at
        if age_s + in_s <= config.watch.expire_after_s:
            await self.store.reschedule(watch, in_s=in_s, status=status)
            return
        error = (
            f"expired: still {status or 'unknown'} after {age_s:.0f} s "
            f"({watch.polls} polls; expire_after_s {config.watch.expire_after_s:g})"
        )
        await self._end_as_letter(watch, error, watch.polls)

    async def _end_as_letter(self, watch: Watch, error: str, polls: int) -> None:
        """End the watch (``expired``) as a dead letter saying ``error``; its replay fetches
        the id once."""
        # A replay of this letter must end the watch the way a callback would: landed.
        job = _fetch_job(watch, now_rfc3339(), from_watch=False)
        letter = await self.state.dead_letters.add(
            sink="watch",
            provider=watch.provider,
            keys=[watch.id],
            attempts=polls,
            error=error,
            function=job.function,
            kwargs=job.kwargs,
        )
        await self.store.end(watch, "expired")
        self.state.metrics.dead_letters.labels("watch").inc()
        log.warning("watch %s %s ended: dead letter %s: %s", watch.kind, watch.id, letter.id, error)

    async def _land(self, watch: Watch, poll: Poll, obj: dict[str, Any], status: str) -> None:
        """Deliver a terminal object (``status``: its final status) once: unless a
        callback's job got there first."""
        if not await self.store.claim_landing(watch, status, lease_s=self.lease_s):
            return
        started = time.monotonic()
        received_at = now_rfc3339()
        if poll.lands_polled:
            await land_response(
                self.state,
                watch.provider,
                obj,
                event_id=None,
                received_at=received_at,
                tenant=watch.tenant,
            )
        else:
            job = _fetch_job(watch, received_at, from_watch=True)
            await put_job(self.state.redis, job, expiry_ms=self.state.settings.job_expiry_s * 1000)
        await self.store.end(watch, "landed", via="poll")
        self.state.metrics.watch_landing_seconds.labels(watch.provider).observe(
            time.monotonic() - started
        )
        log.info("watch %s %s/%s: %s, landed", watch.kind, watch.provider, watch.id, status)


def _fetch_job(watch: Watch, received_at: str, *, from_watch: bool) -> QueuedJob:
    """The fetch job that lands ``watch``'s object: queued by a poll that
    claimed the landing (``from_watch``), or kept in an expired watch's dead letter, whose
    replay then turns the watch pending and, once fetched, landed (as a callback would)."""
    return fetch_payload(watch.kind).of_watch(
        watch.provider,
        watch.id,
        received_at=received_at,
        tenant=watch.tenant,
        from_watch=from_watch,
    )
