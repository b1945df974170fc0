"""Third-party sinks come in through the ``nopoll.sinks`` entry-point group."""

from __future__ import annotations

from pathlib import Path

import pytest

from nopoll.exceptions import ConfigError
from receiver.config.settings import load_settings
from sinks.registry import create_sink, validate_sink_config


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution that declares a sink, installed the way pip would (a .dist-info)."""
    dist = tmp_path / "nopoll_example_sink-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nopoll-example-sink\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text(
        "[nopoll.sinks]\nexample = tests.sinks.flaky:FlakySink\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


async def test_entry_point_sink_is_configured_and_written(installed_plugin, tmp_path):
    out = tmp_path / "out"
    settings = load_settings(
        None,
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "sinks": {"mine": {"type": "example", "dir": str(out), "fail_write": 0}},
        },
    )
    config = settings.sinks["mine"]
    assert type(config).__name__ == "FlakySinkConfig"
    sink = create_sink("mine", config)
    from nopoll.envelope import envelope_from_response
    from receiver.demo.simulator import make_response

    env = envelope_from_response(
        make_response("resp_p"), provider="sim", received_at="2026-01-01T00:00:00.000Z"
    )
    await sink.open()
    await sink.write([env])
    await sink.aclose()
    assert [p.name for p in (out / "sim").iterdir()]


def test_unknown_type_lists_the_known_ones(installed_plugin):
    with pytest.raises(
        ConfigError, match=r"sinks\.x\.type: unknown sink type 'nope' \(known: .*example"
    ):
        validate_sink_config("x", {"type": "nope"})
