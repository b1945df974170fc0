"""One batch's progress in Redis, owned by one class: :class:`BatchState`.

It holds the batch's hash ``nopoll:batch:<provider>:<batch id>`` (chunk bounds, each
sink's committed chunk, rows by status per chunk, parked summaries), the index
``nopoll:batchindex`` and each sink's set of chunks pending elsewhere. Every change that
touches more than one of them is one Lua call (:meth:`commit`, :meth:`settle`,
:meth:`park_summary`), so a worker killed between two steps cannot leave a hand-off
without its job or a summary without its writer.

See docs/batches.md; the hash's fields are in docs/capacity.md.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from receiver.queue.enqueue import PUT_JOB_LUA, QueuedJob
from receiver.queue.jobs import FETCH_BATCH, STATE_VERSION, DeliverJob, check_state_version

__all__ = [
    "BATCH_INDEX_KEY",
    "BatchProgress",
    "BatchState",
    "ChunkBounds",
    "batch_state_key",
    "summary_job",
]

BATCH_INDEX_KEY = "nopoll:batchindex"


def batch_state_key(provider: str, batch_id: str) -> str:
    """The Redis hash holding one batch's progress."""
    return f"nopoll:batch:{provider}:{batch_id}"


def summary_job(
    sink: str, state_key: str, summary: dict[str, Any], fp: str | None = None
) -> QueuedJob:
    """The ``deliver`` job that writes a batch summary to ``sink`` (one id per sink;
    ``fp``: the sink's config fingerprint)."""
    return DeliverJob(sink, [summary], fp=fp).summary(state_key)


# KEYS: 1 state hash, 2 pending set; 3-5 the hand-off job (job key, result key, queue)
# ARGV: 1 sink, 2 chunk number, 3 mode ('settled' | 'pending' | 'handoff'), 4 unused,
#       5-8 the hand-off job's put_job arguments (mode 'handoff')
_COMMIT = (
    PUT_JOB_LUA
    + """
local field = 'c:' .. ARGV[1]
local n = tonumber(ARGV[2])
if ARGV[3] == 'settled' then
  redis.call('SREM', KEYS[2], ARGV[2])
else
  redis.call('SADD', KEYS[2], ARGV[2])
  if ARGV[3] == 'handoff' then
    put_job(KEYS[3], KEYS[4], KEYS[5], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
  end
end
local current = tonumber(redis.call('HGET', KEYS[1], field) or '-1')
if n > current then redis.call('HSET', KEYS[1], field, ARGV[2]) end
return 1
"""
)

# Turn a parked summary into its deliver job once nothing of the sink is pending.
_RELEASE = """
local function release(state, pending, job_key, result_key, queue, field,
                       expiry_ms, score, job_id, ttl)
  if redis.call('SCARD', pending) > 0 then return 0 end
  local payload = redis.call('HGET', state, field)
  if not payload then return 0 end
  put_job(job_key, result_key, queue, payload, expiry_ms, score, job_id)
  redis.call('HDEL', state, field)
  local parked = redis.call('HINCRBY', state, 'parked', -1)
  if parked <= 0 and redis.call('HEXISTS', state, 'done') == 1 then
    redis.call('EXPIRE', state, ttl)
  end
  return 1
end
"""

# KEYS: 1 state, 2 pending set, 3-5 summary job keys.
# ARGV: 1 sink, 2 chunk ('' for none), 3 expiry, 4 score, 5 job id, 6 state ttl s
_SETTLE = (
    PUT_JOB_LUA
    + _RELEASE
    + """
if ARGV[2] ~= '' then redis.call('SREM', KEYS[2], ARGV[2]) end
return release(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], 's:' .. ARGV[1],
               ARGV[3], ARGV[4], ARGV[5], ARGV[6])
"""
)

# KEYS: as _SETTLE. ARGV: 1 sink, 2 summary job payload, 3 expiry, 4 score, 5 id, 6 ttl
_PARK = (
    PUT_JOB_LUA
    + _RELEASE
    + """
if redis.call('HSET', KEYS[1], 's:' .. ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'parked', 1)
end
return release(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], 's:' .. ARGV[1],
               ARGV[3], ARGV[4], ARGV[5], ARGV[6])
"""
)

# KEYS: 1 state. ARGV: 1 ttl s, 2 now (Unix s)
_FINISH = """
redis.call('HSET', KEYS[1], 'done', '1')
redis.call('HSETNX', KEYS[1], 't1', ARGV[2])
if tonumber(redis.call('HGET', KEYS[1], 'parked') or '0') <= 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return 1
"""


@dataclass(frozen=True, slots=True)
class ChunkBounds:
    """Where a batch's chunks end: ``rows`` rows, or ``bytes`` raw bytes (0: rows only),
    whichever comes first. Stored as ``<rows>`` when ``bytes`` is 0, the form every
    version reads; else ``<rows>/<bytes>``, which a version from before byte bounds cannot
    read: its run of the batch fails (and is retried) instead of cutting other chunks
    under the same numbers and skipping rows that were never written."""

    rows: int
    bytes: int = 0

    def encode(self) -> str:
        return f"{self.rows}/{self.bytes}" if self.bytes else str(self.rows)

    @classmethod
    def decode(cls, value: str) -> ChunkBounds:
        rows, _, size = value.partition("/")
        return cls(int(rows), int(size or 0))


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """What earlier runs of a batch left behind."""

    bounds: ChunkBounds | None
    committed: dict[str, int]
    done: bool


class BatchState:
    """The progress of one batch (see the module docs for the keys and their rules)."""

    def __init__(self, redis: Redis, key: str, *, ttl_s: int, job_expiry_ms: int) -> None:
        self.redis = redis
        self.key = key
        self._ttl_s = ttl_s
        self._expiry_ms = job_expiry_ms

    @classmethod
    def of(
        cls, redis: Redis, provider: str, batch_id: str, *, ttl_s: int, job_expiry_ms: int
    ) -> BatchState:
        return cls(
            redis, batch_state_key(provider, batch_id), ttl_s=ttl_s, job_expiry_ms=job_expiry_ms
        )

    def pending_key(self, sink: str) -> str:
        return f"{self.key}:h:{sink}"

    async def load(self, sinks: list[str]) -> BatchProgress:
        raw = await self.redis.hgetall(self.key)  # type: ignore[misc]
        state = {k.decode(): v.decode() for k, v in raw.items()}
        check_state_version(FETCH_BATCH, state.get("v"))  # begun by a newer nopoll?
        bounds = state.get("cs")
        return BatchProgress(
            bounds=ChunkBounds.decode(bounds) if bounds else None,
            committed={s: int(state.get(f"c:{s}", -1)) for s in sinks},
            done=bool(state.get("done")),
        )

    async def begin(self, bounds: ChunkBounds | int) -> ChunkBounds:
        """Record the chunk bounds on the first run; returns the ones to use (the first
        run's: a changed ``batch.chunk_size`` or ``batch.chunk_bytes`` must not shift
        chunk numbers under a resume). An int is a row count alone."""
        if isinstance(bounds, int):
            bounds = ChunkBounds(bounds)
        now = time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(self.key, "v", str(STATE_VERSION))
            pipe.hsetnx(self.key, "cs", bounds.encode())
            pipe.hsetnx(self.key, "t0", f"{now:.3f}")
            pipe.zadd(BATCH_INDEX_KEY, {self.key: now}, nx=True)
            pipe.hget(self.key, "cs")
            *_, stored = await pipe.execute()
        return ChunkBounds.decode(stored.decode())

    async def record_rows(self, total: int) -> None:
        """The batch's row count, from its object (for progress and an ETA)."""
        await self.redis.hset(self.key, "rows", str(total))  # type: ignore[misc]

    async def reset(self, sinks: list[str]) -> None:
        """Forget everything (``nopoll fetch-batch --force``)."""
        await self.redis.delete(self.key, *(self.pending_key(s) for s in sinks))

    async def record_counts(self, number: int, counts: Counter[str]) -> None:
        await self.redis.hset(self.key, f"k:{number}", orjson.dumps(counts).decode())  # type: ignore[misc]

    async def counts(self) -> Counter[str]:
        """Rows by status over every chunk recorded, by this run and earlier ones."""
        raw = await self.redis.hgetall(self.key)  # type: ignore[misc]
        total: Counter[str] = Counter()
        for name, value in raw.items():
            if name.startswith(b"k:"):
                total.update(orjson.loads(value))
        return total

    async def commit(
        self, sink: str, number: int, *, pending: bool = False, handoff: QueuedJob | None = None
    ) -> None:
        """The sink is done with chunk ``number``: written (settled), or ``pending`` (some
        rows are dead letters), or handed to ``handoff``, a deliver job queued in this step."""
        mode = "handoff" if handoff is not None else "pending" if pending else "settled"
        keys = [self.key, self.pending_key(sink)]
        args: list[Any] = [sink, number, mode, self._ttl_s]
        if handoff is not None:
            keys += handoff.keys()
            args += handoff.args(self._expiry_ms)
        else:
            keys += ["", "", ""]
        await self.redis.eval(_COMMIT, 5, *keys, *args)  # type: ignore[misc]

    async def settle(self, sink: str, number: int | None) -> bool:
        """A pending chunk (None: nothing) was delivered; queues the parked summary if that
        was the sink's last. Returns True when the summary was queued now."""
        chunk = "" if number is None else str(number)
        return await self._release(_SETTLE, sink, summary_job(sink, self.key, {}), chunk)

    async def park_summary(
        self, sink: str, summary: dict[str, Any], *, fp: str | None = None
    ) -> bool:
        """Keep the summary for ``sink``; it is queued at once if nothing is pending."""
        job = summary_job(sink, self.key, summary, fp)
        return await self._release(_PARK, sink, job, None)

    async def _release(self, script: str, sink: str, job: QueuedJob, chunk: str | None) -> bool:
        """Run ``_SETTLE`` (ARGV 2: ``chunk``) or ``_PARK`` (ARGV 2: ``job``'s payload, when
        ``chunk`` is None); both end in ``release``, which queues the summary job once
        nothing of the sink is pending."""
        payload, expiry, score, job_id = job.args(self._expiry_ms)
        keys = [self.key, self.pending_key(sink), *job.keys()]
        args = [sink, payload if chunk is None else chunk, expiry, score, job_id, self._ttl_s]
        return bool(await self.redis.eval(script, 5, *keys, *args))  # type: ignore[misc]

    async def pending(self, sink: str) -> int:
        """How many of the sink's chunks are still pending elsewhere."""
        return int(await self.redis.scard(self.pending_key(sink)))  # type: ignore[misc]

    async def finish(self) -> None:
        """Every summary is parked or queued: mark done (the state expires after the TTL
        once no summary is parked any more)."""
        await self.redis.eval(  # type: ignore[misc]
            _FINISH, 1, self.key, str(self._ttl_s), f"{time.time():.3f}"
        )
