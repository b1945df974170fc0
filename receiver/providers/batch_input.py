"""The create side of ``nopoll submit --batch``, as the dialects build it.

A dialect checks a file's lines into a :class:`BatchInput` (every bad line listed before
anything is sent) and turns it into :class:`CreateCall` objects, the POSTs that create its
batches; ``nopoll submit`` (:mod:`receiver.submit.batch`) sends them, records each id
under the call's ``record`` and watches the batches. :func:`check_lines` checks the OpenAI
batch-input lines that every dialect but ``anthropic`` takes, before each dialect's own
rules.

See docs/submit.md (file format: a batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["MAX_LISTED", "BadLine", "BatchInput", "CreateCall", "Rule", "check_lines"]

MAX_LISTED = 1000
"""Bad lines listed at most (the count says how many more)."""


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that cannot go into the batch (line 0: the file as a whole)."""

    line: int
    custom_id: str | None
    error: str


@dataclass(frozen=True, slots=True)
class CreateCall:
    """One POST that creates something at the provider."""

    record: str
    """The name its created id is recorded under for the file (a rerun sends nothing for a
    recorded one), also what its Idempotency-Key is made of: ``file``, ``batch``,
    ``batch:<part>``."""
    path: str
    content: bytes
    content_type: str = "application/json"
    batch: bool = True
    """The created id is a batch (reported and watched); False: a step before one (a file)."""


@dataclass
class BatchInput:
    """A file of ``submit --batch`` lines, checked by a dialect: what its create calls are
    built from."""

    rows: int = 0
    rejected: list[BadLine] = field(default_factory=list)
    """At most :data:`MAX_LISTED` bad lines, and reasons about the whole file (line 0)."""
    problems: int = 0
    """Bad lines and other reasons, counted (``rejected`` lists at most 1,000)."""
    endpoint: str = ""
    model: str = ""
    requests: bytearray = field(default_factory=bytearray)
    """The ``requests`` array's items, comma-separated (dialects that send rows inline)."""
    file: bytearray = field(default_factory=bytearray)
    """The lines as JSONL (a dialect that uploads a file first)."""
    lines: Iterable[tuple[int, bytes]] = ()
    """The lines themselves, for a dialect that reads them again to build its calls."""


Rule = Callable[[dict[str, Any]], "str | None"]
"""A dialect's own check of one line that passed the common ones: why its provider would
refuse it (naming the field and the rule), or None."""


def check_lines(
    lines: Iterable[tuple[int, bytes]],
    dialect: str,
    row_limit: int,
    add: Callable[[BatchInput, dict[str, Any]], None],
    rule: Rule | None = None,
) -> BatchInput:
    """Check OpenAI batch-input lines (see the module docs), and each with the dialect's
    ``rule``; ``add`` puts every good line into the batch in the dialect's shape."""
    batch, seen, bad = BatchInput(), set[str](), 0
    for number, raw in lines:
        error, custom_id = _check(raw, batch, seen, rule)
        if error is not None:
            bad += 1
            if len(batch.rejected) < MAX_LISTED:
                batch.rejected.append(BadLine(number, custom_id, error))
            continue
        batch.rows += 1
        add(batch, orjson.loads(raw))
    if batch.rows + bad > row_limit:
        over = f"{batch.rows + bad:,} lines: {dialect} takes at most {row_limit:,} per batch"
        batch.rejected.insert(0, BadLine(0, None, over))
    if not batch.rows and not batch.rejected:
        batch.rejected.append(BadLine(0, None, "the file holds no lines"))
    batch.problems = bad + (len(batch.rejected) - min(bad, MAX_LISTED))
    return batch


def _check(
    raw: bytes, batch: BatchInput, seen: set[str], rule: Rule | None
) -> tuple[str | None, str | None]:
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
    if batch.endpoint and url != batch.endpoint:
        return (
            f"url: {url}, but the batch's first line has {batch.endpoint} (one per batch)",
            custom_id,
        )
    if not isinstance(body, dict):
        return "body: must be an object", custom_id
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return "body.model: must be a non-empty string", custom_id
    if batch.model and model != batch.model:
        return (
            f"body.model: {model}, but the batch's first line has {batch.model} "
            "(one model per batch)",
            custom_id,
        )
    if rule is not None and (error := rule(row)) is not None:
        return error, custom_id
    batch.endpoint, batch.model = url, model
    return None, custom_id
