"""How kvroute commands print figures: ``--format table|json|csv``, and tables that fold instead of cutting.

Rich sizes a table to the terminal (80 columns when piped) and by default cuts long cells with "…";
``fold(table)`` makes every column wrap its text instead, so nothing printed is lost.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvroute.policies.errors import InputError

FORMATS = ("table", "json", "csv")
FORMAT_HELP = "table | json | csv"


def resolve_format(fmt: str, json_flag: bool = False) -> str:
    """The output format asked for (``--json`` is short for ``--format json``); unknown ones raise ``InputError``."""
    if json_flag:
        return "json"
    if fmt not in FORMATS:
        raise InputError("--format", f"must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return fmt


def write_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def write_csv(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """One header line, then one line per row (missing cells empty, extra keys ignored)."""
    writer = csv.DictWriter(sys.stdout, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)


def fold(table: Any) -> Any:
    """Make every column of a rich ``Table`` wrap long cells onto more lines instead of cutting them."""
    for column in table.columns:
        column.overflow = "fold"
        column.no_wrap = False
    return table
