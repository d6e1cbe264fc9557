"""How kvroute commands print figures: ``--format table|json|csv``, and tables that are never cut.

Rich sizes a table to the terminal (80 columns when piped) and by default cuts long cells with "…".
``fold(table)`` makes every column wrap its text instead; ``stdout_console()`` gives piped output the table's
natural width (one row per line, nothing cut) and a terminal its own width.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvroute.policies.errors import InputError

FORMATS = ("table", "json", "csv")
PIPED_WIDTH = 4096  # wide enough for any kvroute table; rich prints only what a row needs
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


def stdout_console() -> Any:
    """A rich ``Console`` on stdout: the terminal's width, or ``PIPED_WIDTH`` when stdout is not a terminal."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
