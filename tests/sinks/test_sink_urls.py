"""A sink's URL as it may be shown: its origin for log lines, everything else masked for
``config check``, and the parts to mask where a server may echo them."""

from __future__ import annotations

import pytest

from nopoll.wire import url_masked, url_origin, url_secrets


@pytest.mark.parametrize(
    ("url", "origin", "masked"),
    [
        (
            "https://user:pw@hook.example:8443/abc/SECRETSEG?token=T1&sig=S2&flag#frag",
            "https://hook.example:8443",
            "https://***@hook.example:8443/***/***?token=***&sig=***&flag",
        ),
        ("http://[::1]:9000/?X-Token=abc", "http://[::1]:9000", "http://[::1]:9000/?X-Token=***"),
        ("https://hook.example", "https://hook.example", "https://hook.example"),
        # a local file: its path is no secret, a query value may be
        ("sqlite:///data/results.db", "sqlite:///data/results.db", "sqlite:///data/results.db"),
        ("sqlite:///x.db?key=k9", "sqlite:///x.db?key=***", "sqlite:///x.db?key=***"),
        # not a URL at all: nothing of it is shown
        ("http://h:notaport/x", "***", "***"),
        ("no scheme at all", "***", "***"),
    ],
)
def test_what_of_a_url_is_shown(url: str, origin: str, masked: str) -> None:
    assert url_origin(url) == origin
    assert url_masked(url) == masked


def test_the_parts_to_mask_are_longest_first_and_decoded_too() -> None:
    parts = url_secrets("https://alice:s%40cret@h.example/hooks/seg-12345?token=abcd%2Bef&x=1")
    assert [len(p) for p in parts] == sorted(map(len, parts), reverse=True)
    assert {"alice", "s%40cret", "s@cret", "hooks", "seg-12345", "abcd+ef"} <= set(parts)
    assert "1" not in parts and "" not in parts  # too short to mask in free text
    assert url_secrets("") == []
