"""``nopoll submit --batch``: a file of batch-input lines becomes the provider's batches.

The provider's dialect checks every line before anything is sent and builds its create
calls (one batch, or as many Message Batches as ``anthropic``'s limits need). Each call
carries an ``Idempotency-Key`` from the provider, the file's hash and the call's record
name; its id is recorded under ``nopoll:submit:<scoped>:<hash>``, so a rerun creates only
what is missing, and watched. Without idempotency (sference) a lost answer is settled
with :meth:`Dialect.batches_like` first.

See docs/submit.md (batch mode, providers without idempotency).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from receiver.providers import Dialect, dialect_type
from receiver.providers.batch_input import BatchInput, CreateCall
from receiver.submit.created import BatchResult
from receiver.submit.created import create_batch as _create
from receiver.submit.created import watch_batch as _watch
from receiver.submit.creates import (
    RECORD_TTL_S,
    CreateInDoubt,
    Rejected,
    Submitter,
    idempotency_key,
    record_key,
    sending_key,
)

__all__ = ["BatchResult", "build_batch", "submit_batch"]


def build_batch(lines: Iterable[tuple[int, bytes]], dialect: str) -> BatchInput:
    """``lines`` checked and shaped by the ``dialect`` named (see the module docs)."""
    return dialect_type(dialect).batch_input(lines, dialect)


async def submit_batch(
    submitter: Submitter,
    lines: Iterable[tuple[int, bytes]],
    digest: str,
    name: str,
    *,
    dialect: type[Dialect] | None = None,
) -> BatchResult:
    """Create the batches of ``lines`` (once per ``digest``: the content's hash), named
    ``name`` (a file name) where the provider keeps a label, and watch them. ``dialect``:
    the provider's own (from its config) unless given."""
    kind = dialect or dialect_type(submitter.config.dialect)
    provider = kind(submitter.client)  # a dialect that authenticates its own way says so here
    result = BatchResult()
    record = record_key(submitter.scope, digest)
    if kind.whole_file_record is not None:
        known = await submitter.redis.hget(record, kind.whole_file_record)  # type: ignore[misc]
        if known is not None:
            result.batch_id, result.already = known.decode(), True
            await _watch(submitter, result.batch_id)
            return result
    batch = kind.batch_input(lines, submitter.config.dialect)
    result.rows, result.problems = batch.rows, batch.problems
    result.rejected = [Rejected(b.line, b.custom_id, None, b.error) for b in batch.rejected]
    if result.rejected:
        return result
    created: dict[str, str] = {}
    sent = 0
    for call in provider.create_calls(batch, name, digest, created):
        known = await submitter.redis.hget(record, call.record)  # type: ignore[misc]
        if known is not None:
            created_id: str | None = known.decode()
        else:
            key = idempotency_key(submitter.scope, digest, call.record)
            created_id = await _create_once(submitter, provider, call, key, digest, batch, result)
            if created_id is None:
                break  # _create said why; a rerun creates what is not recorded yet
            sent += 1
            async with submitter.redis.pipeline(transaction=False) as pipe:
                pipe.hset(record, call.record, created_id)
                pipe.expire(record, RECORD_TTL_S)
                await pipe.execute()
        assert created_id is not None
        created[call.record] = created_id
        if call.batch:
            result.batch_ids.append(created_id)
            await _watch(submitter, created_id)
    result.batch_id = result.batch_ids[0] if result.batch_ids else None
    result.already = bool(result.batch_ids) and sent == 0 and not result.rejected
    return result


async def _create_once(
    submitter: Submitter,
    provider: Dialect,
    call: CreateCall,
    key: str,
    digest: str,
    batch: BatchInput,
    result: BatchResult,
) -> str | None:
    """The call's created id. At a provider without idempotency the call is marked as
    being sent first, and a lost answer (this run's, or a killed run's mark) is looked for
    among the account's batches before the call is sent again (see the module docs)."""
    if submitter.idempotent:
        return await _create(submitter, call.path, call.content, key, call.content_type, result)
    marks = sending_key(submitter.scope, digest)
    sent = await submitter.redis.hget(marks, call.record)  # type: ignore[misc]
    since = float(sent) if sent is not None else None
    for _ in range(3):
        if since is not None:  # sent before, its answer lost: was it created?
            await asyncio.sleep(submitter.settle_after_s)
            found = await provider.batches_like(batch.rows, since)
            if found is None or len(found) > 1:
                why = (
                    f"{len(found)} batches of {batch.rows} requests were created at "
                    f"{submitter.name} since"
                    if found
                    else f"{submitter.name} cannot list its batches to tell whether it was created"
                )
                result.rejected.append(
                    Rejected(
                        0,
                        None,
                        None,
                        f"POST /{call.path}: in doubt: its answer was lost and {why}; nopoll "
                        "does not send it again (it may have been created)",
                    )
                )
                result.problems += 1
                return None
            if found:
                return found[0]
        since = time.time()
        async with submitter.redis.pipeline(transaction=False) as pipe:
            pipe.hset(marks, call.record, repr(since))
            pipe.expire(marks, RECORD_TTL_S)
            await pipe.execute()
        try:
            created_id = await _create(
                submitter, call.path, call.content, key, call.content_type, result
            )
        except CreateInDoubt:
            continue
        if created_id is None:
            await submitter.redis.hdel(marks, call.record)  # type: ignore[misc]
        return created_id
    result.rejected.append(
        Rejected(
            0,
            None,
            None,
            f"POST /{call.path}: in doubt: its answer was lost three times; nopoll does not "
            "send it again (it may have been created)",
        )
    )
    result.problems += 1
    return None
