"""The cyclic garbage collector's settings for a worker process, in one place.

Used around the worker's open state (:mod:`receiver.worker.process`) and by ``nopoll
fetch-batch``, which runs the same batch pipeline in a process of its own.

Everything that exists once the state is open (modules, settings, clients, sinks) lives as
long as the state, so it is frozen out of the GC's sight: a full collection then walks only
what jobs allocate. And a job's objects die by reference counting within milliseconds of
their creation; with Python's default first threshold (700 objects) every job in flight is
scanned and promoted a few times before it ends (with both, the GC's share of a worker's
CPU time at 1,000 results/s in ``bench/e2e.py`` fell from about a quarter to about a
sixteenth). A batch's parsed rows are many small containers too: the same thresholds keep
the collector from walking a chunk's objects over and over while it is in flight.
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
