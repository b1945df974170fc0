"""The one backoff rule every retry in nopoll uses: capped exponential, full jitter, and a
provider's ``Retry-After`` as a floor.

Try ``n`` waits a random time in ``[floor, max(floor, min(max_s, first_s * 2**(n-1)))]``
(tenacity's ``wait_random_exponential`` draw), so workers that failed together do not
retry together. The floor is 0, or the ``Retry-After`` capped at ``max_retry_after_s``.
:class:`Backoff` serves the job retries, the provider client's and a batch chunk's
in-job retries, and the wait for Redis.

See docs/reliability.md (retries and their bound).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential backoff with full jitter and a ``Retry-After`` floor."""

    first_s: float
    """The ceiling of the first wait; each later one doubles it."""
    max_s: float
    """The largest ceiling: no wait drawn from the backoff is longer."""
    max_retry_after_s: float | None = None
    """The longest ``Retry-After`` honoured as a floor (None: ``max_s``)."""

    def ceiling(self, attempt: int) -> float:
        """The upper end of wait ``attempt`` before any ``Retry-After``."""
        if self.first_s <= 0 or self.max_s <= 0:
            return 0.0
        try:
            return min(self.max_s, math.ldexp(self.first_s, max(1, attempt) - 1))
        except OverflowError:  # a ceiling past any float is the cap
            return self.max_s

    def floor(self, retry_after_s: float | None) -> float:
        """The lower end of a wait: the ``Retry-After``, capped; 0 without one."""
        if retry_after_s is None or retry_after_s <= 0:
            return 0.0
        cap = self.max_s if self.max_retry_after_s is None else self.max_retry_after_s
        return min(retry_after_s, cap)

    def delay(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after failed try ``attempt`` (1, 2, ...): random in
        ``[floor, max(floor, ceiling)]``."""
        floor = self.floor(retry_after_s)
        return random.uniform(floor, max(floor, self.ceiling(attempt)))
