"""Config loading: interpolation, validation errors that name the key, no secrets in errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from receiver.cli import main
from receiver.config import load_settings
from receiver.exceptions import ConfigError

GOOD = """
redis_url: ${REDIS_URL:-redis://127.0.0.1:6379/1}
data_dir: {data}
providers:
  sference:
    dialect: sference
    base_url: https://api.sference.com/v1/
    api_key: ${SFERENCE_API_KEY}
    webhook_secrets: ["${SFERENCE_WEBHOOK_SECRET}", "raw-old-secret"]
sinks:
  files: {type: jsonl, dir: {data}/results}
  db: {type: sql, url: "postgresql://app:hunter2@db/results"}
routes:
  - match: {provider: sference, kind: [response], metadata.label: eval}
    sinks: [db]
"""
ENV = {"SFERENCE_API_KEY": "sk-live-secret", "SFERENCE_WEBHOOK_SECRET": "whsec_aGVsbG8gd29ybGQ="}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nopoll.yaml"
    path.write_text(text.replace("{data}", str(tmp_path)))
    return path


def test_good_config_interpolates_and_normalizes(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, GOOD), env=ENV)
    p = s.providers["sference"]
    assert p.base_url == "https://api.sference.com/v1"
    assert p.api_key is not None and p.api_key.get_secret_value() == "sk-live-secret"
    assert p.secret_keys() == [b"hello world", b"raw-old-secret"]
    assert s.redis_url.get_secret_value() == "redis://127.0.0.1:6379/1"
    assert s.sinks["db"].url.get_secret_value().startswith("postgresql+asyncpg://")
    assert s.routes[0].sinks == ["db"]


def test_secrets_do_not_print(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, GOOD), env=ENV)
    text = repr(s) + str(s)
    for secret in ("sk-live-secret", "aGVsbG8gd29ybGQ", "raw-old-secret", "hunter2"):
        assert secret not in text


def test_missing_variable_names_key_and_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in ENV.items() if k != "SFERENCE_API_KEY"}
    with pytest.raises(
        ConfigError,
        match=r"providers\.sference\.api_key: environment variable "
        r"SFERENCE_API_KEY is not set",
    ):
        load_settings(write(tmp_path, GOOD), env=env)


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        (("dialect: sference", "dialect: bogus"), r"providers\.sference\.dialect"),
        (
            ("base_url: https://api.sference.com/v1/", "base_url: ftp://x"),
            r"providers\.sference\.base_url",
        ),
        (("sinks: [db]", "sinks: [nowhere]"), r"routes\.0\.sinks: unknown sink 'nowhere'"),
        (("type: jsonl", "type: nosuch"), r"sinks\.files\.type: unknown sink type 'nosuch'"),
        (("metadata.label: eval", "colour: red"), r"unknown match key 'colour'"),
        (("data_dir:", "unknown_key: 1\ndata_dir:"), r"unknown_key: Extra inputs"),
    ],
)
def test_invalid_config_names_the_key(
    tmp_path: Path, patch: tuple[str, str], expected: str
) -> None:
    text = GOOD.replace(*patch)
    with pytest.raises(ConfigError, match=expected):
        load_settings(write(tmp_path, text), env=ENV)


def test_bad_whsec_secret_error_does_not_echo_it(tmp_path: Path) -> None:
    env = {**ENV, "SFERENCE_WEBHOOK_SECRET": "whsec_%%%SECRETVALUE%%%"}
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, GOOD), env=env)
    assert "webhook_secrets" in str(info.value)
    assert "SECRETVALUE" not in str(info.value)


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("providers: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_settings(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "nope.yaml")


def test_defaults_without_config(tmp_path: Path) -> None:
    s = load_settings(None, env={}, overrides={"data_dir": str(tmp_path)})
    assert s.embedded_redis
    assert {c.type for c in s.sinks.values()} == {"sql", "jsonl"}
    assert str(tmp_path / "results.db") in s.sinks["db"].url.get_secret_value()
    assert s.dedupe_ttl_s >= 72 * 3600


def test_cli_config_check_exits_2_with_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    path = write(tmp_path, GOOD.replace("dialect: sference", "dialect: bogus"))
    assert main(["config", "check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "providers.sference.dialect" in err
    good = write(tmp_path, GOOD)
    assert main(["config", "check", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    assert "provider sference: dialect sference" in out and "sk-live-secret" not in out


def test_empty_rotation_slot_is_dropped(tmp_path: Path) -> None:
    text = GOOD.replace('"raw-old-secret"', '"${OLD_SECRET:-}"')
    s = load_settings(write(tmp_path, text), env=ENV)
    assert s.providers["sference"].secret_keys() == [b"hello world"]
    only_empty = GOOD.replace(
        '["${SFERENCE_WEBHOOK_SECRET}", "raw-old-secret"]', '["${OLD_SECRET:-}"]'
    )
    with pytest.raises(ConfigError, match=r"providers\.sference\.webhook_secrets"):
        load_settings(write(tmp_path, only_empty), env=ENV)
