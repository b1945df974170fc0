"""The ``jsonl`` sink: one file per provider per UTC day, one envelope per line.

Files are ``{dir}/{provider}/{YYYY-MM-DD}.jsonl``. Each write appends all its lines for a
file with one ``write`` call and flushes, so concurrent writers never interleave lines.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import orjson

from nopoll.envelope import Envelope
from nopoll.exceptions import SinkError
from sinks.base import SinkBase, SinkConfig

__all__ = ["JsonlSink", "JsonlSinkConfig"]


class JsonlSinkConfig(SinkConfig):
    """``{type: jsonl, dir: ./nopoll-data/results}``."""

    type: Literal["jsonl"] = "jsonl"
    dir: Path
    fsync: bool = False
    """Also fsync after each write (slower; survives power loss, not only a crash)."""

    def rebased(self, base: Path) -> JsonlSinkConfig:
        return self if self.dir.is_absolute() else self.model_copy(update={"dir": base / self.dir})

    def location(self) -> str:
        """The directory, absolute."""
        return str(self.dir.absolute())


class JsonlSink(SinkBase):
    """Appends envelopes as JSON lines."""

    config_model = JsonlSinkConfig
    config: JsonlSinkConfig

    def path_for(self, provider: str, when: datetime | None = None) -> Path:
        """The file that ``provider``'s envelopes written at ``when`` go to."""
        day = (when or datetime.now(UTC)).strftime("%Y-%m-%d")
        return self.config.dir / provider / f"{day}.jsonl"

    async def open(self) -> None:
        try:
            self.config.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SinkError(
                f"cannot create {self.config.dir}: {exc.strerror}", sink=self.name
            ) from exc

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        if not envelopes:
            return
        now = datetime.now(UTC)
        by_file: dict[Path, list[bytes]] = defaultdict(list)
        for env in envelopes:
            by_file[self.path_for(env.provider, now)].append(orjson.dumps(env.to_dict()) + b"\n")
        try:
            await asyncio.to_thread(self._append, by_file)
        except OSError as exc:
            raise SinkError(f"append failed: {exc.strerror}", sink=self.name) from exc

    def _append(self, by_file: dict[Path, list[bytes]]) -> None:
        for path, lines in by_file.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                data = b"".join(lines)
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
