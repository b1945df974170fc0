"""Watches: results nopoll polls for, because no callback comes (or as a safety net).

:class:`WatchStore` owns the watch keys and their Lua transitions. A watch is ``(tenant,
provider, kind, id)``: one hash per tenant's watch, a callback marker, and one due set per
provider (its member naming the tenant) so the pollers take a provider's due watches in
one call under one rate limit. Every transition (register, take, reschedule, claim the
landing, a callback's claim, end) is one Lua call, so a poll and a callback never both
deliver.

See docs/watches.md (states, one delivery); the keys are in
docs/capacity.md.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec

from redis.asyncio import Redis

from nopoll.kinds import WatchKind as Kind
from nopoll.wire import safe_id
from receiver.config.accounts import DEFAULT_TENANT, scoped
from receiver.queue.trips import SharedTrips
from receiver.watches import scripts as lua

__all__ = [
    "RECHECK_S",
    "Kind",
    "Registered",
    "Watch",
    "WatchStore",
    "due_key",
    "due_member",
    "ended_key",
    "held_watches_key",
    "read_member",
    "register_many",
    "shown_state",
    "watch_key",
]

RECHECK_S = 900.0
"""A callback's job that has not landed its watched id this long after it started (its
retries ran out: a dead letter) hands the id back to polling."""

_P = ParamSpec("_P")
_WAITING = frozenset({b"pending", b"polling", b"callback"})
"""The states of a watch whose result has not landed (nor expired)."""


def watch_key(provider: str, kind: str, object_id: str, tenant: str = DEFAULT_TENANT) -> str:
    return f"nopoll:watch:{scoped(provider, tenant)}:{kind}:{object_id}"


def held_watches_key(worker_id: str) -> str:
    """The set of watches a worker process took for a poll (see :mod:`receiver.worker.liveness`)."""
    return f"nopoll:worker:{worker_id}:watches"


def due_key(provider: str) -> str:
    return f"nopoll:watches:due:{provider}"


def due_member(kind: str, object_id: str, tenant: str = DEFAULT_TENANT) -> str:
    """A watch's member of its provider's due set: ``kind:id``, ``kind:id@tenant``."""
    member = f"{kind}:{object_id}"
    return member if tenant == DEFAULT_TENANT else f"{member}@{tenant}"


def read_member(member: str) -> tuple[str, str, str]:
    """``(tenant, kind, id)`` of a due-set member (:func:`due_member`)."""
    watched, at, tenant = member.rpartition("@")
    if not at:
        watched, tenant = member, DEFAULT_TENANT
    kind, _, object_id = watched.partition(":")
    return tenant, kind, object_id


def ended_key(provider: str) -> str:
    return f"nopoll:watches:ended:{provider}"


def marker_key(provider: str, kind: str, object_id: str, tenant: str = DEFAULT_TENANT) -> str:
    """Left by a callback for an id its tenant does not watch (yet): ``landing``, then
    ``landed``."""
    return f"nopoll:watches:called:{scoped(provider, tenant)}:{kind}:{object_id}"


MARKER_TTL_S = 3600
"""How long a callback for an unwatched id is remembered (a watch registered later, as
``nopoll submit`` registers after its create answered, then does not poll it)."""


def shown_state(state: str) -> str:
    """The state users see: ``pending`` until the watch ended, then ``landed``/``expired``."""
    return state if state in ("landed", "expired") else "pending"


@dataclass(frozen=True, slots=True)
class Watch:
    """One watch as stored."""

    provider: str
    kind: str
    id: str
    state: str
    polls: int
    next_at: float | None
    """Unix seconds of the next poll (pending watches)."""
    registered_at: float
    expect_callback: bool
    tenant: str
    status: str | None
    """The provider's status at the last poll."""
    keyed_as: str = DEFAULT_TENANT
    """The tenant its keys are scoped by: ``tenant``, except for a watch registered before
    watches were scoped by tenant (kept under the default tenant's keys)."""
    owner: str | None = None
    """The worker that took it for a poll (:mod:`receiver.worker.liveness`), if any."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "kind": self.kind,
            "id": self.id,
            "state": shown_state(self.state),
            "phase": self.state,
            "polls": self.polls,
            "next_poll_at": self.next_at,
            "registered_at": self.registered_at,
            "expect_callback": self.expect_callback,
            "tenant": self.tenant,
            "last_status": self.status,
        }


def _sent_alone(
    command: Callable[Concatenate[WatchStore, _P], tuple[Any, ...]],
) -> Callable[Concatenate[WatchStore, _P], Coroutine[Any, Any, None]]:
    """The store method that sends ``command``'s command alone, with its arguments."""

    @functools.wraps(command)
    async def send(store: WatchStore, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        await store._run(command(store, *args, **kwargs))

    return send


class WatchStore:
    """The watches of every provider and tenant on the shared Redis (see the module docs)."""

    def __init__(
        self, redis: Redis, *, ended_ttl_s: int = 7 * 86_400, trips: SharedTrips | None = None
    ) -> None:
        self.redis = redis
        self._ended_ttl_s = ended_ttl_s
        self._trips = trips
        """A worker's: its jobs' transitions share round trips (and go by ``EVALSHA``)."""

    async def _eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any:
        """Run one transition's script: in a shared round trip when this store has one."""
        return await self._run(self._command(script, numkeys, *keys_and_args))

    def _command(self, script: str, numkeys: int, *keys_and_args: Any) -> tuple[Any, ...]:
        """A transition's script as a command: ``EVALSHA`` for the shared trips, else
        ``EVAL``."""
        if self._trips is None:
            return ("EVAL", script, numkeys, *keys_and_args)
        return self._trips.evalsha(script, numkeys, *keys_and_args)

    async def _run(self, command: tuple[Any, ...]) -> Any:
        """Send one :meth:`_command`; its reply, or its error raised."""
        if self._trips is None:
            return await self.redis.execute_command(*command)  # type: ignore[no-untyped-call]
        [reply] = await self._trips.run([command])
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def register(
        self,
        provider: str,
        kind: Kind,
        object_id: str,
        *,
        first_poll_in_s: float,
        expect_callback: bool = False,
        tenant: str = DEFAULT_TENANT,
    ) -> bool:
        """Start watching; False when this id is already watched (or landed, or expired)
        for this tenant."""
        [added] = await self.register_all(
            provider,
            kind,
            [object_id],
            first_poll_in_s=first_poll_in_s,
            expect_callback=expect_callback,
            tenant=tenant,
        )
        return added

    async def register_all(
        self,
        provider: str,
        kind: Kind,
        ids: list[str],
        *,
        first_poll_in_s: float,
        expect_callback: bool = False,
        tenant: str = DEFAULT_TENANT,
    ) -> list[bool]:
        """:meth:`register` for many ids, pipelined 1,000 at a time."""
        added: list[bool] = []
        for start in range(0, len(ids), 1000):
            now = _ms()
            async with self.redis.pipeline(transaction=False) as pipe:
                for object_id in ids[start : start + 1000]:
                    pipe.eval(
                        *_transition(lua.REGISTER, provider, kind, object_id, tenant),
                        str(now),
                        str(now + int(first_poll_in_s * 1000)),
                        "1" if expect_callback else "0",
                        tenant,
                        str(now + int(RECHECK_S * 1000)),
                        str(self._ended_ttl_s),
                    )
                added += [bool(r) for r in await pipe.execute()]
        return added

    async def poll_now(
        self, provider: str, kind: Kind, ids: list[str], *, tenant: str = DEFAULT_TENANT
    ) -> int:
        """Make the pending watches of ``ids`` that are not due yet (waiting for a
        callback) due now; how many were."""
        moved = 0
        for start in range(0, len(ids), 1000):
            now = str(_ms())
            async with self.redis.pipeline(transaction=False) as pipe:
                for object_id in ids[start : start + 1000]:
                    pipe.eval(*_transition(lua.POLL_NOW, provider, kind, object_id, tenant), now)
                moved += sum(int(r) for r in await pipe.execute())
        return moved

    async def take_due(
        self, provider: str, *, limit: int, lease_s: float, owner: str | None = None
    ) -> list[Watch]:
        """Due watches of ``provider``, every tenant's (at most ``limit``), each taken for
        ``lease_s``; with ``owner`` (a worker id, :mod:`receiver.worker.liveness`), taken by that
        worker: handed on as soon as it is found dead, and only it can reschedule or land
        them."""
        members: list[bytes] = await self._eval(
            lua.TAKE,
            2,
            due_key(provider),
            held_watches_key(owner) if owner else due_key(provider),
            str(_ms()),
            str(int(lease_s * 1000)),
            str(limit),
            f"nopoll:watch:{provider}",
            owner or "",
            provider,
        )
        watches = []
        for member in members:
            tenant, kind, object_id = read_member(member.decode())
            watch = await self.get(provider, kind, object_id, tenant)
            if watch is not None and watch.state == "polling":
                watches.append(watch)
        return watches

    async def next_due_in_s(self, provider: str) -> float | None:
        """Seconds until the provider's earliest watch is due (0: now), None: no watch."""
        first = await self.redis.zrange(due_key(provider), 0, 0, withscores=True)
        if not first:
            return None
        return max(0.0, (float(first[0][1]) - _ms()) / 1000)

    async def reschedule(
        self, watch: Watch, *, in_s: float, status: str | None, polled: bool = True
    ) -> None:
        """Poll ``watch`` again in ``in_s``; ``polled=False``: its take made no request
        (no rate-limit slot), so it does not count as a poll."""
        await self._eval(
            *_transition(lua.RESCHEDULE, watch.provider, watch.kind, watch.id, watch.keyed_as),
            str(_ms() + int(in_s * 1000)),
            status or "",
            "0" if polled else "1",
            watch.owner or "",
        )

    async def claim_landing(self, watch: Watch, status: str, *, lease_s: float) -> bool:
        """A poll found the object terminal: True if this poll delivers it (within
        ``lease_s``, else the watch comes due again)."""
        return bool(
            await self._eval(
                *_transition(
                    lua.CLAIM_LANDING, watch.provider, watch.kind, watch.id, watch.keyed_as
                ),
                status,
                str(_ms() + int(lease_s * 1000)),
                watch.owner or "",
            )
        )

    def finish_command(
        self,
        provider: str,
        kind: str,
        object_id: str,
        state: str,
        *,
        tenant: str = DEFAULT_TENANT,
        status: str | None = None,
        via: str = "",
    ) -> tuple[Any, ...]:
        """``tenant``'s watch ended: ``landed`` (with the object's final ``status`` when
        known) or ``expired``; kept a dedupe window for lookups. Not watched: its marker,
        if a callback left one, says ``state``. As a command, to send with others in the
        store's shared trips (its reply an error or not, nothing else); :meth:`finish`
        sends it alone."""
        return self._command(
            *_transition(lua.FINISH, provider, kind, object_id, tenant),
            state,
            str(_ms()),
            str(self._ended_ttl_s),
            status or "",
            via,
        )

    finish = _sent_alone(finish_command)
    """:meth:`finish_command` sent alone (its arguments, its docs)."""

    async def end(self, watch: Watch, state: str, *, via: str = "") -> None:
        """:meth:`finish` for a watch taken by a poll (wherever its keys are)."""
        await self.finish(
            watch.provider, watch.kind, watch.id, state, tenant=watch.keyed_as, via=via
        )

    async def callback_arrived(
        self,
        provider: str,
        kind: str,
        object_id: str,
        *,
        tenant: str = DEFAULT_TENANT,
        recheck_s: float = RECHECK_S,
    ) -> str:
        """A callback's job of ``tenant`` is about to fetch: ``none`` (the tenant does not
        watch it) or ``callback`` (go on; polling stops, unless the job has not landed it
        ``recheck_s`` from now), ``landed``/``landing`` (a poll delivered it: skip). Other
        tenants' watches of the same id are not touched."""
        result = await self._eval(
            *_transition(lua.CALLBACK, provider, kind, object_id, tenant),
            str(_ms() + int(recheck_s * 1000)),
            str(MARKER_TTL_S),
        )
        return result.decode() if isinstance(result, bytes) else str(result)

    async def get(
        self, provider: str, kind: str, object_id: str, tenant: str = DEFAULT_TENANT
    ) -> Watch | None:
        """``tenant``'s watch of the id, or None."""
        raw = await self.redis.hgetall(watch_key(provider, kind, object_id, tenant))  # type: ignore[misc]
        return _watch(provider, kind, object_id, tenant, raw) if raw else None

    async def waiting(
        self, provider: str, kind: str, ids: list[str], tenant: str = DEFAULT_TENANT
    ) -> set[str]:
        """Those of ``ids`` that ``tenant`` watches and that have not landed or expired
        (one round trip)."""
        if not ids:
            return set()
        async with self.redis.pipeline(transaction=False) as pipe:
            for object_id in ids:
                pipe.hget(watch_key(provider, kind, object_id, tenant), "state")
            states = await pipe.execute()
        return {i for i, s in zip(ids, states, strict=True) if s in _WAITING}

    async def delete(
        self, provider: str, kind: str, object_id: str, tenant: str = DEFAULT_TENANT
    ) -> bool:
        """End ``tenant``'s watch of the id at once (nothing polls it any more)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(watch_key(provider, kind, object_id, tenant))
            pipe.zrem(due_key(provider), due_member(kind, object_id, tenant))
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def scan(
        self,
        *,
        provider: str | None = None,
        kind: str | None = None,
        state: str | None = None,
        tenant: str | None = DEFAULT_TENANT,
        cursor: int = 0,
        count: int = 100,
    ) -> tuple[list[Watch], int]:
        """A page of watches matching the filters (``tenant`` None: every tenant's), and
        the cursor of the next page (0: the last). Pages come from Redis SCAN, so a page
        may hold fewer than ``count``."""
        if provider is None:
            where = "*" if tenant in (None, DEFAULT_TENANT) else f"*@{tenant}:*"
        else:
            where = f"{provider}[:@]*" if tenant is None else f"{scoped(provider, tenant)}:*"
        pattern = f"nopoll:watch:{where}"
        found: list[Watch] = []
        next_cursor = cursor
        for _ in range(100):  # bounded: a page needs at most this many SCAN calls
            next_cursor, keys = await self.redis.scan(next_cursor, match=pattern, count=500)
            for key in keys:
                scope, _, rest = key.decode().removeprefix("nopoll:watch:").partition(":")
                p, at, t = scope.partition("@")
                k, _, object_id = rest.partition(":")
                keyed_as = t if at else DEFAULT_TENANT
                if (
                    provider not in (None, p)
                    or kind not in (None, k)
                    or tenant not in (None, keyed_as)
                ):
                    continue
                watch = await self.get(p, k, object_id, keyed_as)
                shown = shown_state(watch.state) if watch else None
                if watch is not None and (state is None or shown == state):
                    found.append(watch)
            if next_cursor == 0 or len(found) >= count:
                break
        return found, int(next_cursor)

    async def counts(self, provider: str) -> dict[str, int]:
        """Watches of ``provider`` (every tenant's) by shown state: ``pending`` (not ended:
        O(1) from the due set), ``landed`` and ``expired`` (how many ever ended so, from a
        counter)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(due_key(provider))
            pipe.hmget(ended_key(provider), ["landed", "expired"])
            pending, (landed, expired) = await pipe.execute()
        return {
            "pending": int(pending),
            "landed": int(landed or 0),
            "expired": int(expired or 0),
        }


def _ms() -> int:
    return int(time.time() * 1000)


def _transition(
    script: str, provider: str, kind: str, object_id: str, tenant: str
) -> tuple[str, int, str, str, str, str, str]:
    """The start of ``EVAL``'s arguments for a transition of one watch: every script of
    :mod:`receiver.watches.scripts` takes that watch's four keys (its hash, the due set,
    the ended counts, its callback marker) and its due member first; its own arguments
    follow."""
    return (
        script,
        4,
        watch_key(provider, kind, object_id, tenant),
        due_key(provider),
        ended_key(provider),
        marker_key(provider, kind, object_id, tenant),
        due_member(kind, object_id, tenant),
    )


def _watch(
    provider: str, kind: str, object_id: str, keyed_as: str, raw: dict[bytes, bytes]
) -> Watch:
    def text(name: str) -> str | None:
        value = raw.get(name.encode())
        return value.decode() if value is not None else None

    next_at = text("next_at")
    # the tenant is the one of its keys; under the default tenant's keys, a watch
    # registered before watches were scoped says its tenant in the hash
    tenant = keyed_as if keyed_as != DEFAULT_TENANT else text("tenant") or DEFAULT_TENANT
    return Watch(
        provider=provider,
        kind=kind,
        id=object_id,
        state=text("state") or "pending",
        polls=int(text("polls") or 0),
        next_at=int(next_at) / 1000 if next_at else None,
        registered_at=int(text("registered_at") or 0) / 1000,
        expect_callback=text("expect_callback") == "1",
        tenant=tenant,
        status=text("status") or None,
        keyed_as=keyed_as,
        owner=text("owner"),
    )


@dataclass(frozen=True, slots=True)
class Registered:
    """What registering a list of ids did."""

    watching: int
    """New watches."""
    already: int
    """Ids that were watched (or had landed) already: nothing changed for them."""
    invalid: list[tuple[str, str]]
    """(id, reason) of every id that was refused and skipped."""


async def register_many(
    store: WatchStore,
    provider: str,
    kind: Kind,
    ids: list[str],
    *,
    first_poll_s: float,
    reconcile_after_s: float,
    expect_callback: bool,
    tenant: str = DEFAULT_TENANT,
) -> Registered:
    """Register ``ids`` (checked against the safe-id pattern first); an id expecting a
    callback is first polled only ``reconcile_after_s`` after it was registered."""
    invalid = [(i, "must match [A-Za-z0-9_.:-]{1,256}") for i in ids if not safe_id(i)]
    bad = {i for i, _ in invalid}
    first = reconcile_after_s if expect_callback else first_poll_s
    added = await store.register_all(
        provider,
        kind,
        list(dict.fromkeys(i for i in ids if i not in bad)),
        first_poll_in_s=first,
        expect_callback=expect_callback,
        tenant=tenant,
    )
    return Registered(sum(added), len(added) - sum(added), invalid)
