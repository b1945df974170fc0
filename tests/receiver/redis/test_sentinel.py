"""Sentinel URLs: what a ``redis+sentinel://`` URL names, what is wrong in a bad one (said
without the URL), and that the config takes one."""

from __future__ import annotations

import pytest

from nopoll.wire import url_credentials_masked
from receiver.config.settings import load_settings
from receiver.redis.schemes import pool_factory
from receiver.redis.sentinel import DEFAULT_SENTINEL_PORT, parse_sentinel_url, sentinel_pool


def test_a_sentinel_url_names_its_sentinels_service_and_database() -> None:
    target = parse_sentinel_url("redis+sentinel://h1:26380,h2,[::1]:7/mymaster/3")
    assert target.sentinels == (("h1", 26380), ("h2", DEFAULT_SENTINEL_PORT), ("::1", 7))
    assert (target.service, target.db, target.tls) == ("mymaster", 3, False)
    secret = parse_sentinel_url(
        "rediss+sentinel://app:p%40ss@h1/m?sentinel_password=s3&sentinel_username=watch"
    )
    assert (secret.username, secret.password, secret.tls) == ("app", "p@ss", True)
    assert (secret.sentinel_username, secret.sentinel_password) == ("watch", "s3")
    assert "p@ss" not in repr(secret) and "s3" not in repr(secret)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel:///m", "at least one sentinel"),
        ("redis+sentinel://h1", "/service or /service/db"),
        ("redis+sentinel://h1/m/db0", "must be a number"),
        ("redis+sentinel://h1:port/m", "port in a Sentinel URL must be a number"),
        ("redis+sentinel://h1/m?password=x", "takes only sentinel_password, sentinel_username"),
    ],
)
def test_a_bad_sentinel_url_says_what_is_wrong_and_not_the_url(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        parse_sentinel_url(url)
    assert "h1" not in str(caught.value)
    with pytest.raises(Exception, match=r"redis\.url") as config_error:
        load_settings(None, env={}, overrides={"redis": {"url": url}})
    assert why.split()[0] in str(config_error.value)


def test_the_scheme_table_makes_a_sentinel_pool_and_the_url_shows_masked() -> None:
    url = "redis+sentinel://:pw@127.0.0.1:26379,127.0.0.1:26380/mymaster/1?sentinel_password=x"
    pool = pool_factory(url)(url, {"socket_timeout": 2.0, "socket_connect_timeout": 1.0})
    assert pool.service_name == "mymaster" and pool.connection_kwargs["db"] == 1
    manager = pool.sentinel_manager
    ports = [s.connection_pool.connection_kwargs["port"] for s in manager.sentinels]
    assert ports == [26379, 26380]
    assert manager.sentinels[0].connection_pool.connection_kwargs["password"] == "x"
    assert pool.connection_kwargs["password"] == "pw"
    assert url_credentials_masked(url) == (
        "redis+sentinel://:***@127.0.0.1:26379,127.0.0.1:26380/mymaster/1?sentinel_password=***"
    )
    assert sentinel_pool is pool_factory("rediss+sentinel://h/m")
