"""``nopoll submit``: create background responses from a JSONL file, then watch them.

Each line is a Responses create body, POSTed with ``background: true`` and an
``Idempotency-Key`` from the provider, the file's hash and the line (or its
``custom_id``), at bounded concurrency within the account's request budget. Created ids
are watched and recorded under ``nopoll:submit:<scoped>:<file hash>``, so a rerun skips
them; at a provider without idempotent creates, lines whose answer was lost are settled
by counting the ids in the run's group. The file is streamed.

See docs/submit.md (idempotency and reruns, retries, the report).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from redis.asyncio import Redis

from nopoll.exceptions import QuotaExceeded, TransientProviderError
from nopoll.wire import RETRY_LATER, safe_id
from receiver.backoff import Backoff
from receiver.config.accounts import DEFAULT_TENANT, scoped
from receiver.config.settings import ProviderConfig
from receiver.feeds.store import FeedStore
from receiver.providers import Dialect, dialect_type
from receiver.providers.base import batch_label
from receiver.providers.client import ProviderClient, error_reason, provider_said
from receiver.providers.push import PushTarget
from receiver.watches.store import WatchStore

__all__ = [
    "CreateInDoubt",
    "Rejected",
    "SubmitResult",
    "Submitter",
    "file_digest",
    "idempotency_key",
    "record_key",
]

RETRY_STATUS = RETRY_LATER | {409}
"""4xx answers retried with the same key: those that say "not now" anywhere, and 409 (the
provider is still busy with that key); every 5xx but 501 (Not Implemented) is retried too,
see :func:`transient`."""


def transient(status: int | None) -> bool:
    """An answer worth another try under the same Idempotency-Key."""
    return status in RETRY_STATUS or (status is not None and status >= 500 and status != 501)


BLOCK = 500
"""Lines read, looked up in Redis and recorded together."""
RECORD_TTL_S = 30 * 86_400
"""How long a file's submitted lines are remembered (a rerun within it sends nothing)."""


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def idempotency_key(provider: str, digest: str, part: str) -> str:
    """The create call's key: the same provider, file and line (or custom_id) → the same
    key, on every run and every retry."""
    raw = f"{provider}\0{digest}\0{part}".encode()
    return "nopoll-" + hashlib.sha256(raw).hexdigest()[:48]


def record_key(provider: str, digest: str) -> str:
    return f"nopoll:submit:{provider}:{digest}"


def sending_key(provider: str, digest: str) -> str:
    """The lines (or calls) sent but not answered yet, at a provider without idempotency."""
    return f"{record_key(provider, digest)}:sending"


GROUP_FIELD = "group"
"""The record's field holding the provider-side group of a run's creates (a stream)."""
SAFE_TO_RESEND = frozenset({425, 429})
"""Answers that say the provider did nothing with the request (too early, too many)."""


class CreateInDoubt(Exception):
    """A create whose answer was lost at a provider that promises no idempotency: it may
    have been done. It is not sent again until nopoll knows (see the module docs)."""


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of every non-blank line, streamed."""
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


@dataclass(frozen=True, slots=True)
class Rejected:
    """A line that was not submitted: the provider refused it (``status``), it is not a
    create body, or every try failed (then a rerun tries it again)."""

    line: int
    custom_id: str | None
    status: int | None
    error: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "custom_id": self.custom_id,
            "status": self.status,
            "error": self.error,
        }


@dataclass
class SubmitResult:
    submitted: int = 0
    """Lines created by this run."""
    already: int = 0
    """Lines a run before had submitted: nothing sent."""
    rejected: list[Rejected] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    """The response id of every submitted line, this run's and earlier ones'."""
    requests: int = 0
    """POSTs made, retries included."""

    @property
    def done(self) -> int:
        return self.submitted + self.already + len(self.rejected)


def create_body(raw: bytes) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """``(body, custom_id, error)`` for one line: the create body with ``background``
    set and ``custom_id`` moved into ``metadata``, or why the line is not one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return None, None, f"not JSON ({str(exc).split(':')[0]})"
    if not isinstance(body, dict):
        return None, None, "not a JSON object"
    custom_id = body.pop("custom_id", None)
    if custom_id is not None and (not isinstance(custom_id, str) or not custom_id):
        return None, None, "custom_id: must be a non-empty string"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return None, custom_id, "model: must be a non-empty string"
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return None, custom_id, "metadata: must be an object"
    if custom_id is not None:
        body["metadata"] = {**(metadata or {}), "custom_id": custom_id}
    body["background"] = True
    return body, custom_id, None


def provider_reason(status: int, content: bytes) -> str:
    """The provider's own message from an error answer, in any provider's error shape
    (:func:`~receiver.providers.client.error_reason`); else the status."""
    if content.lstrip()[:1] in (b"{", b"["):
        reason = error_reason(content)
        if reason:
            return reason[:500]
    return f"HTTP {status}"


class Submitter:
    """Submits create bodies for one provider (see the module docs); for a ``tenant``,
    ``config`` and ``client`` are the tenant's account there."""

    def __init__(
        self,
        name: str,
        config: ProviderConfig,
        client: ProviderClient,
        redis: Redis,
        *,
        concurrency: int = 200,
        max_tries: int = 8,
        backoff: Backoff | None = None,
        on_progress: Callable[[SubmitResult], None] | None = None,
        tenant: str = DEFAULT_TENANT,
        poll: bool = False,
        settle_after_s: float = 10.0,
        push: PushTarget | None = None,
    ) -> None:
        self.name = name
        self.tenant = tenant
        self.scope = scoped(name, tenant)
        """What records and idempotency keys are made of: the provider, and the tenant."""
        self.config = config
        self.client = client
        self.redis = redis
        self.store = WatchStore(redis)
        self.concurrency = client.useful_concurrency(max(1, concurrency))
        self.max_tries = max(1, max_tries)
        self.backoff = backoff or Backoff(0.5, 30.0, 300.0)
        self.on_progress = on_progress
        self.push = None if poll else push
        """Where each create asks the provider to push its finished response (Sail, Valar
        with ``public_url`` set), unless ``poll``."""
        told = bool(config.webhook_secrets) or self.push is not None or config.follows_feed
        self.expect_callback = told and not poll
        """Response watches first polled ``reconcile_after_s`` after they were registered,
        if no callback came (a provider with webhook secrets, pushes or a completion feed,
        unless ``poll``)."""
        self.batch_expects_callback = bool(config.webhook_secrets) and not poll
        """The same for a batch's watch: only signed callbacks announce batches (no
        provider pushes them, and the feeds name single completions)."""
        self._custom_ids: dict[str, int] = {}
        """custom_id → the line that used it first (this run)."""
        self.refused: QuotaExceeded | None = None
        """The first refusal for ``insufficient_quota``: nothing more is sent this run."""
        kind = dialect_type(config.dialect)
        self.idempotent = kind.idempotent_creates
        """The provider documents idempotent creates (else: see the module docs)."""
        self._kind = kind
        self._dialect: Dialect | None = None
        self.group: str | None = None
        """The provider-side group of this run's creates (providers without idempotency)."""
        self.settle_after_s = settle_after_s
        """How long a create whose answer was lost is given to show up before the group's
        ids are counted."""
        self._in_doubt: list[tuple[int, bytes, str | None, str]] = []
        """(line, raw line, custom_id, why) of creates whose answers were lost."""

    @property
    def dialect(self) -> Dialect:
        """The provider's dialect (made when first needed: some authenticate their own
        way, which changes the client)."""
        if self._dialect is None:
            self._dialect = self._kind(self.client)
        return self._dialect

    async def post(
        self, path: str, content: bytes, key: str, content_type: str, result: SubmitResult
    ) -> tuple[int | None, bytes, str]:
        """POST with retries of transient answers under the same key: ``(status, body,
        error)``; status None when every try failed in transit, or when nothing was sent
        because the provider refused a create for ``insufficient_quota`` before. At a
        provider without idempotency only answers that say nothing was done are retried;
        any other lost answer raises :class:`CreateInDoubt`."""
        status: int | None = None
        content_back, error = b"", ""
        for attempt in range(1, self.max_tries + 1):
            if self.refused is not None:
                return None, b"", self._not_sent()
            retry_after: float | None = None
            result.requests += 1
            try:
                status, content_back, retry_after = await self.client.post_once(
                    path, content, content_type=content_type, idempotency_key=key
                )
            except QuotaExceeded as exc:
                self.refused = self.refused or exc
                said = provider_said(str(exc.args[0]))[1]
                return exc.status, b"", f"{said or 'quota spent'} (insufficient_quota)"
            except TransientProviderError as exc:
                status, error, retry_after = None, str(exc.args[0]), exc.retry_after_s
                if not self.idempotent and not exc.unsent:
                    raise CreateInDoubt(error) from None
            else:
                if not transient(status):
                    return status, content_back, ""
                error = provider_reason(status, content_back)
                if not self.idempotent and status not in SAFE_TO_RESEND:
                    raise CreateInDoubt(f"HTTP {status}: {error}")
            if attempt < self.max_tries:
                await asyncio.sleep(self.backoff.delay(attempt, retry_after))
        return status, content_back, f"gave up after {self.max_tries} tries: {error}"

    def _not_sent(self) -> str:
        """Why a line is not sent: the provider refused an earlier create for quota."""
        assert self.refused is not None
        said = provider_said(str(self.refused.args[0]))[1]
        words = f': "{said}"' if said else ""
        return (
            f"not submitted: {self.name} refused an earlier create for insufficient_quota"
            f"{words}; run the same command again once the quota allows"
        )

    async def submit_lines(self, lines: Iterable[tuple[int, bytes]], digest: str) -> SubmitResult:
        """Submit every line not recorded as submitted for ``digest``; see module docs."""
        result = SubmitResult()
        queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue(self.concurrency * 2)
        created: list[tuple[int, str]] = []
        if not self.idempotent:
            self.group = await self._open_group(digest)
        workers = [
            asyncio.create_task(self._worker(queue, digest, result, created))
            for _ in range(self.concurrency)
        ]
        try:
            async for block in _blocks(lines):
                fields = [str(n) for n, _ in block]
                recorded = await self.redis.hmget(  # type: ignore[misc]
                    record_key(self.scope, digest), fields
                )
                sending: list[Any] = [None] * len(block)
                if not self.idempotent:  # sent by a run before, never answered: in doubt
                    sending = await self.redis.hmget(  # type: ignore[misc]
                        sending_key(self.scope, digest), fields
                    )
                to_send = []
                for (number, raw), known, sent in zip(block, recorded, sending, strict=True):
                    if known is not None:
                        result.already += 1
                        result.ids.append(known.decode())
                        self._progress(result)
                    elif sent is not None:
                        custom_id = create_body(raw)[1]
                        self._in_doubt.append((number, raw, custom_id, "a run before sent it"))
                    else:
                        to_send.append((number, raw))
                for item in to_send:
                    await queue.put(item)
                if len(created) >= BLOCK:
                    await self._record(digest, created, result)
            for _ in workers:
                await queue.put(None)
            await asyncio.gather(*workers)
            await self._record(digest, created, result)
            if self._in_doubt:
                await self._settle(digest, result, created)
        finally:
            for task in workers:
                task.cancel()
        return result

    async def _open_group(self, digest: str) -> str | None:
        """This file's group at the provider: the one a run before made, else a new one."""
        key = record_key(self.scope, digest)
        known = await self.redis.hget(key, GROUP_FIELD)  # type: ignore[misc]
        if known is not None:
            group: str | None = str(known.decode())
        else:
            group = await self.dialect.submit_group(batch_label(self.scope, digest))
            if group is not None:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.hset(key, GROUP_FIELD, group)
                    pipe.expire(key, RECORD_TTL_S)
                    await pipe.execute()
        if group is not None and self.config.follows_feed:  # its completions land from there
            await FeedStore(self.redis).follow_stream(self.scope, group)
        return group

    async def _mark_sending(self, digest: str, numbers: list[int]) -> None:
        """At a provider without idempotency: these lines are being sent now (a run killed
        before their answers are recorded leaves them in doubt, not unsent). One write per
        line, just before its POST: a line marked long before it is sent would be in doubt
        after a kill for no reason."""
        if self.idempotent or not numbers:
            return
        key = sending_key(self.scope, digest)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={str(n): "1" for n in numbers})
            pipe.expire(key, RECORD_TTL_S)
            await pipe.execute()

    async def _not_created(self, digest: str, number: int) -> None:
        """The line was certainly not created (refused, or never sent): not in doubt."""
        if not self.idempotent:
            await self.redis.hdel(sending_key(self.scope, digest), str(number))  # type: ignore[misc]

    async def _settle(
        self, digest: str, result: SubmitResult, created: list[tuple[int, str]]
    ) -> None:
        """Settle the lines whose creates are in doubt (see the module docs): the group's
        ids that no line recorded say how many of them were done."""
        for _ in range(3):
            doubt, self._in_doubt = self._in_doubt, []
            if not doubt:
                return
            await asyncio.sleep(self.settle_after_s)  # a create still under way shows up
            found = await self.dialect.group_ids(self.group) if self.group else None
            recorded = {
                value.decode()
                for field, value in (
                    await self.redis.hgetall(record_key(self.scope, digest))  # type: ignore[misc]
                ).items()
                if field != GROUP_FIELD.encode()
            }
            if found is None:
                why = f"{self.name} cannot list the creates of this run to tell"
                self._doubtful(doubt, result, why)
                return
            unknown = sorted(found - recorded)
            if not unknown:  # none of them was done: each is sent again, once
                for number, raw, _, _ in doubt:
                    await self._one(number, raw, digest, result, created)
                await self._record(digest, created, result)
                continue
            if len(unknown) == len(doubt):  # all were done: each line gets one of the ids
                for (number, _, _, _), rid in zip(sorted(doubt), unknown, strict=True):
                    created.append((number, rid))
                result.submitted += len(doubt)
                await self._record(digest, created, result)
                return
            # some were done, some not, and the provider cannot say which: the ids that
            # exist are watched; the lines are not sent again
            watch = self.config.watch
            await self.store.register_all(
                self.name,
                "response",
                unknown,
                first_poll_in_s=watch.first_poll_s,
                tenant=self.tenant,
            )
            result.ids.extend(unknown)
            why = (
                f"{len(unknown)} of the {len(doubt)} creates whose answers were lost exist "
                f"at {self.name}, which cannot say which (it documents no idempotency)"
            )
            self._doubtful(doubt, result, why)
            return
        self._doubtful(self._in_doubt, result, "its answer was lost three times")
        self._in_doubt = []

    def _doubtful(
        self, doubt: list[tuple[int, bytes, str | None, str]], result: SubmitResult, why: str
    ) -> None:
        for number, _, custom_id, lost in doubt:
            result.rejected.append(
                Rejected(
                    number,
                    custom_id,
                    None,
                    f"in doubt: its answer was lost ({lost[:120]}) and {why}; nopoll does not "
                    "send it again (it may have been created)",
                )
            )
            self._progress(result)

    async def _worker(
        self,
        queue: asyncio.Queue[tuple[int, bytes] | None],
        digest: str,
        result: SubmitResult,
        created: list[tuple[int, str]],
    ) -> None:
        while (item := await queue.get()) is not None:
            number, raw = item
            try:
                await self._one(number, raw, digest, result, created)
            except Exception as exc:  # never a stuck run: the line is reported, others go on
                error = f"{type(exc).__name__}: {str(exc)[:200]}"
                result.rejected.append(Rejected(number, None, None, error))
            self._progress(result)

    async def _one(
        self,
        number: int,
        raw: bytes,
        digest: str,
        result: SubmitResult,
        created: list[tuple[int, str]],
    ) -> None:
        """Create one line's response (or reject the line, saying why)."""
        body, custom_id, error = create_body(raw)
        if body is not None and custom_id is not None:
            first = self._custom_ids.setdefault(custom_id, number)
            if first != number:
                body, error = None, f"custom_id: {custom_id} is also on line {first}"
        if body is None:
            await self._not_created(digest, number)
            result.rejected.append(Rejected(number, custom_id, None, error or "bad line"))
            return
        key = idempotency_key(
            self.scope, digest, f"custom_id:{custom_id}" if custom_id else f"line:{number}"
        )
        if self.group is not None:
            body = self.dialect.in_group(body, self.group)
        if self.push is not None:
            body = self.push.asked(body)
        await self._mark_sending(digest, [number])  # just before it leaves
        try:
            status, content, error = await self.post(
                "responses", orjson.dumps(body), key, "application/json", result
            )
        except CreateInDoubt as exc:
            self._in_doubt.append((number, raw, custom_id, str(exc)))
            return
        response_id = created_id(status, content)
        if response_id is not None:
            result.submitted += 1
            if self.idempotent:  # recorded with its block: a rerun's create replays the id
                created.append((number, response_id))
            else:  # recorded at once: a kill leaves in doubt only the creates in flight
                await self._record(digest, [(number, response_id)], result)
        else:
            await self._not_created(digest, number)
            reason = error or (
                provider_reason(status or 0, content)
                if status is not None and status >= 400
                else "the answer holds no usable response id"
            )
            result.rejected.append(Rejected(number, custom_id, status, reason))

    async def _record(
        self, digest: str, created: list[tuple[int, str]], result: SubmitResult
    ) -> None:
        """Record created ids (a rerun skips their lines) and watch them."""
        if not created:
            return
        batch, created[:] = list(created), []
        watch = self.config.watch
        # Watched first: killed in between, a rerun sends the line again with its key, the
        # provider replays the id, and registering it again changes nothing.
        await self.store.register_all(
            self.name,
            "response",
            [rid for _, rid in batch],
            first_poll_in_s=watch.reconcile_after_s if self.expect_callback else watch.first_poll_s,
            expect_callback=self.expect_callback,
            tenant=self.tenant,
        )
        key = record_key(self.scope, digest)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={str(n): rid for n, rid in batch})
            pipe.expire(key, RECORD_TTL_S)
            await pipe.execute()
        result.ids.extend(rid for _, rid in batch)

    def _progress(self, result: SubmitResult) -> None:
        if self.on_progress is not None:
            self.on_progress(result)


def created_id(status: int | None, content: bytes) -> str | None:
    if status is None or not 200 <= status < 300:
        return None
    with contextlib.suppress(orjson.JSONDecodeError):
        data = orjson.loads(content)
        rid = data.get("id") if isinstance(data, dict) else None
        if isinstance(rid, str) and safe_id(rid):
            return rid
    return None


async def _blocks(lines: Iterable[tuple[int, bytes]]) -> AsyncIterator[list[tuple[int, bytes]]]:
    block: list[tuple[int, bytes]] = []
    for item in lines:
        block.append(item)
        if len(block) >= BLOCK:
            yield block
            block = []
            await asyncio.sleep(0)
    if block:
        yield block
