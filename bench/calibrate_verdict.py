"""The calibration's judgement: how far each model's prediction lies from what llama.cpp measured, per cell.

A cell is one workload × one router. Each model (the fake engine, the simulator) predicts the cell's cached share
of prompt tokens and its TTFT p50/p90; against the measured figures:

- cached share: the error in points (predicted − measured), met within ``Bounds.cached_pt``;
- TTFT p90: the relative error (predicted / measured − 1), met within ``Bounds.p90_rel``;
- TTFT p50: its relative error is shown, not judged (the bound is on p90).

Where a source ran several repeats its figures are the medians over them (``Figures.repeats``; the min–max of the
cached share and TTFT p90 ride along, shown, not judged): median against median, the same bounds.

A prediction with a figure missing (a model not run, a run with failed requests, no measurement) misses: the
calibration never passes on what it did not compare. ``Calibration.met`` holds when every check of every cell is.

``paired`` judges a model that was given each measured repeat's own arrivals: repeat against repeat, the median
size of the cached share's error within the same bound (TTFT p90's shown). Where a cell's repeats spread (round
robin's share is a lottery over which turn meets which prompt), medians of a few repeats differ by more than the
bounds between llama.cpp's own runs; given the arrivals, the engine model and the router's picks are judged.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Bounds:
    """How far a model may lie: cached share in points, TTFT p90 as a share of the measured."""

    cached_pt: float = 1.5
    p90_rel: float = 0.25


@dataclass(frozen=True, slots=True)
class Figures:
    """One source's figures for one cell (shares in 0..1, times in ms; None: not measured)."""

    cached_share: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    failed: int = 0
    cached_range: tuple[float, float] | None = None  # min–max over the repeats the figures are medians of
    p90_range: tuple[float, float] | None = None
    repeats: int = 1

    @classmethod
    def of(cls, row: Mapping | None, runs: Sequence[Mapping] | None = None) -> Figures | None:
        """From a ``bench/peers.py`` summary row or a simulated cell (None stays None); ``runs``: the repeats the
        row's figures are medians of, for their spread."""
        if row is None:
            return None
        runs = list(runs or ())

        def spread(metric: str) -> tuple[float, float] | None:
            values = [r[metric] for r in runs if r.get(metric) is not None]
            return (min(values), max(values)) if values else None

        return cls(row.get("cached_share"), row.get("ttft_p50_ms"), row.get("ttft_p90_ms"), int(row.get("failed") or 0),
                   spread("cached_share"), spread("ttft_p90_ms"), max(1, len(runs)))

    @property
    def complete(self) -> bool:
        return None not in (self.cached_share, self.ttft_p50_ms, self.ttft_p90_ms) and self.failed == 0


@dataclass(frozen=True, slots=True)
class Check:
    """One model's prediction of one cell against the measurement."""

    model: str
    predicted: Figures | None
    cached_err_pt: float | None
    p50_err: float | None
    p90_err: float | None
    cached_met: bool
    p90_met: bool
    why: str = ""

    @property
    def met(self) -> bool:
        return self.cached_met and self.p90_met


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured <= 0:
        return None
    return predicted / measured - 1.0


def check(model: str, measured: Figures | None, predicted: Figures | None, bounds: Bounds = Bounds()) -> Check:
    """``predicted`` against ``measured`` within ``bounds`` (a missing or incomplete side misses, saying which)."""
    if measured is None or not measured.complete:
        return Check(model, predicted, None, None, None, False, False, "no complete measurement")
    if predicted is None or not predicted.complete:
        return Check(model, predicted, None, None, None, False, False, "no complete prediction")
    cached = (predicted.cached_share - measured.cached_share) * 100.0  # type: ignore[operator]
    p90 = _rel(predicted.ttft_p90_ms, measured.ttft_p90_ms)
    return Check(model, predicted, cached, _rel(predicted.ttft_p50_ms, measured.ttft_p50_ms), p90,
                 abs(cached) <= bounds.cached_pt + 1e-9, p90 is not None and abs(p90) <= bounds.p90_rel + 1e-9)


@dataclass(slots=True)
class Cell:
    """One workload × router: the measurement and every model's check."""

    workload: str
    router: str
    measured: Figures | None
    checks: list[Check] = field(default_factory=list)

    @property
    def met(self) -> bool:
        return bool(self.checks) and all(c.met for c in self.checks)


@dataclass(slots=True)
class Calibration:
    """Every cell; ``met`` when every cell is."""

    cells: list[Cell]
    bounds: Bounds

    @property
    def met(self) -> bool:
        return bool(self.cells) and all(c.met for c in self.cells)

    def missed(self) -> list[str]:
        """``workload router model: what`` for every check that missed."""
        out = []
        for cell in self.cells:
            for c in cell.checks:
                if c.met:
                    continue
                what = c.why or ", ".join(
                    ([f"cached {c.cached_err_pt:+.1f} pt"] if not c.cached_met else [])
                    + ([f"p90 {c.p90_err:+.0%}" if c.p90_err is not None else "p90 -"] if not c.p90_met else []))
                out.append(f"{cell.workload} {cell.router} {c.model}: {what}")
        return out


def calibrate(measured: Mapping[tuple[str, str], Figures | None],
              predictions: Mapping[str, Mapping[tuple[str, str], Figures | None]],
              models: Iterable[str], bounds: Bounds = Bounds()) -> Calibration:
    """Check every model in ``models`` on every measured (workload, router) cell."""
    models = list(models)
    cells = []
    for (workload, router), fig in measured.items():
        cell = Cell(workload, router, fig)
        for model in models:
            cell.checks.append(check(model, fig, predictions.get(model, {}).get((workload, router)), bounds))
        cells.append(cell)
    return Calibration(cells, bounds)


@dataclass(frozen=True, slots=True)
class Paired:
    """A model given each measured repeat's own arrivals, against that repeat: per repeat, the cached share's error
    in points and TTFT p90's relative error; met when the median size of the cached share's error is inside its
    bound (the largest shown, not judged: a repeat whose picks turned on a completion time the model moved can
    differ). TTFT p90 is shown, not judged: the closed-loop models are judged on it, and with the arrivals pinned
    a turn the model runs slower than llama.cpp did has the next one queue behind it."""

    cached_err_pt: tuple[float, ...]
    p90_err: tuple[float, ...]
    bounds: Bounds = Bounds()

    @property
    def repeats(self) -> int:
        return len(self.cached_err_pt)

    @property
    def cached_pt(self) -> float | None:
        return statistics.median(map(abs, self.cached_err_pt)) if self.cached_err_pt else None

    @property
    def p90_rel(self) -> float | None:
        return statistics.median(map(abs, self.p90_err)) if self.p90_err else None

    @property
    def met(self) -> bool:
        c = self.cached_pt
        return c is not None and c <= self.bounds.cached_pt + 1e-9


def paired(measured: Sequence[Mapping], predicted: Sequence[Mapping], bounds: Bounds = Bounds()) -> Paired:
    """Repeat ``i`` of ``predicted`` against repeat ``i`` of ``measured`` (``bench/peers.py`` run figures); a pair
    with a figure missing or a failed request on either side is left out, so a cell with none misses."""
    cached, p90 = [], []
    for m, p in zip(measured, predicted, strict=False):
        figures = [r.get(k) for r in (m, p) for k in ("cached_share", "ttft_p90_ms")]
        if None in figures or m.get("failed") or p.get("failed") or not m["ttft_p90_ms"] > 0:
            continue
        cached.append((p["cached_share"] - m["cached_share"]) * 100.0)
        p90.append(p["ttft_p90_ms"] / m["ttft_p90_ms"] - 1.0)
    return Paired(tuple(cached), tuple(p90), bounds)
