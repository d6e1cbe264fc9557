"""Import usage events from a JSONL file (schema in ``kvroute.billing.events``): validate all, then insert.

Idempotent (deterministic event ids, insert-or-ignore). A file with bad lines inserts nothing unless
``skip_invalid`` is set; every bad line is reported with its number, field and reason. Batches commit one by
one, so an interrupted import leaves whole batches only and a re-run completes it without duplicates.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from kvroute.billing.events import UsageEvent, event_from_json
from kvroute.billing.ledger import Ledger
from kvroute.policies.errors import InputError


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


def read_events(path: str | Path) -> tuple[list[UsageEvent], list[LineError], int]:
    """Parse every line; blank lines are skipped. Returns (events, errors, lines read)."""
    events, errors = [], []
    n = 0
    source = Path(path)
    if not source.is_file():
        raise InputError(str(path), "no such file")
    with source.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                data = json.loads(raw, parse_float=Decimal)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                errors.append(LineError(n, "(json)", f"not valid JSON: {exc}"))
                continue
            try:
                events.append(event_from_json(data))
            except InputError as exc:
                errors.append(LineError(n, exc.where, exc.message))
    return events, errors, n


def ingest_file(ledger: Ledger, path: str | Path, *, batch_size: int = 5000, skip_invalid: bool = False,
                progress: Callable[[int], None] | None = None) -> IngestResult:
    """Validate ``path`` and insert its events; nothing is inserted when a line is bad (unless ``skip_invalid``)."""
    events, errors, lines = read_events(path)
    result = IngestResult(lines=lines, valid=len(events), errors=errors)
    if errors and not skip_invalid:
        return result
    for start in range(0, len(events), batch_size):
        batch = events[start:start + batch_size]
        result.inserted += ledger.insert_events(batch)
        if progress is not None:
            progress(len(batch))
    return result
