"""The registry's one table: a sink type's row holds its class and its install extra."""

from __future__ import annotations

import pytest

from nopoll.exceptions import ConfigError, SinkUnavailable
from sinks import registry
from sinks.base import SinkBase
from sinks.registry import BUILTIN_SINKS, SinkType, sink_class, validate_sink_config


def test_every_builtin_row_names_a_sink_class() -> None:
    assert {"sql", "jsonl", "s3", "kafka", "http"} <= set(BUILTIN_SINKS)
    for name, row in BUILTIN_SINKS.items():
        cls = sink_class(name)
        assert issubclass(cls, SinkBase) and row.target.endswith(f":{cls.__name__}")
        assert cls.config_model.model_fields["type"].default == name


def test_a_missing_driver_is_an_install_hint_naming_the_rows_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row = SinkType("nopoll_no_such_driver:Sink", extra="kafka")
    monkeypatch.setitem(registry.BUILTIN_SINKS, "gone", row)
    with pytest.raises(SinkUnavailable, match=r"pip install 'nopoll\[kafka\]'"):
        sink_class("gone")
    with pytest.raises(ConfigError, match=r"sinks\.g: the 'gone' sink needs nopoll_no_such"):
        validate_sink_config("g", {"type": "gone"})


def test_a_row_without_an_extra_hints_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.BUILTIN_SINKS, "gone", SinkType("nopoll_no_such_driver:Sink"))
    with pytest.raises(SinkUnavailable, match=r"pip install 'nopoll\[all\]'"):
        sink_class("gone")
