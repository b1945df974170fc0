"""``nopoll submit --batch`` for the ``anthropic`` dialect: Message Batches from a file.

Two line forms, checked line by line before anything is sent (any problem refuses the file,
every bad line listed; see :func:`receiver.providers.anthropic.batch_request`): OpenAI
batch-input lines whose chat completion body becomes the request's ``params``, or native
lines ``{"custom_id", "params"}``. custom_ids are unique across the file.

The requests are then cut, in file order, into batches under the API's limits (100,000
requests, 256 MB per create body), each created with ``POST /v1/messages/batches`` under an
``Idempotency-Key`` of its own (the provider, the file's hash and the part's number) and
watched. Each created id is recorded in Redis (field ``batch:<part>`` of
``nopoll:submit:<provider>:<hash>``): a rerun creates only the parts not recorded yet. The
file is read twice (check, then build) and one part is held at a time: memory is about
one part, not the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import orjson

from receiver.providers.anthropic import (
    BATCHES_PATH,
    MAX_BATCH_BYTES,
    MAX_REQUESTS,
    auth_headers,
    batch_request,
    create_body,
    split,
)
from receiver.submit.created import MAX_LISTED as _MAX_LISTED
from receiver.submit.created import BatchResult
from receiver.submit.created import create_batch as _create
from receiver.submit.created import watch_batch as _watch
from receiver.submit.creates import RECORD_TTL_S, Rejected, Submitter, idempotency_key, record_key

__all__ = ["submit_message_batches"]

_ENVELOPE = len(b'{"requests":[]}')


def _requests(
    lines: Iterable[tuple[int, bytes]],
) -> Iterator[tuple[int, bytes | None, str | None, str | None]]:
    """``(line number, serialized request or None, custom_id, error)`` for every line."""
    for number, raw in lines:
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError:
            yield number, None, None, "not JSON"
            continue
        request, custom_id, error = batch_request(row)
        yield number, (orjson.dumps(request) if request is not None else None), custom_id, error


def _check(lines: Iterable[tuple[int, bytes]], result: BatchResult, max_bytes: int) -> None:
    """Every line checked; rows counted, bad lines listed (at most 1,000) and counted."""
    seen: dict[str, int] = {}
    for number, item, custom_id, error in _requests(lines):
        if item is not None and custom_id is not None:
            first = seen.setdefault(custom_id, number)
            if first != number:
                error = f"custom_id: {custom_id} is also on line {first}"
            elif len(item) + _ENVELOPE > max_bytes:
                error = f"the request is larger than a whole batch may be ({max_bytes:,} bytes)"
        if error is None:
            result.rows += 1
            continue
        result.problems += 1
        if len(result.rejected) < _MAX_LISTED:
            result.rejected.append(Rejected(number, custom_id, None, error))
    if not result.rows and not result.rejected:
        result.rejected.append(Rejected(0, None, None, "the file holds no lines"))
        result.problems += 1


async def submit_message_batches(
    submitter: Submitter,
    lines: Iterable[tuple[int, bytes]],
    digest: str,
    *,
    max_requests: int = MAX_REQUESTS,
    max_bytes: int = MAX_BATCH_BYTES,
) -> BatchResult:
    """Create the file's Message Batches (once per ``digest``) and watch each one; see the
    module docs. ``lines`` is read twice (a one-shot iterator is kept in memory first)."""
    if iter(lines) is lines:
        lines = list(lines)
    config = submitter.config
    key = config.api_key.get_secret_value() if config.api_key is not None else None
    submitter.client.authenticate(auth_headers(key, config.api_version))
    result = BatchResult()
    _check(lines, result, max_bytes)
    if result.rejected:
        return result
    record = record_key(submitter.scope, digest)
    items = (item for _, item, _, _ in _requests(lines) if item is not None)
    created = 0
    for part, group in enumerate(split(items, max_requests=max_requests, max_bytes=max_bytes)):
        field = f"batch:{part}"
        known = await submitter.redis.hget(record, field)  # type: ignore[misc]
        if known is not None:
            batch_id: str | None = known.decode()
        else:
            idem = idempotency_key(submitter.scope, digest, field)
            batch_id = await _create(
                submitter, BATCHES_PATH, create_body(group), idem, "application/json", result
            )
            if batch_id is None:
                break  # _create said why; a rerun creates the parts not recorded yet
            created += 1
            async with submitter.redis.pipeline(transaction=False) as pipe:
                pipe.hset(record, field, batch_id)
                pipe.expire(record, RECORD_TTL_S)
                await pipe.execute()
        assert batch_id is not None
        result.batch_ids.append(batch_id)
        await _watch(submitter, batch_id)
    result.batch_id = result.batch_ids[0] if result.batch_ids else None
    result.already = bool(result.batch_ids) and created == 0 and not result.rejected
    return result
