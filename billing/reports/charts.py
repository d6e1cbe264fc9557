"""Small inline SVG charts for the report page: grouped daily bars and daily lines, no script, no network.

Every mark carries a ``<title>`` (the exact figure, shown on hover); text is escaped. Values are floats here: a
chart is a picture, the exact figures sit in the page's tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

WIDTH, HEIGHT = 720, 180
LEFT, RIGHT, TOP, BOTTOM = 60, 12, 12, 28
PALETTE = ("#3b6fd8", "#e08a2e", "#2e9e6b", "#b0468c")


def _scale(values: Sequence[Sequence[float | None]]) -> float:
    top = max((v for series in values for v in series if v is not None), default=0.0)
    return top if top > 0 else 1.0


def _frame(days: Sequence[str], top: float, fmt: Callable[[float], str], label: str) -> list[str]:
    plot_h = HEIGHT - TOP - BOTTOM
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
           f'aria-label="{escape(label)}" class="chart">']
    for i in range(5):  # four gridlines and their values
        y = TOP + plot_h * i / 4
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
                   f'{escape(fmt(top * (4 - i) / 4))}</text>')
    step = max(1, len(days) // 8)
    slot = (WIDTH - LEFT - RIGHT) / max(1, len(days))
    for i, day in enumerate(days):
        if i % step == 0:
            x = LEFT + slot * (i + 0.5)
            out.append(f'<text x="{x:.1f}" y="{HEIGHT - 8}" text-anchor="middle" class="tick">'
                       f'{escape(day[5:])}</text>')
    return out


def _start(days: Sequence[str], series: dict[str, Sequence[float | None]], fmt: Callable[[float], str],
           label: str) -> tuple[list[str], float, float, float]:
    """(the SVG so far: frame, gridlines, ticks; the top of the scale; the plot's height; one day's width)."""
    top = _scale(list(series.values()))
    return _frame(days, top, fmt, label), top, HEIGHT - TOP - BOTTOM, (WIDTH - LEFT - RIGHT) / max(1, len(days))


def _legend(names: Sequence[str]) -> str:
    items = "".join(f'<span class="key"><i style="background:{PALETTE[i % len(PALETTE)]}"></i>{escape(n)}</span>'
                    for i, n in enumerate(names))
    return f'<div class="legend">{items}</div>'


def bars(days: Sequence[str], series: dict[str, Sequence[float | None]], fmt: Callable[[float], str],
         label: str) -> str:
    """Grouped bars, one group per day, one bar per series."""
    out, top, plot_h, slot = _start(days, series, fmt, label)
    bar = slot * 0.8 / max(1, len(series))
    for s, (name, values) in enumerate(series.items()):
        for i, v in enumerate(values):
            if not v or v < 0:
                continue
            h = plot_h * v / top
            x = LEFT + slot * i + slot * 0.1 + bar * s
            out.append(f'<rect x="{x:.1f}" y="{TOP + plot_h - h:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                       f'fill="{PALETTE[s % len(PALETTE)]}"><title>{escape(days[i])} {escape(name)}: '
                       f'{escape(fmt(v))}</title></rect>')
    out.append("</svg>")
    return _legend(list(series)) + "".join(out)


def lines(days: Sequence[str], series: dict[str, Sequence[float | None]], fmt: Callable[[float], str],
          label: str) -> str:
    """One line per series over the days (a day without a value breaks the line)."""
    out, top, plot_h, slot = _start(days, series, fmt, label)
    for s, (name, values) in enumerate(series.items()):
        color = PALETTE[s % len(PALETTE)]
        points: list[str] = []
        runs: list[list[str]] = [points]
        for i, v in enumerate(values):
            if v is None:
                points = []
                runs.append(points)
                continue
            x, y = LEFT + slot * (i + 0.5), TOP + plot_h - plot_h * v / top
            points.append(f"{x:.1f},{y:.1f}")
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"><title>{escape(days[i])} '
                       f'{escape(name)}: {escape(fmt(v))}</title></circle>')
        for run in runs:
            if len(run) > 1:
                out.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" stroke-width="2"/>')
    out.append("</svg>")
    return _legend(list(series)) + "".join(out)
