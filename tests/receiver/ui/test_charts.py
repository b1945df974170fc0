"""The ``/ui`` charts' bars: one slot per period across the width, scaled to the tallest,
standing on the axis (``y1="118"``); a stack leaves out its empty parts."""

from __future__ import annotations

import re

from receiver.ui.charts import bar_chart, stacked_chart

RECT = re.compile(r"<rect [^>]*>.*?</rect>")


def test_bar_chart_draws_every_minute_scaled_to_the_peak() -> None:
    chart = bar_chart([0, 3, 6], title="Fetches")
    assert RECT.findall(chart) == [
        '<rect x="1.0" y="118.0" width="198.3" height="0.0"><title>0</title></rect>',
        '<rect x="200.3" y="60.0" width="198.3" height="58.0"><title>3</title></rect>',
        '<rect x="399.7" y="2.0" width="198.3" height="116.0"><title>6</title></rect>',
    ]
    assert 'aria-label="Fetches, last 3 minutes: 9 in all, peak 6 per minute, 6 in the ' in chart
    assert "<span>-3 min</span>" in chart


def test_bar_chart_of_nothing_draws_no_bar() -> None:
    assert RECT.findall(bar_chart([0, 0], title="Fetches")) == [
        '<rect x="1.0" y="118.0" width="298.0" height="0.0"><title>0</title></rect>',
        '<rect x="300.0" y="118.0" width="298.0" height="0.0"><title>0</title></rect>',
    ]
    assert RECT.findall(bar_chart([], title="Fetches")) == []


def test_stacked_chart_stacks_each_hour_in_series_order() -> None:
    chart = stacked_chart({"a": [1, 0], "b<": [2, 4]}, title="Tokens", unit="per hour")
    assert RECT.findall(chart) == [
        '<rect x="1.0" y="89.0" width="298.0" height="29.0" fill="#2f6fba">'
        "<title>a: 1</title></rect>",
        '<rect x="1.0" y="31.0" width="298.0" height="58.0" fill="#d08a1e">'
        "<title>b&lt;: 2</title></rect>",
        '<rect x="300.0" y="2.0" width="298.0" height="116.0" fill="#d08a1e">'
        "<title>b&lt;: 4</title></rect>",
    ]
    assert "(a 1, b&lt; 6), peak 4 per hour" in chart
    assert RECT.findall(stacked_chart({}, title="Tokens", unit="per hour")) == []
