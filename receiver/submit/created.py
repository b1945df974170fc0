"""One batch create call and its watch, and what a batch submit reports
(:mod:`receiver.submit.batch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from receiver.providers.batch_input import MAX_LISTED
from receiver.submit.creates import Rejected, Submitter, provider_reason

__all__ = ["MAX_LISTED", "BatchResult", "create_batch", "watch_batch"]


@dataclass
class BatchResult:
    batch_id: str | None = None
    rows: int = 0
    already: bool = False
    """A run before had created this batch: nothing sent."""
    rejected: list[Rejected] = field(default_factory=list)
    requests: int = 0
    batch_ids: list[str] = field(default_factory=list)
    """Every batch created for the file (several when it was split, ``anthropic``)."""
    problems: int = 0
    """Bad lines, and other reasons nothing was created (``rejected`` lists at most 1,000)."""


async def create_batch(
    submitter: Submitter,
    path: str,
    content: bytes,
    key: str,
    content_type: str,
    result: BatchResult,
) -> str | None:
    from receiver.submit.creates import SubmitResult, created_id

    counter = SubmitResult()
    status, answer, error = await submitter.post(path, content, key, content_type, counter)
    result.requests += counter.requests
    created = created_id(status, answer)
    if created is None:
        reason = error or (
            provider_reason(status, answer)
            if status is not None and status >= 400
            else f"POST /{path}: the answer holds no usable id"
        )
        result.rejected.append(Rejected(0, None, status, f"POST /{path}: {reason}"))
        result.problems += 1
    return created


async def watch_batch(submitter: Submitter, batch_id: str) -> None:
    watch = submitter.config.watch
    await submitter.store.register_all(
        submitter.name,
        "batch",
        [batch_id],
        first_poll_in_s=watch.reconcile_after_s
        if submitter.batch_expects_callback
        else watch.first_poll_s,
        expect_callback=submitter.batch_expects_callback,
        tenant=submitter.tenant,
    )
