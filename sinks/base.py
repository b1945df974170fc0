"""The sink contract: open, write a sequence of envelopes, close.

A sink is any object with this shape; :class:`SinkBase` adds ``async with`` support. A
failed write raises (:class:`~nopoll.exceptions.SinkError` or any exception): the worker
retries each sink on its own, then keeps a dead letter. So an envelope can be written
again: a sink that can overwrite by ``(provider, key)`` does (``sql``, ``s3``); one that
cannot delivers at least once and says so in its docs.

See docs/architecture.md and docs/sinks/.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from nopoll.envelope import Envelope

__all__ = ["Sink", "SinkBase", "SinkConfig"]


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
