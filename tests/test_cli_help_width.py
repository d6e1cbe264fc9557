"""Every command's ``--help`` fits an 80-column terminal: no option's help or value list is cut with an ellipsis,
and ``kvroute simulate --help`` names every workload."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvroute.plugin.cli.cli import app


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [path]
    for name, sub in sorted((getattr(group, "commands", None) or {}).items()):
        out += _commands(sub, (*path, name))
    return out


COMMANDS = _commands(typer.main.get_command(app))


def _help(args: tuple[str, ...]) -> str:
    res = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "kvroute")
def test_help_fits_80_columns(args):
    text = _help(args)
    assert "…" not in text, f"kvroute {' '.join(args)} --help cuts a line at 80 columns:\n{text}"
    assert max(len(line) for line in text.splitlines()) <= 80


def test_simulate_help_names_every_workload():
    from kvroute.sim.workloads import GENERATORS

    flat = " ".join(_help(("simulate",)).split())
    for name in [*GENERATORS, "mooncake:PATH", "kvct:PATH", "azure:PATH", "log:PATH"]:
        assert name in flat, name
