"""The journey of one response or batch: what nopoll did with it, newest events kept.

:class:`JourneyStore` owns the keys ``nopoll:journey:<scoped>:<id>`` (a list of events,
the newest :data:`MAX_EVENTS`, kept ``journey_ttl_s`` after the last) and
``nopoll:journey-hook:<scoped>:<webhook-id>`` (the id a callback named), and the Lua the
enqueue script includes (:data:`PUSH_LUA`) to write a callback's event in its own round
trip. The steps are ``callback``, ``fetch``, ``sink``, ``dead_letter`` and ``replay``.
Writes outside the enqueue and the dead letters are best-effort: a lost event never fails
the work.

See docs/ui.md (where is my result?) and docs/http.md (the journey API).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from receiver.config.accounts import DEFAULT_TENANT, scoped

__all__ = [
    "ANSWERS",
    "HOOK_PREFIX",
    "JOURNEY_PREFIX",
    "MAX_EVENTS",
    "PUSH_LUA",
    "JourneyStore",
    "callback_head",
    "envelope_ids",
    "hook_key",
    "journey_key",
]

log = logging.getLogger("nopoll.journey")

JOURNEY_PREFIX = "nopoll:journey:"
HOOK_PREFIX = "nopoll:journey-hook:"
MAX_EVENTS = 64
"""The newest events kept per id: enough for every try of a fetch and its sinks; a
longer story (a watch polled for days) keeps its end."""
ANSWERS = {0: "200 duplicate", 1: "202 queued", 2: "202 already queued"}
"""A callback event's ``outcome`` (the enqueue script's answer) as the provider got it."""

PUSH_LUA = f"""
local function journey_push(key, event, ttl_ms)
  redis.call('RPUSH', key, event)
  redis.call('LTRIM', key, -{MAX_EVENTS}, -1)
  redis.call('PEXPIRE', key, ttl_ms)
end
"""
"""A Lua function other scripts include: append one event to a trail, keep the newest
:data:`MAX_EVENTS`, and expire the trail ``ttl_ms`` after it."""


def journey_key(provider: str, object_id: str, tenant: str = DEFAULT_TENANT) -> str:
    """The trail of ``tenant``'s ``object_id`` at ``provider``."""
    return f"{JOURNEY_PREFIX}{scoped(provider, tenant)}:{object_id}"


def hook_key(provider: str, webhook_id: str, tenant: str = DEFAULT_TENANT) -> str:
    """Where a webhook-id's object id is kept (``provider`` scoped as in
    :func:`journey_key`)."""
    return f"{HOOK_PREFIX}{scoped(provider, tenant)}:{webhook_id}"


def callback_head(at_ms: int, event_type: str, webhook_id: str, tenant: str) -> bytes:
    """A callback event without its end: the enqueue Lua appends the outcome and ``}``."""
    event = {
        "at": at_ms / 1000,
        "step": "callback",
        "event": event_type,
        "webhook_id": webhook_id,
        "tenant": tenant,
    }
    return orjson.dumps(event)[:-1] + b',"outcome":'


class JourneyStore:
    """Every id's trail on the shared Redis (see the module docs)."""

    def __init__(self, redis: Redis, *, ttl_s: int) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def add_to(
        self,
        pipe: Pipeline,
        provider: str,
        object_id: str,
        step: str,
        tenant: str = DEFAULT_TENANT,
        **fields: Any,
    ) -> None:
        """Queue the event's write on ``pipe`` (it lands with the pipeline's other work)."""
        for command, *args in self.commands(provider, object_id, step, tenant, **fields):
            pipe.execute_command(command, *args)

    def commands(
        self,
        provider: str,
        object_id: str,
        step: str,
        tenant: str = DEFAULT_TENANT,
        **fields: Any,
    ) -> list[tuple[Any, ...]]:
        """The Redis commands that write the event (none while trails are off), for a
        caller that sends them with its own (the worker lands a result's events and ends
        its watch in one round trip); stamped now."""
        return self.steps_commands(provider, object_id, [(step, fields)], tenant)

    def steps_commands(
        self,
        provider: str,
        object_id: str,
        steps: list[tuple[str, Mapping[str, Any]]],
        tenant: str = DEFAULT_TENANT,
    ) -> list[tuple[Any, ...]]:
        """:meth:`commands` for several events of one id, in order, in one ``RPUSH``; an
        event's ``at`` in its fields (when it happened earlier) is kept."""
        if not self.enabled or not steps:
            return []
        key = journey_key(provider, object_id, tenant)
        at = round(time.time(), 3)
        events = [orjson.dumps({"at": at, "step": step, **fields}) for step, fields in steps]
        return [
            ("RPUSH", key, *events),
            ("LTRIM", key, -MAX_EVENTS, -1),
            ("PEXPIRE", key, self.ttl_s * 1000),
        ]

    async def record(
        self,
        provider: str,
        object_id: str,
        step: str,
        tenant: str = DEFAULT_TENANT,
        **fields: Any,
    ) -> None:
        """Append one event to the id's trail, in one round trip; an event Redis cannot
        take now is logged and dropped (the work goes on)."""
        if not self.enabled:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                self.add_to(pipe, provider, object_id, step, tenant, **fields)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.debug("journey event %s of %s/%s dropped: %s", step, provider, object_id, exc)

    async def events(
        self, provider: str, object_id: str, tenant: str = DEFAULT_TENANT
    ) -> list[dict[str, Any]]:
        """The id's events, oldest first (a callback's outcome also as its ``answer``)."""
        raw = await self.redis.lrange(journey_key(provider, object_id, tenant), 0, -1)  # type: ignore[misc]
        events = []
        for item in raw:
            try:
                event = orjson.loads(item)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(event, dict):
                continue
            if event.get("step") == "callback" and "outcome" in event:
                event["answer"] = ANSWERS.get(event["outcome"], str(event["outcome"]))
            events.append(event)
        return events

    async def by_webhook(
        self, provider: str, webhook_id: str, tenant: str = DEFAULT_TENANT
    ) -> str | None:
        """The id a callback with this webhook-id was about, while its trail is kept."""
        found = await self.redis.get(hook_key(provider, webhook_id, tenant))
        return found.decode() if isinstance(found, bytes) else found


def envelope_ids(envelopes: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """The journeys envelopes (as dicts) belong to, each once: ``(provider, tenant, id)``,
    a batch row's (or summary's) being its batch's; at most :data:`_MOST_IDS` of them."""
    found: dict[tuple[str, str, str], None] = {}
    for env in envelopes:
        object_id = env.get("batch_id") or env.get("key")
        provider = env.get("provider")
        if not (isinstance(object_id, str) and isinstance(provider, str)):
            continue
        tenant = env.get("tenant") or DEFAULT_TENANT
        found[(provider, str(tenant), object_id)] = None
        if len(found) >= _MOST_IDS:
            break
    return list(found)


_MOST_IDS = 20
"""A write of many responses' envelopes (a replay of many) marks the first ones' trails."""
