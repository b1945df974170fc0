"""Small charts drawn on the server as SVG: no script, no library, readable by a screen
reader through their label. The drawing stretches to any width; its labels are HTML
(``.chart-box``'s ``.peak`` and ``.ticks``), so they keep their shape on a phone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

__all__ = ["PALETTE", "bar_chart", "stacked_chart"]

_W, _H, _PAD = 600, 120, 2
PALETTE = ("#2f6fba", "#d08a1e", "#3f9a5a", "#a2479b", "#c4473f", "#6b7380")
"""One colour per series of :func:`stacked_chart`, the last for "other"."""


def bar_chart(values: Sequence[int], *, title: str, unit: str = "per minute") -> str:
    """One bar per value (oldest first), scaled to the largest; the last bar is "now"."""
    peak = max(values, default=0)
    total = sum(values)
    label = (
        f"{title}, last {len(values)} minutes: {total:,} in all, "
        f"peak {peak:,} {unit}, {values[-1] if values else 0:,} in the current minute"
    )
    bars = []
    for i, v in enumerate(values):
        h = _height(v, peak)
        bars.append(_bar(i, len(values), _H - _PAD - h, h, f"{v:,}"))
    return _frame(label, f'<g class="bars">{"".join(bars)}</g>', peak, f"-{len(values)} min")


def stacked_chart(series: Mapping[str, Sequence[int]], *, title: str, unit: str) -> str:
    """One stacked bar per period (oldest first), a colour per series in ``series``' order
    (:data:`PALETTE`; give at most that many), scaled to the tallest stack."""
    columns = list(zip(*series.values(), strict=True)) if series else []
    stacks = [sum(c) for c in columns]
    peak = max(stacks, default=0)
    names = ", ".join(f"{name} {sum(values):,}" for name, values in series.items())
    label = (
        f"{title}, last {len(columns)} hours: {sum(stacks):,} in all"
        f"{' (' + names + ')' if names else ''}, peak {peak:,} {unit}"
    )
    bars = []
    for i, column in enumerate(columns):
        y = float(_H - _PAD)
        for colour, name, v in zip(PALETTE, series, column, strict=False):
            if not v:
                continue
            h = _height(v, peak)
            y -= h
            bars.append(_bar(i, len(columns), y, h, f"{escape(name)}: {v:,}", colour))
    return _frame(label, f"<g>{''.join(bars)}</g>", peak, f"-{len(columns)} h")


def _height(value: int, peak: int) -> float:
    """How tall ``value``'s bar is when ``peak`` stands as high as the drawing."""
    return 0.0 if peak == 0 else (_H - _PAD - 2) * value / peak


def _bar(i: int, count: int, y: float, height: float, title: str, fill: str = "") -> str:
    """The bar in slot ``i`` of ``count`` side by side across the width, its top at ``y``;
    ``title`` (HTML, escaped already) is what a pointer on it shows."""
    step = (_W - 2) / max(count, 1)
    colour = f' fill="{fill}"' if fill else ""
    return (
        f'<rect x="{1 + i * step:.1f}" y="{y:.1f}" width="{max(step - 1, 1):.1f}" '
        f'height="{height:.1f}"{colour}><title>{title}</title></rect>'
    )


def _frame(label: str, bars: str, peak: int, since: str) -> str:
    """The drawing with its axis, and its labels as HTML beside it, not SVG text: the
    drawing stretches to the width it is given (preserveAspectRatio none), which would
    squeeze text on a phone."""
    return (
        '<div class="chart-box">'
        f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" aria-label="{escape(label)}" '
        f'preserveAspectRatio="none" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(label)}</title>"
        f'<line x1="0" y1="{_H - _PAD}" x2="{_W}" y2="{_H - _PAD}" class="axis"/>'
        f"{bars}"
        "</svg>"
        f'<span class="peak" aria-hidden="true">{peak:,}</span>'
        '<div class="ticks" aria-hidden="true">'
        f"<span>{since}</span><span>now</span></div>"
        "</div>"
    )
