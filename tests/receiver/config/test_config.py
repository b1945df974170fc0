"""Config loading: interpolation, validation errors that name the key, no secrets in errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from nopoll.exceptions import ConfigError
from receiver.cli import main
from receiver.config.settings import load_settings, redact_url

HEAD = """
redis_url: ${REDIS_URL:-redis://127.0.0.1:6379/1}
data_dir: {data}
providers:
  sference:
    dialect: sference
"""
GOOD = (
    HEAD
    + """    base_url: https://api.sference.com/v1/
    api_key: ${SFERENCE_API_KEY}
    webhook_secrets: ["${SFERENCE_WEBHOOK_SECRET}", "raw-old-secret"]
sinks:
  files: {type: jsonl, dir: {data}/results}
  db: {type: sql, url: "postgresql://app:hunter2@db/results"}
routes:
  - match: {provider: sference, kind: [response], metadata.label: eval}
    sinks: [db]
"""
)
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
        (("data_dir:", "unknown_key: 1\ndata_dir:"), r"unknown_key: unknown key"),
        (
            ("data_dir:", "dedupe_ttl_s: 500\ndata_dir:"),
            r"dedupe_ttl_s \(500 s\) must be at least twice providers\.sference\.tolerance_s",
        ),
        (
            ("data_dir:", "api: {trusted_proxies: [10.0.0.0/8, nginx]}\ndata_dir:"),
            r"api\.trusted_proxies: .*'nginx' is not an IP address or a CIDR network",
        ),
        (("data_dir:", "api: {trusted_proxies: ['*']}\ndata_dir:"), r"api\.trusted_proxies"),
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


# --- a new user's first hour: empty variables, hints, typos, lenient loading -----------


def test_set_but_empty_variable_names_key_and_variable(tmp_path: Path) -> None:
    env = {**ENV, "SFERENCE_WEBHOOK_SECRET": ""}
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, GOOD), env=env)
    message = str(info.value)
    assert "providers.sference.webhook_secrets.0" in message
    assert "SFERENCE_WEBHOOK_SECRET is set but empty" in message
    assert "at least 1 item" not in message


def test_explicit_empty_default_stays_allowed(tmp_path: Path) -> None:
    text = GOOD.replace('"raw-old-secret"', '"${OLD_SECRET:-}"')
    s = load_settings(write(tmp_path, text), env={**ENV, "OLD_SECRET": ""})
    assert s.providers["sference"].secret_keys() == [b"hello world"]


def test_default_applies_to_an_empty_variable_as_in_the_shell(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, GOOD), env={**ENV, "REDIS_URL": ""})
    assert s.redis_url.get_secret_value() == "redis://127.0.0.1:6379/1"


@pytest.mark.parametrize(
    ("line", "secret"),
    [
        ("api_key: ${SFERENCE_API_KEY}", True),
        ('webhook_secrets: ["${SFERENCE_WEBHOOK_SECRET}", "raw-old-secret"]', True),
        ('url: "postgresql://app:hunter2@db/results"', True),
        ("base_url: https://api.sference.com/v1/", False),
    ],
)
def test_missing_variable_hint_never_suggests_a_default_for_a_secret(
    tmp_path: Path, line: str, secret: bool
) -> None:
    replacement = {
        "api_key: ${SFERENCE_API_KEY}": "api_key: ${NEW_VAR}",
        'webhook_secrets: ["${SFERENCE_WEBHOOK_SECRET}", "raw-old-secret"]': (
            'webhook_secrets: ["${NEW_VAR}"]'
        ),
        'url: "postgresql://app:hunter2@db/results"': 'url: "postgresql://app:${NEW_VAR}@db/r"',
        "base_url: https://api.sference.com/v1/": "base_url: ${NEW_VAR}",
    }[line]
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, GOOD.replace(line, replacement)), env=ENV)
    message = str(info.value)
    assert "NEW_VAR is not set" in message
    if secret:
        assert "${NEW_VAR:-" not in message
        assert "set it in the environment" in message and "never live in the file" in message
    else:
        assert "${NEW_VAR:-default}" in message


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        (("webhook_secrets:", "webhook_secret:"), "did you mean 'webhook_secrets'?"),
        (("routes:", "route:"), "did you mean 'routes'?"),
        (("data_dir:", "http: {read_timout_s: 3}\ndata_dir:"), "did you mean 'read_timeout_s'?"),
        (("{type: jsonl, dir:", "{type: jsonl, dirr:"), "did you mean 'dir'?"),
        (("type: jsonl", "type: jsonll"), "did you mean 'jsonl'?"),
        (("metadata.label: eval", "provder: x"), "did you mean 'provider'?"),
    ],
)
def test_typo_says_did_you_mean(tmp_path: Path, patch: tuple[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, GOOD.replace(*patch)), env=ENV)
    assert expected in str(info.value)


def test_typo_names_its_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, GOOD.replace("webhook_secrets:", "webhook_secret:")), env=ENV)
    assert "providers.sference.webhook_secret: unknown key; did you mean" in str(info.value)


def test_webhook_secrets_are_optional(tmp_path: Path) -> None:
    text = GOOD.replace(
        '    webhook_secrets: ["${SFERENCE_WEBHOOK_SECRET}", "raw-old-secret"]\n', ""
    )
    s = load_settings(write(tmp_path, text), env=ENV)
    assert s.providers["sference"].webhook_secrets == []
    assert s.providers["sference"].secret_keys() == []
    empty = load_settings(
        write(tmp_path, GOOD.replace('["${SFERENCE_WEBHOOK_SECRET}", "raw-old-secret"]', "[]")),
        env=ENV,
    )
    assert empty.providers["sference"].webhook_secrets == []
    # a given secret is still checked
    bad = GOOD.replace('"raw-old-secret"', '"whsec_%%%"')
    with pytest.raises(ConfigError, match=r"providers\.sference\.webhook_secrets"):
        load_settings(write(tmp_path, bad), env=ENV)


LENIENT = (
    HEAD
    + """    base_url: ${SFERENCE_BASE_URL}
    api_key: ${SFERENCE_API_KEY}
    webhook_secrets: ["${SFERENCE_WEBHOOK_SECRET}", "whsec_${ROTATED}"]
sinks:
  db: {type: sql, url: "${DATABASE_URL}"}
  audit: {type: http, url: "https://consumer.example/hook", secret: "${AUDIT_SECRET}"}
http: {read_timeout_s: "${READ_TIMEOUT}"}
"""
)


def test_lenient_load_turns_unset_variables_into_notes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SFERENCE_BASE_URL is not set"):
        load_settings(write(tmp_path, LENIENT), env={})
    s = load_settings(write(tmp_path, LENIENT), env={"ROTATED": ""}, require_env=False)
    notes = "\n".join(s.notes)
    for key, name in [
        ("providers.sference.base_url", "SFERENCE_BASE_URL"),
        ("providers.sference.api_key", "SFERENCE_API_KEY"),
        ("providers.sference.webhook_secrets.0", "SFERENCE_WEBHOOK_SECRET"),
        ("sinks.db.url", "DATABASE_URL"),
        ("sinks.audit.secret", "AUDIT_SECRET"),
        ("http.read_timeout_s", "READ_TIMEOUT"),
    ]:
        assert f"{key}: {name} is not set (needed to run)" in notes
        assert s.unset_env[key] == (name,)
    assert "providers.sference.webhook_secrets.1: ROTATED is set but empty" in notes
    assert s.providers["sference"].base_url == "${SFERENCE_BASE_URL}"  # a visible placeholder
    assert s.sinks["db"].type == "sql" and s.sinks["audit"].type == "http"
    assert s.redis_url.get_secret_value() == "redis://127.0.0.1:6379/1"
    assert s.http.read_timeout_s == 30.0  # the default, until READ_TIMEOUT is set


def test_lenient_load_still_reports_real_mistakes(tmp_path: Path) -> None:
    text = LENIENT.replace("dialect: sference", "dialect: bogus")
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text), env={}, require_env=False)
    message = str(info.value)
    assert "providers.sference.dialect" in message
    assert "base_url" not in message  # unset there: a note, not an error
    bad_name = LENIENT.replace("  sference:", "  'bad name':")
    with pytest.raises(ConfigError, match=r"name 'bad name' must match"):
        load_settings(write(tmp_path, bad_name), env={}, require_env=False)
    typo = LENIENT.replace("{type: http, url:", "{type: http, urll:")
    with pytest.raises(ConfigError, match=r"sinks\.audit\.urll: unknown key; did you mean 'url'"):
        load_settings(write(tmp_path, typo), env={}, require_env=False)


def test_strict_load_has_no_notes(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, GOOD), env=ENV)
    assert s.notes == () and dict(s.unset_env) == {}


@pytest.mark.parametrize(
    ("target", "what"),
    [("files", "a jsonl sink"), ("nowhere", "not a configured sink")],
)
def test_claim_check_must_name_an_s3_sink(tmp_path: Path, target: str, what: str) -> None:
    sinks = {
        "files": {"type": "jsonl", "dir": str(tmp_path)},
        "bus": {
            "type": "kafka",
            "bootstrap_servers": "k:9092",
            "topic": "t",
            "claim_check": target,
        },
    }
    with pytest.raises(ConfigError, match=rf"sinks\.bus\.claim_check: '{target}' is {what}"):
        load_settings(None, env={}, overrides={"sinks": sinks})


def test_every_unset_variable_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "providers:\n  sim:\n    dialect: openai\n    base_url: http://127.0.0.1:9/v1\n"
        "    api_key: ${SIM_API_KEY}\n    webhook_secrets: ['${SIM_WEBHOOK_SECRET}']\n"
    )
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    message = str(info.value)
    assert message.startswith(f"invalid configuration in {path}:")
    assert "SIM_API_KEY is not set" in message and "SIM_WEBHOOK_SECRET is not set" in message


TOKENS = (
    GOOD
    + """tenants: {team-a: {}}
tenant_keys: ["${TENANT_KEY}"]
admin_tokens: ["${OLD_ADMIN:-}", "${ADMIN}"]
consumer_tokens:
  - {token: "${TEAM_A}", tenant: team-a}
  - {token: "${ALL}"}
"""
)
TOKEN_ENV = {
    **ENV,
    "TENANT_KEY": "k" * 40,
    "ADMIN": "admin-SECRETVALUE-0001",
    "TEAM_A": "team-a-SECRETVALUE-0002",
    "ALL": "all-SECRETVALUE-0003",
}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (  # the file's own index, counting the empty rotation slot before it
            {"ALL": TOKEN_ENV["ADMIN"]},
            "consumer_tokens.1.token: the same token as admin_tokens.1",
        ),
        (
            {"ALL": TOKEN_ENV["TEAM_A"]},
            "consumer_tokens.1.token: the same token as consumer_tokens.0.token",
        ),
        (
            {"OLD_ADMIN": TOKEN_ENV["ADMIN"]},
            "admin_tokens.1: the same token as admin_tokens.0",
        ),
    ],
    ids=["consumer-and-admin", "limited-and-unlimited", "admin-twice"],
)
def test_a_token_configured_twice_names_both_keys_and_not_the_token(
    tmp_path: Path, env: dict[str, str], expected: str
) -> None:
    path = write(tmp_path, TOKENS)
    assert len(load_settings(path, env=TOKEN_ENV).consumer_tokens) == 2
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={**TOKEN_ENV, **env})
    assert expected in str(info.value)
    assert "SECRETVALUE" not in str(info.value)


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("short-token", "must be at least 16 characters long"),
        ("a token with spaces in it", "printable ASCII without spaces"),
        ("token-wïth-an-umlaut-0123", "printable ASCII without spaces"),
    ],
)
def test_a_token_that_cannot_travel_in_a_header_is_refused(
    tmp_path: Path, token: str, expected: str
) -> None:
    path = write(tmp_path, TOKENS)
    for variable, key in [("ADMIN", "admin_tokens"), ("ALL", "consumer_tokens.1.token")]:
        with pytest.raises(ConfigError) as info:
            load_settings(path, env={**TOKEN_ENV, variable: token})
        assert f"{key}: " in str(info.value) and expected in str(info.value)
        assert token not in str(info.value)


def test_a_lenient_load_leaves_unset_keys_and_tokens_unchecked(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, TOKENS), env={}, require_env=False)
    assert [k.get_secret_value() for k in s.tenant_keys] == ["${TENANT_KEY}"]
    assert [t.get_secret_value() for t in s.admin_tokens] == ["${ADMIN}"]
    assert [t.token.get_secret_value() for t in s.consumer_tokens] == ["${TEAM_A}", "${ALL}"]
    assert "tenant_keys.0: TENANT_KEY is not set (needed to run)" in s.notes
    # the same variable twice is the same token whatever its value
    twice = write(tmp_path, TOKENS.replace("${ALL}", "${ADMIN}"))
    with pytest.raises(ConfigError, match=r"consumer_tokens\.1\.token: the same token as admin"):
        load_settings(twice, env={}, require_env=False)
    # a value that is set is checked as usual
    with pytest.raises(ConfigError, match="tenant_keys: a tenant key must be at least 32"):
        load_settings(write(tmp_path, TOKENS), env={"TENANT_KEY": "short"}, require_env=False)


REDIS_TAIL = "data_dir: {data}\n"


@pytest.mark.parametrize(
    "spelling",
    [
        "redis_url: ${REDIS_URL}\n",  # the top-level key nopoll always had
        "redis:\n  url: ${REDIS_URL}\n",  # its home in the redis section
    ],
)
def test_the_redis_url_has_two_spellings_and_one_home(tmp_path: Path, spelling: str) -> None:
    url = "redis://:hunter2@127.0.0.1:6379/4"
    s = load_settings(write(tmp_path, spelling + REDIS_TAIL), env={"REDIS_URL": url})
    assert s.redis.url.get_secret_value() == url
    assert s.redis_url.get_secret_value() == url
    assert not s.embedded_redis
    assert s.redis.queue.connect_s == 5 and s.redis.queue.socket_s == 10  # today's values
    assert s.redis.api.connect_s == 2 and s.redis.api.socket_s == 2
    assert "hunter2" not in repr(s) + str(s)
    lenient = load_settings(write(tmp_path, spelling + REDIS_TAIL), env={}, require_env=False)
    assert lenient.unset_env["redis.url"] == ("REDIS_URL",)


def test_the_redis_url_given_twice_is_refused(tmp_path: Path) -> None:
    text = "redis_url: redis://a:6379/0\nredis:\n  url: redis://b:6379/0\n" + REDIS_TAIL
    with pytest.raises(ConfigError, match=r"redis_url and redis\.url are the same setting"):
        load_settings(write(tmp_path, text), env={})


def test_redis_role_timeouts_are_configurable(tmp_path: Path) -> None:
    text = "redis:\n  health: {connect_s: 1, socket_s: 3}\n" + REDIS_TAIL
    s = load_settings(write(tmp_path, text), env={})
    assert s.embedded_redis
    assert (s.redis.health.connect_s, s.redis.health.socket_s) == (1, 3)
    assert s.redis.queue.socket_s == 10
    with pytest.raises(ConfigError, match=r"redis\.queue\.connect_s"):
        load_settings(write(tmp_path, "redis:\n  queue: {connect_s: 0, socket_s: 1}\n"), env={})


def test_a_redis_url_of_an_unknown_scheme_is_refused_without_printing_it(tmp_path: Path) -> None:
    for spelling in ("redis_url: ${URL}\n", "redis:\n  url: ${URL}\n"):
        env = {"URL": "http://:hunter2@127.0.0.1:6379/0"}
        with pytest.raises(ConfigError, match=r"redis\.url.*http://") as caught:
            load_settings(write(tmp_path, spelling + REDIS_TAIL), env=env)
        assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "redis://u:pw@h:6379/0?password=p&db=3&flag",
            "redis://u:***@h:6379/0?password=***&db=3&flag",
        ),
        ("https://user@h.example/p?token=t&x=1", "https://user@h.example/p?token=***&x=1"),
        (
            "postgresql://a:b:c@h/db?sslmode=require&api_key=k",
            "postgresql://a:***@h/db?sslmode=require&api_key=***",
        ),
        ("redis://h:notaport/0?secret=s", "redis://h:notaport/0?secret=***"),
        ("http://[::1", "***"),
        ("no url", "no url"),
    ],
)
def test_redact_url_masks_the_password_and_secret_looking_query_values(
    url: str, shown: str
) -> None:
    assert redact_url(url) == shown
