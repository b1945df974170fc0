"""Sink types: the config's ``type:`` maps to a :class:`SinkType` row (``"module:Class"``
and its install extra), the class imported lazily.

Built-in sinks are the rows of :data:`BUILTIN_SINKS`; third-party ones (the ``nopoll.sinks``
entry-point group) register the same way. A sink whose driver is not installed turns into
an install hint (the row's extra), not a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from importlib.metadata import entry_points
from typing import Any

from pydantic import ValidationError

from nopoll.exceptions import ConfigError, SinkUnavailable
from sinks.base import Sink, SinkBase, SinkConfig

__all__ = [
    "BUILTIN_SINKS",
    "ENTRY_POINT_GROUP",
    "SinkType",
    "create_sink",
    "sink_class",
    "validate_sink_config",
]

ENTRY_POINT_GROUP = "nopoll.sinks"


@dataclasses.dataclass(frozen=True)
class SinkType:
    """One sink type: where its class is and which extra installs its driver."""

    target: str
    """``"module:Class"``, imported on first use."""
    extra: str = "all"
    """The ``nopoll[...]`` extra the install hint names when the module cannot be imported."""


BUILTIN_SINKS: dict[str, SinkType] = {
    "sql": SinkType("sinks.sql:SqlSink", extra="postgres"),
    "jsonl": SinkType("sinks.jsonl:JsonlSink"),
    "s3": SinkType("sinks.s3:S3Sink", extra="s3"),
    "kafka": SinkType("sinks.kafka:KafkaSink", extra="kafka"),
    "http": SinkType("sinks.http:HttpSink"),
}


def _row(sink_type: str) -> SinkType | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == sink_type:
            return SinkType(str(ep.value))
    return BUILTIN_SINKS.get(sink_type)


def sink_class(sink_type: str) -> type[SinkBase]:
    """The class implementing ``sink_type``; raises ConfigError for an unknown type."""
    row = _row(sink_type)
    if row is None:
        known = sorted({*BUILTIN_SINKS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
        raise ConfigError(
            f"unknown sink type {sink_type!r}{_did_you_mean(sink_type, known)} "
            f"(known: {', '.join(known)})"
        )
    module_name, _, attr = row.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = row.extra
        raise SinkUnavailable(
            f"the {sink_type!r} sink needs {exc.name or 'a missing package'}: "
            f"pip install 'nopoll[{extra}]' (from a clone: pip install '.[{extra}]')",
            sink=sink_type,
        ) from exc
    cls = getattr(module, attr)
    if not isinstance(cls, type):
        raise ConfigError(f"sink type {sink_type!r} points at {row.target}, which is not a class")
    return cls


def validate_sink_config(name: str, raw: Any) -> SinkConfig:
    """Validate one ``sinks.<name>`` entry with its sink's own config model."""
    if isinstance(raw, SinkConfig):
        return raw
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ConfigError(f"sinks.{name}: must be a mapping with a 'type' key")
    try:
        cls = sink_class(raw["type"])
    except SinkUnavailable as exc:
        raise ConfigError(f"sinks.{name}: {exc.args[0]}") from None
    except ConfigError as exc:
        raise ConfigError(f"sinks.{name}.type: {exc}") from None
    try:
        return cls.config_model.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False)
        # an unknown key first: it is usually a typo of the field reported missing
        errors.sort(key=lambda e: e["type"] != "extra_forbidden")
        lines = []
        for err in errors:
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
                msg = "unknown key" + _did_you_mean(loc, list(cls.config_model.model_fields), ";")
            lines.append(f"sinks.{name}.{loc}: {msg}" if loc else f"sinks.{name}: {msg}")
        raise ConfigError("\n  ".join(lines)) from None


def _did_you_mean(word: str, known: list[str], sep: str = ":") -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f"{sep} did you mean {close[0]!r}?" if close else ""


def create_sink(name: str, config: SinkConfig) -> Sink:
    """A new, unopened sink for one ``sinks.<name>`` entry."""
    sink: Sink = sink_class(config.type)(name, config)
    return sink
