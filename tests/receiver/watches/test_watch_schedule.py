"""The watch schedule: each interval grows by ``GROWTH`` up to ``max_interval_s``, with
jitter only downwards, so a completed result waits at most ``max_interval_s`` for its poll."""

from __future__ import annotations

import pytest

from receiver.config.settings import Settings, WatchConfig
from receiver.worker.poller import GROWTH, JITTER, lease_s, next_interval_s


@pytest.mark.parametrize("polls", [1, 2, 3, 4, 5, 10, 50])
def test_intervals_grow_then_stay_at_the_cap(polls: int) -> None:
    cfg = WatchConfig(first_poll_s=1, max_interval_s=60)
    ceiling = min(60.0, GROWTH ** (polls - 1))
    got = [next_interval_s(cfg, polls) for _ in range(500)]
    assert all(ceiling * (1 - JITTER) <= g <= ceiling for g in got)
    assert max(got) - min(got) > ceiling * JITTER / 2  # jittered: watches spread out


def test_the_defaults_poll_at_about_1_2_6_22_82_seconds_then_every_minute() -> None:
    cfg = WatchConfig()
    at = [cfg.first_poll_s]
    for polls in range(1, 7):
        at.append(at[-1] + next_interval_s(cfg, polls))
    upper = [1.0, 2.0, 6.0, 22.0, 82.0, 142.0, 202.0]
    assert all(u * (1 - JITTER) - 1e-9 <= a <= u for a, u in zip(at, upper, strict=True))


def test_a_lease_outlasts_every_try_of_the_request() -> None:
    settings = Settings.model_validate({"http": {"read_timeout_s": 30, "attempts": 3}})
    http = settings.http
    assert lease_s(settings) >= 3 * (http.connect_timeout_s + http.read_timeout_s) * 3
    assert lease_s(Settings.model_validate({})) >= 15
