"""The cyclic garbage collector's settings for a worker process, in one place.

:class:`GcPolicy` freezes what exists once the worker's state is open and raises the
collector's thresholds (:data:`JOB_GC_THRESHOLD`) while jobs run; it is used around the
worker's state (:mod:`receiver.worker.process`) and by ``nopoll fetch-batch``.

See docs/architecture.md (garbage collection in the worker) for why.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["JOB_GC_THRESHOLD", "GcPolicy", "job_gc"]

JOB_GC_THRESHOLD = (20_000, 20, 20)


class GcPolicy:
    """Freeze what exists now and raise the thresholds (:meth:`apply`); :meth:`restore`
    puts back what was there before. Applying twice is applying once."""

    def __init__(self, threshold: tuple[int, int, int] = JOB_GC_THRESHOLD) -> None:
        self.threshold = threshold
        self._before: tuple[int, int, int] | None = None

    def apply(self) -> None:
        if self._before is not None:
            return
        self._before = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(*self.threshold)

    def restore(self) -> None:
        if self._before is None:
            return
        gc.unfreeze()
        gc.set_threshold(*self._before)
        self._before = None


@contextlib.contextmanager
def job_gc(threshold: tuple[int, int, int] = JOB_GC_THRESHOLD) -> Iterator[GcPolicy]:
    """:class:`GcPolicy` applied for the ``with`` block."""
    policy = GcPolicy(threshold)
    policy.apply()
    try:
        yield policy
    finally:
        policy.restore()
