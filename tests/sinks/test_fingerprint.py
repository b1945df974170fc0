"""A sink config's fingerprint: the same for the same effective config, different for any
difference (secrets included), and built without keeping a secret."""

from __future__ import annotations

from sinks.base import _plain
from sinks.http import HttpSinkConfig
from sinks.sql import SqlSinkConfig


def _http(**overrides: object) -> HttpSinkConfig:
    fields: dict[str, object] = {"url": "http://127.0.0.1:9/hook", "secret": "s3cret-value"}
    return HttpSinkConfig.model_validate({"type": "http", **fields, **overrides})


def test_same_config_same_fingerprint_and_any_difference_another() -> None:
    base = _http().fingerprint()
    assert len(base) == 16 and base == _http().fingerprint()
    assert _http(url="http://127.0.0.1:10/hook").fingerprint() != base
    assert _http(secret="another-secret").fingerprint() != base
    assert _http(headers={"Authorization": "Bearer x"}).fingerprint() != base
    assert _http(timeout_s=5).fingerprint() != base
    one = SqlSinkConfig.model_validate({"type": "sql", "url": "sqlite:///a.db", "table": "t"})
    two = SqlSinkConfig.model_validate({"type": "sql", "url": "sqlite:///a.db", "table": "u"})
    assert one.fingerprint() != two.fingerprint()


def test_the_digested_text_holds_no_secret() -> None:
    """What the fingerprint digests names each secret by its own digest only."""
    config = _http(headers={"Authorization": "Bearer header-secret"})
    plain = repr(_plain(config.model_dump()))
    assert "s3cret-value" not in plain and "header-secret" not in plain
    assert plain.count("sha256:") == 2
