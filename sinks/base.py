"""The sink contract: open, write a sequence of envelopes, close.

A sink is any object with this shape; :class:`SinkBase` adds ``async with`` support. A
failed write raises (:class:`~nopoll.exceptions.SinkError` or any exception): the worker
retries each sink on its own, then keeps a dead letter. So an envelope can be written
again: a sink that can overwrite by ``(provider, key)`` does (``sql``, ``s3``); one that
cannot delivers at least once and says so in its docs.

See docs/architecture.md and docs/sinks/.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Protocol, Self, TypeAlias, runtime_checkable

import orjson
from pydantic import BaseModel, ConfigDict, SecretBytes, SecretStr

if TYPE_CHECKING:
    from nopoll.envelope import Envelope

__all__ = [
    "ClaimCheck",
    "ClaimCheckConfig",
    "HoldsClaims",
    "Sink",
    "SinkBase",
    "SinkConfig",
    "UsesClaimCheck",
    "WritesBatchParts",
]

ClaimCheck: TypeAlias = Callable[["Envelope"], Awaitable[str]]
"""Stores an envelope's body elsewhere (S3) and returns where it is (the ``body_ref``)."""


class SinkConfig(BaseModel):
    """Base of every sink's config model; ``type`` picks the sink class."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    timeout_s: float = 30.0
    """A write that takes longer fails (and is retried), so one slow sink stalls nobody."""

    def rebased(self, base: Path) -> Self:
        """This config with its relative file paths made absolute under ``base`` (the
        config file's folder); a sink with file paths overrides it."""
        return self

    def location(self) -> str:
        """Where the sink writes, for the start-up summary (``sink <name>: <type> ->
        <location>``): never a secret (of a URL only the scheme, host and port); ``""``
        says nothing."""
        return ""

    def fingerprint(self) -> str:
        """A digest of this effective config, its secrets hashed before they are digested
        (never kept): two workers whose sinks of one name differ in anything (another URL,
        table, key) have different fingerprints. A delivery carries its sink's, so a
        worker whose sink differs hands the delivery back (docs/reliability.md)."""
        text = orjson.dumps(_plain(self.model_dump()), option=orjson.OPT_SORT_KEYS, default=str)
        return hashlib.sha256(text).hexdigest()[:16]


def _plain(value: object) -> object:
    """A config's ``model_dump()`` as JSON-able data for :meth:`SinkConfig.fingerprint`,
    its secrets as digests."""
    if isinstance(value, SecretStr | SecretBytes):
        secret = value.get_secret_value()
        raw = secret.encode() if isinstance(secret, str) else secret
        return "sha256:" + hashlib.sha256(raw).hexdigest()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    return value


@runtime_checkable
class Sink(Protocol):
    """What the worker needs from a sink."""

    name: str

    async def open(self) -> None:
        """Connect and create what the sink needs (tables, directories)."""

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        """Write envelopes (overwriting earlier copies where the destination can); raise
        on failure."""

    async def aclose(self) -> None:
        """Release connections and files."""


# Optional capabilities: small runtime-checkable Protocols the fan-out tests with isinstance.


@runtime_checkable
class WritesBatchParts(Protocol):
    """A sink that writes a batch's rows as numbered parts (S3 part files, SQL chunks);
    the fan-out calls it for each chunk of a batch in place of ``write``."""

    async def write_batch_part(self, part: int, envelopes: Sequence[Envelope]) -> None:
        """Write (or rewrite) part number ``part`` of a batch's rows."""


@runtime_checkable
class HoldsClaims(Protocol):
    """A sink that keeps bodies too large for another sink (claim-check: ``s3``)."""

    async def put_claim(self, env: Envelope) -> str:
        """Store ``env``'s body; returns the reference to carry in its place."""


@runtime_checkable
class UsesClaimCheck(Protocol):
    """A sink with a size limit (``kafka``) that hands bodies too large for it to a hook."""

    claim_check: ClaimCheck | None
    """Where such bodies go (set by the fan-out from :class:`ClaimCheckConfig`); None:
    they cannot be sent."""


@runtime_checkable
class ClaimCheckConfig(Protocol):
    """A sink config that names the sink holding its oversize bodies."""

    @property
    def claim_check(self) -> str | None:
        """The name of a configured sink that :class:`HoldsClaims`; None: no claim-check."""


class SinkBase:
    """Convenience base: stores name and config, adds ``async with``."""

    config_model: ClassVar[type[SinkConfig]] = SinkConfig

    def __init__(self, name: str, config: SinkConfig) -> None:
        self.name = name
        self.config = config

    async def open(self) -> None:
        return None

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
