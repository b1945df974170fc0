"""``nopoll config check`` as a user runs it: the installed command, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

NOPOLL = str(Path(sys.executable).parent / "nopoll")

# What `pip install .` without the postgres extra gives: no asyncpg to import or find.
HIDE_ASYNCPG = """
import sys

class _NoAsyncpg:
    def find_spec(self, name, path=None, target=None):
        if name == "asyncpg" or name.startswith("asyncpg."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoAsyncpg())
"""

CONFIG = """
providers:
  sail:
    dialect: sail
    base_url: https://api.sail.example/v1
    api_key: ${SAIL_API_KEY}
  sference:
    dialect: sference
    base_url: https://api.sference.com/v1
    api_key: ${SFERENCE_API_KEY}
    webhook_secrets: ["${SFERENCE_WEBHOOK_SECRET}"]
sinks:
  warehouse: {type: sql, url: "postgresql://app:${PG_PASSWORD}@db/results"}
  audit:
    type: http
    url: "https://consumer.example/hook?token=${HOOK_TOKEN}"
    secret: "${AUDIT_SECRET}"
  files: {type: jsonl, dir: {data}/results}
redis_url: ${REDIS_URL:-redis://127.0.0.1:6379/2}
data_dir: {data}
"""
SECRETS = {
    "SFERENCE_API_KEY": "sk-live-SECRETVALUE1",
    "SFERENCE_WEBHOOK_SECRET": "whsec_U0VDUkVUVkFMVUUy",
    "SAIL_API_KEY": "sk-sail-SECRETVALUE3",
    "PG_PASSWORD": "SECRETVALUE4",
    "HOOK_TOKEN": "SECRETVALUE5",
    "AUDIT_SECRET": "SECRETVALUE6",
}


def bare_env(**extra: str) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")  # PYTHONPATH: a checkout
    return {**{k: os.environ[k] for k in keep if k in os.environ}, **extra}


def nopoll(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [NOPOLL, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )


def write(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "nopoll.yaml"
    path.write_text(text.replace("{data}", str(tmp_path / "data")))
    return path


def test_postgres_sink_without_asyncpg_fails_at_config_check(tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_ASYNCPG)
    config = tmp_path / "nopoll.yaml"
    config.write_text(
        "sinks:\n  warehouse: {type: sql, url: 'postgresql://app@127.0.0.1/results'}\n"
    )
    env = bare_env(PYTHONPATH=str(hide))
    probe = subprocess.run(
        [sys.executable, "-c", "import asyncpg"], env=env, capture_output=True, timeout=60
    )
    assert probe.returncode != 0  # the hiding works
    result = nopoll("config", "check", "--config", str(config), env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "config OK" not in result.stdout
    assert "sinks.warehouse.url" in result.stderr
    assert "pip install 'nopoll[postgres]'" in result.stderr
    assert "Traceback" not in result.stderr
    # SQLite needs no extra
    config.write_text("sinks:\n  db: {type: sql, url: 'sqlite:///x.db'}\n")
    ok = nopoll("config", "check", "--config", str(config), env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_redacted_prints_the_effective_config_without_any_secret(tmp_path: Path) -> None:
    config = write(tmp_path)
    result = nopoll(
        "config",
        "check",
        "--redacted",
        "--config",
        str(config),
        env=bare_env(**SECRETS),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert "SECRETVALUE" not in out and "U0VDUkVUVkFMVUUy" not in out
    shown = yaml.safe_load(result.stdout)
    assert shown["redis"]["url"] == "redis://127.0.0.1:6379/2"  # the redis_url key's home
    assert shown["redis"]["queue"] == {"connect_s": 5.0, "socket_s": 10.0}
    assert shown["providers"]["sference"]["base_url"] == "https://api.sference.com/v1"
    assert shown["providers"]["sference"]["api_key"] == "***"
    assert shown["providers"]["sference"]["webhook_secrets"] == ["***"]
    assert shown["providers"]["sail"]["webhook_secrets"] == []
    assert shown["sinks"]["warehouse"]["url"] == "postgresql+asyncpg://***@db/***"
    assert shown["sinks"]["audit"]["url"] == "https://consumer.example/***?token=***"
    assert shown["sinks"]["audit"]["secret"] == "***"
    assert shown["http"]["read_timeout_s"] == 30.0  # defaults are part of the effective config


def test_redacted_needs_no_secret_in_the_environment(tmp_path: Path) -> None:
    config = write(tmp_path)
    strict = nopoll("config", "check", "--config", str(config), env=bare_env(), cwd=tmp_path)
    assert strict.returncode == 2
    assert "SFERENCE_API_KEY is not set" in strict.stderr
    result = nopoll(
        "config", "check", "--redacted", "--config", str(config), env=bare_env(), cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for key, name in [
        ("providers.sference.api_key", "SFERENCE_API_KEY"),
        ("providers.sference.webhook_secrets.0", "SFERENCE_WEBHOOK_SECRET"),
        ("sinks.warehouse.url", "PG_PASSWORD"),
    ]:
        assert f"{key}: {name} is not set (needed to run)" in result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["providers"]["sference"]["api_key"] == "${SFERENCE_API_KEY} (not set)"
    assert shown["sinks"]["warehouse"]["url"] == "postgresql+asyncpg://***@db/***"


TOKENS = """
redis_url: '{redis}'
data_dir: {data}
providers:
  sim: {dialect: openai, base_url: 'https://api.example/v1'}
tenants: {team-a: {}, team-b: {}}
tenant_keys: ['${TENANT_KEY}']
admin_tokens: ['${ADMIN_TOKEN}']
consumer_tokens:
  - {token: '${TEAM_A_TOKEN}', tenant: team-a}
  - {token: '${OTHER_TOKEN}'}
  - {token: '${ALL_TOKEN}'}
"""
TOKEN_ENV = {
    "TENANT_KEY": "tenant-key-SECRETVALUE-0123456789abcdef",
    "ADMIN_TOKEN": "admin-SECRETVALUE-aaaa",
    "TEAM_A_TOKEN": "team-a-SECRETVALUE-bbbb",
    "OTHER_TOKEN": "other-SECRETVALUE-cccc",
    "ALL_TOKEN": "all-SECRETVALUE-dddd",
}


def _refused_to_start(command: str, config: Path, env: dict[str, str], cwd: Path) -> str:
    """``nopoll serve|api`` on ``config``: it must exit by itself, status 2; its output.
    (A process that starts anyway is stopped by its process group after 20 s.)"""
    from tests.servers import free_port

    process = subprocess.Popen(
        [NOPOLL, command, "--config", str(config), "--port", str(free_port())],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        out, _ = process.communicate(timeout=10)
        raise AssertionError(f"nopoll {command} started with overlapping tokens:\n{out}") from None
    assert process.returncode == 2, out
    return out


@pytest.mark.parametrize(
    ("same", "expected"),
    [
        # a token limited to team-a listed again without a tenant: it would read team-b
        (
            ("ALL_TOKEN", "TEAM_A_TOKEN"),
            "consumer_tokens.2.token: the same token as consumer_tokens.0.token",
        ),
        # a consumer token that is also an admin token
        (
            ("OTHER_TOKEN", "ADMIN_TOKEN"),
            "consumer_tokens.1.token: the same token as admin_tokens.0",
        ),
    ],
    ids=["limited-then-unlimited", "consumer-and-admin"],
)
def test_a_token_configured_twice_is_refused_naming_both_keys(
    tmp_path: Path, redis_url: str, same: tuple[str, str], expected: str
) -> None:
    config = tmp_path / "nopoll.yaml"
    config.write_text(
        TOKENS.replace("{data}", str(tmp_path / "data")).replace("{redis}", redis_url)
    )
    copy, of = same
    env = bare_env(**{**TOKEN_ENV, copy: TOKEN_ENV[of]})
    ok = nopoll("config", "check", "--config", str(config), env=bare_env(**TOKEN_ENV), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # distinct tokens are fine
    check = nopoll("config", "check", "--config", str(config), env=env, cwd=tmp_path)
    assert check.returncode == 2, check.stdout + check.stderr
    assert expected in check.stderr
    assert "SECRETVALUE" not in check.stdout + check.stderr
    for command in ("serve", "api"):
        out = _refused_to_start(command, config, env, tmp_path)
        assert expected in out and "SECRETVALUE" not in out


def test_redacted_needs_no_tenant_key_or_token_in_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "nopoll.yaml"
    config.write_text(TOKENS.replace("{data}", str(tmp_path / "data")).replace("{redis}", ""))
    result = nopoll(
        "config", "check", "--redacted", "--config", str(config), env=bare_env(), cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tenant_keys.0: TENANT_KEY is not set (needed to run)" in result.stderr
    assert "admin_tokens.0: ADMIN_TOKEN is not set (needed to run)" in result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["tenant_keys"] == ["${TENANT_KEY} (not set)"]
    assert shown["admin_tokens"] == ["${ADMIN_TOKEN} (not set)"]
    # without --redacted the same config is still checked in full
    strict = nopoll("config", "check", "--config", str(config), env=bare_env(), cwd=tmp_path)
    assert strict.returncode == 2 and "TENANT_KEY is not set" in strict.stderr
    short = bare_env(**{**TOKEN_ENV, "TENANT_KEY": "short"})
    strict = nopoll("config", "check", "--config", str(config), env=short, cwd=tmp_path)
    assert strict.returncode == 2
    assert "tenant_keys: a tenant key must be at least 32 characters long" in strict.stderr
    # and --redacted still checks a key that is set
    lenient = nopoll(
        "config", "check", "--redacted", "--config", str(config), env=short, cwd=tmp_path
    )
    assert lenient.returncode == 2
    assert "a tenant key must be at least 32 characters long" in lenient.stderr


SHARED_KEYS = """
redis_url: '{redis}'
data_dir: {data}
providers:
  sim:
    dialect: openai
    base_url: http://127.0.0.1:9/v1
    api_key: ${PROVIDER_KEY}
    webhook_secrets: ['whsec_c2VjcmV0LWZvci10aGUtc2hhcmVkLWtleS10ZXN0']
tenants:
  team-a:
    providers:
      sim: {api_key: "${TEAM_A_KEY}"}
  team-b:
    providers:
      sim: {api_key: "${TEAM_B_KEY}"}
tenant_keys: ['0123456789abcdef0123456789abcdef']
"""


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (
            {"TEAM_A_KEY": "sk-PROVIDERSECRET", "TEAM_B_KEY": "sk-team-b-own"},
            "tenants.team-a.providers.sim.api_key: the provider's own api_key",
        ),
        (
            {"TEAM_A_KEY": "sk-team-shared", "TEAM_B_KEY": "sk-team-shared"},
            "tenants.team-b.providers.sim.api_key: the same key as tenants.team-a",
        ),
    ],
    ids=["the-providers-key", "another-tenants-key"],
)
def test_a_tenant_account_with_a_key_it_shares_is_refused(
    tmp_path: Path, redis_url: str, keys: dict[str, str], expected: str
) -> None:
    """A tenant whose account key is the provider's own (or another tenant's) could fetch
    the other's results with a replayed callback: `config check` refuses it, naming both
    keys and printing neither."""
    config = tmp_path / "nopoll.yaml"
    config.write_text(
        SHARED_KEYS.replace("{data}", str(tmp_path / "data")).replace("{redis}", redis_url)
    )
    own = {"PROVIDER_KEY": "sk-PROVIDERSECRET", "TEAM_A_KEY": "sk-a", "TEAM_B_KEY": "sk-b"}
    ok = nopoll("config", "check", "--config", str(config), env=bare_env(**own), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # each its own key: fine
    env = bare_env(**{**own, **keys})
    check = nopoll("config", "check", "--config", str(config), env=env, cwd=tmp_path)
    assert check.returncode == 2, check.stdout + check.stderr
    assert expected in check.stderr, check.stderr
    assert "PROVIDERSECRET" not in check.stdout + check.stderr
    assert "sk-team-shared" not in check.stdout + check.stderr


def test_a_base_urls_key_and_signature_in_its_query_are_never_printed(tmp_path: Path) -> None:
    """Some providers take the key or a signature in the query (`?api-key=`, `?sig=`):
    neither `config check` nor `--redacted` prints their values."""
    config = tmp_path / "nopoll.yaml"
    config.write_text(
        f"data_dir: {tmp_path / 'data'}\nproviders:\n  az:\n    dialect: openai\n"
        "    base_url: https://az.example/openai/v1?api-version=2025&api-key=QUERYKEYVALUE"
        "&sig=QUERYSIGVALUE\n"
    )
    for extra in ((), ("--redacted",)):
        result = nopoll(
            "config", "check", *extra, "--config", str(config), env=bare_env(), cwd=tmp_path
        )
        out = result.stdout + result.stderr
        assert result.returncode == 0, out
        assert "QUERYKEYVALUE" not in out and "QUERYSIGVALUE" not in out, out
        assert "api-version=2025" in out  # what is not secret is shown
