"""How ``/ui`` writes a span of seconds: ``ago`` (how long ago or until, to one unit) and
``duration`` (how long something took, as precisely as is worth reading)."""

from __future__ import annotations

import pytest

from receiver.ui.app import _ago, _duration


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (-5.0, "0 s"),
        (0.4, "0 s"),
        (42.0, "42 s"),
        (89.4, "89 s"),
        (90.0, "2 min"),
        (150.0, "2 min"),
        (5399.0, "90 min"),
        (5400.0, "1.5 h"),
        (36000.0, "10.0 h"),
    ],
)
def test_ago_rounds_to_one_unit(seconds: float | None, text: str) -> None:
    assert _ago(seconds) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (-5.0, "0.0 s"),
        (0.4, "0.4 s"),
        (1.44, "1.4 s"),
        (42.0, "42 s"),
        (89.4, "89 s"),
        (90.0, "1 min 30 s"),
        (123.0, "2 min 3 s"),
        (180.0, "3 min"),
        (3600.0, "1 h"),
        (3900.0, "1 h 5 min"),
    ],
)
def test_duration_is_as_precise_as_worth_reading(seconds: float | None, text: str) -> None:
    assert _duration(seconds) == text
