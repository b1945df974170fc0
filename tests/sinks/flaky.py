"""A test sink: JSONL that fails its Nth write a given number of times (a plugin sink)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from nopoll.envelope import Envelope
from sinks.jsonl import JsonlSink, JsonlSinkConfig


class FlakySinkConfig(JsonlSinkConfig):
    type: str = "flaky"  # type: ignore[assignment]  # registered under any name
    fail_write: int = 3
    """Which write (1-based, counting only non-empty writes) fails."""
    fail_times: int = 5


class FlakySink(JsonlSink):
    config_model = FlakySinkConfig
    config: FlakySinkConfig
    writes: ClassVar[dict[str, int]] = {}
    failures: ClassVar[dict[str, int]] = {}

    async def write(self, envelopes: Sequence[Envelope]) -> None:
        if not envelopes:
            return
        key = str(self.config.dir)
        n = self.writes.get(key, 0) + 1
        if n == self.config.fail_write and self.failures.get(key, 0) < self.config.fail_times:
            self.failures[key] = self.failures.get(key, 0) + 1
            raise OSError("flaky sink: simulated outage on this chunk")
        self.writes[key] = n
        await super().write(envelopes)
