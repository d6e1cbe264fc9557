"""The README's simulator example, run exactly as written: its table is what the command prints today."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from kvroute.plugin.cli.cli import app

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> tuple[list[str], dict[str, list[str]]]:
    """The README's ``kvroute simulate`` command and its table, row cells by policy name."""
    text = README.read_text()
    command = re.search(r"^kvroute (simulate [^\n]+)$", text, re.M)
    assert command, "README.md shows no kvroute simulate command"
    after = text[command.end():]
    rows = re.findall(r"^\| (?!policy|---)(.+) \|$", after.split("\n\n", 2)[1], re.M)
    table = {}
    for row in rows:
        cells = [c.strip().strip("*") for c in row.split(" | ")]
        table[cells[0].split(" ")[0]] = cells[1:]
    return shlex.split(command.group(1)), table


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def test_the_readme_simulate_table_is_what_the_command_prints() -> None:
    args, table = _example()
    res = CliRunner().invoke(app, [*args, "--json"], terminal_width=200)
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)["policies"]
    assert set(table) == set(got), (sorted(table), sorted(got))
    for policy, cells in table.items():
        r = got[policy]
        expected = [f"{r['hit_rate'] * 100:.1f} %", _seconds(r["ttft_p50_s"]), _seconds(r["ttft_p90_s"]),
                    _seconds(r["ttft_p99_s"]), f"{r['wasted_prefill_share'] * 100:.1f} %"]
        assert cells == expected, (policy, cells, expected)
