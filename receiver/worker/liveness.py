"""Worker liveness: each worker process's heartbeat, the provider accounts and sinks it
serves, and the hand-back of what a worker that died (or stops) still holds.

:class:`Liveness` runs one task per worker process, apart from its jobs. Every
:data:`BEAT_S` it stamps ``nopoll:workers`` and prunes the sets of job locks and watches
the process holds; it reaps a worker silent for :data:`DEAD_AFTER_S` with one Lua call
(:data:`_RELEASE`) and publishes ``nopoll:workers:accounts``. :meth:`Liveness.stop` hands
everything back on SIGTERM.

See docs/reliability.md (worker liveness) and docs/configuration.md (a worker without a
provider); the keys are in docs/capacity.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from receiver.aio import cancel_and_wait, cancel_requested
from receiver.config.accounts import DEFAULT_TENANT, scoped, tenant_providers
from receiver.config.settings import Settings
from receiver.queue.jobs import JOBS, READS, parse_job_id
from receiver.redis.connector import RedisConnector
from receiver.watches.scripts import WATCH_OF
from receiver.watches.store import held_watches_key

__all__ = [
    "BEAT_S",
    "DEAD_AFTER_S",
    "SERVED_KEY",
    "WORKERS_KEY",
    "Liveness",
    "ServedAccounts",
    "accounts_of",
    "held_jobs_key",
    "new_worker_id",
]

log = logging.getLogger("nopoll.worker")

WORKERS_KEY = "nopoll:workers"
BEAT_S = 2.0
"""How often a worker process beats (and looks for dead workers)."""
DEAD_AFTER_S = 8.0
"""A worker whose last beat is this old is dead: what it holds is handed to others (at the
next beat of another worker: within ``DEAD_AFTER_S + BEAT_S`` of its last beat)."""
SERVED_KEY = "nopoll:workers:accounts"
_QUEUED_LOOKED_AT = 1000
"""Queued job ids read at the first publication to find the accounts they name."""


def new_worker_id() -> str:
    """A worker process's id: the start of its leases' tokens (no ``:`` in it)."""
    return uuid.uuid4().hex[:12]


def worker_identity(data_dir: Path, given: str | None = None) -> str:
    """A worker process's stable id: ``given`` (``--worker-id``, the chart's pod name), else
    its host and its ``data_dir``: the same for a worker restarted in place, which then
    takes back at once what its previous life held (:meth:`Liveness.start`)."""
    if given:
        return re.sub(r"[^A-Za-z0-9_.-]", "-", given)[:64]
    where = hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{socket.gethostname()[:40]}-{where}")


def process_key(worker_id: str) -> str:
    """Which process runs as ``worker_id`` now: ``<host>/<pid>/<started>``."""
    return f"nopoll:worker:{worker_id}:process"


_PROCESS_TTL_S = 120
"""How long :func:`process_key` outlives its process's last beat."""


async def claim_identity(redis: Redis, wanted: str, *, dead_after_s: float = DEAD_AFTER_S) -> str:
    """The id this worker process runs as: ``wanted`` (:func:`worker_identity`), whose
    previous life's holdings (job locks, watches mid-poll) are released now rather than
    after ``dead_after_s``; a random id when a live process runs as ``wanted`` (two
    workers given one ``--worker-id``), so two never hold under one name. A previous life
    is known dead when it ran on another host and stopped beating, or on this host as a
    process that is gone (or as this very pid, as in a container). Raises a RedisError
    when Redis cannot be asked: the caller then runs under a random id."""
    key = process_key(wanted)
    host = _this_host()
    previous = await redis.set(
        key, f"{host}/{os.getpid()}/{time.time():.3f}", ex=_PROCESS_TTL_S, get=True
    )
    if previous is None:
        return wanted
    was_host, _, rest = previous.decode(errors="replace").partition("/")
    pid_text = rest.partition("/")[0]
    was_pid = int(pid_text) if pid_text.isdigit() else 0
    if was_host == host:  # this host (and pid namespace) can tell whether it still runs
        gone = was_pid == os.getpid() or not _running(was_pid)
    else:  # another host's: gone once it stopped beating
        beat = await redis.zscore(WORKERS_KEY, wanted)
        gone = beat is None or time.time() * 1000 - beat >= dead_after_s * 1000
    if not gone:
        log.warning(
            "worker id %s is in use by a live process (%s, pid %d): this one runs as a new id",
            wanted,
            was_host,
            was_pid,
        )
        await redis.set(key, previous, ex=_PROCESS_TTL_S)
        return new_worker_id()
    keys = [WORKERS_KEY, held_jobs_key(wanted), held_watches_key(wanted)]
    reply: Any = await redis.eval(_RELEASE, 3, *keys, wanted, "", "all")  # type: ignore[misc]
    if reply and (int(reply[0]) or int(reply[1])):
        log.info(
            "worker %s restarted: took back %d job(s) and %d watch(es) its previous life held",
            wanted,
            int(reply[0]),
            int(reply[1]),
        )
    return wanted


def held_jobs_key(worker_id: str) -> str:
    return f"nopoll:worker:{worker_id}:jobs"


def accounts_of(settings: Settings) -> frozenset[str]:
    """The accounts a process with ``settings`` fetches with."""
    default = {scoped(name, DEFAULT_TENANT) for name in settings.providers}
    tenants = {scoped(provider, tenant) for tenant, provider in tenant_providers(settings)}
    return frozenset(default | tenants)


class ServedAccounts:
    """The published accounts and sinks of the live worker processes (see the module
    docs)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def publish(
        self,
        process: str,
        accounts: Iterable[str],
        ttl_s: float,
        sinks: Iterable[str] = (),
        prints: Mapping[str, str] | None = None,
    ) -> None:
        """``prints``: each sink's config fingerprint (published as ``name@fingerprint``)."""
        until = int((time.time() + ttl_s) * 1000)
        entry = {
            "until": until,
            "accounts": sorted(accounts),
            "sinks": sorted(sinks),
            "prints": sorted(f"{name}@{fp}" for name, fp in (prints or {}).items()),
            "reads": sorted(READS),
        }
        await self.redis.hset(SERVED_KEY, process, orjson.dumps(entry).decode())  # type: ignore[misc]

    async def withdraw(self, process: str) -> None:
        await self.redis.hdel(SERVED_KEY, process)  # type: ignore[misc]

    async def live(self, what: str = "accounts") -> dict[str, set[str]]:
        """What every live process serves, by process id: its ``"accounts"`` or its
        ``"sinks"`` (stale entries dropped)."""
        return {p: set(entry.get(what) or ()) for p, entry in (await self._entries()).items()}

    async def of_all(self, *whats: str) -> dict[str, set[str]]:
        """Each of ``whats`` (``"accounts"``, ``"sinks"``, ...) over every live process,
        from one read."""
        entries = (await self._entries()).values()
        return {what: set().union(*(set(e.get(what) or ()) for e in entries)) for what in whats}

    async def _entries(self) -> dict[str, dict[str, Any]]:
        """Every live process's published entry (stale ones dropped)."""
        raw = await self.redis.hgetall(SERVED_KEY)  # type: ignore[misc]
        now, found, stale = time.time() * 1000, {}, []
        for process, text in raw.items():
            try:
                entry = orjson.loads(text)
                until = float(entry["until"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                until, entry = 0.0, {}
            if until < now or not isinstance(entry, dict):
                stale.append(process)
            else:
                found[process.decode()] = entry
        if stale:
            await self.redis.hdel(SERVED_KEY, *stale)  # type: ignore[misc]
        return found

    async def served(self, account: str) -> bool:
        """Whether a live worker process serves ``account``."""
        return any(account in accounts for accounts in (await self.live()).values())

    async def reads(self, mark: str) -> bool:
        """Whether a live worker process reads what ``mark`` names (``job:<version>``,
        ``state:<version>``: :data:`~receiver.queue.jobs.READS`)."""
        return any(mark in reads for reads in (await self.live("reads")).values())

    async def serves_sink(self, sink: str, fingerprint: str | None = None) -> bool:
        """Whether a live worker process has a sink named ``sink`` (with this config
        ``fingerprint``, when one is given)."""
        if fingerprint is None:
            return any(sink in sinks for sinks in (await self.live("sinks")).values())
        mark = f"{sink}@{fingerprint}"
        return any(mark in prints for prints in (await self.live("prints")).values())


async def _queued(redis: Redis) -> tuple[set[str], set[str]]:
    """The accounts and the sinks the first queued jobs name (their ids, read by
    :func:`~receiver.queue.jobs.parse_job_id`)."""
    named: dict[str, set[str]] = {"account": set(), "sink": set()}
    for queue in dict.fromkeys(spec.queue for spec in JOBS.values()):
        for job_id in await redis.zrange(queue, 0, _QUEUED_LOOKED_AT - 1):
            parsed = parse_job_id(job_id.decode())
            if parsed is not None:
                named[parsed.spec.id_names].add(parsed.named)
    return named["account"], named["sink"]


_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: 1 workers zset, 2 held jobs, 3 held watches. ARGV: 1 worker id
# Stamp the beat; forget the locks no longer this worker's (finished, retried) and the
# watches it no longer polls. Returns {now ms, 1 if the entry was new}.
_BEAT = (
    WATCH_OF
    + _NOW
    + """
local added = redis.call('ZADD', KEYS[1], now, ARGV[1])
local mine = ARGV[1] .. ':'
for _, lock in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local token = redis.call('GET', lock)
  if not token or string.sub(token, 1, #mine) ~= mine then redis.call('SREM', KEYS[2], lock) end
end
for _, entry in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local key = watch_of(entry)
  local state = redis.call('HGET', key, 'state')
  if redis.call('HGET', key, 'owner') ~= ARGV[1] or (state ~= 'polling' and state ~= 'landing') then
    redis.call('SREM', KEYS[3], entry)
  end
end
return {now, added}
"""
)

# KEYS: 1 workers zset, 2 held jobs, 3 held watches. ARGV: 1 worker id, 2 its beat must be
# older than this (ms; '' for a worker releasing its own), 3 'all' or 'watches'
# Release what the worker still holds: its locks (only those still carrying its token)
# and its watches (only those it still owns, polling or landing: due now, owner cleared).
# 'all' also forgets the worker. Returns {locks released, watches released}, or false
# when the worker beat meanwhile.
_RELEASE = (
    WATCH_OF
    + _NOW
    + """
if ARGV[2] ~= '' then
  local beat = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if beat and tonumber(beat) >= tonumber(ARGV[2]) then return false end
end
local jobs, watches = 0, 0
if ARGV[3] == 'all' then
  local mine = ARGV[1] .. ':'
  for _, lock in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    local token = redis.call('GET', lock)
    if token and string.sub(token, 1, #mine) == mine then
      redis.call('DEL', lock)
      jobs = jobs + 1
    end
  end
  redis.call('DEL', KEYS[2])
end
for _, entry in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local key, due, member = watch_of(entry)
  local state = redis.call('HGET', key, 'state')
  if redis.call('HGET', key, 'owner') == ARGV[1] and (state == 'polling' or state == 'landing') then
    redis.call('HSET', key, 'state', 'pending', 'next_at', now)
    redis.call('HDEL', key, 'owner')
    redis.call('ZADD', due, now, member)
    watches = watches + 1
  end
end
redis.call('DEL', KEYS[3])
if ARGV[3] == 'all' then redis.call('ZREM', KEYS[1], ARGV[1]) end
return {jobs, watches}
"""
)


class Liveness:
    """One worker process's heartbeat, its served accounts and sinks, and the reaper (see
    the module docs). With ``accounts`` (:func:`accounts_of`), the beat publishes them and
    ``sinks`` every ``accounts_every_s``; without, it publishes none."""

    def __init__(
        self,
        redis: RedisConnector,
        *,
        worker_id: str | None = None,
        beat_s: float = BEAT_S,
        dead_after_s: float = DEAD_AFTER_S,
        accounts: frozenset[str] | None = None,
        sinks: frozenset[str] = frozenset(),
        accounts_every_s: float = BEAT_S,
        claimed: bool = False,
        prints: Mapping[str, str] | None = None,
    ) -> None:
        """``claimed``: ``worker_id`` was given by :func:`claim_identity`; ``prints``: each
        sink's config fingerprint, published with the sinks."""
        self._connector = redis
        self.worker_id = worker_id or new_worker_id()
        self.beat_s = beat_s
        self.dead_after_s = dead_after_s
        self.accounts = accounts
        self.sinks = sinks
        self.prints = dict(prints or {})
        self.accounts_every_s = accounts_every_s
        self._redis: Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._registered = False
        self._beating_since: float | None = None
        """When this process's beats last started to go through (reaping waits for it)."""
        self._last_beat: float | None = None
        self._published_at: float | None = None
        """When this process's accounts were last published (None: not yet)."""
        self._looked_for_lacking = False
        self._served_as = f"{socket.gethostname()}:{os.getpid()}:{self.worker_id}"
        self._process = claimed
        """Whether :func:`claim_identity` named this process for :attr:`worker_id` (its
        key is then kept alive, and removed on the way out)."""

    def _keys(self, worker_id: str) -> list[str]:
        return [WORKERS_KEY, held_jobs_key(worker_id), held_watches_key(worker_id)]

    @property
    def redis(self) -> Redis:
        if self._redis is None:
            self._redis = self._connector.client("health")
        return self._redis

    async def start(self) -> None:
        """Beat once now (so this process is known before it claims anything), then keep
        beating in a task of its own."""
        with contextlib.suppress(RedisError, OSError):
            await self.beat()
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="worker liveness")

    async def beat(self) -> int:
        """Stamp this process's heartbeat; Redis's time now (ms)."""
        now, added = await self.redis.eval(_BEAT, 3, *self._keys(self.worker_id), self.worker_id)  # type: ignore[misc]
        if added and self._registered:
            log.warning(
                "worker %s was taken for dead (no heartbeat for %g s): what it held went to "
                "other workers",
                self.worker_id,
                self.dead_after_s,
            )
        self._registered = True
        return int(now)

    async def run(self) -> None:
        """Beat, publish the accounts when due, and reap every ``beat_s`` until cancelled;
        Redis errors only pause it. A gap in this process's own beats longer than a few
        beats (an outage, not one slow call) restarts the wait before it may reap."""
        while True:
            try:
                now_ms = await self.beat()
                if self._process:  # still this process's name
                    await self.redis.expire(process_key(self.worker_id), _PROCESS_TTL_S)
                now = time.monotonic()
                gap = now - self._last_beat if self._last_beat is not None else None
                if self._beating_since is None or (gap is not None and gap > 4 * self.beat_s):
                    self._beating_since = now
                self._last_beat = now
                if self.accounts is not None and (
                    self._published_at is None or now - self._published_at >= self.accounts_every_s
                ):
                    await self._publish_accounts(self.accounts)
                    self._published_at = now
                if now - self._beating_since >= self.dead_after_s:
                    await self.reap(now_ms)
            except (RedisError, OSError) as exc:
                if cancel_requested():  # redis-py turned the stop into a connection error
                    raise asyncio.CancelledError from exc
                log.debug("worker heartbeat waits for Redis: %s", type(exc).__name__)
            await asyncio.sleep(self.beat_s)

    async def _publish_accounts(self, accounts: frozenset[str]) -> None:
        """Publish this process's accounts and sinks; at the first publication, warn about
        the accounts and sinks other workers serve or queued jobs name that this one lacks
        (a missing or wrong ``--config``)."""
        store = ServedAccounts(self.redis)
        if not self._looked_for_lacking:
            queued_accounts, queued_sinks = await _queued(self.redis)
            served = await store.of_all("accounts", "sinks", "prints")
            others, other_sinks = served["accounts"], served["sinks"]
            lacking = [
                f"{what} {', '.join(sorted(names))}"
                for what, names in (
                    ("provider account(s)", (others | queued_accounts) - accounts),
                    ("sink(s)", (other_sinks | queued_sinks) - self.sinks),
                )
                if names
            ]
            marks = (mark.rpartition("@") for mark in served["prints"])
            differing = sorted(
                {name for name, _, fp in marks if name in self.prints and fp != self.prints[name]}
            )
            if differing:
                log.warning(
                    "sink(s) %s: other workers have a sink of that name configured otherwise "
                    "(another URL, table or key; is this worker's --config another one?); "
                    "deliveries queued by them are left to them",
                    ", ".join(differing),
                )
            if lacking:
                log.warning(
                    "%s: served by other workers or named by queued jobs, but this worker "
                    "does not have them (is its --config missing or another one?); it "
                    "leaves their jobs to a worker that has them",
                    "; ".join(lacking),
                )
            self._looked_for_lacking = True
        ttl_s = 3 * self.accounts_every_s + 5
        await store.publish(self._served_as, accounts, ttl_s, self.sinks, self.prints)

    async def reap(self, now_ms: int) -> list[tuple[str, int, int]]:
        """Release what every dead worker holds: ``(worker id, locks, watches)`` each."""
        stale_before = now_ms - int(self.dead_after_s * 1000)
        dead = await self.redis.zrangebyscore(
            WORKERS_KEY, "-inf", f"({stale_before}", withscores=True
        )
        reaped = []
        for raw_id, beat_ms in dead:
            worker_id = raw_id.decode()
            if worker_id == self.worker_id:
                continue
            released = await self._release(worker_id, str(stale_before), "all")
            if released is None:
                continue  # it beat meanwhile
            jobs, watches = released
            log.warning(
                "worker %s sent no heartbeat for %.0f s: %d job(s) and %d watch(es) it held "
                "are taken over",
                worker_id,
                (now_ms - beat_ms) / 1000,
                jobs,
                watches,
            )
            reaped.append((worker_id, jobs, watches))
        return reaped

    async def _release(
        self, worker_id: str, stale_before: str, what: str
    ) -> tuple[int, int] | None:
        reply: Any = await self.redis.eval(  # type: ignore[misc]
            _RELEASE, 3, *self._keys(worker_id), worker_id, stale_before, what
        )
        return (int(reply[0]), int(reply[1])) if reply else None

    async def hand_back_watches(self) -> int:
        """A stopping process's watches come due now for the other workers (its pollers
        stopped first); how many."""
        released = await self._release(self.worker_id, "", "watches")
        return released[1] if released else 0

    async def stop(self) -> None:
        """Stop beating, withdraw the accounts and sinks, hand back everything still held (nothing
        of this process runs any more) and leave the set of workers."""
        if self._task is not None:
            await cancel_and_wait(self._task, 10.0)
            self._task = None
        if self.accounts is not None:
            with contextlib.suppress(RedisError, OSError):
                await ServedAccounts(self.redis).withdraw(self._served_as)
        try:
            released = await self._release(self.worker_id, "", "all")
            if released and any(released):
                log.info("handed back %d job(s) and %d watch(es) on the way out", *released)
            if self._process:
                await self.redis.delete(process_key(self.worker_id))
        except (RedisError, OSError) as exc:
            log.warning(
                "could not hand back this worker's work (%s): others take it over within %g s",
                type(exc).__name__,
                self.dead_after_s + self.beat_s,
            )
        finally:
            if self._redis is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self._redis.aclose()
                self._redis = None


def _this_host() -> str:
    """The host name and the pid namespace: two containers sharing a host name (the host
    network) see different pids, so a pid is only looked up in the namespace it came from;
    a container restarted in place gets a new namespace and so waits for the beat."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").removeprefix("pid:")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()[:60]}{namespace}".replace("/", "-")


def _running(pid: int) -> bool:
    """A process ``pid`` runs on this host (a zombie, killed and not yet waited for, does
    not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    with contextlib.suppress(OSError, IndexError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True
