"""``nopoll submit --batch``: one batch from a file of OpenAI batch-input lines.

Each line is ``{"custom_id", "method": "POST", "url", "body"}``. Every line is checked
before anything is sent (a unique non-empty ``custom_id``, ``POST``, one ``url`` for the
whole file, a ``body`` object with a ``model``, one model per batch, the dialect's row
limit); any problem rejects the file with every bad line listed. Then the dialect's own
create call, with an ``Idempotency-Key`` from the provider and the file's hash:

- ``openai``: ``POST /files`` (multipart, ``purpose=batch``, the lines re-serialized), then
  ``POST /batches {"input_file_id", "endpoint", "completion_window": "24h"}``;
- ``sference``: ``POST /batches {"window": "24h", "requests": [{"custom_id", "body"}]}``;
- ``sail``, ``valar``: ``POST /batches {"endpoint", "label", "requests": [{"custom_id",
  "params": body}]}``.

The ids are recorded in Redis (the file's ``file`` and ``batch`` fields of
``nopoll:submit:<provider>:<hash>``): a rerun of the same file creates nothing, and a
batch watch is registered. The request body is built as bytes, line by line: memory is
about the file's size.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson

from receiver.submit.anthropic import submit_message_batches
from receiver.submit.created import MAX_LISTED as _MAX_LISTED
from receiver.submit.created import BatchResult
from receiver.submit.created import create_batch as _create
from receiver.submit.created import watch_batch as _watch
from receiver.submit.creates import (
    RECORD_TTL_S,
    Rejected,
    Submitter,
    idempotency_key,
    record_key,
)

__all__ = ["ROW_LIMIT", "BatchResult", "build_batch", "submit_batch"]

ROW_LIMIT = {"openai": 50_000, "sference": 100_000, "sail": 100_000, "valar": 100_000}
"""Rows per batch each dialect's provider documents (or accepts)."""


@dataclass
class _Built:
    endpoint: str = ""
    model: str = ""
    rows: int = 0
    requests: bytearray = field(default_factory=bytearray)
    """The ``requests`` array's items, comma-separated (inline dialects)."""
    file: bytearray = field(default_factory=bytearray)
    """The lines as JSONL (openai)."""
    rejected: list[Rejected] = field(default_factory=list)
    bad: int = 0


def build_batch(lines: Iterable[tuple[int, bytes]], dialect: str) -> _Built:
    """Check every line and build the dialect's rows (see the module docs)."""
    built, seen = _Built(), set[str]()
    for number, raw in lines:
        error, custom_id = _check(raw, built, seen)
        if error is not None:
            built.bad += 1
            if len(built.rejected) < _MAX_LISTED:
                built.rejected.append(Rejected(number, custom_id, None, error))
            continue
        built.rows += 1
        row = orjson.loads(raw)
        if dialect == "openai":
            built.file += orjson.dumps(row) + b"\n"
        else:
            part = "body" if dialect == "sference" else "params"
            item = orjson.dumps({"custom_id": row["custom_id"], part: row["body"]})
            built.requests += (b"," if built.rows > 1 else b"") + item
    limit = ROW_LIMIT.get(dialect, 100_000)
    if built.rows + built.bad > limit:
        built.rejected.insert(
            0,
            Rejected(
                0,
                None,
                None,
                f"{built.rows + built.bad:,} lines: {dialect} takes at most {limit:,} per batch",
            ),
        )
    if not built.rows and not built.rejected:
        built.rejected.append(Rejected(0, None, None, "the file holds no lines"))
    return built


def _check(raw: bytes, built: _Built, seen: set[str]) -> tuple[str | None, str | None]:
    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "not JSON", None
    if not isinstance(row, dict):
        return "not a JSON object", None
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "custom_id: must be a non-empty string", None
    if custom_id in seen:
        return f"custom_id: {custom_id} appears twice", custom_id
    seen.add(custom_id)
    if row.get("method") != "POST":
        return 'method: must be "POST"', custom_id
    url, body = row.get("url"), row.get("body")
    if not isinstance(url, str) or not url.startswith("/"):
        return "url: must be a path such as /v1/responses", custom_id
    if built.endpoint and url != built.endpoint:
        return (
            f"url: {url}, but the batch's first line has {built.endpoint} (one per batch)",
            custom_id,
        )
    if not isinstance(body, dict):
        return "body: must be an object", custom_id
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return "body.model: must be a non-empty string", custom_id
    if built.model and model != built.model:
        return (
            f"body.model: {model}, but the batch's first line has {built.model} "
            "(one model per batch)",
            custom_id,
        )
    built.endpoint, built.model = url, model
    return None, custom_id


async def submit_batch(
    submitter: Submitter, lines: Iterable[tuple[int, bytes]], digest: str, name: str
) -> BatchResult:
    """Create one batch from ``lines`` (once per ``digest``: the content's hash), named
    ``name`` (a file name) in its label, and watch it."""
    if submitter.config.dialect == "anthropic":  # several batches, each under the limits
        return await submit_message_batches(submitter, lines, digest)
    result = BatchResult()
    record = record_key(submitter.scope, digest)
    known = await submitter.redis.hget(record, "batch")  # type: ignore[misc]
    if known is not None:
        result.batch_id, result.already = known.decode(), True
        await _watch(submitter, result.batch_id)
        return result
    dialect = submitter.config.dialect
    built = build_batch(lines, dialect)
    result.rows, result.rejected = built.rows, built.rejected
    result.problems = built.bad + (len(built.rejected) - min(built.bad, _MAX_LISTED))
    if built.rejected:
        return result
    key = idempotency_key(submitter.scope, digest, "batch")
    if dialect == "openai":
        file_id = await _upload(submitter, record, digest, name, built, result)
        if file_id is None:
            return result
        body = {"input_file_id": file_id, "endpoint": built.endpoint, "completion_window": "24h"}
        content = orjson.dumps(body)
    else:
        if dialect == "sference":
            head = b'{"window":"24h","requests":['
        else:
            label = orjson.dumps(f"nopoll {name} {digest[:12]}")
            head = (
                b'{"endpoint":'
                + orjson.dumps(built.endpoint)
                + b',"label":'
                + label
                + b',"requests":['
            )
        content = head + bytes(built.requests) + b"]}"
    batch_id = await _create(submitter, "batches", content, key, "application/json", result)
    if batch_id is None:
        return result
    async with submitter.redis.pipeline(transaction=False) as pipe:
        pipe.hset(record, "batch", batch_id)
        pipe.expire(record, RECORD_TTL_S)
        await pipe.execute()
    result.batch_id = batch_id
    await _watch(submitter, batch_id)
    return result


async def _upload(
    submitter: Submitter, record: str, digest: str, name: str, built: _Built, result: BatchResult
) -> str | None:
    known = await submitter.redis.hget(record, "file")  # type: ignore[misc]
    if known is not None:
        return str(known.decode())
    boundary = "nopoll" + os.urandom(12).hex()
    content = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f"--{boundary}\r\nContent-Disposition: form-data; "
            f'name="file"; filename="{_safe(name)}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + bytes(built.file)
        + f"\r\n--{boundary}--\r\n".encode()
    )
    key = idempotency_key(submitter.scope, digest, "file")
    file_id = await _create(
        submitter, "files", content, key, f"multipart/form-data; boundary={boundary}", result
    )
    if file_id is not None:
        async with submitter.redis.pipeline(transaction=False) as pipe:
            pipe.hset(record, "file", file_id)
            pipe.expire(record, RECORD_TTL_S)
            await pipe.execute()
    return file_id


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:100] or "batch.jsonl"
