"""The one Redis connector: each role's timeouts, a URL that never prints, one close."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from receiver.redis import ROLES, RedisConfig, RedisConnector, RedisTimeouts

SECRET_URL = "redis://nopoll:hunter2@127.0.0.1:6379/3?password=hunter3"


def _kwargs(pool) -> dict:
    return pool.connection_kwargs


def test_each_role_gets_todays_timeouts() -> None:
    redis = RedisConnector.from_url("redis://127.0.0.1:6379/3")
    expected = {"queue": (5, 10), "api": (2, 2), "results": (5, 30), "health": (5, 10)}
    assert set(expected) == set(ROLES)
    for role, (connect_s, socket_s) in expected.items():
        kwargs = _kwargs(redis.pool(role))
        assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (connect_s, socket_s)
        assert kwargs["db"] == 3
    assert _kwargs(redis.pool("api"))["health_check_interval"] == 30
    assert "health_check_interval" not in _kwargs(redis.pool("queue"))


def test_a_cap_lowers_both_timeouts_and_config_sets_them() -> None:
    redis = RedisConnector.from_url("redis://127.0.0.1:6379/0")
    kwargs = _kwargs(redis.client("results", at_most_s=3).connection_pool)
    assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (3, 3)
    config = RedisConfig(
        url=SecretStr("redis://127.0.0.1:6379/0"),
        health=RedisTimeouts(connect_s=1, socket_s=4),
    )
    kwargs = _kwargs(RedisConnector(config).pool("health"))
    assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (1, 4)


def test_the_url_never_prints() -> None:
    redis = RedisConnector(RedisConfig(url=SecretStr(SECRET_URL)))
    shown = redis.masked_url + repr(redis) + str(redis) + repr(redis.config)
    assert "hunter2" not in shown and "hunter3" not in shown
    assert redis.masked_url == "redis://nopoll:***@127.0.0.1:6379/3?password=***"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "redis://u:pw@h:6379/0?password=p&db=3&flag",
            "redis://u:***@h:6379/0?password=***&db=***&flag",
        ),
        (
            "rediss://user@h.example/1?ssl_cert_reqs=none",
            "rediss://user@h.example/1?ssl_cert_reqs=***",
        ),
        ("unix://:pw@/tmp/redis.sock?db=2", "unix://:***@/tmp/redis.sock?db=***"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_the_masked_url_masks_the_password_and_every_query_value(url: str, shown: str) -> None:
    assert RedisConnector.from_url(url).masked_url == shown


def test_arq_settings_name_the_same_redis() -> None:
    settings = RedisConnector(RedisConfig(url=SecretStr(SECRET_URL))).arq_settings()
    assert (settings.host, settings.port, settings.database) == ("127.0.0.1", 6379, 3)
    assert settings.password == "hunter2" and settings.conn_timeout == 5


async def test_aclose_closes_every_pool_it_made(redis_url: str) -> None:
    redis = RedisConnector.from_url(redis_url)
    client = redis.client("api")
    assert await client.ping()
    assert (
        client.connection_pool._in_use_connections or client.connection_pool._available_connections
    )
    await redis.aclose()
    assert not client.connection_pool._in_use_connections
    assert all(not c.is_connected for c in client.connection_pool._available_connections)
    await client.aclose()


def test_the_scheme_picks_a_row_and_an_unknown_one_is_refused() -> None:
    from nopoll.exceptions import ConfigError
    from receiver.redis.schemes import SCHEMES

    assert set(SCHEMES) == {"redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel"}
    assert (
        RedisConnector.from_url("unix:///tmp/nopoll.sock").pool("queue").connection_kwargs["path"]
        == "/tmp/nopoll.sock"
    )
    assert RedisConnector.from_url("rediss://127.0.0.1:6380/0").pool("api") is not None
    for url in ("http://:hunter2@127.0.0.1/0", "127.0.0.1:6379"):
        try:
            RedisConnector.from_url(url)
        except ConfigError as exc:
            assert "redis.url" in str(exc) and "hunter2" not in str(exc)
        else:
            raise AssertionError(f"{url} was taken")


def test_only_the_redis_package_makes_clients_and_only_wire_reaches_inside() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).parents[3]
    makes = re.compile(r"Redis\.from_url|ConnectionPool\.from_url|\bRedis\(|ConnectionPool\(")
    private = re.compile(r"\._parser\b|\.get_connection\(")
    for path in [*root.joinpath("receiver").rglob("*.py"), *root.joinpath("sinks").rglob("*.py")]:
        text = path.read_text()
        where = path.relative_to(root).as_posix()
        if not where.startswith("receiver/redis/"):
            assert not makes.search(text), f"{where} makes its own Redis client"
        if where != "receiver/redis/wire.py":
            assert not private.search(text), f"{where} reaches into redis-py"
