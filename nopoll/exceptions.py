"""Errors raised by nopoll: one root, so callers can catch exactly ours::

    NopollError
    ├── ConfigError (also ValueError)   the config is invalid
    ├── VerificationError               a callback's signature fails
    ├── ProviderError                   a provider request failed
    │   ├── QuotaExceeded               no retry helps
    │   └── TransientProviderError      a later try may succeed
    │       └── ResultNotReady          not terminal yet
    └── SinkError                       a sink could not open or write
        ├── SinkRejected                the destination refuses the payload
        │   └── SinkRowsRejected        only some rows; the rest were written
        └── SinkUnavailable             its plugin cannot be imported

Each carries its context (provider, path, status; sink, key) and never a secret.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "NopollError",
    "ProviderError",
    "QuotaExceeded",
    "ResultNotReady",
    "SinkError",
    "SinkRejected",
    "SinkRowsRejected",
    "SinkUnavailable",
    "TransientProviderError",
    "VerificationError",
]


class NopollError(Exception):
    """Root of every error nopoll raises on purpose."""


class ConfigError(NopollError, ValueError):
    """The configuration is invalid; the message names the key and the problem."""


class VerificationError(NopollError):
    """A callback failed signature or timestamp verification (answered with 401)."""


class ProviderError(NopollError):
    """A request to a provider failed for good (a 4xx other than 408/429, or bad JSON)."""

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        path: str,
        status: int | None = None,
        method: str = "GET",
    ) -> None:
        super().__init__(message)
        self.provider = provider
        self.path = path
        self.status = status
        self.method = method

    def __str__(self) -> str:
        where = f"{self.provider} {self.method} {self.path}"
        status = f" (HTTP {self.status})" if self.status is not None else ""
        return f"{where}{status}: {self.args[0]}"


class QuotaExceeded(ProviderError):
    """The provider refused the request because the account's quota is spent (a 429, 402 or
    403 whose error says ``insufficient_quota``, as OpenAI and Valar answer at their spend
    caps). Unlike a rate limit, waiting a few seconds does not help: it keeps failing until
    the quota is raised or the spend ages out, so the work becomes a dead letter at once,
    and the message carries the provider's own words."""


class TransientProviderError(ProviderError):
    """A provider request failed in a way worth retrying later (429, 5xx, timeout, network)."""

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        path: str,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, provider=provider, path=path, status=status)
        self.retry_after_s = retry_after_s
        self.unsent = False
        """The request never left (no connection was made, or no slot of the account's
        budget came): sending it again cannot do it twice, even where creates are not
        idempotent."""


class ResultNotReady(TransientProviderError):
    """The provider answered, but the response or batch is not finished yet (its status is
    ``in_progress``, ``finalizing``, ...): nothing is stored, the fetch is retried later."""

    def __init__(self, *, provider: str, path: str, status: str) -> None:
        super().__init__(f"not finished yet (status {status!r})", provider=provider, path=path)
        self.object_status = status


class SinkError(NopollError):
    """A sink failed to open or to write; carries the sink's name, and how long the
    destination asked to wait before the next try (``retry_after_s``, None: no advice)."""

    def __init__(self, message: str, *, sink: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.sink = sink
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"sink {self.sink!r}: {self.args[0]}"


class SinkRejected(SinkError):
    """The destination refused the payload itself (an HTTP 4xx other than 408/429): retrying
    cannot help, so the delivery becomes a dead letter at once."""

    def __init__(self, message: str, *, sink: str, status: int | None = None) -> None:
        super().__init__(message, sink=sink)
        self.status = status


class SinkRowsRejected(SinkRejected):
    """Some envelopes of one write were refused for good (their data cannot be stored, e.g.
    a number out of the column's range); every other envelope of that write was written.
    ``rejected`` maps each refused envelope's key to the reason."""

    def __init__(self, message: str, *, sink: str, rejected: dict[str, str]) -> None:
        super().__init__(message, sink=sink)
        self.rejected = rejected


class SinkUnavailable(SinkError):
    """A sink type's module or driver is not installed; the message says what to install."""
