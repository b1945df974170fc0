"""Result sinks: where envelopes go. See :mod:`sinks.base` for the contract."""

from __future__ import annotations

from sinks.base import Sink, SinkBase, SinkConfig
from sinks.registry import create_sink, sink_class, validate_sink_config

__all__ = ["Sink", "SinkBase", "SinkConfig", "create_sink", "sink_class", "validate_sink_config"]
