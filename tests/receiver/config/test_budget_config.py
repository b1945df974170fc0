"""``providers.<name>.rate_limit_rps``: each provider account's request budget, defaulting
per dialect to the provider's documented limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from nopoll.exceptions import ConfigError
from receiver.config.accounts import tenant_provider
from receiver.config.dialects import DIALECTS
from receiver.config.settings import load_settings

CONFIG = """
data_dir: {data}
providers:
  prov:
    dialect: {dialect}
    base_url: https://api.example/v1
    api_key: sk-test
{extra}"""


def _load(tmp_path: Path, dialect: str, extra: str = "", tail: str = ""):
    path = tmp_path / "nopoll.yaml"
    text = CONFIG.replace("{data}", str(tmp_path)).replace("{dialect}", dialect)
    path.write_text(text.replace("{extra}", extra) + tail)
    return load_settings(path, env={})


def test_valar_defaults_to_its_documented_60_a_minute_and_the_others_to_none(
    tmp_path: Path,
) -> None:
    assert DIALECTS["valar"].rate_limit_rps == 1.0
    for dialect in DIALECTS:
        provider = _load(tmp_path, dialect).providers["prov"]
        assert provider.rate_limit_rps == DIALECTS[dialect].rate_limit_rps, dialect
        if dialect != "valar":
            assert provider.rate_limit_rps is None, dialect


def test_a_set_value_wins_and_null_turns_the_budget_off(tmp_path: Path) -> None:
    assert _load(tmp_path, "valar", "    rate_limit_rps: 5\n").providers["prov"].rate_limit_rps == 5
    assert _load(tmp_path, "openai", "    rate_limit_rps: 0.5\n").providers[
        "prov"
    ].rate_limit_rps == pytest.approx(0.5)
    off = _load(tmp_path, "valar", "    rate_limit_rps: null\n").providers["prov"]
    assert off.rate_limit_rps is None


@pytest.mark.parametrize("value", ["0", "-1", "10001", "fast"])
def test_a_bad_value_is_an_error_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"providers\.prov\.rate_limit_rps"):
        _load(tmp_path, "valar", f"    rate_limit_rps: {value}\n")


TENANTS = """tenants:
  team-a:
    providers:
      prov: {api_key: sk-team-a{own}}
tenant_keys: ['0123456789abcdef0123456789abcdef']
"""


def test_a_tenant_account_has_the_providers_rate_unless_it_sets_its_own(tmp_path: Path) -> None:
    settings = _load(tmp_path, "valar", "    rate_limit_rps: 3\n", TENANTS.replace("{own}", ""))
    account = tenant_provider(settings, "team-a", "prov")
    assert account is not None and account.rate_limit_rps == 3
    own = TENANTS.replace("{own}", ", rate_limit_rps: 0.25")
    settings = _load(tmp_path, "valar", "", own)
    account = tenant_provider(settings, "team-a", "prov")
    assert account is not None and account.rate_limit_rps == pytest.approx(0.25)
    assert settings.providers["prov"].rate_limit_rps == 1.0
    off = _load(tmp_path, "valar", "", TENANTS.replace("{own}", ", rate_limit_rps: null"))
    account = tenant_provider(off, "team-a", "prov")
    assert account is not None and account.rate_limit_rps is None


def test_a_bad_tenant_value_names_the_tenants_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tenants\.team-a\.providers\.prov\.rate_limit_rps"):
        _load(tmp_path, "valar", "", TENANTS.replace("{own}", ", rate_limit_rps: 0"))
