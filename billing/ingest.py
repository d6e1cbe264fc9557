"""Import usage events from a JSONL file (schema in ``kvroute.billing.events``): validate all, then insert.

JSON numbers are read exactly (floats as ``Decimal`` from their literal). Every line is checked before anything
is written: the schema and column limits, the event window (``EventWindow``: at most ``late_days`` old, at most
``future_skew_s`` ahead of the clock) and the rating (currencies, amount limits). A file with bad lines inserts
nothing unless ``skip_invalid`` is set; every bad line is reported with its number, field and reason.

Idempotent (deterministic event ids, insert-or-ignore). Batches commit one by one, so an interrupted import
leaves whole batches only and a re-run stores the rest, each event once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from kvroute.billing.events import UsageEvent, event_from_json
from kvroute.billing.ledger import Ledger
from kvroute.policies.errors import InputError

#: ``progress(phase, done, total)``: phase ``read`` counts bytes of the file, ``insert`` counts events.
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class EventWindow:
    """Which event times are accepted: at most ``late_days`` old and at most ``future_skew_s`` in the future.

    The default 35 days matches the late-event windows of Stripe and Metronome; 300 s of clock skew covers
    hosts whose clocks drift a little ahead of the ledger's.
    """

    late_days: float = 35.0
    future_skew_s: float = 300.0

    def check(self, moment: datetime, now: datetime) -> str | None:
        """``None`` when ``moment`` is inside the window, else the reason it is not."""
        if moment < now - timedelta(days=self.late_days):
            age = (now - moment).total_seconds() / 86400
            return (f"is {age:.0f} days old; events older than the late-event window of {self.late_days:g} days "
                    "are refused (--late-days)")
        if moment > now + timedelta(seconds=self.future_skew_s):
            return (f"{moment.isoformat()} is in the future (more than {self.future_skew_s:g} s ahead of "
                    f"{now.isoformat()})")
        return None


@dataclass(frozen=True)
class LineError:
    line: int
    field: str
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.field}: {self.reason}"


@dataclass
class IngestResult:
    lines: int = 0
    valid: int = 0
    inserted: int = 0
    errors: list[LineError] = field(default_factory=list)
    unpriced: dict[str, int] = field(default_factory=dict)  # backend -> events rated without any price


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_line(raw: bytes) -> Any:
    """One JSON line with exact numbers: floats as ``Decimal`` from their literal, integers as ``int`` (Python
    refuses literals over 4300 digits: a line error; field limits catch the rest), no NaN/Infinity."""
    return json.loads(raw, parse_float=Decimal, parse_int=int, parse_constant=_no_constant)


def read_events(path: str | Path, window: EventWindow | None = None, now: datetime | None = None,
                progress: Progress | None = None) -> tuple[list[tuple[int, UsageEvent]], list[LineError], int]:
    """Parse every line (blank lines skipped), checking the window when given.

    Returns ((line number, event) pairs, errors, lines read).
    """
    events: list[tuple[int, UsageEvent]] = []
    errors: list[LineError] = []
    n = 0
    source = Path(path)
    if not source.is_file():
        raise InputError(str(path), "no such file")
    total = source.stat().st_size
    done = 0
    with source.open("rb") as f:
        for n, raw in enumerate(f, 1):
            done += len(raw)
            if progress is not None and n % 2000 == 0:
                progress("read", done, total)
            if not raw.strip():
                continue
            try:
                data = parse_line(raw)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge ints, NaN
                errors.append(LineError(n, "(json)", f"not valid JSON: {exc}"))
                continue
            try:
                e = event_from_json(data)
            except InputError as exc:
                errors.append(LineError(n, exc.where, exc.message))
                continue
            reason = window.check(e.occurred_at, now) if window is not None and now is not None else None
            if reason is not None:
                errors.append(LineError(n, "occurred_at", reason))
                continue
            events.append((n, e))
    if progress is not None:
        progress("read", total, total)
    return events, errors, n


def ingest_file(ledger: Ledger, path: str | Path, *, batch_size: int = 5000, skip_invalid: bool = False,
                window: EventWindow | None = EventWindow(), progress: Progress | None = None) -> IngestResult:
    """Validate ``path`` and insert its events; nothing is inserted when a line is bad (unless ``skip_invalid``).

    ``window=None`` accepts any event time (the ledger's clock is the reference otherwise).
    """
    numbered, errors, lines = read_events(path, window, ledger.clock(), progress)
    events = [e for _, e in numbered]
    rows, refused = ledger.rate_events(events)
    for i, exc in refused:
        errors.append(LineError(numbered[i][0], exc.where, exc.message))
    errors.sort(key=lambda err: err.line)
    if refused:
        events = [e for e, row in zip(events, rows, strict=True) if row is not None]
        rows = [row for row in rows if row is not None]
    result = IngestResult(lines=lines, valid=len(events), errors=errors)
    if errors and not skip_invalid:
        return result
    for row in rows:
        if row is not None and row["cost_source"] == "unknown":
            result.unpriced[row["backend_id"]] = result.unpriced.get(row["backend_id"], 0) + 1
    for start in range(0, len(events), batch_size):
        result.inserted += ledger.insert_events(events[start:start + batch_size],
                                                rows[start:start + batch_size])  # type: ignore[arg-type]
        if progress is not None:
            progress("insert", min(start + batch_size, len(events)), len(events))
    return result
