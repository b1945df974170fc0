"""The ``deliver`` job's payload: the one place its arq kwargs are built and read.

Queued jobs and dead letters outlive a deploy, so the keys (``sink``, ``envelopes``,
``batch_state``, ``part``, ``settle``) and the job ids (``deliver:<sink>:<uuid>``, a batch
chunk's ``deliver:<sink>:<batch state key>:<part>``, a summary's
``deliver:<sink>:<batch state key>:summary``) never change; :meth:`DeliverJob.from_kwargs`
also reads the jobs queued before ``settle`` existed.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkRowsRejected
from receiver.queue.enqueue import DELIVER, QueuedJob

__all__ = ["DeliverJob", "rejection_text"]


@dataclass(frozen=True, slots=True)
class DeliverJob:
    """Write ``envelopes`` to one sink. ``part`` is the chunk number S3 names its part file
    by (None: a plain write); ``batch_state`` and ``settle`` name the batch and the pending
    chunk this delivery settles when it succeeds."""

    sink: str
    envelopes: list[dict[str, Any]] = field(default_factory=list)
    batch_state: str | None = None
    part: int | None = None
    settle: int | None = None

    @classmethod
    def of(
        cls,
        sink: str,
        envelopes: Sequence[Envelope] | Sequence[dict[str, Any]],
        batch_state: str | None = None,
        part: int | None = None,
        settle: int | None = None,
    ) -> DeliverJob:
        dicts = [e.to_dict() if isinstance(e, Envelope) else e for e in envelopes]
        return cls(sink, dicts, batch_state, part, settle)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> DeliverJob:
        batch_state = kwargs.get("batch_state")
        part = kwargs.get("part")
        settle = kwargs.get("settle")
        if settle is None and batch_state is not None:
            settle = part  # a job queued before ``settle`` existed
        return cls(kwargs["sink"], list(kwargs.get("envelopes") or []), batch_state, part, settle)

    def to_kwargs(self) -> dict[str, Any]:
        return {
            "sink": self.sink,
            "envelopes": self.envelopes,
            "batch_state": self.batch_state,
            "part": self.part,
            "settle": self.settle,
        }

    def handoff(self, *, defer_s: float) -> QueuedJob:
        """This delivery as a job of its own; a batch chunk's has one id per (sink, chunk)."""
        job_id = (
            f"deliver:{self.sink}:{self.batch_state}:{self.part}"
            if self.batch_state is not None and self.part is not None
            else f"deliver:{self.sink}:{uuid.uuid4().hex}"
        )
        return QueuedJob(DELIVER, job_id, self.to_kwargs(), defer_s=defer_s, job_try=2)

    def summary(self, state_key: str) -> QueuedJob:
        """The job that writes a batch summary to this sink (one id per sink)."""
        kwargs = {k: v for k, v in self.to_kwargs().items() if k != "settle"}
        return QueuedJob(DELIVER, f"deliver:{self.sink}:{state_key}:summary", kwargs)


def rejection_text(error: SinkRowsRejected) -> str:
    """A dead letter's reason for rows a sink refused."""
    reasons = sorted(set(error.rejected.values()))
    return f"sink {error.sink!r} refused {len(error.rejected)} row(s): " + "; ".join(reasons)[:1500]
